"""Gather a group's parameters with one collective in graph mode's per-rank program, as FSDP2 gathers a wrapped
module's parameters with one flat all-gather.

Traced op by op, the program gathers each parameter on its own (``strategies.param_gathers``): a fully-sharded
layer of twelve parameters makes twelve all-gathers, each paying the collective's latency. ``bucket_parameter_gathers``
merges, in the joint graph, the all-gathers of the parameters of one group (``param_gathers.gather_groups``) on
one process group, of one dtype and of one phase into a single all-gather of their shards flattened and
concatenated, issued where the group's first gather was; each parameter's gathered value is then cut out of the
result (a copy, as FSDP2's copy-out). Called after tracing and before ``rewrite.reshard`` tags gathers for
recomputation (which follows the merged gather: one gather per group again in backward). ``search.estimate``
prices the merged gathers by the same grouping. Must never merge a collective that moves an activation or a
gradient, nor change a value.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Callable

import torch
import torch.fx as fx

from torch_autopar import _compat
from torch_autopar.strategies.param_gathers import parameter_side

aten = torch.ops.aten


def _forward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes the forward outputs of the joint ``graph`` depend on (what the partitioner puts in forward)."""
    output = graph.find_nodes(op="output")[0]
    pending = [node for node, desc in zip(output.args[0], output.meta["desc"])
               if isinstance(node, fx.Node) and _compat.output_index(desc) is not None]
    seen: set[fx.Node] = set()
    while pending:
        node = pending.pop()
        if node not in seen:
            seen.add(node)
            pending.extend(node.all_input_nodes)
    return seen


def _add(graph: fx.Graph, like: fx.Node, target, *args, **kwargs) -> fx.Node:
    """A node calling ``target``, with its fake value and ``like``'s other metadata (stack trace, sequence number)."""
    node = graph.call_function(target, args, kwargs)
    node.meta.update({k: v for k, v in like.meta.items() if k != "val"})
    values = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    with like.meta["val"].fake_mode:
        node.meta["val"] = target(*values[0], **values[1])
    return node


def _merge(graph: fx.Graph, members: list[tuple[fx.Node, fx.Node, list[fx.Node]]], order: dict) -> None:
    """One all-gather for ``members`` ((gather, its wait, the parameter-side nodes feeding it in graph order), in
    graph order), at the first member's gather; each member's wait replaced by its cut of the result."""
    first = members[0][0]
    for _, _, side in members:  # later shards' own casts and paddings, moved before the merged gather
        for node in side:
            if order[node] > order[first]:
                first.prepend(node)
    shards = [gather.args[0] for gather, _, _ in members]
    ranks, group = first.args[1], first.args[2]
    with graph.inserting_before(first):
        flat = _add(graph, first, aten.cat.default, [_add(graph, first, aten.view.default, s, [-1]) for s in shards])
        gathered = _add(graph, first, _compat.functional_all_gather(), flat, ranks, group)
        waited = _add(graph, first, _compat.functional_wait_tensor(), gathered)
        rows = _add(graph, first, aten.view.default, waited, [ranks, -1])
        sizes = [s.meta["val"].numel() for s in shards]
        split = _add(graph, first, aten.split_with_sizes.default, rows, sizes, 1)
        for index, (gather, wait, _) in enumerate(members):
            piece = _add(graph, first, aten.clone.default, _add(graph, first, operator.getitem, split, index),
                         memory_format=torch.contiguous_format)
            cut = _add(graph, first, aten.view.default, piece, list(wait.meta["val"].shape))
            wait.replace_all_uses_with(cut)
    for gather, wait, _ in members:  # after the insertions, which the first gather anchors
        graph.erase_node(wait)
        graph.erase_node(gather)


def bucket_parameter_gathers(graph_module: fx.GraphModule, group_of: Callable[[fx.Node], str | None]) -> int:
    """Merge, in the joint graph ``graph_module``, the all-gathers of each group's parameters (per process group,
    dtype and phase) into one; returns how many gathers the merged ones replaced. ``group_of(placeholder)``: the
    parameter's group (``param_gathers.gather_groups``), None for any other placeholder."""
    graph = graph_module.graph
    forward = _forward_nodes(graph)
    order = {node: index for index, node in enumerate(graph.nodes)}
    buckets: dict[tuple, list] = defaultdict(list)
    for gather in graph.find_nodes(op="call_function", target=_compat.functional_all_gather()):
        side = parameter_side(gather.args[0], lambda node: group_of(node) is not None)
        waits = list(gather.users)
        if side is None or len(waits) != 1 or waits[0].target is not _compat.functional_wait_tensor():
            continue
        params, chain = side
        if len(params) != 1:
            continue
        shard = gather.args[0].meta["val"]
        key = (group_of(next(iter(params))), gather.args[1], gather.args[2], shard.dtype, gather in forward)
        buckets[key].append((gather, waits[0], sorted(chain, key=order.__getitem__)))
    merged = 0
    for members in buckets.values():
        if len(members) > 1:
            _merge(graph, sorted(members, key=lambda member: order[member[0]]), order)
            merged += len(members)
    graph.lint()
    graph_module.recompile()
    return merged
