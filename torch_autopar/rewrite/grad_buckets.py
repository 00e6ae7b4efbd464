"""Graph mode's gradient buckets, while the per-rank program is traced: each bucket of the plan flattened into one
buffer and reduced by one functional collective, issued as soon as its last gradient is computed and waited for
when the next bucket's collective is issued (or, for the last, where a gradient of it is first used: the program's
output), and unflattened there. One collective in flight at a time, as FSDP2 reduce-scatters: until it is waited
for, a collective holds its input (gloo's reduce_scatter a whole copy of it), so waiting for every bucket at the
output kept every bucket's unreduced gradients until the end of backward.

A bucket (``Plan.grad_buckets``) holds gradients of one dtype reduced the same way (``cost.pricing.bucket_key``:
collective kind and mesh axis; under mixed precision in the policy's ``reduce_dtype``, then cast back): an
all_reduce of their concatenation, or a reduce_scatter of a buffer laid out rank by rank, each gradient's chunk of
its reduced dim (padded to equal chunks of ``cost.pricing.shard_chunk`` rows, as the plan prices them) in bucket
order inside each rank's segment, so that the segment a rank receives holds its chunk of every gradient. A gradient
whose layout is not its bucket's is moved on its own (the caller's ``redistribute``). Must never choose a bucket
(the plan does) and never run a collective outside the traced program.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torch_autopar import _compat
from torch_autopar.cost import pricing


@dataclass(frozen=True, slots=True)
class _Gradient:
    node: fx.Node
    value: DTensor
    """As computed (global shape, its layout)."""
    target: tuple
    reduction: pricing.GradReduction


@dataclass(kw_only=True)
class _Bucket:
    names: list[str]
    waiting: set[str]
    key: tuple | None = None
    """``cost.pricing.bucket_key`` of the first gradient that arrived."""
    ready: dict[str, _Gradient] = field(default_factory=dict)
    reduced: torch.Tensor | None = None
    waited: torch.Tensor | None = None
    results: dict[fx.Node, DTensor] | None = None


class GradBuckets:
    """The plan's buckets over the gradients of one traced program.

    ``buckets``: the plan's buckets of parameter names; ``grads``: gradient node → (parameter name, its parameter's
    placements), for the gradients this program computes (a bucket's other names are left out)."""

    def __init__(self, buckets: list[list[str]], grads: dict[fx.Node, tuple[str, tuple]], mesh: DeviceMesh,
                 reduce_dtype: torch.dtype | None = None):
        self.mesh, self.reduce_dtype = mesh, reduce_dtype
        self.target = {name: placements for name, placements in grads.values()}
        self.name_of = {node: name for node, (name, _) in grads.items()}
        present = [[name for name in bucket if name in self.target] for bucket in buckets]
        self.buckets = [_Bucket(names=names, waiting=set(names)) for names in present if names]
        self.bucket_of = {name: bucket for bucket in self.buckets for name in bucket.names}
        self.in_flight: _Bucket | None = None
        """The bucket whose collective was issued last (waited for when the next one is issued)."""

    def add(self, node: fx.Node, value) -> bool:
        """Gradient ``node``, just computed as ``value``: taken into its bucket (True; the bucket's collective is
        issued when it completes) or left to the caller to move on its own (False)."""
        name = self.name_of.get(node)
        bucket = self.bucket_of.get(name)
        if bucket is None or not isinstance(value, DTensor):
            return False
        source, target = tuple(value.placements), self.target[name]
        key = pricing.bucket_key(value.dtype, source, target)
        if key is None or bucket.key not in (None, key):  # not laid out as planned: moved alone
            bucket.names.remove(name)
            self._arrived(bucket, name)
            return False
        bucket.key = key
        bucket.ready[name] = _Gradient(node=node, value=value, target=target,
                                       reduction=pricing.grad_reduction(source, target))
        self._arrived(bucket, name)
        return True

    def _arrived(self, bucket: _Bucket, name: str) -> None:
        bucket.waiting.discard(name)
        if not bucket.waiting and bucket.ready:
            self._issue(bucket)

    def _members(self, bucket: _Bucket) -> list[_Gradient]:
        return [bucket.ready[name] for name in bucket.names]

    def _issue(self, bucket: _Bucket) -> None:
        """The bucket's collective, right after its last gradient (in the order the program is traced), once the
        collective issued before it is waited for."""
        if self.in_flight is not None:
            self._wait(self.in_flight)
        _, kind, axis = bucket.key
        group = _compat.group_name(self.mesh.get_group(axis))
        members = self._members(bucket)
        if kind == "all_reduce":
            flat = torch.cat([grad.value.to_local().reshape(-1) for grad in members])
            bucket.reduced = _compat.functional_all_reduce()(self._in_reduce_dtype(flat), "sum", group)
        else:
            ranks = self.mesh.size(axis)
            rows = [_rank_rows(grad.value.to_local(), grad.reduction, ranks) for grad in members]
            flat = torch.cat(rows, dim=1).reshape(-1)
            bucket.reduced = _compat.functional_reduce_scatter()(self._in_reduce_dtype(flat), "sum", ranks, group)
        self.in_flight = bucket

    def _wait(self, bucket: _Bucket) -> None:
        """The wait for ``bucket``'s collective, traced once: it frees the collective's buffers."""
        if bucket.waited is None:
            bucket.waited = _compat.functional_wait_tensor()(bucket.reduced)

    def _in_reduce_dtype(self, flat: torch.Tensor) -> torch.Tensor:
        return flat if self.reduce_dtype is None else flat.to(self.reduce_dtype)

    def result(self, node: fx.Node, target: tuple) -> DTensor | None:
        """Gradient ``node`` in ``target`` from its bucket's collective, waited for and unflattened on first use
        (None: ``node`` was not reduced in a bucket to ``target``)."""
        name = self.name_of.get(node)
        bucket = self.bucket_of.get(name)
        if bucket is None or name not in bucket.ready or bucket.ready[name].target != tuple(target):
            return None
        if bucket.reduced is None:  # a gradient of the bucket was never computed: issued at its first use
            self._issue(bucket)
        if bucket.results is None:
            bucket.results = self._unflatten(bucket)
        return bucket.results[node]

    def _unflatten(self, bucket: _Bucket) -> dict[fx.Node, DTensor]:
        ranks = self.mesh.size(bucket.key[2])
        members = self._members(bucket)
        self._wait(bucket)
        waited = bucket.waited.to(members[0].value.dtype)
        shapes = [pricing.bucket_slot_shape(grad.value.to_local().shape, grad.reduction, ranks) for grad in members]
        results = {}
        for grad, piece, shape in zip(members, torch.split(waited, [math.prod(s) for s in shapes]), shapes):
            local = piece.view(shape)
            if grad.reduction.kind == "reduce_scatter":
                local = self._own_rows(local, grad.value.to_local().shape[grad.reduction.dim], grad.reduction, ranks)
            results[grad.node] = DTensor.from_local(local, self.mesh, grad.target, run_check=False,
                                                    shape=grad.value.shape, stride=grad.value.stride())
        return results

    def _own_rows(self, chunk: torch.Tensor, size: int, reduction, ranks: int) -> torch.Tensor:
        """This rank's rows of a padded chunk: DTensor's ``Shard`` (``torch.chunk``) gives rank ``r`` rows
        ``[r * c, min(size, (r + 1) * c))`` of ``size``, ``c`` the full chunk."""
        rank = self.mesh.get_local_rank(reduction.axis)
        full = pricing.shard_chunk(size, ranks)
        rows = max(0, min(size, (rank + 1) * full) - rank * full)
        return chunk if rows == full else chunk.narrow(reduction.dim, 0, rows).contiguous()


def _rank_rows(local: torch.Tensor, reduction, ranks: int) -> torch.Tensor:
    """``local`` as ``ranks`` rows: row ``r`` is rank ``r``'s chunk of the reduced dim (padded to equal chunks),
    flattened."""
    dim = reduction.dim
    chunk = pricing.shard_chunk(local.shape[dim], ranks)
    missing = chunk * ranks - local.shape[dim]
    if missing:
        pad = list(local.shape)
        pad[dim] = missing
        local = torch.cat([local, local.new_zeros(pad)], dim=dim)
    split = list(local.shape[:dim]) + [ranks, chunk] + list(local.shape[dim + 1:])
    return local.reshape(split).movedim(dim, 0).reshape(ranks, -1)
