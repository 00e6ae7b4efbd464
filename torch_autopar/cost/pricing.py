"""One set of pricing functions: a node's compute, the optimizer step, a layout change, the gradient sync and its
buckets, memory per device.

Memory per device is what a training step holds at its peak: each parameter's shard with its Adam state, buffers,
and the larger of the activations autograd keeps from the forward for backward (``saved_for_backward``: each
by the storage it keeps alive, on the plan's local shard shapes) and the gradients, which backward makes as it
frees those activations (``peak_bytes``, ``memory_copies``' two phases); a repeated layer that recomputes in backward
(activation checkpointing) keeps only its input and makes its activations again, one layer at a time
(``recomputed_activations``, ``recompute_memory``).

The MILP's objective (``search.problem``, ``search.milp``) and a plan's estimate (``search.estimate``) both price
with these, so the solver optimises the number the plan reports; graph mode's per-rank program lays out its
gradient buckets with the same ``bucket_key``, ``grad_reduction`` and ``shard_chunk``, so the plan prices the
buffers that run. Must never choose a plan.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from torch_autopar.capture import CapturedProgram
from torch_autopar.capture.layers import CASTS
from torch_autopar.cost.model import CollectiveCost, CostModel, is_sharded
from torch_autopar.cost.ops import dtype_name, is_free

ADAM_STATE_PER_PARAM = 2
"""Optimizer state per parameter: Adam keeps two tensors the size of each parameter."""
PARAMETER_COPIES = 2 + ADAM_STATE_PER_PARAM
"""Bytes kept per parameter byte: the parameter, its gradient and the optimizer state."""
PEAK_PHASES = ("backward start", "backward end")
"""The two moments a training step can peak at (``peak_bytes``): the forward's saved activations all held, or
every gradient made."""
FREED_BY_BACKWARD = ("activations", "recomputed_layer", "gathered_for_backward")
"""The kinds of ``peak_bytes``'s memory that the forward keeps for backward and backward frees as it goes:
saved activations (with the rise of a recomputed layer's, ``recompute_memory``), and parameters gathered in
forward and kept for backward."""
ADAMW_UPDATE_PASSES = 20
"""Bytes one ``torch.optim.AdamW`` step moves through memory per parameter byte, in its default for-loop (CPU)
and foreach (CUDA) implementations: weight decay (read and write the parameter), ``lerp_`` of the first moment
(3), ``mul_`` and ``addcmul_`` of the second (5), ``sqrt``, ``div`` and ``add_`` of the denominator (6), and
``addcdiv_`` into the parameter (4). Measured on this project's 2-core machine: 60 ms per step for 8.4M
parameters at 11 GB/s, i.e. 19.6 passes (``bench/bench_fidelity.py`` times the step with it)."""
ADAMW_UPDATE_OPS = 10
"""Kernels one AdamW step launches per parameter tensor (each pays the per-op overhead; on a DTensor parameter
also DTensor's dispatch, ``search.executed``)."""

_aten = torch.ops.aten
SAVED_BY_SELECTIVE = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten.convolution.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default, _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
}
"""Ops whose outputs "selective" recomputation keeps (``runtime.recompute``): the ones that cost FLOPs to redo
(torchtitan's choice, minus its every other matmul rule)."""
CHECKPOINT_STATE_BYTES = torch.get_rng_state().numel()
"""What non-reentrant ``torch.utils.checkpoint`` keeps per recomputed layer besides its inputs: the CPU random
generator's state, to replay the layer's random ops (dropout) when it recomputes."""


def local_nbytes(value, placements, cost: CostModel) -> int:
    """Bytes of one device's shard of ``value`` (0 for what is not a tensor; None placements: replicated)."""
    if not isinstance(value, torch.Tensor):
        return 0
    return value.numel() * value.element_size() // cost.shard_factor(placements or ())


def optimizer_seconds(local_bytes: float, tensors: int, cost: CostModel) -> float:
    """Seconds one device spends in the optimizer step on ``tensors`` parameter shards of ``local_bytes`` in all:
    a memory-bound update (``ADAMW_UPDATE_PASSES``) and the per-op overhead of its kernels. It runs after the
    gradient sync and overlaps nothing."""
    hardware = cost.hardware
    return (ADAMW_UPDATE_PASSES * local_bytes / hardware.memory_bandwidth
            + ADAMW_UPDATE_OPS * tensors * hardware.op_overhead_s)


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
            local[placement.dim] = shard_chunk(local[placement.dim], cost.mesh_shape[axis])
    return local


def reshard_seconds(source, target, global_nbytes: int, cost: CostModel) -> float:
    """Seconds to move a tensor of ``global_nbytes`` from ``source`` to ``target`` placements."""
    if source is None or target is None or tuple(source) == tuple(target) or global_nbytes == 0:
        return 0.0
    latency, per_byte = cost.reshard_coefficients(tuple(source), tuple(target))
    return latency + per_byte * global_nbytes


@dataclass(frozen=True, slots=True)
class GradReduction:
    """A gradient's sync as one collective on one mesh axis: its partial sum there reduced into a replica
    ("all_reduce") or into this rank's chunk of tensor dim ``dim`` ("reduce_scatter")."""

    kind: str
    axis: int
    dim: int | None = None


def grad_reduction(source, target) -> GradReduction | None:
    """The one collective that moves a gradient from ``source`` (the layout it is computed in) to ``target`` (its
    parameter's), when that is all it takes: one mesh axis changes, from a partial sum to a replica or to a shard
    of a dim no other axis shards. None otherwise (nothing moves, or a move of several steps): such a gradient
    is moved on its own, never in a bucket. Gradients with equal dtype and reduction kind and axis share buckets
    (``bucket_key``)."""
    types = (Shard, Replicate, Partial)
    if not all(type(p) in types for p in (*source, *target)):
        return None
    changed = [axis for axis, (have, want) in enumerate(zip(source, target)) if have != want]
    if len(changed) != 1:
        return None
    axis = changed[0]
    have, want = source[axis], target[axis]
    if not have.is_partial() or have.reduce_op != "sum" or want.is_partial():
        return None
    if want.is_replicate():
        return GradReduction("all_reduce", axis)
    if any(isinstance(p, Shard) and p.dim == want.dim for other, p in enumerate(source) if other != axis):
        return None
    return GradReduction("reduce_scatter", axis, want.dim)


def bucket_key(dtype, source, target) -> tuple | None:
    """The key of the buckets a gradient computed in ``source`` (its parameter in ``target``) may share: (dtype,
    collective kind, mesh axis); None when its sync is not one reduction (it moves alone)."""
    reduction = None if source is None else grad_reduction(source, target)
    return None if reduction is None else (dtype, reduction.kind, reduction.axis)


def shard_chunk(size: int, ranks: int) -> int:
    """Rows of the largest chunk when ``size`` rows are split over ``ranks`` (DTensor's ``Shard``, ``torch.chunk``)."""
    return -(-size // ranks)


def bucket_slot_shape(local_shape, reduction: GradReduction, axis_size: int) -> list[int]:
    """The shape of one rank's piece of a gradient (this rank's tensor of ``local_shape`` before the sync) in its
    bucket's flat buffer: all of it for an all_reduce; for a reduce_scatter, one of ``axis_size`` equal chunks of
    its dim (the last ones padded)."""
    shape = list(local_shape)
    if reduction.kind == "reduce_scatter":
        shape[reduction.dim] = shard_chunk(shape[reduction.dim], axis_size)
    return shape


def bucket_slot_numel(local_shape, reduction: GradReduction, axis_size: int) -> int:
    """Elements one gradient takes in its bucket's flat buffer before the sync: for a reduce_scatter, every
    rank's piece (``bucket_slot_shape``)."""
    pieces = axis_size if reduction.kind == "reduce_scatter" else 1
    return math.prod(bucket_slot_shape(local_shape, reduction, axis_size)) * pieces


def grad_bucket_collective(members, itemsize: int, cost: CostModel) -> CollectiveCost:
    """The one collective of a bucket of gradients reduced the same way (kind and mesh axis): ``members`` are each
    gradient's (global shape, placements it is computed in, its ``GradReduction``), ``itemsize`` bytes an element.
    Its bytes are the flat buffer's on one rank (of the largest local shards)."""
    kinds = {(reduction.kind, reduction.axis) for _, _, reduction in members}
    if len(kinds) != 1:
        raise AssertionError(f"a gradient bucket reduced in several ways: {sorted(kinds)}")
    (kind, axis), = kinds
    numel = sum(bucket_slot_numel(_local_shape(shape, source, cost), reduction, cost.mesh_shape[axis])
                for shape, source, reduction in members)
    return CollectiveCost(kind, axis, numel * itemsize)


def exposed_grad_sync(total: float, last: float, backward: float) -> float:
    """Gradient synchronisation left on the step: each gradient's sync overlaps the backward compute still to
    come, except the sync of the gradient ready last (``last``), which nothing follows."""
    return max(last, total - backward)


def forward_nodes(program: CapturedProgram) -> set[fx.Node]:
    """What the forward computes: every node the forward outputs and buffer updates depend on, with each output
    (``getitem``) of a multi-output op among them (the forward allocates all of them)."""
    forward, pending = set(), list(program.output_nodes.values()) + list(program.buffer_updates.values())
    while pending:
        node = pending.pop()
        if node not in forward:
            forward.add(node)
            pending.extend(node.all_input_nodes)
    forward.update(user for node in list(forward) for user in node.users if user.target is operator.getitem)
    return forward


def storage_owner(node: fx.Node) -> fx.Node:
    """The node that allocated ``node``'s storage: a view's base; an output of a multi-output op (not a view's
    split) is its own."""
    while node.op == "call_function" and is_free(node) and node.all_input_nodes:
        source = node.all_input_nodes[0]
        if node.target is operator.getitem and not (source.op == "call_function" and is_free(source)):
            break
        node = source
    return node


def saved_for_backward(program: CapturedProgram) -> set[fx.Node]:
    """The activations autograd keeps from the forward until backward reads them: each forward value read by an
    op outside the forward (backward) or returned, as the node that allocated its storage (a saved view keeps its
    base whole). Placeholders are not activations: parameters, buffers and inputs are held anyway; nor are the
    mixed-precision casts of parameters (copies of parameters, counted with them where a plan gathers them)."""
    forward = forward_nodes(program)
    weights = set(program.param_nodes.values()) | set(program.buffer_nodes.values())
    saved = set()
    for node in forward:
        if any(user not in forward for user in node.users):
            owner = storage_owner(node)
            if owner.op == "call_function" and not (owner.target in CASTS and set(owner.all_input_nodes) <= weights):
                saved.add(owner)
    return saved


def recomputed_activations(program: CapturedProgram, layers: dict) -> dict:
    """Repeated layer (any key) → the saved activations that recomputing it frees, for ``layers`` (key → its
    forward ops, ``capture.layers.forward_layer_nodes``): those it allocates, less those read outside it by a
    forward op or the program's output (its own output, the next layer's input: kept by that layer, as its
    checkpoint's input or for its backward). Non-reentrant checkpointing keeps the layer's inputs instead."""
    saved, forward = saved_for_backward(program), forward_nodes(program)
    returned = {storage_owner(arg) for output in program.graph.graph.find_nodes(op="output")
                for arg in output.all_input_nodes}
    freed = {}
    for layer, nodes in layers.items():
        inside = set(nodes)
        kept = returned | {storage_owner(arg) for user in forward - inside for arg in user.all_input_nodes}
        freed[layer] = {node for node in nodes if node in saved and node not in kept}
    return freed


def selectively_kept(program: CapturedProgram, layers: dict) -> dict:
    """Repeated layer → what "selective" recomputation keeps of it besides what "full" keeps: the outputs of its
    ``SAVED_BY_SELECTIVE`` ops (each by its storage), whether backward reads them or not, that full recomputation
    frees or never kept."""
    freed, saved = recomputed_activations(program, layers), saved_for_backward(program)
    kept = {}
    for layer, nodes in layers.items():
        ops = [node for node in nodes if node.target in SAVED_BY_SELECTIVE]
        outputs = {storage_owner(node) for node in ops} | {user for node in ops for user in node.users
                                                            if user.target is operator.getitem}
        kept_by_full = {node for node in nodes if node in saved} - freed[layer]
        kept[layer] = outputs - kept_by_full
    return kept


def all_recomputed(program: CapturedProgram, layers: dict) -> set[fx.Node]:
    """The saved activations freed when every layer of ``layers`` (as in ``recomputed_activations``) recomputes."""
    return set().union(*recomputed_activations(program, layers).values())


def memory_copies(program: CapturedProgram, recomputed: set[fx.Node] = frozenset(),
                  phase: str = "backward start", backward_frees: bool = True) -> dict[fx.Node, int]:
    """How many copies of each node's value a device holds at ``phase``, one of ``PEAK_PHASES`` (absent: none):
    each parameter with its optimizer state and the buffers throughout; as backward starts, the activations
    autograd saved (those in ``recomputed`` are not kept: their layers recompute them in backward); as it ends,
    each parameter's gradient instead (``peak_bytes``); without ``backward_frees`` (graph mode) the gradients
    are counted at both ends."""
    if phase not in PEAK_PHASES:
        raise ValueError(f"torch_autopar: memory phase must be one of {PEAK_PHASES}, found {phase!r}")
    start = phase == PEAK_PHASES[0]
    copies = {node: 1 for node in saved_for_backward(program) - set(recomputed)} if start else {}
    copies.update({node: 1 for node in program.buffer_nodes.values()})
    copies.update({node: PARAMETER_COPIES - (start and backward_frees) for node in program.param_nodes.values()})
    return copies


def peak_bytes(memory: dict[str, int], backward_frees: bool = True) -> int:
    """A step's peak bytes per device from its memory by kind (a plan's ``memory_breakdown``). Backward frees
    what the forward saved for it (``FREED_BY_BACKWARD``) as it makes the gradients, which the step starts
    without (``optimizer.zero_grad()`` sets them to None, PyTorch's default and ``Model.train``'s), so the two
    kinds peak at backward's two ends, never together: the step holds everything else plus the larger of them.
    Measured (``bench/bench_fsdp_memory.py``): the GPT's fully-sharded peak is at backward's end, data
    parallelism's too, and a plan that keeps every gathered parameter for backward peaks as backward starts.
    Steps that keep gradients while the next forward runs (accumulating micro-batches, ``zero_grad(set_to_none=
    False)``) hold both: up to the smaller of the two more than this (pipeline schedules price that sum).
    ``backward_frees`` False: graph mode, whose compiled backward is one autograd node that releases what the
    forward saved only as it ends (measured: the fully-sharded GPT's graph-mode peak is the sum), so the step
    holds the sum of every kind."""
    if not backward_frees:
        return sum(memory.values())
    freed = sum(memory.get(kind, 0) for kind in FREED_BY_BACKWARD)
    return sum(memory.values()) - min(freed, memory.get("gradients", 0))


def peak_phase(memory: dict[str, int]) -> str:
    """The end of backward (of ``PEAK_PHASES``) where ``peak_bytes(memory)`` is held."""
    freed = sum(memory.get(kind, 0) for kind in FREED_BY_BACKWARD)
    return PEAK_PHASES[0] if freed >= memory.get("gradients", 0) else PEAK_PHASES[1]


def recompute_memory(activations: int, layers: list[tuple[str, int, int]], recomputed) -> dict[str, int]:
    """Activation bytes per device when the layers in ``recomputed`` recompute. ``activations``: all kept;
    ``layers``: (layer, bytes of the saved activations it allocates, bytes recomputing it frees), in forward
    order. "activations": what the forward keeps; "recomputed_layer": how far the backward of a recomputed layer
    rises above that (its activations made again while the layers before it still hold theirs and those after it
    have freed theirs)."""
    kept = activations - sum(freed for layer, _, freed in layers if layer in recomputed)
    later, extra = 0, 0
    for layer, saved, freed in reversed(layers):
        if layer in recomputed:
            extra = max(extra, freed - later)
        later += saved - freed if layer in recomputed else saved
    return {"activations": kept, "recomputed_layer": extra}


def read_by_backward(program: CapturedProgram, param: fx.Node) -> bool:
    """Whether backward reads parameter ``param``'s value (itself, a view or its cast for mixed precision): then
    autograd keeps the gathered copy, and a group that frees it after forward gathers it again for backward (a
    weight whose input needs no gradient, a bias, is not read: ``runtime.fsdp`` does not gather those again)."""
    pending = [param]
    while pending:
        for user in pending.pop().users:
            if program.is_backward(user):
                return True
            if user.op == "call_function" and (is_free(user) or user.target in CASTS):
                pending.append(user)
    return False
