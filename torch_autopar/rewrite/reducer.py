"""Eager-mode gradient averaging: bucketed all-reduces launched from parameter hooks during backward.

Each parameter's post-accumulate-grad hook copies its gradient into its bucket's flat buffer and drops it (so a
gradient is held once, not once as itself and once in the buffer: the step's peak is DDP's); a bucket's
all-reduce starts (asynchronously) as soon as it and every earlier bucket are ready, so every rank starts buckets
in the same order and communication overlaps the rest of backward. At the end of backward the results are waited
for, averaged in place, and each gradient becomes a view of its bucket (DDP's ``gradient_as_bucket_view``); a
bucket all-reduced in ``reduce_dtype`` (mixed precision) is copied back in the gradients' own dtype. The local
batch size rides along in the first bucket, so ranks that were given unequal slices (which would make the average
gradient wrong) raise a clear error instead; in graph mode, whose backward graph averages, the reducer only checks
the sizes, by an all-reduce issued with the forward and waited for as backward ends (``check_in_background``). An
all-reduce that fails
because another rank died or stalled raises a ``torch_autopar:`` error naming the step. Must never change the
forward computation.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from torch_autopar import _compat
from torch_autopar.errors import AutoparError
from torch_autopar.launch.faults import collective_failure

_PHASE = "backward: gradient all-reduce"
_CHECK_PHASE = "forward: the previous call's batch-size check"


class GradientReducer:
    def __init__(self, named_params: dict[str, torch.nn.Parameter], buckets: list[list[str]],
                 group: dist.ProcessGroup | None, *, step=None, reduce_dtype: torch.dtype | None = None):
        """step: a callable giving the step number that errors about dead or stalled ranks name.
        reduce_dtype: the dtype each bucket is all-reduced in (mixed precision); None: the gradients' own."""
        listed = {name for bucket in buckets for name in bucket}
        trailing = [name for name, p in named_params.items() if p.requires_grad and name not in listed]
        self.buckets = [[named_params[n] for n in bucket] for bucket in buckets + ([trailing] if trailing else [])]
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.offsets = {id(p): start for bucket in self.buckets  # where a gradient starts in its bucket's buffer
                        for p, start in zip(bucket, itertools.accumulate((q.numel() for q in bucket), initial=0))}
        self.group = group
        self.reduce_dtype = reduce_dtype
        self._step = step or (lambda: 0)
        self.world_size = dist.get_world_size(group)
        self.local_batch: int | None = None
        self._batch_check: tuple | None = None
        self._armed = self._reduced = False
        self._reset()
        for bucket in self.buckets:
            for param in bucket:
                param.register_post_accumulate_grad_hook(self._on_grad_ready)

    def arm(self, local_batch: int | None) -> None:
        """Called by the forward pass: the next backward's gradients are to be averaged (from empty buckets,
        whatever a backward that raised midway left)."""
        self._translating_failures(self._wait_batch_check, phase=_CHECK_PHASE)
        self._reset()
        self._armed, self._reduced = True, False
        self.local_batch = local_batch

    def skip(self) -> None:
        """Called by a forward whose backward this reducer leaves alone (``no_sync``: gradients accumulate
        locally; graph mode: its backward graph averages them)."""
        self._armed, self._reduced = False, False

    def check_in_background(self, local_batch: int | None) -> None:
        """Called by a graph-mode forward, whose backward graph averages the gradients: the ranks' batch sizes are
        compared by one 16-byte all-reduce issued now and waited for as backward ends (the first gradient's hook
        queues it), not before the forward: waiting there made every rank wait for the slowest at each step
        (3-9 ms a step on 2-4 gloo ranks, measured on the bench GPT). Unequal slices raise at ``backward()``, as
        eager mode's do, before an optimizer step can take the wrong average; a check no backward waited for
        (a forward alone) is waited for before the next one is issued, so every rank issues them in one order."""
        self._translating_failures(self._wait_batch_check, phase=_CHECK_PHASE)
        self.skip()
        self._callback_queued = False  # a backward that raised may have dropped the callback it queued
        self.local_batch = local_batch
        batch = float(local_batch or 0)
        check = torch.tensor([batch, batch * batch], dtype=torch.float64)
        self._batch_check = (dist.all_reduce(check, group=self.group, async_op=True), check)

    def _reset(self) -> None:
        self._flats: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._staged = [set() for _ in self.buckets]
        self._launched: list[dist.Work] = []
        self._callback_queued = False

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self._translating_failures(self._mark_ready, param)

    def _finish(self) -> None:
        self._translating_failures(self._finish_all)

    def _finish_batch_check(self) -> None:
        self._callback_queued = False
        self._translating_failures(self._wait_batch_check)

    def _wait_batch_check(self) -> None:
        if self._batch_check is not None:
            work, check = self._batch_check
            self._batch_check = None
            work.wait()
            self._check_batches(check)

    def _translating_failures(self, fn, *args, phase: str = _PHASE) -> None:
        try:
            fn(*args)
        except RuntimeError as error:
            failure = collective_failure(error, self._step(), phase)
            if failure is None:
                raise
            raise failure from error

    def _mark_ready(self, param: torch.Tensor) -> None:
        if not self._armed:
            if self._reduced:  # no forward since this step's averages were written back
                raise _accumulated_again("this step's gradients were averaged")
            if self._batch_check is not None and not self._callback_queued:  # graph mode's check
                self._callback_queued = True
                _compat.queue_backward_callback(self._finish_batch_check)
            return
        if not self._callback_queued:
            self._callback_queued = True
            _compat.queue_backward_callback(self._finish)
        self._stage(self.bucket_of[id(param)], param)
        self._launch_ready()

    def _carries_batch(self, index: int) -> bool:
        """The first bucket carries the local batch size when its dtype holds it exactly (fp32, fp64)."""
        return index == 0 and self._dtype(index) in (torch.float32, torch.float64)

    def _dtype(self, index: int) -> torch.dtype:
        return self.reduce_dtype or self.buckets[index][0].dtype

    def _flat(self, index: int) -> torch.Tensor:
        """Bucket ``index``'s buffer (zeros where a parameter has no gradient), allocated when first needed."""
        if self._flats[index] is None:
            params = self.buckets[index]
            numel = sum(p.numel() for p in params) + 2 * self._carries_batch(index)
            self._flats[index] = torch.zeros(numel, dtype=self._dtype(index), device=params[0].device)
        return self._flats[index]

    def _stage(self, index: int, param: torch.Tensor) -> None:
        """Copy ``param``'s gradient into its bucket's buffer and drop it (the buffer holds it from here on). A
        gradient accumulated again in the same backward (reentrant checkpointing runs a parameter's hook once per
        segment that uses it) is added in, unless its bucket has been sent."""
        if param.grad is None:
            return
        offset = self.offsets[id(param)]
        piece = self._flat(index)[offset:offset + param.numel()]
        if id(param) not in self._staged[index]:
            piece.copy_(param.grad.reshape(-1))
        elif index >= len(self._launched):
            piece.add_(param.grad.reshape(-1))
        else:
            raise _accumulated_again("its bucket's all-reduce started")
        param.grad = None
        self._staged[index].add(id(param))

    def _launch_ready(self) -> None:
        while len(self._launched) < len(self.buckets):
            index = len(self._launched)
            if len(self._staged[index]) < len(self.buckets[index]):
                return
            self._launch(index)

    def _launch(self, index: int) -> None:
        for param in self.buckets[index]:  # not ready this backward: a gradient accumulated earlier, or zeros
            self._stage(index, param)
        flat = self._flat(index)
        batch = float(self.local_batch or 0)
        if self._carries_batch(index):  # rides along: exact in fp32 for any realistic batch size
            flat[-2:] = torch.tensor([batch, batch * batch], dtype=flat.dtype)
        elif index == 0:  # low-precision buckets cannot carry it exactly: one tiny collective of its own
            check = torch.tensor([batch, batch * batch], dtype=torch.float64, device=flat.device)
            self._batch_check = (dist.all_reduce(check, group=self.group, async_op=True), check)
        self._launched.append(dist.all_reduce(flat, group=self.group, async_op=True))

    def _finish_all(self) -> None:
        self._armed = False
        self._callback_queued = False
        while len(self._launched) < len(self.buckets):
            self._launch(len(self._launched))
        self._wait_batch_check()
        for index, work in enumerate(self._launched):
            work.wait()
            flat = self._flats[index]
            if self._carries_batch(index):
                self._check_batches(flat[-2:])
            self._write_back(self.buckets[index], self.offsets, flat.div_(self.world_size))
        self._flats = [None] * len(self.buckets)
        self._reduced = True

    def _check_batches(self, sums: torch.Tensor) -> None:
        total, squares = float(sums[0]), float(sums[1])
        if abs(self.world_size * squares - total * total) > 0.5:  # every rank raises (an empty slice too)
            raise AutoparError(
                f"ranks were given batches of unequal size (this rank: {self.local_batch}, sum over "
                f"{self.world_size} ranks: {int(total)}); averaged gradients would not equal the global batch's. "
                "Make the global batch divisible by the data-parallel size (drop or pad the last batch), or "
                "use autopar.Model(...).train(), which shards data evenly."
            )

    @staticmethod
    def _write_back(params, offsets: dict[int, int], flat: torch.Tensor) -> None:
        """Each gradient a view of the averaged bucket (a copy where its dtype or layout differs)."""
        for param in params:
            piece = flat[offsets[id(param)]:offsets[id(param)] + param.numel()].view(param.shape)
            if piece.dtype == param.dtype and param.is_contiguous():
                param.grad = piece
            else:
                param.grad = torch.empty_like(param).copy_(piece)


def _accumulated_again(after: str) -> AutoparError:
    return AutoparError(
        f"a parameter's gradient was accumulated again after {after} (a parameter used in two reentrant "
        "checkpointed segments, or a second backward without a forward in between); data parallelism expects one "
        "backward per forward, each gradient complete when its hook runs. Use torch.utils.checkpoint(..., "
        "use_reentrant=False) or compile(..., activation_checkpointing=...), call the model again before another "
        "backward, or accumulate with pmodel.no_sync().")
