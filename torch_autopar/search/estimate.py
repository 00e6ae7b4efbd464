"""Evaluate one placement of a captured program: compute and communication time, collectives, memory.

Every plan, propagated or searched, is priced here, so candidates compare on equal terms, with the functions of
``cost.pricing`` that the MILP's objective uses. ``weights`` says how many real nodes a captured node stands for
(folded layers). Must never change the placement it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from torch_autopar.capture import CapturedProgram
from torch_autopar.capture.layers import forward_layer_nodes, reshard_groups
from torch_autopar.cost import CostModel, pricing
from torch_autopar.cost.ops import is_free, node_flops
from torch_autopar.cost.pricing import ADAM_STATE_PER_PARAM
from torch_autopar.search.plan import LayerActivations, PlannedCollective
from torch_autopar.strategies import Sharding, boundary, param_gathers

HIDDEN_PHASES = ("grad_sync", "background")
"""Collectives that run alongside backward and are waited for as it ends: the gradient buckets' ("grad_sync"), and
the checks issued ahead of that ("background": data parallelism's batch check, ``rewrite.reducer``)."""


@dataclass(kw_only=True)
class Estimate:
    weights: dict = field(default_factory=dict)
    backward_frees: bool = True
    """Whether backward frees the activations as it makes the gradients (eager mode; ``pricing.peak_bytes``)."""
    forward_compute: float = 0.0
    backward_compute: float = 0.0
    optimizer: float = 0.0
    """Seconds of the optimizer step on this device's parameter shards (``add_optimizer``)."""
    collectives: list[PlannedCollective] = field(default_factory=list)
    memory: dict[str, int] = field(default_factory=dict)
    exposed_comm: float = 0.0
    last_grad_sync: float = 0.0
    """Seconds of the last bucket's gradient sync (its gradients are ready last: nothing hides it)."""
    node_seconds: dict = field(default_factory=dict)
    """Compute seconds of one instance of each node."""
    layers: dict = field(default_factory=dict)
    """Repeated layer ``(family, index)`` → ``LayerActivations`` of one instance, in forward order
    (``add_layer_activations``)."""
    kept_gathers: dict = field(default_factory=dict)
    """Graph mode's program: forward parameter gather (``param_gathers.gather_key``) → local bytes of what it
    gathers, for the gathers of parameters backward reads (``pricing.read_by_backward``) and that are not made
    again for backward: the partitioner saves them from forward to backward."""

    def weight(self, node: fx.Node) -> int:
        return self.weights.get(node, 1)

    @property
    def compute(self) -> float:
        return self.forward_compute + self.backward_compute + self.optimizer

    @property
    def step_time(self) -> float:
        return self.compute + self.exposed_comm

    @property
    def peak_memory(self) -> int:
        return pricing.peak_bytes(self.memory, self.backward_frees)


def _placements(spec):
    return getattr(spec, "placements", None)


def _input_placements(node: fx.Node, sharding: Sharding, moved: list) -> list:
    """The placements ``node``'s inputs are in when it runs: its producers' layouts, each moved as the
    redistributions of ``node`` say (``moved``: their (input position, source, target); an input whose layout
    is not the source at that position is found by its layout, in order)."""
    inputs = [_placements(sharding.specs.get(a)) for a in node.all_input_nodes]
    done = [False] * len(inputs)
    for index, source, target in moved:
        candidates = [index] if index < len(inputs) else []
        for position in candidates + list(range(len(inputs))):
            have = inputs[position]
            if not done[position] and have is not None and tuple(have) == source:
                inputs[position], done[position] = target, True
                break
    return inputs


def _moves_by_node(sharding: Sharding) -> dict[str, list]:
    moves: dict[str, list] = {}
    for r in sharding.redistributions:
        moves.setdefault(r.node, []).append((r.arg_index, tuple(r.source), tuple(r.target)))
    return moves


def add_compute(estimate: Estimate, program: CapturedProgram, sharding: Sharding, cost: CostModel,
                scale: float = 1.0) -> None:
    """Compute seconds of every op on its local shards; ``scale`` multiplies each (data parallelism: the
    one-process step over the number of ranks)."""
    moves = _moves_by_node(sharding)
    for node in program.graph.graph.nodes:
        if node.op != "call_function" or is_free(node):
            continue
        inputs = _input_placements(node, sharding, moves.get(node.name, ()))
        output = _placements(sharding.specs.get(node))
        estimate.node_seconds[node] = pricing.compute_seconds(node, node_flops(node), inputs, output, cost) * scale
        seconds = estimate.node_seconds[node] * estimate.weight(node)
        if program.is_backward(node):
            estimate.backward_compute += seconds
        else:
            estimate.forward_compute += seconds


def add_optimizer(estimate: Estimate, params: dict, placements: dict, cost: CostModel) -> None:
    """The optimizer step on each parameter's shard (``cost.pricing.optimizer_seconds``), the MILP's cost of a
    parameter's layout. ``params``: name → ``TensorInfo``; ``placements``: name → the placements it is kept in."""
    held = sum(info.nbytes // cost.shard_factor(placements[name]) for name, info in params.items())
    estimate.optimizer = pricing.optimizer_seconds(held, len(params), cost)


def _moved_value(node: fx.Node, arg_index: int) -> fx.Node:
    """The node whose value a redistribution on input ``arg_index`` of ``node`` moves (a placeholder's own)."""
    inputs = node.all_input_nodes
    return inputs[arg_index] if 0 <= arg_index < len(inputs) else node


def add_redistributions(estimate: Estimate, program: CapturedProgram, sharding: Sharding, cost: CostModel,
                        axis_names, once_per_value: bool = False, reshard_after_forward: bool = True,
                        kept: frozenset = frozenset(), regather_views: bool = True,
                        grouped_in: str | None = None) -> None:
    """The collectives of every redistribution; ``once_per_value``: a value moved to one layout is moved once
    for all its consumers (graph mode's program), else once per consumer (DTensor in eager mode); there a view of
    a parameter is gathered as its parameter (``strategies.param_gathers``): once per step, or once per phase
    with ``reshard_after_forward`` unless the parameter (node) is in ``kept`` (``Plan.kept_gathered``). A gathered
    copy that backward reads through a view made of it in forward (a weight used by its transpose, which both
    products read) is gathered again for backward when the plan frees it after forward, once: in graph mode every
    parameter's (``rewrite.reshard``), in eager mode a layer's (``runtime.fsdp``; the root group stays).
    ``regather_views`` False leaves that out (eager execution's pricing notes its groups' regathers itself).
    A parameter's gather starting with an all-gather that mode ``grouped_in`` makes per group
    (``boundary.made_per_group``) is part of its group's (``_GroupGathers``): one all-gather per group, mesh axis
    and phase, as graph mode's program runs it and as the search prices a group's latency (in eager mode as
    searched, of the bytes moved for every consumer; None: eager execution's pricing, which has its flat
    groups)."""
    by_name = {node.name: node for node in program.graph.graph.nodes}
    in_layers = {program.param_nodes[name] for names in reshard_groups(program.param_nodes).values()
                 for name in names}
    params = set(program.param_nodes.values())
    grouped = _GroupGathers(program, cost, axis_names, once_per_value, grouped_in) if grouped_in else None
    done = set()
    for redistribution in sharding.redistributions:
        node = by_name[redistribution.node]
        key = (_moved_value(node, redistribution.arg_index), tuple(redistribution.target))
        gather = _gather_key(params, sharding, redistribution, key[0], reshard_after_forward, kept)
        root = param_gathers.gathered_root(key[0], params.__contains__)  # a gather of it is its group's
        param = None if gather is None else param_gathers.param_of(gather[0])
        resharded = reshard_after_forward and param is not None and param not in kept
        if resharded and regather_views and not redistribution.backward and (once_per_value or param in in_layers) \
                and param_gathers.view_read_by_backward(program, node, params.__contains__):
            again = param_gathers.gather_key(gather[0], gather[1], True, True)
            if again not in done:
                done.add(again)
                _add_moves(estimate, cost, axis_names, redistribution, True, estimate.weight(node), gather[0],
                           grouped)
        if once_per_value:
            key = gather or key
            if gather is not None and not (redistribution.backward or resharded or key in done) \
                    and pricing.read_by_backward(program, gather[0]):
                estimate.kept_gathers[key] = (redistribution.global_nbytes * estimate.weight(node)
                                              // cost.shard_factor(tuple(redistribution.target)))
            if key in done:
                continue
        done.add(key)
        _add_moves(estimate, cost, axis_names, redistribution, redistribution.backward, estimate.weight(node),
                   root, grouped)
    if grouped is not None:
        estimate.collectives += grouped.collectives()


@dataclass
class _GroupGathers:
    """Parameter gathers made per group: the first collective of each parameter's gather, an all-gather straight
    from its shard, joins its group's (``param_gathers.gather_groups``) one all-gather per mesh axis, dtype and
    phase. Graph mode's program (``once_per_value``, ``rewrite.gather_buckets``): a group gathered in forward
    and needed again in backward (``rewrite.reshard``'s recomputation) is gathered whole in backward; a parameter
    that only backward gathers joins the group's backward-only gather. Eager mode as searched: the gathers its
    flat groups make (``boundary.made_per_group``), of the bytes of every consumer's move, one latency (the
    search's price, ``search.problem``)."""

    program: CapturedProgram
    cost: CostModel
    axis_names: tuple
    once_per_value: bool
    mode: str
    """The mode whose per-group gathers these are (``boundary.made_per_group``)."""
    members: dict = field(default_factory=dict)
    """(group, mesh axis, dtype, count, backward) → {root: bytes}."""

    def __post_init__(self):
        groups = param_gathers.gather_groups(self.program.param_nodes)
        self.group_of = {node: groups[name] for name, node in self.program.param_nodes.items()}

    def add(self, root: fx.Node, move, backward: bool, count: int) -> None:
        """Take ``move``, the leading all-gather of a gather of ``root``, into its group's."""
        key = (self.group_of[param_gathers.param_of(root)], move.axis, root.meta["val"].dtype, count, backward)
        members = self.members.setdefault(key, {})
        members[root] = members.get(root, 0) + move.nbytes

    def collectives(self) -> list[PlannedCollective]:
        gathers = []
        for (group, axis, dtype, count, backward), members in self.members.items():
            forward = self.members.get((group, axis, dtype, count, False), {}) if self.once_per_value else {}
            if backward and members.keys() & forward.keys():  # the forward gather made again: whole
                gathers.append(self._collective(group, axis, sum(forward.values()), True, count))
                members = {root: n for root, n in members.items() if root not in forward}
            if members:
                gathers.append(self._collective(group, axis, sum(members.values()), backward, count))
        return gathers

    def _collective(self, group: str, axis: int, nbytes: int, backward: bool, count: int) -> PlannedCollective:
        return PlannedCollective(kind="all_gather", axis=self.axis_names[axis], nbytes=nbytes,
                                 phase="backward" if backward else "forward", where=f"{group or 'root'} parameters",
                                 seconds=self.cost.collective_time("all_gather", axis, nbytes), count=count)


def _add_moves(estimate: Estimate, cost: CostModel, axis_names, redistribution, backward: bool, count,
               root: fx.Node | None = None, grouped: _GroupGathers | None = None) -> None:
    """The collectives of ``redistribution``; where it gathers the parameter ``root`` starting with an
    all-gather its group makes, that one joins its group's (``grouped``)."""
    moves = cost.moves(redistribution.source, redistribution.target, redistribution.global_nbytes)
    if grouped is not None and root is not None and moves and moves[0].kind == "all_gather" and \
            boundary.made_per_group(grouped.mode, "all_gather", moves[0].axis, tuple(redistribution.source),
                                    tuple(redistribution.target)):
        grouped.add(root, moves[0], backward, count)
        moves = moves[1:]
    for c in moves:
        estimate.collectives.append(PlannedCollective(
            kind=c.kind, axis=axis_names[c.axis], nbytes=c.nbytes, phase="backward" if backward else "forward",
            where=redistribution.node, seconds=cost.collective_time(c.kind, c.axis, c.nbytes), count=count))


def _gather_key(params: set, sharding: Sharding, redistribution, moved: fx.Node,
                reshard_after_forward: bool, kept: frozenset) -> tuple | None:
    """The key graph mode's program gathers ``moved`` under when it is a view of a parameter (one of ``params``;
    its parameter's gather, ``param_gathers.gather_key``); None for any other move."""
    root = param_gathers.gathered_root(moved, params.__contains__)
    layout = _placements(sharding.specs.get(root)) if root is not None else None
    wanted = None if layout is None else param_gathers.root_target(
        tuple(redistribution.source), tuple(redistribution.target), tuple(layout))
    if wanted is None:
        return None
    return param_gathers.gather_key(root, wanted, redistribution.backward,
                                    reshard_after_forward and param_gathers.param_of(root) not in kept)


def add_grad_sync(estimate: Estimate, sharding: Sharding, cost: CostModel, buckets: list[list[str]],
                  grad_node, params: dict, reduce_dtype: torch.dtype | None, param_placements: dict,
                  axis_names, flat_nbytes: dict | None = None, grouped_in: str | None = None) -> None:
    """One collective per bucket and mesh axis on which the gradients are not yet in their parameter's layout: a
    bucket whose sync is one reduction (``cost.pricing.grad_reduction``) is one flat buffer of the bytes
    ``cost.pricing.grad_bucket_collective`` prices, as graph mode's program lays it out.

    ``grad_node(name)``: the captured node computing parameter ``name``'s gradient (None: no gradient);
    ``params``: name → ``TensorInfo``; ``reduce_dtype``: the dtype gradients are reduced in (None: their own);
    ``flat_nbytes``: name → padded bytes of a gradient in an eager fully-sharded flat group (``runtime.flat``), a
    bucket of which moves those bytes. ``grouped_in``: buckets of one gradient each, priced as the search prices
    them (``search.problem``) for that mode: the buckets of one parameter group (``param_gathers.gather_groups``)
    moved by one reduction of the same kind and mesh axis that the mode makes per group
    (``boundary.made_per_group``) pay one latency, with the last of them; the last bucket pays its own."""
    flat_nbytes = flat_nbytes or {}
    synced = []
    for index, bucket in enumerate(buckets):
        first = grad_node(bucket[0])
        if first is None:
            continue
        source, target = sharding.specs[first].placements, param_placements[bucket[0]]
        members = [(params[name].shape, _grad_layout(sharding, grad_node(name)), param_placements[name])
                   for name in bucket]
        keys = {pricing.bucket_key(None, have, want) for _, have, want in members}
        if all(name in flat_nbytes for name in bucket):
            moves = cost.moves(source, target, sum(flat_nbytes[name] for name in bucket))
        elif None in keys or len(keys) != 1:  # not one reduction: moved as the layouts of its first gradient say
            moves = cost.moves(source, target, sum(in_dtype(params[name], reduce_dtype) for name in bucket))
        else:
            itemsize = (reduce_dtype or getattr(torch, params[bucket[0]].dtype)).itemsize
            moves = [pricing.grad_bucket_collective(
                [(shape, have, pricing.grad_reduction(have, want)) for shape, have, want in members], itemsize, cost)]
        grouped = grouped_in is not None and len(moves) == 1 and moves[0].kind != "all_gather" and \
            boundary.made_per_group(grouped_in, moves[0].kind, moves[0].axis, tuple(source), tuple(target))
        synced.append((index, bucket[0], grouped, moves))
    latency_paid = _latency_payers(synced, param_gathers.gather_groups([name for _, name, _, _ in synced])) \
        if grouped_in else None
    for index, _, _, moves in synced:
        collectives = [PlannedCollective(kind=c.kind, axis=axis_names[c.axis], nbytes=c.nbytes, phase="grad_sync",
                                         where=f"bucket{index}",
                                         seconds=_without_latency(cost, c, latency_paid is not None
                                                                  and index not in latency_paid))
                       for c in moves]
        estimate.collectives += collectives
        if index == synced[-1][0]:
            estimate.last_grad_sync = sum(c.seconds for c in collectives)


def _latency_payers(synced: list, group_of: dict) -> set[int]:
    """Of ``synced`` (bucket index, its first gradient, whether its move is one grouped reduction, moves), the
    buckets that pay their collectives' latency: the last bucket, any not moved by one grouped reduction, and the
    last one of each parameter group and reduction."""
    payers, last_of = {synced[-1][0]} if synced else set(), {}
    for index, name, grouped, moves in synced[:-1]:
        if grouped:
            last_of[(group_of[name], moves[0].kind, moves[0].axis)] = index
        else:
            payers.add(index)
    return payers | set(last_of.values())


def _without_latency(cost: CostModel, collective, apart: bool) -> float:
    """Seconds of ``collective``, less its latency where ``apart`` (its group pays it)."""
    if not apart or collective.nbytes == 0:
        return cost.collective_time(collective.kind, collective.axis, collective.nbytes)
    return cost.collective_coefficients(collective.kind, collective.axis)[1] * collective.nbytes


def _grad_layout(sharding: Sharding, node: fx.Node | None):
    return None if node is None else _placements(sharding.specs.get(node))


def add_exposed_comm(estimate: Estimate) -> None:
    """Forward/backward redistributions are exposed; gradient sync, and what is waited for with it
    (``HIDDEN_PHASES``), hides behind backward except the last bucket (``cost.pricing.exposed_grad_sync``)."""
    blocking = sum(c.seconds * c.count for c in estimate.collectives if c.phase not in HIDDEN_PHASES)
    total_grad = sum(c.seconds * c.count for c in estimate.collectives if c.phase in HIDDEN_PHASES)
    estimate.exposed_comm = blocking + pricing.exposed_grad_sync(total_grad, estimate.last_grad_sync,
                                                                 estimate.backward_compute)


def add_memory(estimate: Estimate, program: CapturedProgram, sharding: Sharding, cost: CostModel) -> None:
    """Bytes per device by kind, the copies ``cost.pricing.memory_copies`` counts at either end of backward: each
    parameter's shard with its gradient and optimizer state, buffers, the activations saved for backward and (graph
    mode) the gathered parameters kept for it; ``Estimate.peak_memory`` is their peak (``pricing.peak_bytes``)."""
    def local(node):
        value, placements = node.meta.get("val"), _placements(sharding.specs.get(node))
        return pricing.local_nbytes(value, placements, cost) * estimate.weight(node)

    params = sum(local(node) for node in program.param_nodes.values())
    buffers = sum(local(node) for node in program.buffer_nodes.values())
    saved = sum(local(node) for node in pricing.saved_for_backward(program))
    estimate.memory = {"parameters": params + buffers, "gradients": params,
                       "optimizer": ADAM_STATE_PER_PARAM * params, "activations": saved}
    if estimate.kept_gathers:  # graph mode: parameters gathered in forward and kept for backward
        estimate.memory["gathered_for_backward"] = sum(estimate.kept_gathers.values())
    add_layer_activations(estimate, program, sharding, cost)


def add_layer_activations(estimate: Estimate, program: CapturedProgram, sharding: Sharding, cost: CostModel) -> None:
    """Per repeated layer, one instance: the activations it saves and those recomputing it frees, on local shards
    (``cost.pricing.recomputed_activations``, less the state its checkpoint keeps; "selective" keeps its matmul
    outputs too), and the compute of one more forward of it (``add_compute`` first; "selective" does not redo
    its matmuls)."""
    def local(node):
        return pricing.local_nbytes(node.meta.get("val"), _placements(sharding.specs.get(node)), cost)

    layers = forward_layer_nodes(program)
    saved, forward = pricing.saved_for_backward(program), pricing.forward_nodes(program)
    freed, selective = pricing.recomputed_activations(program, layers), pricing.selectively_kept(program, layers)
    for layer, nodes in layers.items():
        full = sum(local(n) for n in freed[layer]) - pricing.CHECKPOINT_STATE_BYTES
        redone = [n for n in nodes if n in forward]
        estimate.layers[layer] = LayerActivations(
            saved_bytes=sum(local(n) for n in nodes if n in saved), freed_bytes=full,
            recompute_s=sum(estimate.node_seconds.get(n, 0.0) for n in redone),
            selective_freed_bytes=full - sum(local(n) for n in selective[layer]),
            selective_recompute_s=sum(estimate.node_seconds.get(n, 0.0) for n in redone
                                      if n.target not in pricing.SAVED_BY_SELECTIVE))


def in_dtype(info, dtype: torch.dtype | None) -> int:
    """Bytes of a tensor described by ``info`` once cast to ``dtype`` (None: as it is)."""
    return info.nbytes if dtype is None else info.numel * dtype.itemsize
