"""The public entry points ``compile`` and ``plan``: capture → strategies/cost → search → Plan → runtime.

Thin by design: every decision lives in a stage. Must never contain planning or execution logic of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import torch

from torch_autopar import launch
from torch_autopar.capture import capture, fake_global_inputs
from torch_autopar.capture.fold import folded_layers
from torch_autopar.capture.modules import positional_inputs
from torch_autopar.capture.program import TensorInfo, params_fingerprint
from torch_autopar.cost import PROFILES
from torch_autopar.cost.job_profile import job_profile
from torch_autopar.errors import AutoparError
from torch_autopar.rewrite.placement import batch_size
from torch_autopar.runtime import ParallelModule, precision, recompute
from torch_autopar.runtime.modes import MODES, get_mode
from torch_autopar.runtime.pipeline import PipelineModule
from torch_autopar.search import Plan, build_plan, check_strategy
from torch_autopar.search import pipeline as pipelining
from torch_autopar.search import reshard_choice
from torch_autopar.search.planner import Planner, plan_from_parameters
from torch_autopar.search.buckets import DEFAULT_BUCKET_CAP_BYTES


def _as_tuple(example_inputs) -> tuple:
    if example_inputs is None:
        return ()
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


def module_fingerprint(module: torch.nn.Module) -> str:
    """The fingerprint a plan for ``module`` carries (parameter names, shapes, dtypes)."""
    return params_fingerprint({name: TensorInfo.of(p) for name, p in module.named_parameters()})


def _capture(module, fake_args, fake_kwargs, policy):
    """The joint graph of one call as the runtime makes it (parameters and inputs cast under ``policy``)."""
    fake_args, fake_kwargs = precision.cast_inputs(policy, fake_args, fake_kwargs)
    return capture(module, fake_args, fake_kwargs, call=precision.CastCall(module, policy))


def _plan_on_mesh(module, args, kwargs, mesh, *, batch_factor, strategy, hardware, memory_budget, bucket_cap_bytes,
                  solver: str = "auto", fold_layers: bool = False, mode: str = "eager",
                  policy: precision.MixedPrecision | None = None, full_batch: bool = False,
                  reshard_after_forward: bool | str = True, activation_checkpointing=None):
    """The plan for one global batch on ``mesh``, priced as it runs in ``mode`` (``Planner.executed``); on a
    folded capture (offline ``fold_layers``) the solver's layouts, which only the unfolded model can run."""
    started = time.perf_counter()
    candidates = recompute.layer_names(module, activation_checkpointing)
    fake_args, fake_kwargs = fake_global_inputs(module, args, kwargs, batch_factor)
    checkpointed = recompute.captured_layers(activation_checkpointing, candidates)
    with recompute.applied(module, checkpointed), folded_layers(module, enabled=fold_layers) as folding:
        program = _capture(module, fake_args, fake_kwargs, policy)
    captured = time.perf_counter()
    names = mesh.mesh_dim_names or launch.default_axis_names(mesh.ndim)
    result = build_plan(program, mesh, names, strategy=strategy, hardware=job_profile(hardware),
                        memory_budget=memory_budget, bucket_cap_bytes=bucket_cap_bytes,
                        global_batch=batch_size(fake_args, fake_kwargs), executable=not folding.lengths,
                        solver=solver, folding=folding, mode=mode, full_batch=full_batch,
                        reshard_after_forward=reshard_after_forward,
                        activation_checkpointing=activation_checkpointing, recompute_candidates=candidates,
                        **precision.planned_dtypes(policy))
    result.search_stats.update({"capture_s": captured - started, "total_s": time.perf_counter() - started})
    if folding.lengths:
        result.notes.append("planned on a folded capture (" + ", ".join(
            f"{path}: {length} layers" for path, length in folding.lengths.items()) + "): the solver's layouts and "
            "estimate (graph mode runs these layouts on the whole model" + ("" if mode == "graph" else
            "; eager mode's DTensor may place ops between module boundaries otherwise") + "); compile plans the "
            "unfolded model and prices it as it runs in its mode (fold_layers=False gives that plan offline)")
    if activation_checkpointing == "auto" and result.activation_checkpointing and mode == "graph" \
            and result.node_layouts and not result.is_data_parallel() and mesh.size() > 1:
        # graph mode runs the plan's node layouts on a capture with the chosen layers checkpointed (a few nodes
        # more): plan again on that capture, with the choice fixed
        return _plan_on_mesh(module, args, kwargs, mesh, batch_factor=batch_factor, strategy=strategy,
                             hardware=hardware, memory_budget=memory_budget, bucket_cap_bytes=bucket_cap_bytes,
                             solver=solver, fold_layers=fold_layers, mode=mode, policy=policy,
                             full_batch=full_batch, reshard_after_forward=reshard_after_forward,
                             activation_checkpointing=dict(result.activation_checkpointing))
    return result


def plan(model: torch.nn.Module, example_inputs=None, *, mesh_shape=(1,), hardware="h100", strategy="auto",
         memory_budget=None, axis_names=None, example_kwargs=None,
         bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, solver: str = "auto", fold_layers: bool = True,
         pipeline=None, microbatches=None, schedule=None, mixed_precision=None, mode=None,
         full_batch: bool = False, reshard_after_forward: bool | str = True, activation_checkpointing=None) -> Plan:
    """Plan ``model`` for one global batch ``example_inputs`` on a mesh you need not have (meta tensors OK).

    example_inputs / example_kwargs: the batch's positional and keyword inputs (a model called with keywords
    only, as ``transformers`` models are, takes ``example_kwargs=`` alone).

    hardware: as in ``compile`` ("measured" measures this process's device once and caches it).
    mode: the mode the plan will run in ("eager" or "graph"; None: the global mode). The plan is priced as it
    runs in that mode (graph: the per-rank program with its boundary moves and gradient buckets; eager: DTensor
    between the module boundaries the search chose): for the same model, mesh, hardware and batch it equals the
    plan ``compile(..., mode=mode)`` makes, with ``fold_layers=False``.
    solver: "auto" (exact MILP unless the problem is too large, then propagation), "milp" or "propagate".
    fold_layers: capture only the first, one middle and the last layer of long lists of identical layers and
    weigh the middle one by the number of layers it stands for (see capture.fold); False captures every layer.
    A folded plan holds the solver's layouts and estimate (the folded program itself cannot run; its notes say so).
    pipeline / microbatches / schedule: as in ``compile``; the mesh's ranks are then (stage ranks, pipeline).
    mixed_precision: as in ``compile``; compute and activations are priced in its param_dtype, gradient
    reductions in its reduce_dtype.
    full_batch: as in ``compile``: every rank passes the whole batch, so inputs arrive and outputs leave
    replicated (False: each rank passes its slice).
    reshard_after_forward: as in ``compile``.
    activation_checkpointing: as in ``compile``; the plan names the layers that recompute
    (``plan.activation_checkpointing``) and prices them.

    pipeline="auto" plans ``strategy`` without a pipeline too and returns the faster of the two that fits."""
    check_strategy(strategy)
    if not _as_tuple(example_inputs) and not example_kwargs and not isinstance(strategy, Plan):
        raise AutoparError("plan() needs one global batch to plan for, as example_inputs (positional inputs) or "
                           "example_kwargs (keyword inputs); found neither (or an empty tuple). Pass e.g. "
                           "autopar.plan(model, torch.empty(batch, features, device='meta')) or "
                           "example_kwargs={'input_ids': ...}.")
    if mode is not None and mode not in MODES:
        raise AutoparError(f"mode={mode!r}: expected one of {MODES} or None (the global mode).")
    recompute.check_policy(activation_checkpointing)
    reshard_choice.check_reshard_after_forward(reshard_after_forward)
    policy = precision.resolve(mixed_precision)
    world = math.prod(launch.mesh.check_mesh_shape(mesh_shape, None, "mesh_shape"))
    options = pipelining.check_options(pipeline, microbatches, schedule, world)
    if options is not None:
        _check_pipeline_recompute(activation_checkpointing)
        _check_pipeline_precision(policy)
        _check_pipeline_strategy(strategy, None, full_batch, options)
        if options.searched:
            intra = functools.partial(plan, model, example_inputs, mesh_shape=mesh_shape, hardware=hardware,
                                      strategy=strategy, memory_budget=memory_budget, axis_names=axis_names,
                                      example_kwargs=example_kwargs, bucket_cap_bytes=bucket_cap_bytes,
                                      solver=solver, fold_layers=fold_layers, mode=mode,
                                      reshard_after_forward=reshard_after_forward)
            try:
                args = positional_inputs(model, _as_tuple(example_inputs), example_kwargs)
            except AutoparError as unbound:
                return _intra_only(intra(), unbound)
            return _searched_pipeline(model, args, options, intra, world=world, batch=batch_size(args, {}) or 0,
                                      hardware=job_profile(hardware), memory_budget=memory_budget,
                                      layouts=_stage_layouts(strategy))[0]
        args = positional_inputs(model, _as_tuple(example_inputs), example_kwargs)
        return _offline_pipeline_plan(model, args, options, world, hardware, _pipeline_layout(strategy))
    if isinstance(strategy, Plan):
        _check_plan_recompute(activation_checkpointing)
        strategy.check_compatible(module_fingerprint(model), math.prod(launch.mesh.parse_mesh_shape(mesh_shape)))
        if tuple(strategy.mesh_shape) != launch.mesh.parse_mesh_shape(mesh_shape):
            raise AutoparError(f"this plan is for a mesh of shape {tuple(strategy.mesh_shape)}, not {mesh_shape}; "
                               "plan again for this mesh.")
        return strategy
    with launch.offline_mesh(mesh_shape, axis_names) as mesh:
        return _plan_on_mesh(model, _as_tuple(example_inputs), dict(example_kwargs or {}), mesh, batch_factor=1,
                             strategy=strategy, hardware=hardware, memory_budget=memory_budget,
                             bucket_cap_bytes=bucket_cap_bytes, solver=solver, fold_layers=fold_layers,
                             policy=policy, mode=mode or get_mode(), full_batch=full_batch,
                             reshard_after_forward=reshard_after_forward,
                             activation_checkpointing=activation_checkpointing)


def _check_pipeline_recompute(activation_checkpointing) -> None:
    """Pipelined stages run without recomputation in this version: neither the stage runtime wraps their layers
    nor the pipeline search prices it, so any policy is refused rather than silently dropped."""
    if activation_checkpointing is not None:
        raise AutoparError(f"activation_checkpointing={activation_checkpointing!r} with pipeline=: pipelined stages "
                           "do not recompute in this version (the stage runtime and the pipeline search know no "
                           "recomputation); expected activation_checkpointing=None, or drop pipeline=.")


def _check_plan_recompute(activation_checkpointing) -> None:
    if activation_checkpointing is not None:
        raise AutoparError(f"activation_checkpointing={activation_checkpointing!r} with a Plan as strategy: the plan "
                           "names the layers that recompute (plan.activation_checkpointing); expected None. Drop the "
                           "argument, or plan again with it (autopar.plan(..., activation_checkpointing=...)).")


def _offline_pipeline_plan(model, args, options, world, hardware, layout: str) -> Plan:
    dp = 1 if layout == "tensor_parallel" else world // options.ranks  # tensor-parallel stages: one replica
    batch = batch_size(args, {})
    if batch is None or batch % dp:
        raise AutoparError(f"the global batch (dim 0: {batch}) must divide by the {dp} data-parallel replicas of "
                           f"a {options.ranks}-stage pipeline on {world} ranks; change the batch or pipeline=.")
    return pipelining.pipeline_plan(model, args, options, world_size=world, hardware=job_profile(hardware),
                                    batch_per_rank=batch // dp, dp_share=dp, layout=layout).plan


def _intra_only(intra: Plan, unbound: AutoparError) -> Plan:
    """pipeline="auto" for inputs no pipeline can take (keywords that do not bind to positions): the intra-op
    plan, saying why."""
    intra.notes.append(f"pipeline='auto' kept the intra-op plan: {str(unbound).removeprefix('torch_autopar: ')}")
    return intra


def _check_pipeline_precision(policy) -> None:
    if policy is not None:
        raise AutoparError(f"mixed_precision={policy!r} with pipeline=: pipelined models compute in their "
                           "parameters' dtype in this version; expected mixed_precision=None. Drop one of them.")


def _searched_pipeline(model, args, options, intra_plan, *, world, batch, hardware, memory_budget, layouts,
                       global_batch=None):
    """pipeline="auto": the intra-op plan (``intra_plan()``) against the pipeline search on the same batch;
    (the chosen plan, its pipeline layout or None)."""
    try:
        intra, error = intra_plan(), None
    except AutoparError as failure:  # nothing fits without a pipeline; a pipelined plan may
        intra, error = None, str(failure).removeprefix("torch_autopar: ")
    budget = memory_budget if memory_budget is not None else hardware.memory_bytes
    found = pipelining.searched_plan(model, args, options, world_size=world, hardware=hardware, batch=batch,
                                     global_batch=global_batch or batch, budget=budget, layouts=layouts)
    return pipelining.choose(intra, error, found, budget)


def _stage_layouts(strategy) -> tuple[str, ...]:
    """Stage layouts pipeline="auto" considers: the one strategy= names, else every one the runtime runs."""
    return (strategy,) if strategy in pipelining.SEARCHED_LAYOUTS else pipelining.SEARCHED_LAYOUTS


def _pipeline_layout(strategy) -> str:
    """The stage layout pipeline=N plans: a pipelined Plan's, strategy='fully_shard' shards stages, 'auto' keeps
    them whole."""
    if isinstance(strategy, Plan):
        return pipelining.stage_layout(strategy)
    return strategy if strategy in pipelining.STAGE_LAYOUTS else "data_parallel"


def _check_pipeline_strategy(strategy, mesh, full_batch, options) -> None:
    given = isinstance(strategy, Plan) and strategy.pipeline_stages > 1 and not options.searched
    layouts = pipelining.SEARCHED_LAYOUTS if options.searched else pipelining.STAGE_LAYOUTS
    if not (strategy == "auto" or strategy in layouts or given):
        raise AutoparError(f"strategy={strategy!r} with pipeline={'auto' if options.searched else options.ranks}: "
                           "stages run whole, fully sharded or (pipeline=N only) tensor parallel over the ranks "
                           f"that hold them in this version; expected strategy='auto' or one of {layouts} (or a "
                           "pipelined Plan without pipeline='auto').")
    if given:
        pipelining.stage_layout(strategy)
    if mesh is not None or full_batch:
        raise AutoparError(f"pipeline= lays the ranks out as (stage ranks, pipeline) itself; found mesh={mesh!r}, "
                           f"full_batch={full_batch}. Drop mesh= and full_batch= for a pipelined model.")


def _pipeline_planner(options, hardware, given: Plan | None, layout: str):
    """Plans a pipelined module from one call's inputs (this rank's slice) for this job's ranks."""
    def planner(module, args):
        world = launch.get_world_size() if launch.is_initialized() else 1
        if given is not None:
            given.check_compatible(module_fingerprint(module), world)
        return pipelining.pipeline_plan(module, args, options, world_size=world,
                                        hardware=job_profile(hardware),
                                        batch_per_rank=batch_size(args, {}) or 0, given=given, layout=layout)

    return planner


def _compile_pipeline(model, example_inputs, example_kwargs, options, strategy, hardware, mode,
                      loss_fn) -> PipelineModule:
    given = strategy if isinstance(strategy, Plan) else None
    planner = _pipeline_planner(options, hardware, given, _pipeline_layout(strategy))
    parallel = PipelineModule(model, planner=planner, loss_fn=loss_fn, mode=mode, pipeline_size=options.ranks,
                              stage_layout=_pipeline_layout(strategy))
    if example_inputs is not None or example_kwargs:
        parallel.prepare(_as_tuple(example_inputs), example_kwargs)
    return parallel


def _compile_searched(model, example_inputs, example_kwargs, options, strategy, hardware, memory_budget,
                      bucket_cap_bytes, mode, loss_fn):
    """compile(pipeline="auto"): plan before the first call, then build the pipelined or the intra-op module."""
    if example_inputs is None and not example_kwargs:
        raise AutoparError("pipeline='auto' chooses between a pipelined and an intra-op layout before the first "
                           "call and needs example_inputs or example_kwargs; found neither. Pass this rank's slice "
                           "of a batch (as for data parallelism), or pipeline=N.")
    args, kwargs = _as_tuple(example_inputs), dict(example_kwargs or {})
    planner = _Planner(None, strategy, hardware, memory_budget, False, bucket_cap_bytes, mode)
    try:
        positional = positional_inputs(model, args, kwargs)
    except AutoparError as unbound:
        plan, layout = _intra_only(planner(model, args, kwargs), unbound), None
    else:
        world = launch.get_world_size() if launch.is_initialized() else 1
        batch = batch_size(positional, {}) or 0
        plan, layout = _searched_pipeline(model, positional, options, lambda: planner(model, args, kwargs),
                                          world=world, batch=batch, global_batch=batch * world,
                                          hardware=job_profile(hardware), memory_budget=memory_budget,
                                          layouts=_stage_layouts(strategy))
    if layout is None:
        parallel = ParallelModule(model, plan, mode=mode)
        parallel.prepare(args, kwargs)
        return parallel
    parallel = PipelineModule(model, planner=lambda *_: layout, loss_fn=loss_fn, mode=mode,
                              pipeline_size=plan.mesh_shape[-1], stage_layout=pipelining.stage_layout(plan))
    parallel.prepare(positional)
    return parallel


def _pipeline_options(pipeline, microbatches, schedule, strategy, loss_fn):
    world = launch.get_world_size() if launch.is_initialized() else 1
    if isinstance(strategy, Plan) and strategy.pipeline_stages > 1 and pipeline is None:
        ranks = strategy.mesh_shape[-1]
        return pipelining.check_options(ranks, microbatches or strategy.microbatches, schedule or strategy.schedule,
                                        world)
    options = pipelining.check_options(pipeline, microbatches, schedule, world)
    if options is None and loss_fn is not None:
        raise AutoparError("loss_fn= is for pipelined models (pmodel.step computes the loss inside the pipeline); "
                           "found pipeline=None. Pass pipeline=N or 'auto', or compute the loss yourself.")
    return options


class _Planner:
    """Plans a module for this job's ranks from the inputs of one call (this rank's slice)."""

    def __init__(self, mesh, strategy, hardware, memory_budget, full_batch, bucket_cap_bytes, mode=None, policy=None,
                 reshard_after_forward: bool | str = True, activation_checkpointing=None):
        self.mesh, self.strategy, self.hardware, self.mode, self.policy = mesh, strategy, hardware, mode, policy
        self.reshard_after_forward, self.activation_checkpointing = reshard_after_forward, activation_checkpointing
        self.memory_budget, self.full_batch, self.bucket_cap_bytes = memory_budget, full_batch, bucket_cap_bytes

    def __call__(self, module, args, kwargs) -> Plan:
        world = launch.get_world_size() if launch.is_initialized() else 1
        factor = 1 if self.full_batch else world
        if isinstance(self.strategy, Plan):
            self.strategy.check_compatible(module_fingerprint(module), world,
                                           {name: tuple(p.shape) for name, p in module.named_parameters()})
            if self.strategy.is_data_parallel() or world == 1:
                return self.strategy
            return self._as_executed(module, args, kwargs, factor)
        try:
            return self._plan_with_graph(module, args, kwargs, world, factor)
        except AutoparError as error:
            if self.strategy not in ("auto", "data_parallel", "stand_alone") or "could not capture" not in str(error):
                raise
            params = {name: TensorInfo.of(p) for name, p in module.named_parameters()}
            names = launch.default_axis_names(1)
            plan = plan_from_parameters(params, world, names, strategy=self.strategy, reason=str(error),
                                        bucket_cap_bytes=self.bucket_cap_bytes)
            return self._unpriced_recompute(module, plan)

    def _unpriced_recompute(self, module, plan: Plan) -> Plan:
        """A plan made without a graph recomputes every repeated layer under "full" / "selective", none under
        "auto" (nothing to price a choice with)."""
        policy = self.activation_checkpointing
        if policy in ("full", "selective"):
            plan.activation_checkpointing = {name: policy for name in recompute.layer_names(module, policy)}
        elif policy == "auto":
            plan.notes.append("activation_checkpointing='auto': no graph to price recomputation with; none chosen")
        return plan

    def without_module_boundaries(self, module, args, kwargs, plan: Plan) -> Plan:
        """``plan`` executed in eager mode as DTensor places every op, with no submodule held to its layouts: what
        eager mode falls back to when DTensor cannot run those layouts (``module`` as a plain module: inside
        ``ShardedRunner.as_plain_module``)."""
        world = launch.get_world_size()
        return self._as_executed(module, args, kwargs, 1 if self.full_batch else world,
                                 dataclasses.replace(plan, node_layouts={}, module_layouts={}))

    def _as_executed(self, module, args, kwargs, factor, plan: Plan | None = None) -> Plan:
        """A given sharded plan (``self.strategy`` unless given) with the collectives the runtime will run for
        it (captured on this call)."""
        plan = plan or self.strategy
        mesh = launch.mesh.job_mesh(tuple(plan.mesh_shape), tuple(plan.axis_names))
        fake_args, fake_kwargs = fake_global_inputs(module, args, kwargs, factor)
        program = _capture(module, fake_args, fake_kwargs, self.policy)
        hardware = plan.hardware if plan.hardware in PROFILES else self.hardware
        planner = Planner(program, mesh, plan.axis_names, hardware=job_profile(hardware),
                          global_batch=batch_size(fake_args, fake_kwargs), mode=self._mode(),
                          bucket_cap_bytes=self.bucket_cap_bytes, full_batch=self.full_batch,
                          reshard_after_forward=plan.reshard_after_forward, kept_gathered=plan.kept_gathered,
                          **precision.planned_dtypes(self.policy))
        return planner.executed(plan)

    def _plan_with_graph(self, module, args, kwargs, world, factor) -> Plan:
        if not launch.is_initialized():
            with launch.offline_mesh((1,) if self.mesh is None else self.mesh) as mesh:
                return self._plan(module, args, kwargs, mesh, factor)
        return self._plan(module, args, kwargs, launch.resolve_mesh(self.mesh, world), factor)

    def _plan(self, module, args, kwargs, mesh, factor) -> Plan:
        return _plan_on_mesh(module, args, kwargs, mesh, batch_factor=factor, strategy=self.strategy,
                             hardware=self.hardware, memory_budget=self.memory_budget,
                             bucket_cap_bytes=self.bucket_cap_bytes, mode=self._mode(),
                             policy=self.policy, full_batch=self.full_batch,
                             reshard_after_forward=self.reshard_after_forward,
                             activation_checkpointing=self.activation_checkpointing)

    def _mode(self) -> str:
        """The mode the module will run in (its own, else the global one at planning time)."""
        return self.mode or get_mode()


def _check_options(strategy, mode, mesh) -> None:
    check_strategy(strategy)
    if mode is not None and mode not in MODES:
        raise AutoparError(f"mode={mode!r}: expected one of {MODES} or None (use the global mode).")
    world = launch.get_world_size() if launch.is_initialized() else 1
    if mesh is not None and not isinstance(mesh, torch.distributed.device_mesh.DeviceMesh):
        launch.check_mesh_shape(mesh, world, "compile(mesh=...)")


def compile(model=None, example_inputs=None, *, mesh=None, strategy="auto", memory_budget=None, hardware=None,
            mode=None, full_batch: bool = False, example_kwargs=None,
            bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, activation_checkpointing=None, pipeline=None,
            microbatches=None, schedule=None, loss_fn=None, mixed_precision=None,
            reshard_after_forward: bool | str = True):
    """Plan ``model`` for this job's ranks and return a module that runs the plan (also a class decorator).

    example_inputs: what this rank will pass (its slice of the global batch); None plans at the first call.
    hardware: the profile the cost model prices with (cost.job_profile): a built-in name, a JSON path or a
    HardwareProfile; None: the profile measured on this machine for this job's shape if one is cached, else the
    device's built-in one; "measured": that cached profile, measured by ``autopar.profile`` on first use.
    full_batch: every rank passes the whole global batch (as parallelize_module users call a model): a sharded
    plan takes it replicated and returns its outputs replicated, moving no batch slices; data parallelism
    computes this rank's slice and gathers the outputs. A named strategy that splits the batch into more pieces
    than the global batch has samples (e.g. "fully_shard" on 8 ranks with 4 samples) is refused with an error
    naming the strategies that split it; "auto" leaves such layouts out.
    activation_checkpointing: None, "auto", "full" or "selective" (runtime.recompute): recompute the repeated
    layers' activations in backward (all of them, or all but matmul and attention outputs) to save memory; "auto"
    recomputes, after the layout search, the fewest layers that bring the plan's predicted peak within
    memory_budget (none when it fits as it is; most bytes freed per second of recompute first) and raises when
    even all of them do not. The plan names the layers (``pmodel.plan.activation_checkpointing``); a Plan passed
    as ``strategy`` carries its own.
    pipeline: None, or N pipeline stages (ranks laid out as world/N data-parallel x N pipeline; cut between the
    layers of the model's nn.ModuleList); microbatches: per rank and step (None: 2N if it divides the batch, else
    N); schedule: "gpipe" | "1f1b" (default) | "interleaved_1f1b" | "zero_bubble"; loss_fn(output, target): what
    ``pmodel.step(inputs, targets)`` minimises (a pipelined model computes the loss inside the schedule);
    keyword inputs (example_kwargs, a dict as ``step``'s inputs) are bound to the forward's positions.
    mixed_precision: None, "bf16", "fp16" or autopar.MixedPrecision(param_dtype=, reduce_dtype=, output_dtype=)
    (runtime.precision): fp32 master parameters and optimizer state, forward and backward in param_dtype,
    gradient reductions in reduce_dtype (fp32 for the short names), outputs in output_dtype (fp32).
    pipeline="auto": the number of stages, micro-batches (unless given) and schedule (unless given) are searched
    and compared with ``strategy`` planned without a pipeline; the faster that fits is built (a pipelined module,
    or the intra-op one, which has no ``step``: check ``pmodel.plan.pipeline_stages``). example_inputs are then
    this rank's slice as for data parallelism; once pipelined, ranks pass ``pmodel.data_parallel_size`` slices.
    reshard_after_forward: a fully-sharded plan gathers its parameters per layer (each element of an
    nn.ModuleList) just before the layer runs, frees them after its forward and gathers them again for its
    backward (FSDP2's default: peak memory of one gathered layer, not of the whole model); False gathers them
    once per step and keeps them until backward (less communication); "auto" chooses per layer: every layer kept
    gathered if that fits memory_budget, else the last layers of the forward that fit (``plan.kept_gathered``),
    whichever plan is fastest (the plan's notes compare them). A Plan passed as ``strategy`` carries its own
    (``plan.reshard_after_forward``, ``plan.kept_gathered``).
    """
    options = dict(mesh=mesh, strategy=strategy, memory_budget=memory_budget, hardware=hardware, mode=mode,
                   full_batch=full_batch, bucket_cap_bytes=bucket_cap_bytes,
                   activation_checkpointing=activation_checkpointing, pipeline=pipeline,
                   microbatches=microbatches, schedule=schedule, loss_fn=loss_fn, mixed_precision=mixed_precision,
                   reshard_after_forward=reshard_after_forward)
    if model is None:
        return lambda target: compile(target, example_inputs, example_kwargs=example_kwargs, **options)
    if isinstance(model, type) and issubclass(model, torch.nn.Module):
        return _decorate_class(model, options)
    if not isinstance(model, torch.nn.Module):
        raise AutoparError(f"compile() expected an nn.Module instance or subclass, found {type(model).__name__}.")
    _check_options(strategy, mode, mesh)
    recompute.check_policy(activation_checkpointing)
    reshard_choice.check_reshard_after_forward(reshard_after_forward)
    if isinstance(strategy, Plan):
        _check_plan_recompute(activation_checkpointing)
    policy = precision.resolve(mixed_precision)
    pipeline_options = _pipeline_options(pipeline, microbatches, schedule, strategy, loss_fn)
    if pipeline_options is not None:
        _check_pipeline_recompute(activation_checkpointing)
        _check_pipeline_strategy(strategy, mesh, full_batch, pipeline_options)
        _check_pipeline_precision(policy)
        if pipeline_options.searched:
            return _compile_searched(model, example_inputs, example_kwargs, pipeline_options, strategy, hardware,
                                     memory_budget, bucket_cap_bytes, mode, loss_fn)
        return _compile_pipeline(model, example_inputs, example_kwargs, pipeline_options, strategy, hardware, mode,
                                 loss_fn)
    if isinstance(mesh, int):
        options["mesh"] = (mesh,)
    recompute.layer_names(model, activation_checkpointing)  # a model without repeated layers fails here, not later
    planner = _Planner(options["mesh"], strategy, hardware, memory_budget, full_batch, bucket_cap_bytes, mode, policy,
                       reshard_after_forward, activation_checkpointing)
    parallel = ParallelModule(model, planner=planner, mode=mode, full_batch=full_batch, mixed_precision=policy)
    if example_inputs is not None or example_kwargs:
        parallel.prepare(_as_tuple(example_inputs), dict(example_kwargs or {}))
    return parallel


def _decorate_class(cls: type, options: dict) -> type:
    """``@autopar.compile`` on a Module subclass: constructing it returns the compiled module."""

    class Compiled(cls):
        def __new__(klass, *args, **kwargs):
            return compile(cls(*args, **kwargs), **options)

    functools.update_wrapper(Compiled, cls, updated=())
    return Compiled

