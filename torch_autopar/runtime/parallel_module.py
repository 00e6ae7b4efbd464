"""``ParallelModule``: the user's module run per a Plan, in eager or graph mode, on this rank.

Eager: the user's Python ``forward`` runs op by op (prints and breakpoints work); gradients are averaged by the
rewrite stage's ``GradientReducer``. Graph: ``torch.compile`` with the data-parallel backend, whose backward
graphs carry the gradient all-reduces. Both follow the semantics of ARCHITECTURE.md: each rank passes its own
slice of the global batch (or, with ``full_batch=True``, all ranks pass the whole batch). Must never change
the user's module's parameters except through the optimizer the user runs. With a ``mixed_precision`` policy
each call casts inputs, parameters and outputs as ``runtime.precision`` says; the parameters stay fp32.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist

from torch_autopar import _compat
from torch_autopar.capture.program import under_dispatch_mode
from torch_autopar.errors import AutoparError
from torch_autopar.launch.faults import collective_failure
from torch_autopar.rewrite import GradientReducer
from torch_autopar.rewrite.placement import batch_size
from torch_autopar.runtime import backend as backends
from torch_autopar.runtime import checks, recompute
from torch_autopar.runtime.modes import get_mode
from torch_autopar.runtime.precision import CastCall, MixedPrecision, cast_inputs, cast_outputs, reduce_dtype
from torch_autopar.runtime.sharded import ShardedRunner
from torch_autopar.strategies import boundary
from torch_autopar.search import Plan

pytree = _compat.pytree()  # torch.utils._pytree: no public equivalent in torch 2.13


def broadcast_module_state(module: torch.nn.Module, group, src: int = 0) -> None:
    """Make every rank's parameters and buffers equal to rank ``src``'s (one flat broadcast per dtype)."""
    tensors = [t for t in list(module.parameters()) + list(module.buffers()) if t.numel() > 0]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    with torch.no_grad():
        for group_tensors in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group_tensors])
            dist.broadcast(flat, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
            offset = 0
            for tensor in group_tensors:
                tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()


class _RestorePoint:
    """The random-number state and the buffers of a module, to undo what a failed call changed."""

    def __init__(self, module: torch.nn.Module):
        self.rng = torch.get_rng_state()
        self.buffers = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]

    def restore(self) -> None:
        torch.set_rng_state(self.rng)
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)


class ParallelModule(torch.nn.Module):
    """A module executed per ``plan`` on the ranks of ``group`` (None: all ranks)."""

    def __init__(self, module: torch.nn.Module, plan: Plan | None = None, *, planner=None, group=None,
                 mode: str | None = None, full_batch: bool = False, broadcast_buffers: bool = True,
                 mixed_precision: MixedPrecision | None = None):
        super().__init__()
        if plan is None and planner is None:
            raise AssertionError("ParallelModule needs a plan or a planner")
        self.module = module
        self.plan = plan
        self.mode = mode
        self.full_batch = full_batch
        self.broadcast_buffers = broadcast_buffers
        self.mixed_precision = mixed_precision
        """The ``runtime.precision`` policy each call runs under (None: the parameters' own dtype)."""
        self.stats: dict = {"forward_calls": 0}
        self._planner = planner
        self._group = group
        self._distributed = False
        self._compiled = None
        self._reducer = None
        self._sharded: ShardedRunner | None = None
        self._sync = True
        self._input_check: checks.InputCheck | None = None
        self._param_ids: dict[str, int] = {}
        self._boundaries_tried = False
        if plan is not None:
            self._set_up(plan)

    def prepare(self, args: tuple, kwargs: dict) -> Plan:
        """Plan (if not done yet) from one call's inputs and set up this rank's execution."""
        if self.plan is None:
            self._set_up(self._planner(self.module, args, kwargs))
        if self._input_check is None:
            self._input_check = checks.InputCheck(checks.input_specs(args, kwargs), type(self.module).__name__)
        return self.plan

    def _set_up(self, plan: Plan) -> None:
        self.plan = plan
        recompute.apply_plan(self.module, plan.activation_checkpointing)
        world = dist.get_world_size(self._group) if dist.is_initialized() else 1
        self._distributed = plan.is_data_parallel() and world > 1
        if world > 1 and not self._distributed:
            if self._group is not None and dist.get_world_size(self._group) != dist.get_world_size():
                raise AutoparError("a sharded plan runs on all ranks of the job; pass group=None.")
            self._sharded = ShardedRunner(self.module, plan, self.mixed_precision)
        elif self._distributed:
            broadcast_module_state(self.module, self._group)
            self._reducer = GradientReducer(dict(self.module.named_parameters()), plan.grad_buckets, self._group,
                                            step=self._step, reduce_dtype=reduce_dtype(self.mixed_precision))
        self._param_ids = checks.parameter_ids(self.module)

    @property
    def world_size(self) -> int:
        """Ranks that split the batch (1 when this module runs alone)."""
        if self._sharded is not None:
            return self._sharded.world_size
        return dist.get_world_size(self._group) if self._distributed else 1

    @property
    def mesh(self):
        """The DeviceMesh a sharded plan runs on (None for data parallelism and one process)."""
        return self._sharded.mesh if self._sharded is not None else None

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes of forwards run inside skip gradient averaging: gradients accumulate locally and the
        first backward outside averages the sums (DDP's ``no_sync``, for gradient accumulation). Only eager data
        parallelism can skip it; graph mode (the all-reduce is in the backward graph) and sharded plans (DTensor
        reduces inside backward) average every backward, which gives the same gradients with more traffic."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @property
    def data_parallel_rank(self) -> int:
        """Which slice of the global batch this rank passes (``global.chunk(data_parallel_size)[rank]``): its own
        under the DDP contract, for data-parallel and sharded plans alike (a pipeline's ranks share one)."""
        return dist.get_rank() if self.world_size > 1 else 0

    @property
    def data_parallel_size(self) -> int:
        """How many slices the global batch is cut into (the ranks that pass different ones)."""
        return self.world_size

    @property
    def forward_calls(self) -> int:
        """How many times this module was called: the step a ``torch_autopar:`` error about a dead or stalled
        rank names (step 3: the third call)."""
        return self.stats["forward_calls"]

    def _step(self) -> int:
        return self.stats["forward_calls"]

    def forward(self, *args, **kwargs):
        self.stats["forward_calls"] += 1
        try:
            return self._forward(args, kwargs)
        except RuntimeError as error:
            failure = collective_failure(error, self._step(), "forward")
            if failure is None:
                raise
            raise failure from error

    def _forward(self, args, kwargs):
        self.prepare(args, kwargs)
        split = self._distributed or self._sharded is not None
        mode = self.mode or get_mode()
        self._check_call(args, kwargs, split, mode)
        if self.full_batch and self._distributed:  # a sharded plan takes the whole batch (plan.full_batch)
            args, kwargs = self._local_slice(args, kwargs)
        args, kwargs = cast_inputs(self.mixed_precision, args, kwargs)
        if self._distributed and self.broadcast_buffers:
            self._broadcast_buffers()
        if self._sharded is not None:
            try:
                output = self._run_sharded(args, kwargs, mode)
            except _compat.DynamoUnsupported() as error:
                raise self._graph_error(error) from error
        else:
            # under a dispatch mode dynamo runs the forward's Python, and the backward graph that would average
            # the gradients never runs: eager mode's reducer averages them (the same numbers)
            graph = mode == "graph" and not _compat.dispatch_mode_active()
            output = self._run_graph(args, kwargs) if graph else self._run_eager(args, kwargs)
        if self.full_batch and self._distributed:  # in the dtype the plan prices, before output_dtype's cast
            local_batch = batch_size(args, kwargs)
            output = pytree.tree_map(lambda leaf: self._gather_batch(leaf, local_batch), output)
        return cast_outputs(self.mixed_precision, output)

    def _run_sharded(self, args, kwargs, mode: str):
        """A sharded plan's call. The first eager call with submodules held to the plan's layouts is a trial:
        where DTensor cannot run those layouts (an error inside the forward), the call's effects on random state
        and buffers are undone, the plan is replaced by its execution as DTensor places every op (priced, with a
        warning), and the call runs again that way."""
        sharded = self._sharded
        if mode == "graph" or not sharded.boundaries.paths or self._planner is None or self._boundaries_tried:
            return sharded.run(args, kwargs, mode, self.stats)
        restore_point = _RestorePoint(self.module)
        try:
            output = sharded.run(args, kwargs, mode, self.stats)
        except (RuntimeError, IndexError, NotImplementedError, ValueError) as error:
            if collective_failure(error, self._step(), "forward") is not None:
                raise
            restore_point.restore()
            with sharded.as_plain_module():
                plan = self._planner.without_module_boundaries(self.module, args, kwargs, self.plan)
            sharded.drop_module_boundaries(plan)
            self.plan = plan
            warnings.warn(
                f"torch_autopar: eager mode could not run {type(self.module).__name__} with its submodules held to the "
                f"plan's layouts (DTensor: {type(error).__name__}: {str(error).splitlines()[0][:200]}); it runs as "
                f"DTensor places each op instead, estimated {plan.estimated_step_time * 1e3:.3f} ms per step "
                "(pmodel.plan). Graph mode (compile(..., mode='graph')) runs the plan's own layouts.", stacklevel=4)
            output = sharded.run(args, kwargs, mode, self.stats)
        self._boundaries_tried = True
        return output

    def _check_call(self, args, kwargs, split: bool, mode: str) -> None:
        """This call's inputs are like the planned ones; parameters unchanged; one full batch on all ranks."""
        self._input_check.check(args, kwargs, mode)
        if split:
            checks.check_parameters_unchanged(self.module, self._param_ids)
        if split and self.full_batch:
            checks.check_same_full_batch(args, kwargs, self._group, self.world_size)

    def _run_eager(self, args, kwargs):
        if self._reducer is not None and torch.is_grad_enabled():
            self._reducer.arm(batch_size(args, kwargs)) if self._sync else self._reducer.skip()
        return CastCall(self.module, self.mixed_precision)(*args, **kwargs)

    def _run_graph(self, args, kwargs):
        if self._compiled is None:
            self._compiled = self._compile()
        if self._reducer is not None and torch.is_grad_enabled():
            if self.full_batch:  # full batches: cut into equal slices here
                self._reducer.skip()
            else:
                self._reducer.check_in_background(batch_size(args, kwargs))
        try:
            return self._compiled(*args, **kwargs)
        except _compat.DynamoUnsupported() as error:
            raise self._graph_error(error) from error

    def _graph_error(self, error) -> AutoparError:
        if _compat.is_graph_compiler_failure(error):
            return AutoparError(
                f"graph mode captured {type(self.module).__name__}.forward, but the graph compiler "
                f"({backends.graph_compiler()!r}) failed on it: {str(error).splitlines()[0][:300]}. Run the graphs as "
                "Python (AUTOPAR_GRAPH_COMPILER=python) or in eager mode (compile(..., mode='eager')).")
        if _compat.dispatch_mode_active():
            return under_dispatch_mode(type(self.module).__name__, error)
        return AutoparError(
            f"graph mode could not compile {type(self.module).__name__}.forward as one graph: "
            f"{_compat.graph_break_reason(error)}. A sharded plan runs the whole forward as one graph; remove or "
            "guard that line (`if not torch.compiler.is_compiling():`, torch.where for a branch on tensor values), "
            "run it in eager mode (compile(..., mode='eager')), or use strategy='data_parallel', whose graph mode "
            "runs compiled pieces with Python in between.")

    def _compile(self):
        if self._distributed:
            group = self._group or dist.group.WORLD
            backend = backends.data_parallel_backend(dict(self.module.named_parameters()), self.plan.grad_buckets,
                                                     group, self.stats, reduce_dtype(self.mixed_precision))
        else:
            backend = backends.autopar_backend
        target = self.module if self.mixed_precision is None else CastCall(self.module, self.mixed_precision)
        return backends.compile_own(target, backend, fullgraph=False)  # graph breaks: pieces, as torch.compile

    def _local_slice(self, args, kwargs):
        rank, size = dist.get_rank(self._group), self.world_size

        def piece(leaf):
            if not isinstance(leaf, torch.Tensor) or leaf.ndim == 0:
                return leaf
            if leaf.shape[0] % size:
                raise AutoparError(
                    f"full_batch=True expects the global batch (dim 0) to divide by the {size} data-parallel ranks; "
                    f"found a tensor with dim 0 of {leaf.shape[0]}. Drop or pad the last batch."
                )
            return leaf.chunk(size)[rank]

        return pytree.tree_map(piece, (args, kwargs))

    def _gather_batch(self, leaf, local_batch: int | None):
        """A batch-shaped output slice gathered whole (``strategies.boundary.gathered_whole``)."""
        if not boundary.gathered_whole(leaf, local_batch):
            return leaf
        return _GatherBatch.apply(leaf, self._group or dist.group.WORLD)

    def _broadcast_buffers(self) -> None:
        buffers = [b for b in self.module.buffers() if b.numel() > 0]
        if buffers:
            with torch.no_grad():
                holder = torch.nn.Module()
                for i, b in enumerate(buffers):
                    holder.register_buffer(f"b{i}", b)
                broadcast_module_state(holder, self._group)

    def state_dict(self, *args, **kwargs):
        """Full, unsharded tensors under the user's own parameter names (loadable into the plain model).
        With a sharded plan every rank must call it (sharded tensors are gathered)."""
        if self._sharded is not None:
            return self._sharded.state_dict(*args, **kwargs)
        return self.module.state_dict(*args, **kwargs)

    def sharded_state_dict(self) -> dict:
        """This rank's shards as DTensors (for torch.distributed.checkpoint); full tensors when nothing is sharded."""
        return self._sharded.sharded_state_dict() if self._sharded is not None else self.module.state_dict()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load full tensors (from state_dict() or the plain model); a sharded plan keeps each rank's shard."""
        if self._sharded is not None:
            return self._sharded.load_state_dict(state_dict, strict)
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


class _GatherBatch(torch.autograd.Function):
    """Data parallelism with ``full_batch=True``: a rank's output slice gathered into the whole batch's output
    (one all_gather), as every rank passed the whole batch. Backward makes no collective: the full-batch
    contract is that every rank computes the same loss from the same whole output (the inputs are checked
    equal, ``checks.check_same_full_batch``; targets and the loss are the caller's), so the gradient of the
    whole output is the same on every rank and the reduce-scatter (sum) of it that an all_gather's backward
    would make is ``world_size`` times this rank's slice of it; the reducer's average over ranks then gives
    one process's gradients. Priced as ``Planner.propagated`` prices the output's move."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.rank, ctx.world = dist.get_rank(group), dist.get_world_size(group)
        whole = local.new_empty((ctx.world * local.shape[0], *local.shape[1:]))
        dist.all_gather_single(whole, local.contiguous(), group=group)
        return whole

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.world)[ctx.rank] * ctx.world, None
