"""Count the collectives that actually run (kind, mesh axis, bytes), to hold them against a Plan's list.

A dispatch mode sees every functional collective DTensor issues and every c10d collective (eager and the
graphs of the "autopar" backend, which run op by op). Bytes follow the plan's convention: the full buffer on
one rank (all_gather: its output; the others: their input). Must never change what runs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from torch_autopar import _compat
from torch_autopar.capture.program import tensor_nbytes


@dataclass(frozen=True, slots=True)
class CountedCollective:
    kind: str
    axis: str
    nbytes: int
    dtype: str = ""
    """Of the tensor sent ("float32", "bfloat16": mixed precision reduces gradients in its reduce_dtype)."""


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter(mesh) as counter: step()`` → ``counter.records`` / ``counter.summary()``.
    ``groups``: axis name → process group, for groups outside a mesh (a pipeline's ``axis_groups``)."""

    def __init__(self, mesh=None, axis_names=None, groups: dict | None = None):
        super().__init__()
        self.records: list[CountedCollective] = []
        self._kinds = {packet: info for packet, info in _compat.collective_op_kinds().items()}
        self._axes: dict[str, str] = {_compat.group_name(group): name for name, group in (groups or {}).items()
                                      if group is not None}
        if mesh is not None:
            names = tuple(axis_names or mesh.mesh_dim_names or range(mesh.ndim))
            for axis in range(mesh.ndim):
                self._axes[_compat.group_name(mesh.get_group(axis))] = str(names[axis])
            if dist.is_initialized():
                self._axes.setdefault(_compat.group_name(dist.group.WORLD), "+".join(map(str, names)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run first; the collectives it issues come back through here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        info = self._kinds.get(func.overloadpacket)
        if info is not None:
            kind, which, group_index = info
            sent = args[which] if isinstance(which, int) else \
                args[0] if which != "output" or isinstance(out, tuple) else out  # c10d ops return (tensors, work)
            nbytes = tensor_nbytes(sent)
            group = args[group_index] if len(args) > group_index else None
            if group is not None and not isinstance(group, str):
                group = _compat.dispatched_group_name(group)
            axis = self._axes.get(group, str(group)) if isinstance(group, str) else self._axes.get(
                _compat.group_name(dist.group.WORLD), "world")
            self.records.append(CountedCollective(kind, axis, nbytes, _dtype_name(sent)))
        return out

    def summary(self) -> Counter:
        """(kind, axis, bytes) → how many ran."""
        return Counter((r.kind, r.axis, r.nbytes) for r in self.records)


def _dtype_name(sent) -> str:
    tensor = sent[0] if isinstance(sent, (list, tuple)) and sent else sent
    tensor = tensor[0] if isinstance(tensor, (list, tuple)) and tensor else tensor
    return str(tensor.dtype).removeprefix("torch.") if isinstance(tensor, torch.Tensor) else ""


def planned_summary(plan) -> Counter:
    """The plan's collectives in the same form: (kind, axis, bytes) → how many per step."""
    counts: Counter = Counter()
    for c in plan.collectives:
        if c.nbytes > 0:
            counts[(c.kind, c.axis, c.nbytes)] += c.count
    return counts
