"""``Model.train(detect_anomalies=True)``: stop at the first non-finite loss or gradient, on every rank at once.

Each rank checks its own losses and (local shards of) gradients, then one small all-reduce (3 numbers per rank)
tells every rank what every other found, so all ranks raise the same error at the same step and none is left
waiting in a collective. Must never change a gradient or the optimizer.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torch_autopar.errors import AutoparError


def _first_nonfinite(named_params) -> int:
    """Index (in ``named_params``) of the first parameter whose gradient on this rank is not finite; -1 if none."""
    for index, (_, param) in enumerate(named_params):
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if not bool(torch.isfinite(local).all()):
            return index
    return -1


def check_finite(losses: list[float], named_params: list, step: int, epoch: int) -> None:
    """Raise the same ``AutoparError`` on every rank if any rank's ``losses`` or gradients are not finite."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    bad_loss = next((loss for loss in losses if not math.isfinite(loss)), None)
    findings = torch.zeros(world, 3, dtype=torch.float64)
    findings[rank] = torch.tensor([bad_loss is not None, _first_nonfinite(named_params) + 1,
                                   0.0 if bad_loss is None else bad_loss], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(findings)
    if findings[:, :2].abs().sum() == 0:
        return
    raise _anomaly_error(findings, [name for name, _ in named_params], step, epoch)


def _anomaly_error(findings: torch.Tensor, names: list[str], step: int, epoch: int) -> AutoparError:
    """Names the first rank whose loss is not finite (else the first whose gradients are not) and that rank's
    first parameter with a non-finite gradient."""
    losses_bad = [r for r in range(len(findings)) if findings[r, 0] > 0]
    rank = losses_bad[0] if losses_bad else next(r for r in range(len(findings)) if findings[r, 1] > 0)
    index = int(findings[rank, 1]) - 1
    parameter = f"first parameter with a non-finite gradient: {names[index]!r}" if index >= 0 else \
        "every gradient is finite"
    loss = f"loss {float(findings[rank, 2])}" if findings[rank, 0] > 0 else "finite loss"
    return AutoparError(
        f"detect_anomalies: training stopped at step {step} (epoch {epoch}) on rank {rank}: {loss}, {parameter}. "
        "Expected finite losses and gradients; found a NaN/Inf (all ranks stopped here, parameters are those before "
        "this step). Check that step's inputs, lower the learning rate or clip gradients (clip_grad_norm=).")
