"""``autopar.Model(network, loss_fn, optimizer).train(...)``: MindSpore-style high-level training.

The dataset is sharded by data-parallel rank: each epoch one permutation (same seed on every rank) is cut to a
multiple of the world size and rank r takes every world_size-th index from r, so across ranks every kept sample
is seen once per epoch and all ranks hold equal local batches (at most world_size - 1 samples are left out per
epoch, reported as "dropped"). Must never plan or synchronise gradients itself: the compiled network does.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, TensorDataset, default_collate

from torch_autopar.errors import AutoparError
from torch_autopar.runtime.parallel_module import ParallelModule


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _as_dataset(data) -> Dataset:
    if isinstance(data, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in data):
        return TensorDataset(*data)
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        return data
    raise AutoparError(f"expected a map-style Dataset or a tuple of tensors, found {type(data).__name__}.")


def _split(batch):
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return tuple(batch[:-1]), batch[-1]
    raise AutoparError("expected dataset items of the form (input..., target); found a single value.")


class Model:
    """Trains ``network`` (an ``autopar.compile``d module, or a plain one to be compiled with strategy "auto")."""

    def __init__(self, network: torch.nn.Module, loss_fn, optimizer: torch.optim.Optimizer | None = None):
        if not isinstance(network, ParallelModule):
            from torch_autopar.api import compile as autopar_compile

            network = autopar_compile(network)
        self.network = network
        self.loss_fn = loss_fn
        self.optimizer = optimizer

    def _local_indices(self, size: int, epoch: int, seed: int, shuffle: bool) -> tuple[list[int], int]:
        rank, world = _world()
        if shuffle:
            order = torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        else:
            order = list(range(size))
        kept = size - size % world
        return order[:kept][rank::world], size - kept

    def _local_batch(self, batch_size: int) -> int:
        _, world = _world()
        if batch_size < world or batch_size % world:
            raise AutoparError(
                f"batch_size={batch_size} is the global batch; it must be a positive multiple of the {world} "
                f"data-parallel ranks (e.g. {max(world, batch_size - batch_size % world)})."
            )
        return batch_size // world

    def _batches(self, dataset, indices: list[int], local_batch: int):
        for start in range(0, len(indices), local_batch):
            yield default_collate([dataset[i] for i in indices[start:start + local_batch]])

    def train(self, epochs: int, dataset, *, batch_size: int, shuffle: bool = True, seed: int = 0,
              progress: bool = True) -> list[dict]:
        """Train for ``epochs``; returns per-epoch metrics (mean loss over all ranks, samples, samples/s)."""
        if self.optimizer is None:
            raise AutoparError("Model.train needs an optimizer: Model(network, loss_fn, optimizer).")
        dataset = _as_dataset(dataset)
        local_batch = self._local_batch(batch_size)
        self.network.train()
        return [self._train_epoch(epoch, dataset, local_batch, shuffle, seed, progress) for epoch in range(epochs)]

    def _train_epoch(self, epoch, dataset, local_batch, shuffle, seed, progress) -> dict:
        indices, dropped = self._local_indices(len(dataset), epoch, seed, shuffle)
        bar = _progress(progress, -(-len(indices) // local_batch), f"epoch {epoch + 1}")
        loss_sum, count, started = 0.0, 0, time.perf_counter()
        for batch in self._batches(dataset, indices, local_batch):
            inputs, target = _split(batch)
            loss = self.loss_fn(self.network(*inputs), target)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            loss_sum += float(loss.detach()) * len(target)
            count += len(target)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_sum / count:.4f}")
        if bar is not None:
            bar.close()
        return self._epoch_metrics(epoch, loss_sum, count, dropped, time.perf_counter() - started)

    def _epoch_metrics(self, epoch, loss_sum, count, dropped, seconds) -> dict:
        totals = torch.tensor([loss_sum, float(count)], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(totals)
        samples = int(totals[1])
        return {"epoch": epoch + 1, "loss": float(totals[0]) / max(samples, 1), "samples": samples,
                "dropped": dropped, "seconds": seconds, "samples_per_s": samples / seconds if seconds else 0.0}

    @torch.no_grad()
    def eval(self, dataset, *, batch_size: int) -> dict:
        """Mean loss over the dataset (sharded like ``train``, without shuffling)."""
        dataset = _as_dataset(dataset)
        local_batch = self._local_batch(batch_size)
        indices, dropped = self._local_indices(len(dataset), 0, 0, shuffle=False)
        self.network.eval()
        loss_sum, count = 0.0, 0
        for batch in self._batches(dataset, indices, local_batch):
            inputs, target = _split(batch)
            loss_sum += float(self.loss_fn(self.network(*inputs), target)) * len(target)
            count += len(target)
        self.network.train()
        return self._epoch_metrics(-1, loss_sum, count, dropped, 0.0) | {"epoch": None}


def _progress(enabled: bool, total: int, description: str):
    rank, _ = _world()
    if not enabled or rank != 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=description, unit="step", dynamic_ncols=True)
