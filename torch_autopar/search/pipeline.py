"""Pipeline plans: where to cut a model between its layers, what each stage costs, what the schedule wastes.

NOTE [stages from module boundaries]
Stages are cut at module boundaries: between the layers of one ``nn.ModuleList`` (``capture.modules``); the
modules called before the first layer join stage 0, those after the last layer join the last stage. Why:
``torch.distributed.pipelining.PipelineStage`` runs one ``nn.Module`` per stage, and the user's own layer
modules are exactly that (each runs its forward as written, eagerly). Splitting the captured aten graph into
stages, with cuts inside a block and each stage priced by the intra-op search on its sub-mesh, is a later step;
so are sharded stages: every stage here is whole on its rank and data-parallel over the ranks that hold it.

The partition, a small dynamic program (Alpa's inter-op formulation with one sub-mesh per stage):
  variables   cuts 0 = c_0 < c_1 < ... < c_S = L between the L layers (every stage has at least one layer)
  objective   minimise max_s cost(layers c_s .. c_{s+1} - 1): the slowest stage sets the pipeline's period;
              step time ≈ (M + S - 1) × (slowest stage per micro-batch) for GPipe and 1F1B, so with S and M
              fixed, balancing the slowest stage is the whole objective (``balanced_cuts``)
  recurrence  best[s][j] = min_{i<j} max(best[s-1][i], C[j] - C[i]), C the prefix sums of layer costs
              (ties broken by the next-largest stage, so the other stages are balanced too)
Layer cost: forward FLOPs × 3 (backward ≈ 2 × forward) from ``torch.utils.flop_counter``'s formulas on fake
tensors, priced by the cost model's roofline. FLOPs rather than parameter counts: an embedding has many
parameters and no FLOPs, attention has FLOPs growing with the sequence and no parameters, and a tied output
head has FLOPs but parameters of its own only on paper; parameter counts would misplace all three.
Must never run a collective or change the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_autopar.capture.modules import (POST, PRE, TopLevel, UnitCost, assign_units, measure_units,
                                           trace_top_level, unit_modules)
from torch_autopar.capture.program import TensorInfo, params_fingerprint
from torch_autopar.cost import CostModel, HardwareProfile
from torch_autopar.errors import AutoparError
from torch_autopar.search.estimate import ADAM_STATE_PER_PARAM
from torch_autopar.search.plan import Plan, PlannedCollective, StageRow

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
VIRTUAL_STAGES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}
"""Stages per pipeline rank: the interleaved schedule runs two stages (chunks) on each rank."""
BACKWARD_FLOPS = 2
"""Backward FLOPs per forward FLOP (gradients for the activations and for the weights)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineOptions:
    """What ``pipeline=``, ``microbatches=`` and ``schedule=`` asked for, checked."""

    ranks: int
    """Pipeline ranks (the ``pipeline=`` value)."""
    microbatches: int | None
    """None: chosen from the local batch (``choose_microbatches``)."""
    schedule: str

    @property
    def stages(self) -> int:
        return self.ranks * VIRTUAL_STAGES[self.schedule]


def check_options(pipeline, microbatches, schedule, world_size: int) -> PipelineOptions | None:
    """Validate the keywords (None: no pipeline); errors say expected / found / fix."""
    if pipeline is None or pipeline == 1:
        if microbatches is not None or schedule is not None:
            raise AutoparError(f"microbatches={microbatches!r} and schedule={schedule!r} apply to pipelined models; "
                               "found pipeline=None. Pass pipeline=N (stages) as well, or drop them.")
        return None
    if not isinstance(pipeline, int) or isinstance(pipeline, bool) or pipeline < 1:
        raise AutoparError(f"pipeline={pipeline!r}: expected None or a positive number of pipeline stages.")
    if world_size % pipeline:
        raise AutoparError(f"pipeline={pipeline} must divide the {world_size} ranks (the mesh is data-parallel x "
                           f"pipeline = {world_size}/{pipeline}); use a pipeline size that divides the world size.")
    if microbatches is not None and (not isinstance(microbatches, int) or microbatches < 1):
        raise AutoparError(f"microbatches={microbatches!r}: expected None or a positive integer.")
    schedule = schedule or "1f1b"
    if schedule not in SCHEDULES:
        raise AutoparError(f"schedule={schedule!r}: expected one of {SCHEDULES} or None (1f1b).")
    return PipelineOptions(ranks=pipeline, microbatches=microbatches, schedule=schedule)


def choose_microbatches(options: PipelineOptions, local_batch: int) -> int:
    """``microbatches=`` if given (it must divide the local batch), else 2 × stages when that divides it, else
    the number of stages (each micro-batch must be a whole number of samples)."""
    if options.microbatches is not None:
        if local_batch % options.microbatches:
            raise AutoparError(
                f"microbatches={options.microbatches} must divide each rank's batch (dim 0 of the inputs); found a "
                f"batch of {local_batch}. Use a micro-batch count that divides it, or change the batch size.")
        return options.microbatches
    for count in (2 * options.ranks, options.ranks):
        if local_batch % count == 0:
            return count
    raise AutoparError(f"pipeline={options.ranks} needs micro-batches of whole samples; a rank's batch of "
                       f"{local_batch} does not divide by {options.ranks}. Pass microbatches= dividing it.")


def check_layers(num_layers: int, stages: int, schedule: str) -> None:
    if stages > num_layers:
        raise AutoparError(
            f"the {schedule} schedule on this pipeline needs {stages} stages of at least one layer each; the model "
            f"has {num_layers} layers. Use pipeline=N with N * {VIRTUAL_STAGES[schedule]} <= {num_layers}.")


def balanced_cuts(costs: list[float], stages: int) -> list[int]:
    """Cut points [0, c_1, ..., L] splitting ``costs`` (one per layer, in order) into ``stages`` contiguous
    non-empty groups whose largest sum is as small as possible; ties go to the split whose next-largest group
    is smallest, and so on (each DP state keeps its groups' sums sorted, largest first, compared in order)."""
    if not 1 <= stages <= len(costs):
        raise AssertionError(f"{stages} stages for {len(costs)} layers")
    total = sum(costs) or 1.0
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost / total)
    best: list[dict[int, tuple]] = [{0: ((), 0)}] + [{} for _ in range(stages)]
    for s in range(1, stages + 1):
        for j in range(s, len(costs) - (stages - s) + 1):
            candidates = []
            for i in range(s - 1, j):
                if i in best[s - 1]:
                    group = round(prefix[j] - prefix[i], 9)
                    candidates.append((tuple(sorted(best[s - 1][i][0] + (group,), reverse=True)), i))
            best[s][j] = min(candidates)
    cuts = [len(costs)]
    for s in range(stages, 0, -1):
        cuts.append(best[s][cuts[-1]][1])
    return cuts[::-1]


def bubble_fraction(ranks: int, microbatches: int, schedule: str) -> float:
    """Predicted idle share of a step: (p - 1) / (v·M + p - 1) with p pipeline ranks and v stages per rank
    (v = 1 for GPipe and 1F1B; the interleaved schedule's v = 2 shrinks the bubble)."""
    virtual = VIRTUAL_STAGES[schedule]
    return (ranks - 1) / (virtual * microbatches + ranks - 1)


def layer_costs(costs: dict, num_layers: int, cost_model: CostModel) -> list[float]:
    """Seconds of forward + backward per layer; the modules before the first layer and after the last are
    added to the first and last layer (they always share those stages)."""
    def seconds(unit) -> float:
        cost = costs.get(unit, UnitCost())
        flops = cost.flops * (1 + BACKWARD_FLOPS)
        return cost_model.compute_time(flops, cost.activation_bytes * (1 + BACKWARD_FLOPS), "float32")

    per_layer = [seconds(k) for k in range(num_layers)]
    per_layer[0] += seconds(PRE)
    per_layer[-1] += seconds(POST)
    return per_layer


def stage_of_units(cuts: list[int]):
    """unit (PRE, layer index, POST) → stage, for ``capture.modules.split_stages``."""
    def stage_of(unit) -> int:
        if unit == PRE:
            return 0
        if unit == POST:
            return len(cuts) - 2
        return next(s for s in range(len(cuts) - 1) if cuts[s] <= unit < cuts[s + 1])

    return stage_of


def stage_rows(cuts: list[int], unit_names: dict, costs: dict, per_layer: list[float], *, ranks: int,
               microbatches: int, schedule: str) -> list[StageRow]:
    """Each stage's modules, parameters, compute and memory (activations in flight under ``schedule``)."""
    stage_of = stage_of_units(cuts)
    rows = []
    for s in range(len(cuts) - 1):
        units = [u for u in unit_names if stage_of(u) == s]
        params: dict[str, tuple[int, int]] = {}
        for unit in units:
            params.update(costs.get(unit, UnitCost()).params or {})
        activations = sum(costs.get(u, UnitCost()).activation_bytes for u in units)
        in_flight = microbatches if schedule == "gpipe" else min(microbatches, ranks - s % ranks)
        param_bytes = sum(nbytes for _, nbytes in params.values())
        memory = param_bytes * (2 + ADAM_STATE_PER_PARAM) + activations * in_flight // microbatches
        rows.append(StageRow(index=s, layers=[n for u in units for n in unit_names[u]],
                             num_params=sum(numel for numel, _ in params.values()),
                             compute_s=sum(per_layer[cuts[s]:cuts[s + 1]]), memory_bytes=int(memory)))
    return rows


def step_time(rows: list[StageRow], *, ranks: int, microbatches: int, schedule: str) -> float:
    """Seconds per step of compute: (v·M + p - 1) time slots of the slowest stage's micro-batch."""
    virtual = VIRTUAL_STAGES[schedule]
    slowest = max(row.compute_s for row in rows) / microbatches
    return (virtual * microbatches + ranks - 1) * slowest


@dataclass(kw_only=True, slots=True)
class PipelineLayout:
    """A pipeline plan and what the runtime needs to build its stages from the traced forward."""

    plan: Plan
    top: TopLevel
    unit: dict
    cuts: list[int]


def pipeline_plan(model, args: tuple, options: PipelineOptions, *, world_size: int, hardware: HardwareProfile,
                  batch_per_rank: int, dp_share: int = 1, given: Plan | None = None) -> PipelineLayout:
    """Trace, price and cut ``model`` into ``options.stages`` stages for ``world_size`` ranks.

    args: one batch, ``dp_share`` times what each data-parallel rank passes (1 in compile: this rank's slice;
    the data-parallel size in autopar.plan: the global batch). given: a pipelined Plan to follow (its stages)."""
    top = trace_top_level(model)
    check_layers(len(top.layers), options.stages, options.schedule)
    microbatches = choose_microbatches(options, batch_per_rank)
    unit = assign_units(top)
    costs = measure_units(top, unit, args)
    for cost in costs.values():
        cost.flops, cost.activation_bytes = cost.flops // dp_share, cost.activation_bytes // dp_share
    dp = world_size // options.ranks
    cost_model = CostModel(hardware, (dp, options.ranks))
    per_layer = layer_costs(costs, len(top.layers), cost_model)
    cuts = cuts_from_plan(given, top) if given is not None else balanced_cuts(per_layer, options.stages)
    rows = stage_rows(cuts, unit_modules(top, unit), costs, per_layer, ranks=options.ranks,
                      microbatches=microbatches, schedule=options.schedule)
    plan = _plan(model, rows, options, microbatches, dp, cost_model, hardware, batch_per_rank * dp)
    return PipelineLayout(plan=plan, top=top, unit=unit, cuts=cuts)


def cuts_from_plan(plan: Plan, top: TopLevel) -> list[int]:
    """The cut points a saved pipelined plan chose (the first layer of each stage)."""
    cuts = [0]
    for row in plan.stages[1:]:
        first = next((top.layers.index(n) for n in row.layers if n in top.layers), None)
        if first is None or first <= cuts[-1]:
            raise AutoparError(f"this plan's stage {row.index} ({row.layers}) does not start at a layer of this "
                               "model after the previous stage's; plan again for this model.")
        cuts.append(first)
    return cuts + [len(top.layers)]


def _grad_sync(rows: list[StageRow], cost_model: CostModel, dp: int) -> list[PlannedCollective]:
    if dp == 1:
        return []
    return [PlannedCollective(kind="all_reduce", axis="dp", nbytes=row.num_params * 4, phase="grad_sync",
                              where=f"stage{row.index}", seconds=cost_model.collective_time("all_reduce", 0,
                                                                                            row.num_params * 4))
            for row in rows]


def _plan(model, rows, options, microbatches, dp, cost_model, hardware, global_batch) -> Plan:
    params = {name: TensorInfo.of(p) for name, p in model.named_parameters()}
    collectives = _grad_sync(rows, cost_model, dp)
    compute = step_time(rows, ranks=options.ranks, microbatches=microbatches, schedule=options.schedule)
    exposed = max((c.seconds for c in collectives), default=0.0)
    return Plan(
        strategy="pipeline" if dp == 1 else "pipeline+data_parallel", mesh_shape=(dp, options.ranks),
        axis_names=("dp", "pp"), hardware=hardware.name, fingerprint=params_fingerprint(params),
        global_batch=global_batch, param_placements={name: ("R", "R") for name in params},
        input_placements={0: ("S(0)", "R")}, grad_buckets=[], collectives=collectives, layers=[],
        replicated_ops={}, compute_time=compute, exposed_comm_time=exposed, estimated_step_time=compute + exposed,
        peak_memory=max(row.memory_bytes for row in rows), pipeline_stages=len(rows), microbatches=microbatches,
        schedule=options.schedule, stages=rows,
        bubble_fraction=bubble_fraction(options.ranks, microbatches, options.schedule),
        notes=["stages are whole on their ranks (data-parallel over the ranks that hold them); stage times are "
               "forward + backward FLOPs priced by the roofline; sends between stages are not priced"])
