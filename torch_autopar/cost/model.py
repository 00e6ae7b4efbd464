"""``CostModel``: seconds for compute and collectives on each mesh axis, bytes of memory per device.

Collectives follow the alpha-beta model for ring algorithms on an axis of ``p`` devices, ``n`` bytes:
all_reduce 2(p-1)·alpha + 2(p-1)/p·n·beta; all_gather, reduce_scatter, all_to_all (p-1)·alpha + (p-1)/p·n·beta.
An axis uses the intra-node link when all the ranks it spans sit in one node, the inter-node link otherwise.
Must never decide a plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard

from torch_autopar.cost.hardware import HardwareProfile, Link

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True, slots=True)
class CollectiveCost:
    kind: str
    axis: int
    nbytes: int
    """Bytes of the full buffer on one rank (all_gather: output; reduce_scatter: input)."""


def collectives_for(source, target, global_nbytes: int, mesh_shape) -> list[CollectiveCost]:
    """The collectives that move a tensor from ``source`` to ``target`` placements (one entry per mesh axis)."""
    result = []
    for axis, (have, wanted) in enumerate(zip(source, target)):
        kind = _transition_kind(have, wanted)
        if kind is None:
            continue
        sharded_elsewhere = 1
        for other, placement in enumerate(target if kind == "all_gather" else source):
            if other != axis and is_sharded(placement):
                sharded_elsewhere *= mesh_shape[other]
        result.append(CollectiveCost(kind, axis, global_nbytes // max(sharded_elsewhere, 1)))
    return result


def is_sharded(placement) -> bool:
    """Shard or _StridedShard (whose ``is_shard()`` is False in torch 2.13)."""
    return placement is not None and (placement.is_shard() or type(placement).__name__ == "_StridedShard")


def _transition_kind(have, want) -> str | None:
    if have == want or have.is_replicate() and (is_sharded(want) or want.is_partial()):
        return None  # a local slice, or a zero/identity contribution: no communication
    if have.is_partial():
        return "reduce_scatter" if is_sharded(want) else "all_reduce"
    if is_sharded(have) and want.is_replicate():
        return "all_gather"
    if is_sharded(have) and is_sharded(want):
        return "all_to_all"
    if is_sharded(have) and want.is_partial():
        return "all_gather"
    raise AssertionError(f"no collective known for {have!r} -> {want!r}")


def _one_step(source, target) -> bool:
    """One mesh axis changes and no other axis shards a tensor dim it touches: DTensor moves it in that one
    step, so asking DTensor's planner (about 1 ms a pair on a 3-D mesh) gives nothing more."""
    plain = (Shard, Replicate, Partial)
    if not all(type(p) in plain for p in (*source, *target)):
        return False
    changed = [axis for axis, (have, want) in enumerate(zip(source, target)) if have != want]
    if len(changed) != 1:
        return False
    dims = {p.dim for p in (source[changed[0]], target[changed[0]]) if isinstance(p, Shard)}
    return not any(isinstance(p, Shard) and p.dim in dims for axis, p in enumerate(source) if axis != changed[0])


def canonical_move(source: tuple, target: tuple) -> tuple[tuple, tuple]:
    """``(source, target)`` with tensor dims renumbered by first appearance (``(S(2), R) -> (R, S(3))`` becomes
    ``(S(0), R) -> (R, S(1))``): the moves between them (their kinds, axes and shares of the bytes) do not depend
    on which dims are split, only on which axes split the same one (DTensor's greedy redistribution compares dims
    for equality only; other placements, such as a masked partial sum, are compared whole). With a
    ``_StridedShard`` (DTensor plans those by graph search): as given."""
    if any(is_sharded(p) and type(p) is not Shard for p in (*source, *target)):
        return source, target
    dims: dict[int, int] = {}
    renumber = lambda p: Shard(dims.setdefault(p.dim, len(dims))) if type(p) is Shard else p  # noqa: E731
    return tuple(map(renumber, source)), tuple(map(renumber, target))


class CostModel:
    """Costs on ``hardware`` for a mesh of ``mesh_shape`` (ranks laid out row-major, last axis innermost)."""

    def __init__(self, hardware: HardwareProfile, mesh_shape: tuple[int, ...], mesh=None):
        self.hardware = hardware
        self.mesh_shape = tuple(mesh_shape)
        self.mesh = mesh
        """A DeviceMesh (real or fake) lets ``moves`` follow DTensor's own redistribution steps."""
        self._moves: dict = {}
        """Memo of ``_unit_moves`` and of ``reshard_coefficients`` by ``canonical_move`` (a 3-D mesh prices tens of
        thousands of placement pairs, a few thousand of them distinct once canonical)."""
        self._coefficients: dict = {}

    @property
    def has_all_to_all(self) -> bool:
        """Gloo has no all_to_all: DTensor all-gathers and keeps its chunk instead (same bytes out)."""
        name = self.hardware.name
        return not (name.startswith("cpu") or "gloo" in name)

    def moves(self, source, target, global_nbytes: int) -> list[CollectiveCost]:
        """The collectives that run to move a tensor of ``global_nbytes`` from ``source`` to ``target``: the
        steps DTensor takes when a mesh is known (exact for multi-axis moves), else one per axis."""
        key = canonical_move(tuple(source), tuple(target))
        if key not in self._moves:
            self._moves[key] = self._unit_moves(*key)
        return [CollectiveCost(kind, axis, int(global_nbytes * share)) for kind, axis, share in self._moves[key]]

    def _unit_moves(self, source, target) -> list[tuple[str, int, float]]:
        if self.mesh is None or _one_step(source, target):
            steps = [(c.axis, c.kind, c.nbytes / (1 << 30)) for c in collectives_for(source, target, 1 << 30, self.mesh_shape)]
        else:
            from torch_autopar import _compat

            steps, current = [], list(source)
            for axis, have, want in _compat.redistribute_steps(self.mesh, source, target):
                others = [self.mesh_shape[d] for d, p in enumerate(current) if d != axis and is_sharded(p)]
                steps.append((axis, _transition_kind(have, want), 1.0 / math.prod(others)))
                current[axis] = want
        moves = []
        for axis, kind, share in steps:
            if kind is None:
                continue
            moves.append(("all_gather" if kind == "all_to_all" and not self.has_all_to_all else kind, axis, share))
        return moves

    def link(self, axis: int) -> Link:
        """The link an axis's collectives run over: intra-node if the ranks it spans share a node."""
        stride = 1
        for size in self.mesh_shape[axis + 1:]:
            stride *= size
        span = stride * self.mesh_shape[axis]
        return self.hardware.intra_node if span <= self.hardware.devices_per_node else self.hardware.inter_node

    def collective_coefficients(self, kind: str, axis: int) -> tuple[float, float]:
        """(seconds of latency, seconds per byte) of one collective on ``axis``: time = a + b * nbytes."""
        if kind not in COLLECTIVE_KINDS:
            raise AssertionError(f"unknown collective kind {kind!r}")
        p = self.mesh_shape[axis]
        if p == 1:
            return 0.0, 0.0
        link = self.link(axis)
        beta = 1.0 / (link.bandwidth * self.hardware.comm_efficiency)
        steps, volume = ((2 * (p - 1), 2 * (p - 1) / p) if kind == "all_reduce" else ((p - 1), (p - 1) / p))
        return link.call_s + steps * link.latency_s, volume * beta

    def collective_time(self, kind: str, axis: int, nbytes: int) -> float:
        """Seconds for one collective of ``nbytes`` (full buffer per rank) on mesh axis ``axis``."""
        if nbytes == 0:
            return 0.0
        latency, per_byte = self.collective_coefficients(kind, axis)
        return latency + per_byte * nbytes

    def reshard_coefficients(self, source, target) -> tuple[float, float]:
        """(latency, seconds per byte of the global tensor) to move a tensor from ``source`` to ``target``."""
        key = canonical_move(tuple(source), tuple(target))
        if key not in self._coefficients:
            latency = per_byte = 0.0
            for move in self.moves(*key, 1 << 30):
                a, b = self.collective_coefficients(move.kind, move.axis)
                latency += a
                per_byte += b * move.nbytes / (1 << 30)
            self._coefficients[key] = (latency, per_byte)
        return self._coefficients[key]

    def compute_time(self, flops: float, bytes_accessed: float, dtype: str) -> float:
        """Roofline: the slower of arithmetic and memory traffic, plus a fixed per-op overhead."""
        peak = self.hardware.peak_flops(dtype) * self.hardware.compute_efficiency
        return max(flops / peak, bytes_accessed / self.hardware.memory_bandwidth) + self.hardware.op_overhead_s

    def shard_factor(self, placements) -> int:
        """How many pieces a tensor with these placements is split into across the mesh."""
        factor = 1
        for axis, placement in enumerate(placements):
            if is_sharded(placement):
                factor *= self.mesh_shape[axis]
        return factor
