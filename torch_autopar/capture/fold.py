"""Fold repeated layers for planning: capture the first, one middle and the last layer of a long ModuleList.

A list of L >= 4 identical layers (same type, same parameter names, shapes and dtypes) is shortened to
[first, middle, last] while capturing; the middle layer then stands for the L - 2 real middle layers: its
nodes, parameters and edges weigh L - 2 in the cost and memory of a plan. Since the middle layer is tied to the
first (capture.layers), this is exact up to boundary effects between middle layers, which cost what the captured
boundary costs. Capture time and problem size no longer grow with depth. Must never change the model
permanently: the original lists are restored on exit.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

import torch

MIN_LAYERS_TO_FOLD = 4


@dataclass(kw_only=True)
class Folding:
    lengths: dict[str, int] = field(default_factory=dict)
    """Module path of each folded ModuleList → its real number of layers."""

    def captured_name(self, real: str) -> str:
        """The captured parameter standing for real parameter ``real`` ("layers.17.w" → "layers.1.w")."""
        for path, length in self.lengths.items():
            match = re.match(rf"^{re.escape(path)}\.(\d+)\.(.*)$", real)
            if match:
                index = int(match.group(1))
                folded = 0 if index == 0 else 2 if index == length - 1 else 1
                return f"{path}.{folded}.{match.group(2)}"
        return real

    def real_names(self, captured: str) -> list[str]:
        """The real parameters a captured one stands for (middle layers in descending order, as backward)."""
        for path, length in self.lengths.items():
            match = re.match(rf"^{re.escape(path)}\.(\d+)\.(.*)$", captured)
            if match:
                index, rest = int(match.group(1)), match.group(2)
                indices = [0] if index == 0 else [length - 1] if index == 2 else list(range(length - 2, 0, -1))
                return [f"{path}.{i}.{rest}" for i in indices]
        return [captured]

    def real_order(self, captured_order: list[str]) -> list[str]:
        """Real parameters in the order of ``captured_order`` (e.g. gradient readiness): each run of a middle
        layer's parameters is repeated for every real middle layer it stands for, layer by layer."""
        result, run, run_family = [], [], None
        for name in captured_order + [None]:
            family = self._middle_family(name) if name is not None else None
            if run and family != run_family:
                length = self.lengths[run_family]
                prefix = f"{run_family}.1."
                for index in range(length - 2, 0, -1):
                    result += [f"{run_family}.{index}.{n[len(prefix):]}" for n in run]
                run = []
            if name is None:
                break
            if family is not None:
                run.append(name)
                run_family = family
            else:
                result += self.real_names(name)
        return result

    def _middle_family(self, captured: str) -> str | None:
        for path in self.lengths:
            if captured.startswith(f"{path}.1."):
                return path
        return None

    def real_layers(self, family: str, index: int) -> list[int]:
        """The indices of the real layers captured layer ``index`` of ``family`` stands for, in forward order."""
        length = self.lengths.get(family)
        if length is None:
            return [index]
        return [0] if index == 0 else [length - 1] if index == 2 else list(range(1, length - 1))

    def layer_weight(self, family: str, index: int) -> int:
        """How many real layers captured layer ``index`` of ``family`` stands for."""
        length = self.lengths.get(family)
        return length - 2 if length is not None and index == 1 else 1


def _signature(layer: torch.nn.Module):
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers())
    return type(layer), params, buffers


def _foldable(module: torch.nn.Module):
    for path, child in module.named_modules():
        if isinstance(child, torch.nn.ModuleList) and len(child) >= MIN_LAYERS_TO_FOLD:
            first = _signature(child[0])
            if all(_signature(layer) == first for layer in child):
                yield path, child


@contextlib.contextmanager
def folded_layers(module: torch.nn.Module, enabled: bool = True):
    """Shorten every foldable ModuleList of ``module`` to [first, middle, last] for the duration."""
    folding = Folding()
    replaced = []
    for path, layers in list(_foldable(module)) if enabled else []:
        parent_path, _, name = path.rpartition(".")
        parent = module.get_submodule(parent_path) if parent_path else module
        setattr(parent, name, torch.nn.ModuleList([layers[0], layers[1], layers[-1]]))
        replaced.append((parent, name, layers))
        folding.lengths[path] = len(layers)
    try:
        yield folding
    finally:
        for parent, name, layers in replaced:
            setattr(parent, name, layers)
