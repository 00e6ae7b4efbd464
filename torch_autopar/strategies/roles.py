"""Named strategies as restrictions of the one search space: a role per mesh axis limits leaf placements.

Roles (per mesh axis):
  dp     parameters replicated, user inputs split on dim 0 (data parallelism)
  fsdp   parameters sharded on dim 0, user inputs split on dim 0, and every op using a parameter takes it whole
         on the axis (ZeRO-3 / FSDP: gathered where used, so the runtime gathers a layer's parameters together)
  tp     user inputs replicated, parameters free (the search finds Megatron column/row pairs)
  free   no restriction ("auto")
Must never look at costs.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Replicate, Shard

from torch_autopar.capture import CapturedProgram
from torch_autopar.errors import AutoparError

ROLES = ("dp", "fsdp", "tp", "free")


def axis_roles(strategy: str, mesh_ndim: int) -> tuple[str, ...]:
    """Roles for the named strategies on a mesh of ``mesh_ndim`` axes.

    tensor_parallel on an N-D mesh is dp x tp (tensor parallelism on the last axis, data parallelism on the
    others); fsdp_tp is fully-sharded data parallelism on the leading axes with tp on the last."""
    if strategy == "auto":
        return ("free",) * mesh_ndim
    if strategy == "data_parallel":
        return ("dp",) * mesh_ndim
    if strategy == "fully_shard":
        return ("fsdp",) * mesh_ndim
    if strategy == "tensor_parallel":
        return ("dp",) * (mesh_ndim - 1) + ("tp",)
    if strategy == "fsdp_tp":
        if mesh_ndim < 2:
            raise AutoparError("strategy 'fsdp_tp' needs a mesh of at least 2 axes, e.g. mesh_shape=(8, 8).")
        return ("fsdp",) * (mesh_ndim - 1) + ("tp",)
    raise AutoparError(f"no axis roles for strategy {strategy!r}")


def batch_pieces(strategy: str, mesh_shape: tuple[int, ...]) -> int:
    """How many pieces a named strategy splits the batch into on ``mesh_shape``: the product of the sizes of the
    axes its roles give dp or fsdp."""
    roles = axis_roles(strategy, len(mesh_shape))
    return math.prod(size for role, size in zip(roles, mesh_shape) if role in ("dp", "fsdp"))


def check_batch_split(strategy: str, mesh_shape: tuple[int, ...], axis_names, global_batch: int | None) -> None:
    """Raise when ``strategy`` splits a batch of ``global_batch`` samples into more pieces than it has: devices
    would hold no sample (or, where a rule then replicates the input, compute the whole batch each), a plan no one
    wants. A batch at least that large divides unevenly where it must, as DTensor's shards do."""
    pieces = batch_pieces(strategy, mesh_shape)
    if global_batch is None or global_batch >= pieces:
        return
    roles = axis_roles(strategy, len(mesh_shape))
    axes = " x ".join(f"{name}={size}" for name, size, role in zip(axis_names, mesh_shape, roles)
                      if role in ("dp", "fsdp"))
    fitting = [name for name in ("data_parallel", "fully_shard", "tensor_parallel", "fsdp_tp")
               if (name != "fsdp_tp" or len(mesh_shape) > 1) and batch_pieces(name, mesh_shape) <= global_batch]
    raise AutoparError(
        f"strategy {strategy!r} splits the batch over the mesh axes {axes} ({pieces} pieces), but the global batch "
        f"has {global_batch} samples (dim 0 of the first input): {pieces - global_batch} of the pieces would be "
        f"empty. Expected a global batch of at least {pieces}; use a larger batch, a mesh with fewer devices on "
        "those axes, or " + (f"a strategy that splits this batch ({', '.join(fitting)}, or auto, which can also "
                             "split other dims)." if fitting else "strategy='auto', which can split other dims."))


def _allowed(role: str, kind: str, placement, value: torch.Tensor) -> bool:
    if role == "free" or kind == "other":
        return True
    if kind == "input":
        return isinstance(placement, Replicate) if role == "tp" else (
            isinstance(placement, Shard) and placement.dim == 0) if value.ndim else True
    if role == "dp":
        return isinstance(placement, Replicate)
    if role == "fsdp":
        return isinstance(placement, Shard) and placement.dim == 0 or value.ndim == 0
    return True  # tp: parameters free


def leaf_filter(program: CapturedProgram, roles: tuple[str, ...]):
    """A ``leaf_filter(node, placements)`` for ``enumerate_strategies`` enforcing ``roles``."""
    kinds = {node: "param" for node in program.param_nodes.values()}
    kinds.update({node: "param" for node in program.buffer_nodes.values()})
    kinds.update({node: "input" for node in program.input_nodes.values()})

    def keep(node, placements):
        kind = kinds.get(node, "other")
        value = node.meta["val"]
        kept = [p for p in placements if all(_allowed(r, kind, q, value) for r, q in zip(roles, p))]
        if kept:
            return kept
        return [tuple(Replicate() for _ in roles)]  # e.g. a tensor too small to shard: replicate it

    return keep


def gathered_uses(roles: tuple[str, ...]):
    """A ``gathered(positions, strategies) -> indices`` for an op whose inputs at ``positions`` are parameters (or
    views of them): the indices of the op's strategies that take each of them replicated on every fsdp axis
    (None where no axis is fsdp or no strategy does: then the op stays free rather than unsolvable)."""
    axes = [axis for axis, role in enumerate(roles) if role == "fsdp"]

    def gathered(positions, strategies):
        if not axes or not positions:
            return None
        kept = [a for a, strategy in enumerate(strategies)
                if all(isinstance(strategy.inputs[i][axis], Replicate) for i in positions for axis in axes)]
        return kept or None

    return gathered
