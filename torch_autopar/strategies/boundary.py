"""How tensors cross a sharded program's boundary: the one home of these rules, for the planner that prices
them and the runtime that runs them.

  batch_arrival  rank r passes the r-th slice of dim 0 of every batch tensor (rank-major over every mesh axis)
  leaving        an output with the batch as dim 0 leaves as this rank's rows (as the batch arrived); any
                 other output (a loss computed inside the model) leaves replicated, the same on every rank
  full_batch     (``compile(full_batch=True)``, as parallelize_module users call a model) every rank passes
                 the whole batch: inputs arrive replicated and every output leaves replicated
  gathered_whole  data parallelism with full batches runs each rank's slice: an output with the slice as dim 0
                 is gathered whole over the ranks; any other output is the rank's own
  compute_layouts  eager mode computes with each parameter in the layout the plan's first op wants it in; a
                 plan without that gathers parameters over the axes the batch is split on (fully sharded)
  move_target    a value moved outside an op (at a program or module boundary) goes to the layout wanted,
                 except that it never becomes a partial sum it was not already
  flat_gather_axis  a fully-sharded group (eager mode) gathers in ONE all_gather per mesh axis and dtype every
                 parameter whose move to its compute layout is Shard(0) -> Replicate on that axis alone, each rank
                 sending its dim-0 shard padded to ``padded_shard_numel`` (as DTensor pads uneven shards), and
                 reduce-scatters back the same way the gradients that ``flat_reduced`` admits (partial sums)
  made_per_group  which of a parameter's gathers and its gradient's reductions a mode makes once per parameter
                 group (one collective, one latency): graph mode all, eager mode its flat groups'
Must never depend on a device mesh object (plans are made offline for meshes that do not exist).
"""

from __future__ import annotations

import math

from torch.distributed.tensor import Replicate, Shard

from torch_autopar.cost import pricing


def batch_arrival(ndim: int) -> tuple:
    return tuple(Shard(0) for _ in range(ndim))


def replicated(ndim: int) -> tuple:
    return tuple(Replicate() for _ in range(ndim))


def arrival(value, ndim: int, full_batch: bool = False) -> tuple:
    """How a user input arrives: batch-split when it has a dim, else replicated (a scalar); replicated when
    every rank passes the whole batch."""
    return batch_arrival(ndim) if value.ndim >= 1 and not full_batch else replicated(ndim)


def leaving(value, ndim: int, global_batch: int | None, full_batch: bool = False) -> tuple:
    if not full_batch and global_batch is not None and value.ndim >= 1 and value.shape[0] == global_batch:
        return batch_arrival(ndim)
    return replicated(ndim)


def gathered_whole(value, batch: int | None) -> bool:
    """Whether data parallelism with full batches gathers output ``value`` whole: a tensor with ``batch`` rows
    (on a rank, its slice's; in a plan, the global batch)."""
    return getattr(value, "ndim", 0) >= 1 and batch is not None and value.shape[0] == batch


def move_target(current: tuple, wanted: tuple) -> tuple:
    """The layout a value in ``current`` is moved to when ``wanted`` is asked for outside an op: ``wanted``,
    with each partial axis replicated unless the value is already that partial sum there (DTensor creates
    partial values only inside an op; the next op's dispatch reduces where it must)."""
    return tuple(w if not w.is_partial() or c == w else Replicate() for c, w in zip(current, wanted))


def batch_axes(first_input: tuple) -> set[int]:
    """Mesh axes over which a plan splits the batch: those its first input is ``Shard(0)`` on."""
    return {axis for axis, p in enumerate(first_input) if p == Shard(0)}


def compute_layouts(storage: dict, first_input: tuple, planned: dict) -> dict:
    """Parameter name → the layout eager mode computes with: ``planned[name]`` (the plan's own: the input layout
    of the parameter's first op) where given, else ``storage[name]`` gathered over the batch axes (fully-sharded
    data parallelism: each batch slice needs the whole parameter). Placements are DTensor objects."""
    axes = batch_axes(first_input)
    return {name: planned.get(name) or tuple(Replicate() if axis in axes and p.is_shard() else p
                                             for axis, p in enumerate(layout))
            for name, layout in storage.items()}


def flat_gather_axis(storage: tuple, computed: tuple) -> int | None:
    """The mesh axis on which a parameter stored in ``storage`` joins its group's flat all-gather to reach
    ``computed``: the one axis moving Shard(0) -> Replicate, every other axis unchanged and none of them
    splitting dim 0 (so the dim-0 shard is the same slice on every rank of that axis). None: moved on its own."""
    moved = [axis for axis, (s, c) in enumerate(zip(storage, computed)) if s != c]
    if len(moved) != 1 or storage[moved[0]] != Shard(0) or computed[moved[0]] != Replicate():
        return None
    kept = [p for axis, p in enumerate(storage) if axis != moved[0]]
    return None if any(p.is_partial() or getattr(p, "dim", None) == 0 for p in kept) else moved[0]


def made_per_group(mode: str, kind: str, axis: int, source: tuple, target: tuple) -> bool:
    """Whether ``mode``'s runtime makes a ``kind`` collective on ``axis``, the first step of moving a parameter
    (or a view of it) from ``source`` to ``target`` or the one step of reducing its gradient from ``source`` to
    the parameter's ``target``, together with its group's: graph mode buckets every parameter all-gather
    (``rewrite.gather_buckets``) and every gradient sync that is one reduction (``rewrite.grad_buckets``,
    ``cost.pricing.grad_reduction``); eager mode only its flat groups' (``runtime.flat``), each other move going
    through DTensor on its own."""
    if mode == "graph":
        if kind == "all_gather":
            return True
        reduction = pricing.grad_reduction(source, target)
        return reduction is not None and (reduction.kind, reduction.axis) == (kind, axis)
    if kind == "all_gather":
        return flat_gather_axis(source, target) == axis
    if kind != "reduce_scatter" or not target[axis] == Shard(0):
        return False
    gathered = tuple(Replicate() if other == axis else p for other, p in enumerate(target))
    return flat_gather_axis(target, gathered) == axis and flat_reduced(source, target, axis)


def padded_shard_numel(shape, ranks: int) -> int:
    """Elements one rank sends for a parameter of ``shape`` (its rows as gathered) in a flat all-gather over
    ``ranks`` ranks: ceil(rows / ranks) rows, the rows it holds padded (DTensor's Shard(0) of uneven sizes)."""
    return -(-shape[0] // ranks) * math.prod(shape[1:])


def flat_reduced(grad: tuple, storage: tuple, axis: int) -> bool:
    """Whether a gradient in ``grad`` placements joins its flat group's reduce-scatter on ``axis`` (a parameter
    stored in ``storage``): a sum still to reduce there, laid out on the other axes as the parameter is. Another
    gradient (a replicated one: each rank keeps its rows) is moved on its own."""
    return grad[axis].is_partial() and getattr(grad[axis], "reduce_op", "sum") == "sum" \
        and all(g == s for other, (g, s) in enumerate(zip(grad, storage)) if other != axis)
