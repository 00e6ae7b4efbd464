"""Eager mode's module boundaries: each once-called submodule's DTensor inputs and outputs redistributed to the
plan's ``module_layouts`` by forward pre-hooks and forward hooks (what parallelize_module's PrepareModuleInput
and PrepareModuleOutput do), so DTensor runs every module's ops from the plan's layouts; ``print`` and
``breakpoint()`` inside still work. The planner prices exactly these moves (``search.module_layouts``).

A tensor is matched with the plan's entry of the same global shape, in order; a tensor whose shape the plan
does not list (a call with other sizes than planned) is left as DTensor placed it, and so is a plain tensor
(graph mode captures with plain parameters), as is everything while dynamo traces (graph mode runs the
plan's node layouts instead). A move never creates a partial sum (``boundary.move_target``).
Must never change a value: a redistribution only moves it.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from torch_autopar import _compat
from torch_autopar.search.plan import Plan
from torch_autopar.strategies import boundary
from torch_autopar.strategies.placements import parse_placements

pytree = _compat.pytree()  # torch.utils._pytree: no public equivalent in torch 2.13


class _Moved(torch.autograd.Function):
    """Forward: the value moved to ``placements``. Backward: its gradient handed on in the layout the ops that
    computed it left it in (the next backward op's rule moves it where it must), as the planner prices the
    backward: each backward op from its producers' layouts."""

    @staticmethod
    def forward(ctx, value, placements):
        return value.redistribute(value.device_mesh, placements)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _moved(tree, entries: tuple):
    """``tree`` with each DTensor leaf moved to the layout of the first unused entry of its global shape."""
    unused = list(entries)

    def move(leaf):
        if not isinstance(leaf, DTensor) or torch.compiler.is_compiling():
            return leaf
        shape = tuple(leaf.shape)
        entry = next((e for e in unused if tuple(e[1]) == shape), None)
        if entry is None:
            return leaf
        unused.remove(entry)
        target = boundary.move_target(tuple(leaf.placements), parse_placements(entry[2]))
        return leaf if tuple(leaf.placements) == target else _Moved.apply(leaf, target)

    return pytree.tree_map(move, tree)


class ModuleBoundaries:
    """The hooks that hold ``module``'s submodules to ``plan.module_layouts``."""

    def __init__(self, module: torch.nn.Module, plan: Plan):
        self.handles = []
        self.paths: list[str] = []
        """The submodules held to the plan (a path the module lacks, from a plan of another version, is not)."""
        for path, layout in plan.module_layouts.items():
            try:
                submodule = module.get_submodule(path)
            except AttributeError:
                continue
            self.paths.append(path)
            if layout.inputs:
                self.handles.append(submodule.register_forward_pre_hook(
                    lambda _, args, kwargs, entries=layout.inputs: _moved((args, kwargs), entries),
                    with_kwargs=True))
            if layout.outputs:
                self.handles.append(submodule.register_forward_hook(
                    lambda _, args, output, entries=layout.outputs: _moved(output, entries)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.paths = [], []
