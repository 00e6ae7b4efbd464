"""Eager-mode gradient averaging: bucketed all-reduces launched from parameter hooks during backward.

Each parameter's post-accumulate-grad hook marks it ready; a bucket's all-reduce starts (asynchronously) as
soon as it and every earlier bucket are ready, so every rank starts buckets in the same order and
communication overlaps the rest of backward. At the end of backward the results are waited for and written
back as averages (a bucket is all-reduced in ``reduce_dtype`` when one is given, for mixed precision, and
written back in the gradients' own dtype). The local batch size rides along in the first bucket, so ranks that were given unequal
slices (which would make the average gradient wrong) raise a clear error instead. An all-reduce that fails
because another rank died or stalled raises a ``torch_autopar:`` error naming the step. Must never change the
forward computation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_autopar import _compat
from torch_autopar.errors import AutoparError
from torch_autopar.launch.faults import collective_failure

_PHASE = "backward: gradient all-reduce"


class GradientReducer:
    def __init__(self, named_params: dict[str, torch.nn.Parameter], buckets: list[list[str]],
                 group: dist.ProcessGroup | None, *, step=None, reduce_dtype: torch.dtype | None = None):
        """step: a callable giving the step number that errors about dead or stalled ranks name.
        reduce_dtype: the dtype each bucket is all-reduced in (mixed precision); None: the gradients' own."""
        listed = {name for bucket in buckets for name in bucket}
        trailing = [name for name, p in named_params.items() if p.requires_grad and name not in listed]
        self.buckets = [[named_params[n] for n in bucket] for bucket in buckets + ([trailing] if trailing else [])]
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.group = group
        self.reduce_dtype = reduce_dtype
        self._step = step or (lambda: 0)
        self.world_size = dist.get_world_size(group)
        self.local_batch: int | None = None
        self._armed = False
        self._handles = []
        for bucket in self.buckets:
            for param in bucket:
                param.register_post_accumulate_grad_hook(self._on_grad_ready)

    def arm(self, local_batch: int | None) -> None:
        """Called by the forward pass: the next backward's gradients are to be averaged."""
        self._armed = True
        self.local_batch = local_batch

    def _reset(self) -> None:
        self._ready = [set() for _ in self.buckets]
        self._launched: list[tuple] = []
        self._callback_queued = False

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        self._translating_failures(self._mark_ready, param)

    def _finish(self) -> None:
        self._translating_failures(self._finish_all)

    def _translating_failures(self, fn, *args) -> None:
        try:
            fn(*args)
        except RuntimeError as error:
            failure = collective_failure(error, self._step(), _PHASE)
            if failure is None:
                raise
            raise failure from error

    def _mark_ready(self, param: torch.Tensor) -> None:
        if not self._armed:
            return
        if not getattr(self, "_callback_queued", False):
            self._reset()
            self._callback_queued = True
            _compat.queue_backward_callback(self._finish)
        self._ready[self.bucket_of[id(param)]].add(id(param))
        self._launch_ready()

    def _launch_ready(self) -> None:
        while len(self._launched) < len(self.buckets):
            index = len(self._launched)
            if len(self._ready[index]) < len(self.buckets[index]):
                return
            self._launch(index)

    def _launch(self, index: int) -> None:
        params = self.buckets[index]
        pieces = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                  for p in params]
        batch = float(self.local_batch or 0)
        dtype = self.reduce_dtype or params[0].dtype
        with_batch = index == 0 and dtype in (torch.float32, torch.float64)
        if with_batch:  # rides along: exact in fp32 for any realistic batch size
            pieces.append(torch.tensor([batch, batch * batch], dtype=dtype, device=params[0].device))
        elif index == 0:  # low-precision buckets cannot carry it exactly: one tiny collective of its own
            check = torch.tensor([batch, batch * batch], dtype=torch.float64, device=params[0].device)
            self._batch_check = (dist.all_reduce(check, group=self.group, async_op=True), check)
        flat = torch.cat([piece.to(dtype) for piece in pieces])
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._launched.append((work, flat, with_batch))

    def _finish_all(self) -> None:
        self._armed = False
        self._callback_queued = False
        while len(self._launched) < len(self.buckets):
            self._launch(len(self._launched))
        if getattr(self, "_batch_check", None) is not None:
            work, check = self._batch_check
            self._batch_check = None
            work.wait()
            self._check_batches(check)
        for index, (work, flat, with_batch) in enumerate(self._launched):
            work.wait()
            if with_batch:
                self._check_batches(flat[-2:])
                flat = flat[:-2]
            self._write_back(self.buckets[index], flat.div_(self.world_size))

    def _check_batches(self, sums: torch.Tensor) -> None:
        total, squares = float(sums[0]), float(sums[1])
        if self.local_batch and abs(self.world_size * squares - total * total) > 0.5:
            raise AutoparError(
                f"ranks were given batches of unequal size (this rank: {self.local_batch}, sum over "
                f"{self.world_size} ranks: {int(total)}); averaged gradients would not equal the global batch's. "
                "Make the global batch divisible by the data-parallel size (drop or pad the last batch), or "
                "use autopar.Model(...).train(), which shards data evenly."
            )

    @staticmethod
    def _write_back(params, flat: torch.Tensor) -> None:
        offset = 0
        for param in params:
            piece = flat[offset:offset + param.numel()].view_as(param)
            offset += param.numel()
            if param.grad is None:
                param.grad = piece.to(param.dtype, copy=True)
            else:
                param.grad.copy_(piece)
