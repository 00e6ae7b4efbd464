"""One set of pricing functions: a node's compute, a layout change, the exposed gradient sync, memory per device.

The MILP's objective (``search.problem``, ``search.milp``) and a plan's estimate (``search.estimate``) both price
with these, so the solver optimises the number the plan reports. Must never choose a plan.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from torch_autopar.capture import CapturedProgram
from torch_autopar.cost.model import CostModel, is_sharded
from torch_autopar.cost.ops import dtype_name, is_free

ADAM_STATE_PER_PARAM = 2
"""Optimizer state per parameter: Adam keeps two tensors the size of each parameter."""
PARAMETER_COPIES = 2 + ADAM_STATE_PER_PARAM
"""Bytes kept per parameter byte: the parameter, its gradient and the optimizer state."""


def local_nbytes(value, placements, cost: CostModel) -> int:
    """Bytes of one device's shard of ``value`` (0 for what is not a tensor; None placements: replicated)."""
    if not isinstance(value, torch.Tensor):
        return 0
    return value.numel() * value.element_size() // cost.shard_factor(placements or ())


def compute_seconds(node: fx.Node, flops: float, inputs, output, cost: CostModel) -> float:
    """Seconds one device spends on ``node`` when its inputs arrive in ``inputs`` (placements per
    ``node.all_input_nodes``, None for non-tensors) and its output is in ``output``: the work is split over every
    mesh axis on which some input is sharded; the bytes are the local shards read and written."""
    if is_free(node):
        return 0.0
    split = 1
    for axis, size in enumerate(cost.mesh_shape):
        if any(p is not None and is_sharded(p[axis]) for p in inputs):
            split *= size
    accessed = sum(local_nbytes(a.meta.get("val"), p, cost) for a, p in zip(node.all_input_nodes, inputs))
    accessed += local_nbytes(node.meta.get("val"), output, cost)
    return cost.compute_time(flops / split / _matmul_fraction(node, inputs, cost), accessed, dtype_name(node))


_MATMUL_OPERANDS = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2)}
"""Positional arguments that are the two multiplied matrices (or batches of them)."""


def _matmul_fraction(node: fx.Node, inputs, cost: CostModel) -> float:
    """Fraction of the peak a matmul reaches on this device's shards (``HardwareProfile.matmul_fraction``); 1
    for every other op and for profiles without shape classes."""
    name = getattr(node.target, "__name__", "").split(".")[0]
    if name not in _MATMUL_OPERANDS or not cost.hardware.matmul_rates:
        return 1.0
    shapes = []
    for index in _MATMUL_OPERANDS[name]:
        operand = node.args[index] if index < len(node.args) else None
        if not isinstance(operand, fx.Node) or not isinstance(operand.meta.get("val"), torch.Tensor):
            return 1.0
        shapes.append(_local_shape(operand.meta["val"].shape, inputs[node.all_input_nodes.index(operand)], cost))
    left, right = shapes
    return cost.hardware.matmul_fraction(left[-2], left[-1], right[-1])


def _local_shape(shape, placements, cost: CostModel) -> list[int]:
    local = list(shape)
    for axis, placement in enumerate(placements or ()):
        if is_sharded(placement):
            local[placement.dim] = -(-local[placement.dim] // cost.mesh_shape[axis])
    return local


def reshard_seconds(source, target, global_nbytes: int, cost: CostModel) -> float:
    """Seconds to move a tensor of ``global_nbytes`` from ``source`` to ``target`` placements."""
    if source is None or target is None or tuple(source) == tuple(target) or global_nbytes == 0:
        return 0.0
    latency, per_byte = cost.reshard_coefficients(tuple(source), tuple(target))
    return latency + per_byte * global_nbytes


def exposed_grad_sync(total: float, last: float, backward: float) -> float:
    """Gradient synchronisation left on the step: each gradient's sync overlaps the backward compute still to
    come, except the sync of the gradient ready last (``last``), which nothing follows."""
    return max(last, total - backward)


def saved_for_backward(program: CapturedProgram) -> set[fx.Node]:
    """Forward results that backward reads: kept from the forward until backward uses them."""
    saved = set()
    for node in program.graph.graph.nodes:
        if node.op == "call_function" and not program.is_backward(node) and not is_free(node):
            if any(program.is_backward(user) for user in node.users):
                saved.add(node)
    return saved


def memory_copies(program: CapturedProgram) -> dict[fx.Node, int]:
    """How many copies of each node's value a device holds through the step (absent: none)."""
    copies = {node: 1 for node in saved_for_backward(program)}
    copies.update({node: 1 for node in program.buffer_nodes.values()})
    copies.update({node: PARAMETER_COPIES for node in program.param_nodes.values()})
    return copies
