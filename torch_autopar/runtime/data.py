"""How ``Model.train``'s batches reach this rank, and how a run finds its place again after a restart.

Every input becomes a ``Feed``: a DataLoader plus the rule that makes its batches this rank's.

* Map-style ``Dataset`` (or a tuple of tensors): ``DistributedSampler`` semantics with ``drop_last=True``: each
  epoch one permutation (seed + epoch, the same on every rank) is cut to a multiple of the world size and rank r
  takes every world-th index from r, so every kept sample is seen once per epoch and all ranks hold equal local
  batches (at most world - 1 samples per epoch are left out: "dropped"). Loaded in local batches of
  ``batch_size // world``.
* ``IterableDataset``: the loader yields global batches and each rank keeps its slice ``chunk(world)[rank]``;
  the rows of a last global batch beyond a multiple of the world size are dropped (and counted). Splitting a stream
  between worker processes is the dataset's business (``get_worker_info``), as in PyTorch.
* A user ``DataLoader``: with a ``DistributedSampler`` (as sampler or inside its batch sampler) its batches are
  this rank's already; otherwise they are global batches, sliced as an IterableDataset's.

Loaders built here are torchdata's ``StatefulDataLoader``: its ``state_dict`` is the exact position inside an
epoch (also with worker processes), and a restored loader skips the samples already seen without loading them.
A user's ``DataLoader`` without ``state_dict`` is fast-forwarded by drawing and discarding the batches already
consumed: exact when its order is fixed per epoch (a ``DistributedSampler``, which is told the epoch, or no
shuffling), not for a ``RandomSampler`` seeded from the global RNG. Must never touch the model, the optimizer
or the RNG streams the model uses.
"""

from __future__ import annotations

import itertools
import warnings

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torch_autopar import _compat
from torch_autopar.errors import AutoparError

pytree = _compat.pytree()  # torch.utils._pytree: no public equivalent in torch 2.13


def as_dataset(data):
    """A Dataset, IterableDataset or DataLoader as given; a tuple of tensors as a TensorDataset."""
    if isinstance(data, (tuple, list)) and data and all(isinstance(t, torch.Tensor) for t in data):
        return TensorDataset(*data)
    if isinstance(data, (DataLoader, IterableDataset)) or (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        return data
    raise AutoparError(f"expected a map-style Dataset, an IterableDataset, a DataLoader or a tuple of tensors as the "
                       f"data; found {type(data).__name__}. Wrap your data in torch.utils.data.TensorDataset.")


def local_batch_size(batch_size: int | None, world: int) -> int:
    if batch_size is None:
        raise AutoparError("Model.train needs batch_size= (the global batch, a multiple of the number of ranks) "
                           "unless it is given a DataLoader, which brings its own; found none.")
    if batch_size < world or batch_size % world:
        raise AutoparError(
            f"batch_size={batch_size} is the global batch; it must be a positive multiple of the {world} "
            f"data-parallel ranks (e.g. {max(world, batch_size - batch_size % world)}).")
    return batch_size // world


class Feed:
    """This rank's batches, epoch by epoch, from one loader; ``epoch(..., loader_state or skip)`` resumes inside
    an epoch."""

    def __init__(self, loader, rank: int, world: int, *, sampler=None, sliced: bool, dropped: int | None = None):
        self.loader, self.rank, self.world = loader, rank, world
        self.sampler, self.sliced = sampler, sliced
        self.dropped = dropped or 0

    def __len__(self) -> int:
        return len(self.loader)

    def has_length(self) -> bool:
        try:
            len(self.loader)
        except TypeError:
            return False
        return True

    def epoch(self, epoch: int, loader_state: dict | None = None, skip: int = 0):
        """An iterator over this rank's batches of ``epoch``: from the start, from ``loader_state`` (this
        loader's own state), or after skipping ``skip`` batches."""
        if self.sampler is not None and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        if loader_state is not None and hasattr(self.loader, "load_state_dict"):
            self.loader.load_state_dict(loader_state)
            skip = 0
        if self.sliced:
            self.dropped = 0
        batches = (self._slice(batch) for batch in self.loader) if self.sliced else iter(self.loader)
        batches = (batch for batch in batches if batch is not None)
        return itertools.islice(batches, skip, None)

    def state(self) -> dict | None:
        """The loader's position now (None for a loader without ``state_dict``)."""
        return self.loader.state_dict() if hasattr(self.loader, "state_dict") else None

    def _slice(self, batch):
        """This rank's rows of a global batch; a batch that does not divide by the world size loses its last
        rows (counted as dropped), one too small for every rank to get a row is skipped (None)."""
        size = _batch_size(batch)
        if size is None:
            raise AutoparError(f"expected batches holding tensors (dim 0: the samples) to split between the "
                               f"{self.world} ranks; found a batch of {type(batch).__name__} without one. Collate samples into "
                               "tensors (the DataLoader's default collate_fn does).")
        kept = size - size % self.world
        self.dropped += size - kept
        if kept == 0:
            return None
        per_rank = kept // self.world
        return pytree.tree_map(lambda leaf: leaf[self.rank * per_rank:(self.rank + 1) * per_rank]
                               if isinstance(leaf, torch.Tensor) and leaf.ndim else leaf, batch)


def _batch_size(batch) -> int | None:
    for leaf in pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.ndim >= 1:
            return int(leaf.shape[0])
    return None


def make_feed(data, batch_size: int | None, rank: int, world: int, *, shuffle: bool, seed: int,
              num_workers: int = 0, pin_memory: bool | None = None) -> Feed:
    """The Feed for what ``Model.train`` was given (see the module docstring for each kind)."""
    data = as_dataset(data)
    if isinstance(data, DataLoader):
        return _user_feed(data, rank, world)
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    options = dict(num_workers=num_workers, pin_memory=pin)
    if isinstance(data, IterableDataset):
        local_batch_size(batch_size, world)
        return Feed(_stateful_loader(data, batch_size=batch_size, **options), rank, world, sliced=True)
    local = local_batch_size(batch_size, world)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
    loader = _stateful_loader(data, batch_size=local, sampler=sampler, **options)
    return Feed(loader, rank, world, sampler=sampler, sliced=False, dropped=len(data) % world)


def _stateful_loader(data, **options) -> StatefulDataLoader:
    with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch.set_vital on construction
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return StatefulDataLoader(data, **options)


def _user_feed(loader: DataLoader, rank: int, world: int) -> Feed:
    sampler = _distributed_sampler(loader)
    if sampler is not None and (sampler.num_replicas, sampler.rank) != (world, rank):
        raise AutoparError(f"the DataLoader's DistributedSampler is for rank {sampler.rank} of {sampler.num_replicas}, "
                           f"but this is rank {rank} of {world}; build it with num_replicas={world}, rank={rank} (or "
                           "pass the Dataset and let Model.train shard it).")
    return Feed(loader, rank, world, sampler=sampler, sliced=sampler is None)


def _distributed_sampler(loader: DataLoader):
    for candidate in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if isinstance(candidate, DistributedSampler):
            return candidate
    return None


def to_device(batch, device: torch.device, non_blocking: bool):
    if device.type == "cpu":
        return batch
    return pytree.tree_map(lambda leaf: leaf.to(device, non_blocking=non_blocking)
                           if isinstance(leaf, torch.Tensor) else leaf, batch)


def split(batch) -> tuple[tuple, object]:
    """(inputs, target) of a batch whose last element is the target."""
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return tuple(batch[:-1]), batch[-1]
    raise AutoparError("expected dataset items of the form (input..., target); found a single value. Return "
                       "(inputs, target) from the dataset's __getitem__ (or pass a tuple of tensors).")
