"""Evaluate one placement of a captured program: compute and communication time, collectives, memory.

Every plan, propagated or searched, is priced here, so candidates compare on equal terms. ``weights`` says how
many real nodes a captured node stands for (folded layers). Must never change the placement it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from torch_autopar.capture import CapturedProgram
from torch_autopar.cost import CostModel
from torch_autopar.cost.ops import dtype_name, is_free, node_flops
from torch_autopar.search.plan import PlannedCollective
from torch_autopar.strategies import Sharding

ADAM_STATE_PER_PARAM = 2
"""Optimizer state assumed for memory estimates: Adam keeps two tensors the size of each parameter."""


@dataclass(kw_only=True)
class Estimate:
    weights: dict = field(default_factory=dict)
    forward_compute: float = 0.0
    backward_compute: float = 0.0
    collectives: list[PlannedCollective] = field(default_factory=list)
    memory: dict[str, int] = field(default_factory=dict)
    exposed_comm: float = 0.0
    node_seconds: dict = field(default_factory=dict)
    """Compute seconds of one instance of each node."""

    def weight(self, node: fx.Node) -> int:
        return self.weights.get(node, 1)

    @property
    def compute(self) -> float:
        return self.forward_compute + self.backward_compute

    @property
    def step_time(self) -> float:
        return self.compute + self.exposed_comm

    @property
    def peak_memory(self) -> int:
        return sum(self.memory.values())


def _local_nbytes(value, spec, cost: CostModel) -> int:
    if not isinstance(value, torch.Tensor):
        return 0
    placements = getattr(spec, "placements", ())
    return value.numel() * value.element_size() // cost.shard_factor(placements)


def _node_compute(node: fx.Node, sharding: Sharding, cost: CostModel) -> float:
    split = max([cost.shard_factor(getattr(sharding.specs.get(a), "placements", ())) for a in node.all_input_nodes] + [1])
    accessed = sum(_local_nbytes(a.meta.get("val"), sharding.specs.get(a), cost) for a in node.all_input_nodes)
    accessed += _local_nbytes(node.meta.get("val"), sharding.specs.get(node), cost)
    return cost.compute_time(node_flops(node) / split, accessed, dtype_name(node))


def add_compute(estimate: Estimate, program: CapturedProgram, sharding: Sharding, cost: CostModel,
                scale: float = 1.0) -> None:
    """Compute seconds of every op on its local shards; ``scale`` multiplies each (data parallelism: the
    one-process step over the number of ranks)."""
    for node in program.graph.graph.nodes:
        if node.op != "call_function" or is_free(node):
            continue
        estimate.node_seconds[node] = _node_compute(node, sharding, cost) * scale
        seconds = estimate.node_seconds[node] * estimate.weight(node)
        if program.is_backward(node):
            estimate.backward_compute += seconds
        else:
            estimate.forward_compute += seconds


def _moved_value(node: fx.Node, arg_index: int) -> fx.Node:
    """The node whose value a redistribution on input ``arg_index`` of ``node`` moves (a placeholder's own)."""
    inputs = node.all_input_nodes
    return inputs[arg_index] if 0 <= arg_index < len(inputs) else node


def add_redistributions(estimate: Estimate, program: CapturedProgram, sharding: Sharding, cost: CostModel,
                        axis_names, once_per_value: bool = False) -> None:
    """The collectives of every redistribution; ``once_per_value``: a value moved to one layout is moved once
    for all its consumers (graph mode's program), else once per consumer (DTensor in eager mode)."""
    by_name = {node.name: node for node in program.graph.graph.nodes}
    done = set()
    for redistribution in sharding.redistributions:
        node = by_name[redistribution.node]
        key = (_moved_value(node, redistribution.arg_index), tuple(redistribution.target))
        if once_per_value and key in done:
            continue
        done.add(key)
        count = estimate.weight(node)
        for c in cost.moves(redistribution.source, redistribution.target, redistribution.global_nbytes):
            estimate.collectives.append(PlannedCollective(
                kind=c.kind, axis=axis_names[c.axis], nbytes=c.nbytes,
                phase="backward" if redistribution.backward else "forward", where=redistribution.node,
                seconds=cost.collective_time(c.kind, c.axis, c.nbytes), count=count))


def add_grad_sync(estimate: Estimate, sharding: Sharding, cost: CostModel, buckets: list[list[str]],
                  grad_node, param_nbytes: dict, param_placements: dict, axis_names) -> None:
    """One collective per bucket and mesh axis on which the gradients are not yet in their parameter's layout.

    ``grad_node(name)``: the captured node computing parameter ``name``'s gradient (None: no gradient)."""
    for index, bucket in enumerate(buckets):
        first = grad_node(bucket[0])
        if first is None:
            continue
        nbytes = sum(param_nbytes[name] for name in bucket)
        for c in cost.moves(sharding.specs[first].placements, param_placements[bucket[0]], nbytes):
            estimate.collectives.append(PlannedCollective(
                kind=c.kind, axis=axis_names[c.axis], nbytes=c.nbytes, phase="grad_sync",
                where=f"bucket{index}", seconds=cost.collective_time(c.kind, c.axis, c.nbytes)))


def add_exposed_comm(estimate: Estimate) -> None:
    """Forward/backward redistributions are exposed; gradient sync hides behind backward except the last bucket."""
    blocking = sum(c.seconds * c.count for c in estimate.collectives if c.phase != "grad_sync")
    grad = [c for c in estimate.collectives if c.phase == "grad_sync"]
    total_grad = sum(c.seconds * c.count for c in grad)
    last_bucket = sum(c.seconds for c in grad if c.where == grad[-1].where) if grad else 0.0
    estimate.exposed_comm = blocking + max(last_bucket, total_grad - estimate.backward_compute)


def add_memory(estimate: Estimate, program: CapturedProgram, sharding: Sharding, cost: CostModel) -> None:
    local = lambda node: _local_nbytes(node.meta.get("val"), sharding.specs.get(node), cost) * estimate.weight(node)  # noqa: E731
    params = sum(local(node) for node in program.param_nodes.values())
    buffers = sum(local(node) for node in program.buffer_nodes.values())
    saved = 0
    for node in program.graph.graph.nodes:
        if node.op == "call_function" and not program.is_backward(node) and not is_free(node):
            if any(program.is_backward(user) for user in node.users):
                saved += local(node)
    estimate.memory = {"parameters": params + buffers, "gradients": params,
                       "optimizer": ADAM_STATE_PER_PARAM * params, "activations": saved}
