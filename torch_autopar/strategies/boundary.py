"""How tensors cross a sharded program's boundary: the one home of these rules, for the planner that prices
them and the runtime that runs them.

  batch_arrival  rank r passes the r-th slice of dim 0 of every batch tensor (rank-major over every mesh axis)
  leaving        an output with the batch as dim 0 leaves as this rank's rows (as the batch arrived); any
                 other output (a loss computed inside the model) leaves replicated, the same on every rank
Must never depend on a device mesh object (plans are made offline for meshes that do not exist).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard


def batch_arrival(ndim: int) -> tuple:
    return tuple(Shard(0) for _ in range(ndim))


def replicated(ndim: int) -> tuple:
    return tuple(Replicate() for _ in range(ndim))


def arrival(value, ndim: int) -> tuple:
    """How a user input arrives: batch-split when it has a dim, else replicated (a scalar)."""
    return batch_arrival(ndim) if value.ndim >= 1 else replicated(ndim)


def leaving(value, ndim: int, global_batch: int | None) -> tuple:
    if global_batch is not None and value.ndim >= 1 and value.shape[0] == global_batch:
        return batch_arrival(ndim)
    return replicated(ndim)
