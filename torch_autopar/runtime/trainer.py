"""``autopar.Model(network, loss_fn, optimizer).train(...)``: MindSpore-style high-level training.

Batches reach each rank as ``runtime.data`` describes (DistributedSampler semantics: every kept sample once per
epoch, equal local batches, at most world - 1 samples per epoch "dropped"). One optimizer step is ``accumulate``
micro-steps (gradients averaged over ranks only on the last when the plan allows, ``ParallelModule.no_sync``),
then optional non-finite checks (``detect_anomalies``), gradient clipping, the optimizer and the LR scheduler
(a network compiled with fp16 mixed precision scales its loss with a ``torch.amp.GradScaler``, unscales before
clipping and skips the steps whose gradients overflowed, on every rank alike),
the step callbacks and, every ``checkpoint_every`` steps, a checkpoint (``runtime.checkpoint``) from which
``resume=True`` continues exactly: same batches, same RNG draws, same numbers. Must never plan or synchronise
gradients itself: the compiled network does.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from torch_autopar.errors import AutoparError
from torch_autopar.runtime import checkpoint, precision
from torch_autopar.runtime.anomalies import check_finite
from torch_autopar.runtime.data import Feed, make_feed, split, to_device
from torch_autopar.runtime.grad_norm import clip_grad_norm_
from torch_autopar.runtime.parallel_module import ParallelModule
from torch_autopar.runtime.pipeline import PipelineModule
from torch_autopar.runtime.sharded import swap_sharded_parameters


class StopTraining(Exception):
    """Raise it in a ``Model.train`` callback (or return True from the callback) to end training after the
    current step or epoch. Every rank stops at the same step (the decision is all-reduced)."""


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclass(kw_only=True, slots=True)
class _Run:
    """What one ``train`` call was asked to do, and how far it got."""

    feed: Feed
    accumulate: int = 1
    """Micro-steps (batches) per optimizer step."""
    clip_grad_norm: float | None = None
    lr_scheduler: object = None
    callbacks: list = field(default_factory=list)
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    """Optimizer steps between checkpoints (None: only at the end of training)."""
    detect_anomalies: bool = False
    progress: bool = True
    device: torch.device = torch.device("cpu")
    step: int = 0
    """Optimizer steps taken so far (over all epochs, including those before a resume)."""
    stop: bool = False


@dataclass(kw_only=True, slots=True)
class _Epoch:
    """Where this rank is inside one epoch (saved in checkpoints, so a resumed epoch reports the same metrics)."""

    epoch: int
    consumed: int = 0
    """Batches (micro-steps) of this epoch already trained on."""
    loss_sum: float = 0.0
    count: int = 0

    def as_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "loss_sum": self.loss_sum, "count": self.count}


def _check_same_precision(network, mixed_precision) -> None:
    compiled_with = getattr(network, "mixed_precision", None)
    if mixed_precision is not None and precision.resolve(mixed_precision) != compiled_with:
        raise AutoparError(f"Model(mixed_precision={mixed_precision!r}): the network was compiled with "
                           f"mixed_precision={compiled_with!r}; expected the same policy or None. Pass it to "
                           "autopar.compile, or pass the plain model to Model.")


def _callbacks(callbacks) -> list:
    if callbacks is None:
        return []
    return list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]


def _device_of(module: torch.nn.Module) -> torch.device:
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


class Model:
    """Trains ``network`` (an ``autopar.compile``d module, or a plain one to be compiled with strategy "auto" and
    ``mixed_precision``, which for a compiled one must be what it was compiled with, or None)."""

    def __init__(self, network: torch.nn.Module, loss_fn, optimizer: torch.optim.Optimizer | None = None, *,
                 mixed_precision=None):
        if isinstance(network, PipelineModule) and network.loss_fn is None:
            network.loss_fn = loss_fn  # a pipelined network computes the loss inside its schedule (step)
        elif not isinstance(network, (ParallelModule, PipelineModule)):
            from torch_autopar.api import compile as autopar_compile

            network = autopar_compile(network, mixed_precision=mixed_precision)
        _check_same_precision(network, mixed_precision)
        self.network = network
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.grad_scaler = precision.grad_scaler(getattr(network, "mixed_precision", None), _device_of(network))
        """The ``torch.amp.GradScaler`` a network compiled with fp16 mixed precision trains with (else None)."""

    def train(self, epochs: int, dataset, *, batch_size: int | None = None, shuffle: bool = True, seed: int = 0,
              progress: bool = True, num_workers: int = 0, pin_memory: bool | None = None, accumulate: int = 1,
              clip_grad_norm: float | None = None, lr_scheduler=None, callbacks=None, checkpoint_dir=None,
              checkpoint_every: int | None = None, resume: bool = False, detect_anomalies: bool = False) -> list[dict]:
        """Train for ``epochs``; returns per-epoch metrics (mean loss over all ranks, samples, samples/s).

        dataset: a map-style Dataset, a tuple of tensors, an IterableDataset or a DataLoader (runtime.data).
        batch_size: the global batch (a multiple of the number of ranks); a DataLoader brings its own.
        accumulate: micro-batches per optimizer step (the step's gradient is the mean over them).
        clip_grad_norm: clip the global gradient norm to this before each step (autopar.clip_grad_norm_).
        lr_scheduler: stepped after every optimizer step (and saved in checkpoints).
        callbacks: callables (or one) called with {"event": "step", "step", "epoch", "loss" (this rank's), "lr"}
            after every optimizer step and with {"event": "epoch", **metrics} after every epoch; returning True
            or raising autopar.StopTraining ends training there (on all ranks).
        checkpoint_dir / checkpoint_every / resume: save every N optimizer steps and at the end; with
            resume=True continue from the checkpoint in checkpoint_dir if there is one (else start afresh).
        detect_anomalies: stop with an error naming the step, rank and parameter at a non-finite loss/gradient.
        """
        run = self._run(dataset, batch_size, shuffle, seed, progress, num_workers, pin_memory, accumulate,
                        clip_grad_norm, lr_scheduler, callbacks, checkpoint_dir, checkpoint_every, detect_anomalies)
        start, resumed = (self._resume(run) if resume else (0, None))
        self.network.train()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = []
        for epoch in range(start, epochs):
            metrics.append(self._train_epoch(run, epoch, resumed if epoch == start else None))
            if run.stop:
                break
        if run.checkpoint_dir is not None and not run.stop:  # resuming a finished run trains no further
            self._save(run, _Epoch(epoch=max(start, epochs)), loader_state=None)
        return metrics

    def _run(self, dataset, batch_size, shuffle, seed, progress, num_workers, pin_memory, accumulate,
             clip_grad_norm, lr_scheduler, callbacks, checkpoint_dir, checkpoint_every, detect_anomalies) -> _Run:
        if self.optimizer is None:
            raise AutoparError("Model.train needs an optimizer: Model(network, loss_fn, optimizer).")
        if accumulate < 1 or (checkpoint_every is not None and checkpoint_every < 1):
            raise AutoparError(f"accumulate={accumulate} and checkpoint_every={checkpoint_every} must be positive "
                               "integers (checkpoint_every may be None: save only at the end).")
        if checkpoint_every is not None and checkpoint_dir is None:
            raise AutoparError("checkpoint_every needs checkpoint_dir=: the directory to save checkpoints in.")
        rank, world = self._data_rank()
        feed = make_feed(dataset, batch_size, rank, world, shuffle=shuffle, seed=seed, num_workers=num_workers,
                         pin_memory=pin_memory)
        return _Run(feed=feed, accumulate=accumulate, clip_grad_norm=clip_grad_norm, lr_scheduler=lr_scheduler,
                    callbacks=_callbacks(callbacks), checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                    detect_anomalies=detect_anomalies, progress=progress, device=_device_of(self.network))

    def _data_rank(self) -> tuple[int, int]:
        """(which slice, of how many): a pipeline's ranks all load their replica's slice."""
        if isinstance(self.network, PipelineModule):
            return self.network.data_parallel_rank, self.network.data_parallel_size
        return _world()

    def _resume(self, run: _Run) -> tuple[int, dict | None]:
        """(first epoch, the saved state of that epoch) from run.checkpoint_dir; (0, None) if it has none."""
        if run.checkpoint_dir is None:
            raise AutoparError("resume=True needs checkpoint_dir=: the directory the checkpoints are saved in.")
        if checkpoint.find_checkpoint(run.checkpoint_dir) is None:
            return 0, None
        if self.network.plan is None:  # plan and place the model first, so the state loads into its layout
            inputs, _ = split(to_device(next(iter(run.feed.epoch(0))), run.device, non_blocking=False))
            self.network.prepare(inputs, {})
        extra, saved = checkpoint.load(run.checkpoint_dir, self.network, self.optimizer)
        run.step = extra.get("step", 0)
        if run.lr_scheduler is not None and saved.get("scheduler") is not None:
            run.lr_scheduler.load_state_dict(saved["scheduler"])
        if self.grad_scaler is not None and saved.get("scaler") is not None:
            self.grad_scaler.load_state_dict(saved["scaler"])
        # another world size (no per-rank state): the same number of global batches into the epoch; a checkpoint
        # from save_checkpoint (no position): the data starts afresh
        position = saved.get("position") or {"epoch": extra.get("epoch", 0), "consumed": extra.get("consumed", 0)}
        return position["epoch"], {**saved, "position": position}

    def _train_epoch(self, run: _Run, epoch: int, resumed: dict | None) -> dict:
        state = _Epoch(**(resumed or {}).get("position", {"epoch": epoch}))
        total = len(run.feed) if run.feed.has_length() else None
        if total is not None and state.consumed >= total:
            batches = iter(())
        else:
            batches = run.feed.epoch(epoch, (resumed or {}).get("loader"), skip=state.consumed)
        if resumed is not None:  # after the loader drew its seeds, as the interrupted run's had
            checkpoint.restore_rng(resumed.get("rng"))
        bar = _progress(run.progress, total, f"epoch {epoch + 1}", state.consumed)
        started, group = time.perf_counter(), []
        for batch in batches:
            state.consumed += 1
            closes, size = _group(state.consumed, total, run.accumulate)
            loss, samples = self._micro_step(run, batch, sync=closes or total is None, scale=1.0 / size)
            group.append((loss, samples))
            state.loss_sum, state.count = state.loss_sum + loss * samples, state.count + samples
            if closes:
                self._optimizer_step(run, state, group)
                group = []
            _advance(bar, state)
            if run.stop:
                break
        if group and not run.stop:  # an epoch of unknown length ended inside an accumulation group
            self._optimizer_step(run, state, group)
        if bar is not None:
            bar.close()
        metrics = self._epoch_metrics(epoch, state.loss_sum, state.count, run.feed.dropped,
                                      time.perf_counter() - started)
        run.stop = self._notify(run, {"event": "epoch", **metrics}) or run.stop
        return metrics

    def _micro_step(self, run: _Run, batch, *, sync: bool, scale: float) -> tuple[float, int]:
        inputs, target = split(to_device(batch, run.device, non_blocking=run.device.type == "cuda"))
        if isinstance(self.network, PipelineModule):  # forward and backward inside the pipeline's schedule
            return float(self.network.step(tuple(inputs), target, loss_scale=scale)), len(target)
        with contextlib.nullcontext() if sync else self.network.no_sync():
            loss = self.loss_fn(self.network(*inputs), target)
            scaled = loss * scale if scale != 1.0 else loss
            (scaled if self.grad_scaler is None else self.grad_scaler.scale(scaled)).backward()
        return float(loss.detach()), len(target)

    def _optimizer_step(self, run: _Run, state: _Epoch, group: list[tuple[float, int]]) -> None:
        run.step += 1
        if run.detect_anomalies:
            check_finite([loss for loss, _ in group], list(self.network.module.named_parameters()), run.step,
                         state.epoch + 1)
        if self.grad_scaler is not None:  # the optimizer must hold the sharded parameters that have the gradients
            swap_sharded_parameters(self.optimizer)
            precision.unscale(self.grad_scaler, self.optimizer)
        if run.clip_grad_norm is not None:
            if isinstance(self.network, PipelineModule):
                self.network.clip_grad_norm_(run.clip_grad_norm)
            else:
                clip_grad_norm_(self.network.parameters(), run.clip_grad_norm)
        if self.grad_scaler is None:
            self.optimizer.step()
        else:  # skips the step if any rank's gradients overflowed, then adapts the scale
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if run.lr_scheduler is not None:
            run.lr_scheduler.step()
        samples = sum(n for _, n in group)
        info = {"event": "step", "step": run.step, "epoch": state.epoch + 1,
                "loss": sum(loss * n for loss, n in group) / max(samples, 1),
                "lr": self.optimizer.param_groups[0]["lr"]}
        run.stop = self._notify(run, info)
        if run.checkpoint_every is not None and run.step % run.checkpoint_every == 0:
            self._save(run, state, loader_state=run.feed.state())

    def _notify(self, run: _Run, info: dict) -> bool:
        """Call the callbacks; True if one asked to stop here on any rank (one all-reduce when there are any)."""
        if not run.callbacks:
            return False
        stop = False
        for callback in run.callbacks:
            try:
                stop = bool(callback(info)) or stop
            except StopTraining:
                stop = True
        if dist.is_initialized():
            flag = torch.tensor([float(stop)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        return stop

    def _save(self, run: _Run, state: _Epoch, loader_state) -> None:
        rank_state = {"position": state.as_dict(), "loader": loader_state,
                      "scheduler": run.lr_scheduler.state_dict() if run.lr_scheduler is not None else None,
                      "scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None}
        extra = {"step": run.step, "epoch": state.epoch, "consumed": state.consumed}
        checkpoint.save(run.checkpoint_dir, self.network, self.optimizer, extra, rank_state)

    def _epoch_metrics(self, epoch, loss_sum, count, dropped, seconds) -> dict:
        totals = torch.tensor([loss_sum, float(count)], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(totals)
        totals /= getattr(self.network, "pipeline_size", 1)  # the ranks of one pipeline count the same samples
        samples = int(totals[1])
        return {"epoch": epoch + 1, "loss": float(totals[0]) / max(samples, 1), "samples": samples,
                "dropped": dropped, "seconds": seconds, "samples_per_s": samples / seconds if seconds else 0.0}

    @torch.no_grad()
    def eval(self, dataset, *, batch_size: int | None = None) -> dict:
        """Mean loss over the dataset (sharded like ``train``, without shuffling)."""
        rank, world = self._data_rank()
        feed = make_feed(dataset, batch_size, rank, world, shuffle=False, seed=0)
        device = _device_of(self.network)
        self.network.eval()
        loss_sum, count = 0.0, 0
        for batch in feed.epoch(0):
            inputs, target = split(to_device(batch, device, non_blocking=False))
            loss_sum += float(self.loss_fn(self.network(*inputs), target)) * len(target)
            count += len(target)
        self.network.train()
        return self._epoch_metrics(-1, loss_sum, count, feed.dropped, 0.0) | {"epoch": None}


def _group(consumed: int, total: int | None, accumulate: int) -> tuple[bool, int]:
    """(does micro-step ``consumed`` (1-based) close its accumulation group, the group's size). Groups are cut
    from the start of the epoch; with a known length the last one may be shorter (its mean is still exact)."""
    start = (consumed - 1) // accumulate * accumulate
    size = accumulate if total is None else min(accumulate, total - start)
    return consumed == start + size, size


def _progress(enabled: bool, total: int | None, description: str, initial: int = 0):
    rank, _ = _world()
    if not enabled or rank != 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=description, unit="batch", dynamic_ncols=True)


def _advance(bar, state: _Epoch) -> None:
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{state.loss_sum / max(state.count, 1):.4f}")
