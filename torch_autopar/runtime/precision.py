"""Mixed precision: fp32 master parameters, forward and backward in a low precision, reductions in ``reduce_dtype``.

``MixedPrecision(param_dtype=, reduce_dtype=, output_dtype=)`` is the policy (FSDP2's ``MixedPrecisionPolicy``);
``compile(..., mixed_precision="bf16" | "fp16" | policy)`` accepts it (``resolve``). Each call of a compiled
module:
  inputs      floating tensors are cast to ``param_dtype`` (integer token ids stay as they are);
  parameters  every floating parameter is cast to ``param_dtype`` once per call (a differentiable ``.to``) and the
              module runs on the copies through ``torch.func.functional_call``: each gradient flows back through the
              cast and accumulates in the fp32 master, which is all the optimizer (and its state) ever sees;
  outputs     floating tensors are cast to ``output_dtype`` (fp32 by default: the loss is computed in fp32).
Gradient reductions run in ``reduce_dtype``: data parallelism casts each bucket (``rewrite.GradientReducer`` in
eager mode, ``rewrite.GradSyncPass`` in graph mode); a sharded plan's parameters pass through ``compute_parameters``,
whose backward casts each gradient to ``reduce_dtype`` before DTensor reduces it into the parameter's layout (the
reduce-scatter of a fully-sharded parameter, the all-reduce of partial sums over the batch axes), while the forward
gathers a fully-sharded parameter already cast to ``param_dtype`` (half the bytes of an fp32 gather, as FSDP2).
Gradients of activations (tensor parallelism's partial sums inside the backward) are reduced in ``param_dtype``:
they are computed in it.

Must never change a master parameter's dtype or value, keep a low-precision copy beyond one call, or hand the
optimizer anything but the fp32 masters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from torch_autopar import _compat
from torch_autopar.errors import AutoparError

pytree = _compat.pytree()  # torch.utils._pytree: no public equivalent in torch 2.13

LOW_PRECISION = (torch.bfloat16, torch.float16, torch.float32)
"""Dtypes a policy may compute in (float32: a policy that only changes reduce_dtype or output_dtype)."""
SHORT_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True, slots=True)
class MixedPrecision:
    """What a compiled module computes in; its parameters (the masters) and optimizer state stay fp32."""

    param_dtype: torch.dtype = torch.bfloat16
    """Dtype of the parameter copies and inputs the forward and backward compute with."""
    reduce_dtype: torch.dtype = torch.float32
    """Dtype gradients are reduced (all-reduced, reduce-scattered) in across ranks (torchtitan's default: fp32)."""
    output_dtype: torch.dtype = torch.float32
    """Dtype the module's floating outputs are cast to (fp32: the loss is computed in fp32)."""

    def __post_init__(self):
        if self.param_dtype not in LOW_PRECISION:
            raise AutoparError(f"MixedPrecision(param_dtype={self.param_dtype!r}): expected one of {LOW_PRECISION}. "
                               "Use torch.bfloat16 (or 'bf16') or torch.float16 (or 'fp16').")
        for field in ("reduce_dtype", "output_dtype"):
            value = getattr(self, field)
            if not isinstance(value, torch.dtype) or not value.is_floating_point:
                raise AutoparError(f"MixedPrecision({field}={value!r}): expected a floating torch.dtype such as "
                                   "torch.float32 or torch.bfloat16.")

    @property
    def needs_grad_scaler(self) -> bool:
        """fp16 gradients underflow without loss scaling (``Model.train`` then uses a GradScaler)."""
        return self.param_dtype == torch.float16


def resolve(mixed_precision) -> MixedPrecision | None:
    """The policy ``compile(mixed_precision=...)`` names: None, "bf16", "fp16" or a ``MixedPrecision``."""
    if mixed_precision is None or isinstance(mixed_precision, MixedPrecision):
        return mixed_precision
    if isinstance(mixed_precision, str) and mixed_precision in SHORT_NAMES:
        return MixedPrecision(param_dtype=SHORT_NAMES[mixed_precision])
    raise AutoparError(f"mixed_precision={mixed_precision!r}: expected None, 'bf16', 'fp16' or "
                       "autopar.MixedPrecision(param_dtype=..., reduce_dtype=..., output_dtype=...).")


def _cast_floating(tree, dtype: torch.dtype):
    def cast(leaf):
        return leaf.to(dtype) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else leaf

    return pytree.tree_map(cast, tree)


def cast_inputs(policy: MixedPrecision | None, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if policy is None:
        return args, kwargs
    return _cast_floating((tuple(args), dict(kwargs)), policy.param_dtype)


def cast_outputs(policy: MixedPrecision | None, output):
    return output if policy is None else _cast_floating(output, policy.output_dtype)


def reduce_dtype(policy: MixedPrecision | None) -> torch.dtype | None:
    """The dtype gradient reductions run in (None: each gradient's own)."""
    return None if policy is None else policy.reduce_dtype


def planned_dtypes(policy: MixedPrecision | None) -> dict:
    """The dtypes the planner prices parameter gathers and gradient reductions in (``search.build_plan``)."""
    if policy is None:
        return {"param_dtype": None, "reduce_dtype": None}
    return {"param_dtype": policy.param_dtype, "reduce_dtype": policy.reduce_dtype}


def grad_scaler(policy: MixedPrecision | None, device: torch.device):
    """A ``torch.amp.GradScaler`` when ``policy`` computes in fp16 (``Model.train`` scales the loss with it), else
    None: bf16 has fp32's exponent range and needs none."""
    if policy is None or not policy.needs_grad_scaler:
        return None
    return torch.amp.GradScaler(device.type)


def unscale(scaler, optimizer) -> None:
    """``scaler.unscale_(optimizer)`` with its non-finite flags agreed over all ranks: a rank that holds only
    shards sees only its own gradients, and every rank must skip the same steps."""
    scaler.unscale_(optimizer)
    if dist.is_initialized():
        for found_inf in _compat.grad_scaler_found_inf(scaler, optimizer):
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)


class CastCall:
    """Calls ``module`` with its floating parameters cast to ``policy.param_dtype`` (``module`` itself when
    ``policy`` is None): what eager and graph mode run, and what planning captures."""

    def __init__(self, module: torch.nn.Module, policy: MixedPrecision | None):
        self.module, self.policy = module, policy

    def __call__(self, *args, **kwargs):
        if self.policy is None:
            return self.module(*args, **kwargs)
        dtype = self.policy.param_dtype
        cast = {name: p.to(dtype) if p.is_floating_point() else p for name, p in self.module.named_parameters()}
        return torch.func.functional_call(self.module, cast, args, kwargs)


class _ToCompute(torch.autograd.Function):
    """Forward: a DTensor parameter cast to ``dtype`` and moved to its compute layout (a fully-sharded one is
    gathered after the cast). Backward: the gradient cast to ``reduce_dtype``, reduced into the parameter's own
    layout there, then cast to the master's dtype."""

    @staticmethod
    def forward(ctx, param, placements, dtype, reduce_dtype):
        ctx.layout, ctx.master_dtype, ctx.reduce_dtype = tuple(param.placements), param.dtype, reduce_dtype
        return param.to(dtype).redistribute(param.device_mesh, placements)

    @staticmethod
    def backward(ctx, grad):
        reduced = grad.to(ctx.reduce_dtype).redistribute(grad.device_mesh, ctx.layout)
        return reduced.to(ctx.master_dtype), None, None, None


def to_compute(param, placements: tuple, dtype: torch.dtype, reduce_dtype: torch.dtype):
    """``param`` (a DTensor) cast to ``dtype`` in ``placements``, its gradient reduced in ``reduce_dtype``."""
    return _ToCompute.apply(param, placements, dtype, reduce_dtype)


def to_compute_node() -> type:
    """The autograd node class of ``to_compute``'s output (activation checkpointing casts the master again)."""
    return _compat.autograd_node_class(_ToCompute)


def compute_parameters(params: dict, placements: dict, policy: MixedPrecision | None) -> dict:
    """Parameter name → the tensor a sharded plan's forward computes with. ``params``: name → DTensor parameter;
    ``placements``: name → compute placements, for the parameters gathered before the forward. Without a policy,
    only those, gathered (the others are used as they are); with one, every floating parameter, cast."""
    if policy is None:
        return {name: params[name].redistribute(params[name].device_mesh, wanted) for name, wanted in placements.items()}
    computed = {}
    for name, param in params.items():
        if param.is_floating_point():
            wanted = placements.get(name, tuple(param.placements))
            computed[name] = to_compute(param, wanted, policy.param_dtype, policy.reduce_dtype)
    return computed
