"""``PipelineModule``: a model cut into pipeline stages (``search.pipeline``), run by ``torch.distributed.pipelining``.

Ranks form a (stage ranks, pipeline) mesh, row-major: rank = d * P + p holds pipeline rank p of stage rank d
(stages p, p + P, ... of the plan: one stage each, two under the interleaved schedules). The ranks of one
pipeline pass the same batch. The stage ranks d are data-parallel replicas (``data_parallel_rank``: d), each
passing its slice of the global batch, unless the stages are tensor parallel: then they pass the same batch
(``data_parallel_rank`` 0 of 1) and hold pieces of each stage's matrices (``runtime.stage_tensor_parallel``).
A step: ``PipelineStage`` + the chosen ``Schedule*`` run forward and backward over the micro-batches (activations
sent between stages by the schedule), then this rank's fresh gradients are scaled to the mean over micro-batches,
summed over the stages that share a tied parameter (each holds a copy: an embedding tied to the output head)
and averaged over the data-parallel ranks of the stage (DDP's semantics; tensor-parallel stages instead leave
each gradient in its parameter's layout, ``settle_grads``), so every copy of a parameter gets the gradient of the
global batch's mean loss and the user's optimizer keeps the copies equal. Gradients
accumulated before the step are set aside and added back, so ``accumulate=K`` sums exact gradients.
Fully-sharded stages (a plan of strategy "pipeline+fully_shard", dp > 1) run under FSDP2
(``runtime.stage_sharding``): the schedule's last backward reduce-scatters each stage's gradients (the mean over
dp), the tied sum runs on those shards, ``parameters()`` are the shards the optimizer steps, and
``state_dict`` / ``load_state_dict`` gather / scatter full tensors.
Each stage is given its micro-batch's input and output shapes (``StageShapes``, from fake copies of the stages), so
torch's schedules skip their shape-inference forward: every step, the first included, runs exactly this rank's
share of the plan's collectives (``search.pipeline.rank_collectives``).
Must never plan (it runs the layout it is given) and never write a schedule of its own.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch.distributed import pipelining

from torch_autopar import _compat, launch
from torch_autopar.capture.modules import mode_dependent_ops, positional_inputs, stages_at
from torch_autopar.errors import AutoparError
from torch_autopar.runtime import backend as backends
from torch_autopar.runtime import stage_sharding, stage_tensor_parallel
from torch_autopar.runtime.modes import get_mode
from torch_autopar.runtime.parallel_module import broadcast_module_state
from torch_autopar.search.pipeline import stage_of_units, tied_axis

_SCHEDULES = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
              "interleaved_1f1b": pipelining.ScheduleInterleaved1F1B,
              "zero_bubble": pipelining.ScheduleInterleavedZeroBubble}


class _CompiledStage(torch.nn.Module):
    """A stage run through ``torch.compile`` with the "autopar" backend (graph mode); same parameters."""

    def __init__(self, stage: torch.fx.GraphModule):
        super().__init__()
        self.stage = stage
        self._run = backends.compile_own(stage, backends.autopar_backend, fullgraph=False)

    def forward(self, *args):
        return self._run(*args)


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _new_groups(rank_lists: list[list[int]], rank: int):
    """Create a group for each list (every rank must call this with the same lists); this rank's one, or None."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


class PipelineModule(torch.nn.Module):
    """The user's module run as a pipeline; ``planner(module, args)`` gives its ``PipelineLayout``."""

    def __init__(self, module: torch.nn.Module, *, planner, pipeline_size: int, loss_fn=None,
                 mode: str | None = None, stage_layout: str = "data_parallel"):
        super().__init__()
        object.__setattr__(self, "_user", module)  # not a submodule: parameters() are this rank's stages'
        self.loss_fn, self.mode, self._planner = loss_fn, mode, planner
        self.pipeline_size = pipeline_size
        """Pipeline ranks; the job's ranks are (world / pipeline_size stage ranks) x pipeline_size."""
        rank, world = _world()
        self._dp, self._pp = world // pipeline_size, pipeline_size
        """Ranks holding each stage (its data-parallel replicas, or its tensor-parallel ranks), pipeline ranks."""
        self._d, self._p = divmod(rank, pipeline_size)
        self.stage_layout = stage_layout
        """How a stage is laid out over its ranks (``search.pipeline.STAGE_LAYOUTS``): "tensor_parallel" stages'
        ranks pass the same batch, the others' each their own slice."""
        self.layout = None
        self.stages: torch.nn.ModuleList | None = None
        self._schedules: dict = {}
        self._sharded = False
        self._tensor_parallel = False
        self._captured: tuple | None = None
        """For stages cut from a dynamo capture: (its micro-batch shapes, the model's mode then, mode-dependent ops)."""

    # ---- set-up -------------------------------------------------------------------------------------------
    def prepare(self, args: tuple, kwargs: dict | None = None):
        """Plan and build this rank's stages from one call's inputs (what this rank passes; keywords are bound
        to positions: ``capture.modules.positional_inputs``)."""
        args = positional_inputs(self._user, tuple(args), kwargs)
        if self.layout is None:
            self._build(self._planner(self._user, args), args)
        return self.plan

    def _build(self, layout, args: tuple) -> None:
        rank, world = _world()
        self.layout, plan = layout, layout.plan
        if tuple(plan.mesh_shape) != (self._dp, self._pp):
            raise AssertionError(f"plan mesh {plan.mesh_shape} vs ({self._dp}, {self._pp})")
        count = plan.pipeline_stages
        self._mine = [s for s in range(count) if s % self._pp == self._p]
        microbatch = _first_microbatch(args, plan.microbatches)
        graphs = stages_at(layout.top, layout.unit, stage_of_units(layout.cuts), microbatch)
        self._graphs = graphs
        self._captured = None if layout.top.captured_from is None else \
            (_shapes(microbatch), self._user.training, mode_dependent_ops(graphs))
        self._stage_shapes = StageShapes(graphs, plan.microbatches)  # before sharding: of the whole parameters
        self._first_names = _first_names(self._user)  # before sharding replaces tied parameters' objects
        if world > 1:
            broadcast_module_state(self._user, None)  # every copy starts from rank 0's values, as DDP does
            self._pp_group = _new_groups([[d * self._pp + p for p in range(self._pp)] for d in range(self._dp)], rank)
            self._dp_group = _new_groups([[d * self._pp + p for d in range(self._dp)] for p in range(self._pp)], rank)
            tied = self._tied_groups(graphs, rank)
        self._sharded = stage_sharding.is_sharded(plan, self._dp)
        self._tensor_parallel = stage_tensor_parallel.is_tensor_parallel(plan, self._dp)
        if self._tensor_parallel != (self.stage_layout == "tensor_parallel" and self._dp > 1):
            raise AssertionError(f"plan {plan.strategy} built as stage layout {self.stage_layout}")
        modules = [graphs[s] for s in self._mine]
        if self._tensor_parallel:  # each parameter stored as the plan places it, under every name of a tied one
            placements = {name: plan.param_placements[first][0] for name, first in self._first_names.items()
                          if first in plan.param_placements}
            self._stage_mesh = stage_tensor_parallel.stage_mesh(plan)
            modules = stage_tensor_parallel.apply_tensor_parallel(modules, self._stage_mesh, placements, self._user)
        mode = self.mode or get_mode()
        self.stages = torch.nn.ModuleList(_CompiledStage(m) if mode == "graph" else m for m in modules)
        if self._sharded:  # replaces the stages' parameters by shards: the tied copies are found by name after
            stage_sharding.apply_fully_shard(list(self.stages), self._dp_group, self._user)
        if world > 1:
            mine = {n: p for s in self._mine for n, p in graphs[s].named_parameters(remove_duplicate=False)}
            self._tied = [(ranks, [mine[n] for n in names], group) for ranks, names, group in tied]

    def _tied_groups(self, graphs, rank) -> list[tuple[tuple, list[str], object]]:
        """For each set of pipeline ranks sharing parameters that holds this rank: (those pipeline ranks, the
        names of this rank's copies, the group of those ranks in this replica)."""
        holders: dict[int, set[int]] = {}
        params: dict[int, torch.nn.Parameter] = {}
        for s, graph in enumerate(graphs):
            for param in graph.parameters():
                holders.setdefault(id(param), set()).add(s % self._pp)
                params[id(param)] = param
        shared: dict[tuple, list] = {}
        for key, ranks in holders.items():
            if len(ranks) > 1:
                shared.setdefault(tuple(sorted(ranks)), []).append(params[key])
        name_of = {id(p): n for s in self._mine for n, p in graphs[s].named_parameters()}
        tied = []
        for ranks, members in sorted(shared.items()):
            group = _new_groups([[d * self._pp + p for p in ranks] for d in range(self._dp)], rank)
            if self._p in ranks:
                tied.append((ranks, [name_of[id(p)] for p in members], group))
        return tied

    def _schedule(self, args: tuple, targets, *, backward: bool = True):
        """The schedule for inputs of these shapes (its stages are built for them: ``StageShapes``);
        without ``backward`` one with no loss, which runs forwards only."""
        key = _shapes(args) + (tuple(targets.shape) if isinstance(targets, torch.Tensor) else None, backward)
        if key not in self._schedules:
            device = torch.device(launch.device_type())
            count, group = self.plan.pipeline_stages, getattr(self, "_pp_group", None)
            metas = self._stage_shapes(args)
            stages = [pipelining.PipelineStage(module, s, count, device, input_args=metas[s][0],
                                               output_args=metas[s][1], group=group)
                      for s, module in zip(self._mine, self.stages)]
            kind = _SCHEDULES[self.plan.schedule]
            target = stages if issubclass(kind, pipelining.schedules.PipelineScheduleMulti) else stages[0]
            self._schedules[key] = kind(target, n_microbatches=self.plan.microbatches,
                                        loss_fn=self._loss if backward else None, scale_grads=False)
        return self._schedules[key]

    def _loss(self, output, target):
        return self.loss_fn(self.layout.top.structured(output), target)

    # ---- what the user calls ------------------------------------------------------------------------------
    @property
    def plan(self):
        return self.layout.plan if self.layout is not None else None

    @property
    def module(self) -> torch.nn.Module:
        """This rank's stages (the user's whole module before the first call)."""
        return self.stages if self.stages is not None else self._user

    @property
    def whole_module(self) -> torch.nn.Module:
        """The user's module: every stage's parameters under their names, with their full shapes."""
        return self._user

    def checkpoint_module(self) -> torch.nn.Module:
        """This rank's stages' parameters and buffers as one module, under the user's names (a tied parameter
        under its first name, whichever module reads it here; a fully-sharded stage's as FSDP2's DTensor
        shards): what this rank saves and loads (``runtime.checkpoint``)."""
        if self.layout is None:
            raise AutoparError("a pipelined model is cut into stages at its first call; found none yet. Call it "
                               "(or pmodel.step) once, or compile it with example inputs, before checkpointing.")
        holder = torch.nn.Module()
        for s in self._mine:
            graph = self._graphs[s]
            for name, param in graph.named_parameters(remove_duplicate=False):
                _register(holder, self._first_names.get(name, name), param)
            for name, buffer in graph.named_buffers(remove_duplicate=False):
                _register(holder, name, buffer, _persistent_in(self._user, name))
        return holder

    @property
    def axis_groups(self) -> dict:
        """Plan axis name → this rank's process group on it (after the first call): "dp" or "tp" (the ranks
        holding the same stages), "pp" (this replica's pipeline), "dp+pp" (every rank), and one "tied" group per
        set of pipeline ranks sharing parameters (``search.pipeline``'s names: "tied" + the stages' pipeline ranks)."""
        if self.layout is None or not dist.is_initialized():
            return {}
        stage_group = self._stage_mesh.get_group() if self._tensor_parallel else self._dp_group
        groups = {self.plan.axis_names[0]: stage_group, "pp": self._pp_group, "dp+pp": dist.group.WORLD}
        return groups | {tied_axis(ranks): group for ranks, _, group in self._tied}

    @property
    def data_parallel_rank(self) -> int:
        """Which slice of the global batch this rank passes (the ranks of one pipeline, and those of a
        tensor-parallel stage, pass the same)."""
        return 0 if self.stage_layout == "tensor_parallel" else self._d

    @property
    def data_parallel_size(self) -> int:
        return 1 if self.stage_layout == "tensor_parallel" else self._dp

    @property
    def pipeline_rank(self) -> int:
        return self._p

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """This rank's stages' parameters under the user's names (the whole model's before the first call)."""
        source = self.stages if self.stages is not None else self._user
        seen = set()
        for stage in (source if self.stages is not None else [source]):
            while isinstance(stage, (_CompiledStage, stage_tensor_parallel.TensorParallelStage)):
                stage = stage.stage  # the user's names, not the wrappers'
            for name, param in stage.named_parameters(prefix=prefix, remove_duplicate=remove_duplicate):
                if id(param) not in seen or not remove_duplicate:
                    seen.add(id(param))
                    yield name, param

    def train(self, mode: bool = True):
        self._user.train(mode)
        return super().train(mode)

    @contextlib.contextmanager
    def no_sync(self):
        """Nothing to skip: each step reduces only the gradients it produced (exact under accumulation)."""
        yield

    def _check_batch(self, args: tuple) -> int:
        leaves = _compat.pytree().tree_leaves(args)
        batch = next((int(a.shape[0]) for a in leaves if isinstance(a, torch.Tensor) and a.ndim), None)
        if batch is None or batch % self.plan.microbatches:
            raise AutoparError(
                f"a pipelined step cuts each rank's batch into {self.plan.microbatches} micro-batches; found a batch "
                f"of {batch}. Pass batches whose dim 0 divides by microbatches={self.plan.microbatches}.")
        if self._captured is not None:
            self._check_captured(args)
        return batch

    def _check_captured(self, args: tuple) -> None:
        """Stages captured by dynamo run the ops of one capture: at its micro-batch shapes, in its mode."""
        shapes, training, mode_dependent = self._captured
        found = _shapes(_first_microbatch(args, self.plan.microbatches))
        name = type(self._user).__name__
        if found != shapes:
            raise AutoparError(
                f"this pipeline's stages were captured from {name}.forward (torch.fx cannot trace it) for "
                f"micro-batches shaped {shapes}; found {found}. Captured stages run at the shapes they were captured "
                "at: pad every batch to those shapes (same batch size and sequence length), or compile another "
                "pipelined model for these.")
        if self._user.training != training and mode_dependent:
            mode = "training" if training else "eval"
            raise AutoparError(
                f"this pipeline's stages were captured from {name}.forward in {mode} mode, and their ops "
                f"{mode_dependent[:3]} keep that mode's behaviour; found the model in "
                f"{'training' if self._user.training else 'eval'} mode. Call pmodel.train({training}) first, or "
                f"compile a model put in the mode you need.")

    def step(self, inputs, targets, *, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward over all micro-batches of this rank's ``inputs`` (a tensor, a tuple of
        positional inputs or a dict of keyword inputs, e.g. ``input_ids`` and ``attention_mask``); returns the
        loss of the whole global batch (the same on every rank). Gradients accumulate into ``.grad`` scaled by
        ``loss_scale`` (1/K for K accumulated steps); the returned loss is not scaled."""
        if self.loss_fn is None:
            raise AutoparError("pmodel.step(inputs, targets) computes the loss inside the pipeline and needs it: "
                               "found loss_fn=None. Pass autopar.compile(..., loss_fn=fn) or train with "
                               "autopar.Model(pmodel, loss_fn, optimizer).")
        args = positional_inputs(self._user, (), inputs) if isinstance(inputs, dict) else \
            inputs if isinstance(inputs, tuple) else (inputs,)
        self.prepare(args)
        self._check_batch(args)
        schedule = self._schedule(args, targets)
        params = list(self.parameters())
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        losses: list = []
        first, last = 0 in self._mine, self.plan.pipeline_stages - 1 in self._mine
        schedule.step(*(args if first else ()), target=targets if last else None, losses=losses if last else None)
        self._reduce_gradients(params, loss_scale / self.plan.microbatches)
        for p, old in zip(params, saved):
            if old is not None:
                p.grad = old if p.grad is None else p.grad.add_(old)
        return self._global_loss(losses if last else None)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale this rank's gradients so that the whole model's ``norm_type``-norm is at most ``max_norm``;
        returns the norm before clipping, the same on every rank (call on every rank, after ``step``). Each
        element counts once: a gradient every data-parallel rank holds whole, or a tied parameter's copy on
        several pipeline ranks, is divided by its number of copies, and so is a DTensor gradient by the ranks it
        is replicated on (a tensor-parallel stage's vectors); shards count as they are. (``autopar.clip_grad_norm_`` on ``pmodel.parameters()`` would see one rank's stages only.)"""
        copies_of = {id(p): len(ranks) for ranks, members, _ in getattr(self, "_tied", []) for p in members}
        norm_type = float(norm_type)
        grads, total = [], torch.zeros((), dtype=torch.float64, device=launch.device_type())
        for param in self.parameters():
            if param.grad is None:
                continue
            local = stage_sharding.local(param.grad)
            copies = copies_of.get(id(param), 1) * (stage_sharding.replicas(param.grad) if local is not param.grad
                                                    else self.data_parallel_size)
            grads.append(local)
            if math.isinf(norm_type):
                total = torch.maximum(total, local.detach().abs().max().double()) if local.numel() else total
            else:
                total += torch.linalg.vector_norm(local.detach().double(), norm_type) ** norm_type / copies
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
        norm = (total if math.isinf(norm_type) else total ** (1.0 / norm_type)).float()
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        with torch.no_grad():
            for grad in grads:
                grad.mul_(scale.to(grad.dtype))
        return norm

    def _reduce_gradients(self, params, scale: float) -> None:
        if self._tensor_parallel:
            stage_tensor_parallel.settle_grads(params)
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
            for _, members, group in getattr(self, "_tied", []):
                for p in members:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                _all_reduce_flat([stage_sharding.local(p.grad) for p in members], group)
            if self.data_parallel_size > 1:  # fully-sharded stages' gradients: averaged by their reduce-scatter
                grads = stage_sharding.dense_grads(params) if self._sharded else \
                    [p.grad for p in params if p.grad is not None]
                _all_reduce_flat(grads, self._dp_group)
                for g in grads:
                    g.div_(self.data_parallel_size)

    def _global_loss(self, losses) -> torch.Tensor:
        """Mean over micro-batches on the last stage, then over its ranks (data-parallel replicas, or
        tensor-parallel ranks holding the same loss): one all-reduce."""
        local = torch.stack([l.detach().float() for l in losses]).mean() if losses else \
            torch.zeros((), device=launch.device_type())  # one fp32 scalar: search.pipeline.LOSS_BYTES
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(local)
        return local / self._dp  # each of the last stage's ranks holds its replica's loss

    def forward(self, *args, **kwargs):
        """Forward only (no autograd history; train with ``step``): the last stage's output, on every rank."""
        args = positional_inputs(self._user, args, kwargs)
        self.prepare(args)
        self._check_batch(args)
        schedule = self._schedule(args, None, backward=False)
        with torch.no_grad():
            output = schedule.step(*(args if 0 in self._mine else ()))
        stage_sharding.reshard(self.stages)
        return self.layout.top.structured(self._from_last_stage(output))

    def _from_last_stage(self, output):
        if self._pp == 1:
            return output
        source = self._d * self._pp + (self.plan.pipeline_stages - 1) % self._pp
        pytree = _compat.pytree()
        leaves, spec = pytree.tree_flatten(output) if output is not None else ([], None)
        meta = [[(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in leaves],
                pytree.treespec_dumps(spec) if spec is not None else None]
        dist.broadcast_object_list(meta, src=source, group=self._pp_group)
        received = []
        for item, mine in zip(meta[0], leaves or [None] * len(meta[0])):
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.dtype):
                tensor = mine.contiguous() if mine is not None else torch.empty(item[0], dtype=item[1])
                dist.broadcast(tensor, src=source, group=self._pp_group)
                received.append(tensor)
            else:
                received.append(item)
        return pytree.tree_unflatten(received, pytree.treespec_loads(meta[1]))

    # ---- state --------------------------------------------------------------------------------------------
    def state_dict(self, *args, **kwargs):
        """Full tensors of the whole model under the user's names, gathered from the stages (call on every rank)."""
        full = self._user.state_dict(*args, **kwargs)
        if self._sharded or self._tensor_parallel:
            stage_sharding.full_state(full)
        if self.layout is None or self._pp == 1:
            return full
        owner = {}
        for s, graph in enumerate(self._graphs):
            for name in graph.state_dict():
                owner.setdefault(name, s % self._pp)
        for p in range(self._pp):
            names = [n for n in full if owner.get(n, 0) == p and isinstance(full[n], torch.Tensor)]
            _broadcast_flat([full[n] for n in names], self._d * self._pp + p, self._pp_group, full, names)
        return full

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load full tensors (from ``state_dict()`` or the plain model); each stage keeps its part (its shards)."""
        if not (self._sharded or self._tensor_parallel):
            return self._user.load_state_dict(state_dict, strict=strict, assign=assign)
        if assign:
            raise AutoparError("load_state_dict(assign=True) would replace sharded stages' shards by whole "
                               "tensors; expected assign=False for a pipelined model with sharded stages.")
        result = stage_sharding.load_dense_state(self._user, state_dict, strict)
        stage_sharding.load_full_state([self._graphs[s] for s in self._mine], state_dict)
        return result


def _persistent_in(model: torch.nn.Module, name: str) -> bool:
    """Whether the user's module saves buffer ``name`` in its state dict (a stage's copy of a module path holds
    its buffers as persistent ones, and a captured stage holds constants the forward made as buffers too)."""
    owner, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return False
    return leaf in module._buffers and _compat.is_persistent_buffer(module, leaf)


def _first_names(module: torch.nn.Module) -> dict[str, str]:
    """Every name of a parameter → its first name (a tied parameter's other names → the first)."""
    first: dict[int, str] = {}
    return {name: first.setdefault(id(param), name)
            for name, param in module.named_parameters(remove_duplicate=False)}


def _register(holder: torch.nn.Module, name: str, tensor: torch.Tensor, persistent: bool | None = None) -> None:
    """Put ``tensor`` at dotted ``name`` in ``holder`` (a parameter, or a buffer when ``persistent`` is given),
    creating the modules on the way; a name already there keeps its first tensor."""
    owner, _, leaf = name.rpartition(".")
    module = holder
    for part in owner.split(".") if owner else ():
        if part not in module._modules:
            module.add_module(part, torch.nn.Module())
        module = module._modules[part]
    if leaf in module._parameters or leaf in module._buffers:
        return
    if persistent is None:
        module.register_parameter(leaf, tensor)
    else:
        module.register_buffer(leaf, tensor, persistent=persistent)


def _first_microbatch(args: tuple, microbatches: int) -> tuple:
    """The first of ``microbatches`` micro-batches of one call's inputs (tensors split on dim 0, as the
    schedule splits them)."""
    return tuple(a.chunk(microbatches)[0] if isinstance(a, torch.Tensor) else a for a in args)


def _shapes(args: tuple) -> tuple:
    return tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))


class StageShapes:
    """Each stage's (inputs, outputs) for one micro-batch of given inputs, as fake tensors: the stages' fake
    copies (whole parameters, taken before any sharding) run on fake tensors, so nothing is computed and no
    collective runs. Given to ``PipelineStage``, they spare a schedule's first step torch's shape inference (a
    real forward of each stage, which would gather fully-sharded stages once more than the plan says, and
    pickled metadata sent between the ranks)."""

    def __init__(self, graphs: list[torch.fx.GraphModule], microbatches: int):
        self._fake = _compat.FakeTensorMode(allow_non_fake_inputs=True)
        self._graphs = [_compat.fake_copy(graph, self._fake) for graph in graphs]
        self._microbatches = microbatches

    def __call__(self, args: tuple) -> list[tuple]:
        metas = []
        with self._fake:
            values = tuple(self._fake.from_tensor(a.chunk(self._microbatches)[0]) if isinstance(a, torch.Tensor)
                           else a for a in args)
            for graph in self._graphs:
                outputs = graph(*values)
                outputs = outputs if isinstance(outputs, tuple) else (outputs,)
                metas.append((tuple(v for v in values if isinstance(v, torch.Tensor)), outputs))
                values = outputs
        return metas


def _all_reduce_flat(tensors: list[torch.Tensor], group) -> None:
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _broadcast_flat(tensors, source: int, group, full: dict, names: list[str]) -> None:
    """Broadcast ``source``'s values of ``tensors`` (one buffer per dtype) into fresh copies in ``full``."""
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        chosen = [(n, t) for n, t in zip(names, tensors) if t.dtype == dtype]
        flat = torch.cat([t.detach().reshape(-1) for _, t in chosen])
        dist.broadcast(flat, src=source, group=group)
        offset = 0
        for name, t in chosen:
            full[name] = flat[offset:offset + t.numel()].view_as(t).clone()
            offset += t.numel()
