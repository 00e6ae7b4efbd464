"""``autopar.clip_grad_norm_``: clip gradients by their global norm, whatever the plan shards.

Each sharded gradient contributes its local shard once; a gradient replicated over some mesh axes is counted
once, not once per replica; one all-reduce (sum, or max for the inf-norm) gives every rank the same total.
For unsharded modules it is ``torch.nn.utils.clip_grad_norm_``; a pipelined model's ranks hold different stages,
so it clips with ``pmodel.clip_grad_norm_`` (``runtime.pipeline``). Must never change a gradient's layout.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torch_autopar.errors import AutoparError


def _replicas(grad: DTensor) -> int:
    """On how many ranks each element of ``grad`` lives (product of the axes it is replicated on)."""
    mesh = grad.device_mesh
    count = 1
    for axis, placement in enumerate(grad.placements):
        if placement.is_partial():
            raise AutoparError("clip_grad_norm_ found a gradient holding partial sums; call it after backward "
                               "(gradients are reduced into their parameters' layouts at the end of backward).")
        if placement.is_replicate():
            count *= mesh.size(axis)
    return count


def _local_total(grads: list[DTensor], norm_type: float) -> torch.Tensor:
    if math.isinf(norm_type):
        values = [g.to_local().detach().abs().max() for g in grads if g.to_local().numel()]
        return torch.stack(values).max() if values else torch.zeros(())
    total = torch.zeros((), dtype=torch.float64)
    for grad in grads:
        local = grad.to_local().detach().double()
        total += torch.linalg.vector_norm(local, norm_type) ** norm_type / _replicas(grad)
    return total


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so that their global ``norm_type``-norm is at most ``max_norm``;
    returns the global norm before clipping (the same value on every rank). Every rank must call it."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    if not sharded:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
    if len(sharded) != len(grads):
        raise AutoparError("clip_grad_norm_ got both sharded (DTensor) and plain gradients; pass the parameters "
                           "of one compiled module (pmodel.parameters()).")
    norm_type = float(norm_type)
    total = _local_total(sharded, norm_type)
    dist.all_reduce(total, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
    total_norm = total if math.isinf(norm_type) else total ** (1.0 / norm_type)
    total_norm = total_norm.float()
    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise AutoparError(f"the total norm of the gradients is {total_norm.item()} (non-finite); the loss or a "
                           "gradient overflowed. Lower the learning rate or check the inputs.")
    scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    with torch.no_grad():
        for grad in sharded:
            grad.to_local().mul_(scale.to(grad.dtype))
    return total_norm
