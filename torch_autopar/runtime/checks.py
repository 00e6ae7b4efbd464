"""Checks a compiled module runs at each call, so bad input fails with a ``torch_autopar:`` error rather than
a wrong answer: inputs of the planned dtype, device and number of dims; the module's parameters unchanged since
planning; with ``full_batch=True``, the same batch on every rank.

Decision on shapes (NOTE [input shapes]): a plan's layouts do not depend on tensor sizes, so the plan is kept
when sizes change. The batch dim may change freely (a last, smaller batch); a change of any other size is
reported once per module with a warning (the plan's estimates were made for the planned sizes); graph mode
compiles once per new shape and refuses, with an error, more than ``MAX_GRAPH_SHAPES`` shapes. A different number
of dims, dtype or device is an error. Must never change an input or run a collective except the full-batch
checksum.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torch_autopar import _compat
from torch_autopar.errors import AutoparError

pytree = _compat.pytree()  # torch.utils._pytree: no public equivalent in torch 2.13

MAX_GRAPH_SHAPES = 8
"""Graph mode compiles once per input shape; dynamo's own recompile limit is 8."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def input_specs(args, kwargs) -> dict[str, TensorSpec]:
    """Each tensor input by its path in (args, kwargs), e.g. "[0][0]" (first positional)."""
    leaves, _ = pytree.tree_flatten_with_path((args, kwargs))
    return {pytree.keystr(path): TensorSpec(tuple(leaf.shape), leaf.dtype, leaf.device)
            for path, leaf in leaves if isinstance(leaf, torch.Tensor)}


def _describe(path: str) -> str:
    return f"input {path}"


class InputCheck:
    """The inputs a module was planned for, and the comparison of each later call's inputs with them."""

    def __init__(self, planned: dict[str, TensorSpec], module_name: str):
        self.planned, self.module_name = planned, module_name
        self.graph_shapes: set = set()
        self.warned = False

    def check(self, args, kwargs, mode: str) -> None:
        found = input_specs(args, kwargs)
        for path, spec in found.items():
            if path in self.planned:
                self._compare(path, self.planned[path], spec)
        if mode == "graph":
            self._count_graph_shape(found)

    def _compare(self, path: str, planned: TensorSpec, found: TensorSpec) -> None:
        fix = (f"Pass inputs like the planned ones, or compile again for the new ones "
               f"(autopar.compile({self.module_name}(...)))")
        if found.dtype != planned.dtype:
            raise AutoparError(f"{_describe(path)} of {self.module_name} was planned as {planned.dtype} but is "
                               f"{found.dtype}; cast it (e.g. x.to({planned.dtype})). {fix}.")
        if found.device != planned.device:
            raise AutoparError(f"{_describe(path)} of {self.module_name} was planned on device {planned.device} "
                               f"but is on {found.device}; move it (x.to('{planned.device}')). {fix}.")
        if len(found.shape) != len(planned.shape):
            raise AutoparError(f"{_describe(path)} of {self.module_name} was planned with {len(planned.shape)} dims "
                               f"{planned.shape} but has {len(found.shape)} dims {found.shape}. {fix}.")
        if found.shape[1:] != planned.shape[1:] and not self.warned:
            self.warned = True
            warnings.warn(
                f"torch_autopar: {_describe(path)} of {self.module_name} has shape {found.shape}, the plan was "
                f"made for {planned.shape}: the plan is kept (its layouts hold for any size) but its estimates "
                "are for the planned sizes; graph mode compiles once per new shape. Warned once per module.",
                stacklevel=4)

    def _count_graph_shape(self, found: dict[str, TensorSpec]) -> None:
        key = tuple(sorted((path, spec.shape) for path, spec in found.items()))
        if key in self.graph_shapes:
            return
        if len(self.graph_shapes) >= MAX_GRAPH_SHAPES:
            shapes = [spec.shape for spec in found.values()]
            raise AutoparError(
                f"graph mode compiles {self.module_name} once per input shape and has compiled "
                f"{len(self.graph_shapes)}; this call brings another ({shapes}). Expected at most "
                f"{MAX_GRAPH_SHAPES} shapes: pad or bucket the inputs to a few shapes (drop_last for the batch), "
                "or run it in eager mode (compile(..., mode='eager')).")
        self.graph_shapes.add(key)


def parameter_ids(module: torch.nn.Module) -> dict[str, int]:
    return {name: id(param) for name, param in module.named_parameters()}


def check_parameters_unchanged(module: torch.nn.Module, planned: dict[str, int]) -> None:
    """The module has the parameters it was planned with (same names, same objects)."""
    now = parameter_ids(module)
    if now == planned:
        return
    added = sorted(name for name in now if name not in planned)
    removed = sorted(name for name in planned if name not in now)
    replaced = sorted(name for name in now if name in planned and now[name] != planned[name])
    found = "; ".join(f"{what} {names}" for what, names in
                      (("added", added), ("removed", removed), ("replaced", replaced)) if names)
    raise AutoparError(
        f"the parameters of {type(module).__name__} changed after autopar.compile planned it ({found}); the plan "
        "and its gradient synchronisation cover the parameters that existed at planning, so the new ones would "
        "train wrongly. Change the model before autopar.compile, or compile the changed model again "
        "(load values with load_state_dict(..., assign=False)).")


_WEIGHTS: dict = {}


def _checksum(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, position-weighted sum) of ``tensor`` in float64: equal inputs give equal sums; different or
    differently shuffled ones almost surely do not."""
    flat = torch.nan_to_num(tensor.detach().reshape(-1).to(torch.float64), nan=0.0, posinf=1e300, neginf=-1e300)
    key = (flat.numel(), flat.device)
    if key not in _WEIGHTS:
        if len(_WEIGHTS) >= 16:
            _WEIGHTS.clear()
        _WEIGHTS[key] = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device).remainder_(251)
    return flat.sum(), (flat * _WEIGHTS[key]).sum()


def check_same_full_batch(args, kwargs, group, world_size: int) -> None:
    """With ``full_batch=True`` every rank must pass the same batch: one all-reduce (MAX) of each tensor's
    checksums and their negatives (2 float64 numbers per tensor each way) compares them on all ranks."""
    tensors = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
    if not tensors:
        return
    sums = torch.stack([value for tensor in tensors for value in _checksum(tensor)])
    both = torch.cat([sums, -sums])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    highest, lowest = both[:len(sums)], -both[len(sums):]
    differs = (highest - lowest).abs() > 1e-9 * torch.maximum(highest.abs(), torch.ones_like(highest))
    if bool(differs.any()):
        which = int(differs.nonzero()[0]) // 2
        raise AutoparError(
            f"full_batch=True expects every rank to pass the same global batch, but input tensor {which} "
            f"(shape {tuple(tensors[which].shape)}) differs between the {world_size} ranks (checksums "
            f"{float(lowest[2 * which]):.6g} to {float(highest[2 * which]):.6g}). Load the same batch on every "
            "rank (same seed and sampler), or drop full_batch=True and pass each rank its slice.")
