"""Free gathered parameters after forward and gather them again for backward, in graph mode's per-rank program
(FSDP's ``reshard_after_forward``, as SimpleFSDP does it under torch.compile).

The traced program gathers each parameter once (``strategies.param_gathers``); AOTAutograd's partitioner saves
every collective's result for backward, so every gathered parameter that backward reads would live from its
forward use to its backward use. ``recompute_parameter_gathers`` tags each parameter's gather, its wait, the cheap
ops between the parameters and the gather (a mixed-precision cast, DTensor's padding of uneven shards, the
concatenation of a group's flattened shards: ``rewrite.gather_buckets``) and those between the wait and the
compute that reads it (views, the split and cat of a gather on another dim, the cut of the padding, a parameter's
cut of its group's gather) for recomputation: the partitioner then saves the parameter's shard and runs the chain again in the
backward graph, just before backward's first use. Called when ``Plan.reshard_after_forward`` is set, after
tracing and before the joint graph is partitioned. Must never tag a collective that moves an activation or a
gradient, nor an op that costs more than a copy.
"""

from __future__ import annotations

import torch.fx as fx

from torch_autopar import _compat
from torch_autopar.strategies.param_gathers import is_cheap, parameter_side


def recompute_parameter_gathers(graph_module: fx.GraphModule, is_param) -> int:
    """Tag, in the joint graph ``graph_module``, every parameter's gather with the cheap ops around it for
    recomputation in backward (``_compat.recompute_in_backward``); returns how many gathers were tagged.
    ``is_param(placeholder)``: whether it is a parameter."""
    tagged: set[fx.Node] = set()
    gathers = graph_module.graph.find_nodes(op="call_function", target=_compat.functional_all_gather())
    for gather in gathers:
        side = parameter_side(gather.args[0], is_param)
        if side is not None:
            tagged.update(side[1] | {gather})
    count = len(tagged & set(gathers))
    for node in graph_module.graph.nodes:  # in topological order: a node's inputs are decided before it
        if node in tagged or node.op != "call_function" or not node.all_input_nodes:
            continue
        waits = node.target is _compat.functional_wait_tensor()
        if (waits or is_cheap(node)) and all(arg in tagged for arg in node.all_input_nodes):
            tagged.add(node)
    for node in tagged:
        _compat.recompute_in_backward(node)
    return count
