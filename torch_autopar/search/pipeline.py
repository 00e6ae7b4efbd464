"""Pipeline plans: how many stages, where to cut a model between its layers, how many micro-batches, which
schedule and which layout inside each stage; what each costs and what the schedule wastes.

NOTE [stages from module boundaries]
Stages are cut at module boundaries: between the layers of one ``nn.ModuleList`` (``capture.modules``); the
modules called before the first layer join stage 0, those after the last layer join the last stage. Why:
``torch.distributed.pipelining.PipelineStage`` runs one ``nn.Module`` per stage, and the user's own layer
modules are exactly that (each runs its forward as written, eagerly). Splitting the captured aten graph into
stages, with cuts inside a block, is a later step.

The search, Alpa's inter-op formulation with one sub-mesh of world / p ranks per pipeline rank:
  variables   p pipeline ranks (p divides the world, world / p divides the global batch), the schedule (v stages
              per rank: 1, or 2 for interleaved 1F1B and zero-bubble), cuts 0 = c_0 < ... < c_{pv} = L between
              the L layers,
              M micro-batches (M divides a replica's batch; torch's schedules' own limits: 1F1B needs M >= p),
              and the layout inside each stage over its world / p ranks ("data_parallel": whole stage, gradients
              all-reduced; "fully_shard": parameters, gradients and Adam state sharded, gathered for the step;
              "tensor_parallel", pipeline=N only, not searched: matrices split, every rank of a stage passing the
              same batch, its collectives per micro-batch in t_r, ``search.stage_tensor_parallel``)
  objective   step = M · max_r t_r + (Σ_r t_r − max_r t_r) / d + max_r (sync_r + opt_r), where t_r is pipeline rank r's
              time per micro-batch (its stages' forward + backward compute plus the activation sends and their
              gradients to the next stage, point-to-point over the cost model's pipeline link) and sync_r its
              stages' gradient synchronisation (and gathers) and its tied-parameter sums once per step, opt_r
              its optimizer step on the parameters it holds (``cost.pricing.optimizer_seconds``), plus the
              loss's all-reduce; d = v (3v for zero-bubble: ``BUBBLE_SHRINK``); d = 1 gives Alpa's
              Σ stage times + (M − 1) × slowest stage (``step_seconds``)
  constraint  memory of every pipeline rank <= the budget: its stages' parameters, gradients and Adam state in
              the stage layout plus the activations of the micro-batches in flight (GPipe: M; 1F1B,
              interleaved and zero-bubble: min(M, p − r)) (``price``)
  cuts        for a stage count, the balanced partition of layer compute (``balanced_cuts``):
              best[s][j] = min_{i<j} max(best[s-1][i], C[j] - C[i]), C the prefix sums of layer costs
              (ties broken by the next-largest stage): with p, v, M fixed, Σ_r t_r hardly depends on the cuts,
              so the slowest stage is what they decide
The rest is enumeration (``search``): a few dozen (p, schedule, M, layout) points, each priced in microseconds.
``choose`` then keeps the pipelined plan only when it estimates faster than the intra-op plan or when that one
does not fit, and writes what was compared into the plan's notes.
Layer cost: forward FLOPs × 3 (backward ≈ 2 × forward) from ``torch.utils.flop_counter``'s formulas on fake
tensors, priced by the cost model's roofline per unit (a layer and its glue), plus the fixed launch cost of each
aten op it runs, per micro-batch (what makes many small micro-batches expensive). FLOPs rather than parameter
counts: an embedding has many parameters and no FLOPs, attention has FLOPs growing with the sequence and none.
Activation memory counts every tensor a stage's forward creates (an upper bound of what backward keeps).
Must never run a collective or change the model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from torch_autopar import _compat
from torch_autopar.capture.modules import (POST, PRE, TopLevel, UnitCost, assign_units, measure_units,
                                           stages_at, trace_top_level, unit_modules)
from torch_autopar.capture.program import TensorInfo, params_fingerprint
from torch_autopar.cost import CostModel, HardwareProfile, pricing
from torch_autopar.errors import AutoparError
from torch_autopar.search import stage_tensor_parallel as tensor_parallel
from torch_autopar.search.estimate import ADAM_STATE_PER_PARAM
from torch_autopar.search.explain import _bytes
from torch_autopar.search.plan import Plan, PlannedCollective, StageRow

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
VIRTUAL_STAGES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2}
"""Stages per pipeline rank: the interleaved schedules run two stages (chunks) on each rank."""
SEARCHED_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
"""What ``pipeline="auto"`` chooses from. Zero-bubble runs when asked but is not searched: its split backward
(input gradients, then weight gradients in a second pass) costs per micro-batch what the bubble model does not
price, and measured slower than every other schedule on 2 CPU ranks (``bench/bench_pipeline.py``: 1.23x
interleaved 1F1B's step at M = 4, 1.42x at M = 8) while its estimate is the lowest."""
BUBBLE_SHRINK = {"zero_bubble": 3}
"""How much smaller a schedule makes 1F1B's bubble besides interleaving. Zero-bubble (torch's
``ScheduleInterleavedZeroBubble``, ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism", 2023) splits each
backward into its input-gradient (B) and weight-gradient (W) parts and fills the idle time with W: 1F1B's
(p - 1)(F + B + W) becomes (p - 1)(F + B - W), a third of it with B = W = F (backward = 2 x forward, as
``BACKWARD_FLOPS`` prices it), at 1F1B's activation memory."""
BACKWARD_FLOPS = 2
"""Backward FLOPs per forward FLOP (gradients for the activations and for the weights)."""
LOSS_BYTES = 4
"""A pipelined step's loss, averaged over every rank once per step (one fp32 scalar: ``runtime.pipeline``)."""
STAGE_LAYOUTS = ("data_parallel", "fully_shard", "tensor_parallel")
"""Layouts of a stage over its ranks, each run by ``runtime.pipeline``: "data_parallel" and "fully_shard" (FSDP2:
``runtime.stage_sharding``) over data-parallel replicas passing their own slices of the batch, "tensor_parallel"
(DTensor: ``runtime.stage_tensor_parallel``) over ranks passing the same batch, matrices split between them."""
SEARCHED_LAYOUTS = ("data_parallel", "fully_shard")
"""The stage layouts ``pipeline="auto"`` searches: a tensor-parallel stage is priced from a capture and a
propagation of the model (``search.stage_tensor_parallel``), too slow to repeat for every candidate."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineOptions:
    """What ``pipeline=``, ``microbatches=`` and ``schedule=`` asked for, checked."""

    ranks: int | None
    """Pipeline ranks (the ``pipeline=`` value); None for ``pipeline="auto"`` (searched)."""
    microbatches: int | None
    """None: chosen (``choose_microbatches`` for a given pipeline, searched under "auto")."""
    schedule: str | None
    """None only under "auto" (searched)."""

    @property
    def searched(self) -> bool:
        return self.ranks is None

    @property
    def stages(self) -> int:
        return self.ranks * VIRTUAL_STAGES[self.schedule]


def check_options(pipeline, microbatches, schedule, world_size: int) -> PipelineOptions | None:
    """Validate the keywords (None: no pipeline); errors say expected / found / fix."""
    if pipeline is None or pipeline == 1:
        if microbatches is not None or schedule is not None:
            raise AutoparError(f"microbatches={microbatches!r} and schedule={schedule!r} apply to pipelined models; "
                               "found pipeline=None. Pass pipeline=N (stages) or 'auto' as well, or drop them.")
        return None
    if pipeline != "auto" and (not isinstance(pipeline, int) or isinstance(pipeline, bool) or pipeline < 1):
        raise AutoparError(f"pipeline={pipeline!r}: expected None, 'auto' or a positive number of pipeline stages.")
    if pipeline != "auto" and world_size % pipeline:
        raise AutoparError(f"pipeline={pipeline} must divide the {world_size} ranks (the mesh is data-parallel x "
                           f"pipeline = {world_size}/{pipeline}); use a pipeline size that divides the world size.")
    if microbatches is not None and (not isinstance(microbatches, int) or microbatches < 1):
        raise AutoparError(f"microbatches={microbatches!r}: expected None or a positive integer.")
    if schedule is not None and schedule not in SCHEDULES:
        raise AutoparError(f"schedule={schedule!r}: expected one of {SCHEDULES} or None (1f1b; searched under "
                           "pipeline='auto').")
    if pipeline == "auto":
        return PipelineOptions(ranks=None, microbatches=microbatches, schedule=schedule)
    return PipelineOptions(ranks=pipeline, microbatches=microbatches, schedule=schedule or "1f1b")


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


def runs_with(schedule: str, microbatches: int, ranks: int) -> bool:
    """torch's own limits: 1F1B needs at least as many micro-batches as stages; the interleaved schedules run
    max(1, M // p) rounds of equal size."""
    if schedule == "1f1b":
        return microbatches >= ranks
    if VIRTUAL_STAGES[schedule] > 1:
        return microbatches % max(1, microbatches // ranks) == 0
    return True


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


def _bubble_divisor(schedule: str, microbatches: int, ranks: int) -> int:
    """d = v x the schedule's own shrink (``BUBBLE_SHRINK``), v the stages per rank when every rank has a
    micro-batch per chunk to switch to (M >= p); with fewer, one micro-batch's path through all the stages is
    the critical one, as without chunks."""
    virtual = VIRTUAL_STAGES[schedule] if microbatches >= ranks else 1
    return virtual * BUBBLE_SHRINK.get(schedule, 1)


def bubble_fraction(ranks: int, microbatches: int, schedule: str) -> float:
    """Predicted idle share of a step: (p - 1) / (d·M + p - 1) with p pipeline ranks (d = 1 for GPipe and 1F1B;
    the interleaved schedule's 2 and zero-bubble's 6 shrink the bubble when M >= p: ``_bubble_divisor``)."""
    return (ranks - 1) / (_bubble_divisor(schedule, microbatches, ranks) * microbatches + ranks - 1)


def step_seconds(per_rank: list[float], microbatches: int, schedule: str) -> float:
    """Seconds of the schedule given each pipeline rank's time per micro-batch: M · slowest + (the others) / d."""
    slowest = max(per_rank)
    return microbatches * slowest + (sum(per_rank) - slowest) / _bubble_divisor(schedule, microbatches,
                                                                                  len(per_rank))


# measuring ---------------------------------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class Measured:
    """A model's top-level forward priced once on one batch (fake tensors); every candidate rescales it."""

    top: TopLevel
    unit: dict
    costs: dict
    batch: int
    """Samples in the measured batch (dim 0)."""
    crossing: list[int]
    """crossing[c]: bytes a stage starting at layer c receives from the stages before it (0 at c = 0 and L)."""
    ops: dict
    """Unit → aten ops its forward runs (views excluded)."""

    @property
    def num_layers(self) -> int:
        return len(self.top.layers)


class _Boundaries(fx.Interpreter):
    """Bytes of each top-level node's result (the values that may cross a stage boundary) and the aten ops
    each unit runs (every op pays the hardware's fixed launch cost, once per micro-batch)."""

    def __init__(self, gm: fx.GraphModule, unit: dict):
        super().__init__(gm)
        self.unit, self.current = unit, None
        self.nbytes: dict[fx.Node, int] = {}
        self.ops: dict = {}

    def run_node(self, node: fx.Node):
        self.current = self.unit.get(node, POST)
        result = super().run_node(node)
        if node.op != "get_attr":  # a parameter read is never sent (each stage reads its own copy)
            self.nbytes[node] = sum(t.numel() * t.element_size() for t in _compat.pytree().tree_leaves(result)
                                    if isinstance(t, torch.Tensor))
        return result

    def count(self, op, args, kwargs, out) -> None:
        if not getattr(op, "is_view", False):
            self.ops[self.current] = self.ops.get(self.current, 0) + 1


def _boundaries(top: TopLevel, unit: dict, args: tuple) -> tuple[list[int], dict]:
    """(crossing bytes per cut, see ``Measured.crossing``; aten ops per unit) on fake tensors."""
    found = _Boundaries(top.graph_module, unit)
    with _compat.FakeTensorMode(allow_non_fake_inputs=True) as fake, torch.no_grad():
        with _compat.recording_ops(found.count):
            found.run(*[fake.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    layers = len(top.layers)

    def position(node: fx.Node) -> int:  # PRE, layer k, POST (and the output) in running order
        return layers if node.op == "output" else {PRE: -1, POST: layers}.get(unit[node], unit[node])

    crossing = [0] * (layers + 1)
    for node, nbytes in found.nbytes.items():
        if node.users:
            last = max(position(user) for user in node.users)
            for cut in range(max(position(node) + 1, 1), min(last, layers - 1) + 1):
                crossing[cut] += nbytes
    return crossing, found.ops


def measure(model: torch.nn.Module, args: tuple, batch: int) -> Measured:
    """Trace ``model``'s top-level forward and price its units and boundaries on ``args`` (``batch`` samples)."""
    top = trace_top_level(model, args)
    unit = assign_units(top)
    crossing, ops = _boundaries(top, unit, args)
    return Measured(top=top, unit=unit, costs=measure_units(top, unit, args), batch=batch, crossing=crossing, ops=ops)


def layer_seconds(measured: Measured, cost_model: CostModel, scale: float) -> list[float]:
    """Seconds of forward + backward per layer on ``scale`` × the measured batch (roofline of its FLOPs and
    bytes plus the fixed cost of each op it launches); the modules before the first layer and after the last
    are added to the first and last layer (they always share those stages)."""
    def seconds(unit) -> float:
        cost, work = measured.costs.get(unit, UnitCost()), scale * (1 + BACKWARD_FLOPS)
        launches = measured.ops.get(unit, 0) * (1 + BACKWARD_FLOPS)  # backward ≈ twice the forward's ops too
        return (cost_model.compute_time(cost.flops * work, cost.activation_bytes * work, "float32")
                + (launches - 1) * cost_model.hardware.op_overhead_s)

    per_layer = [seconds(k) for k in range(measured.num_layers)]
    per_layer[0] += seconds(PRE)
    per_layer[-1] += seconds(POST)
    return per_layer


def stage_of_units(cuts: list[int]):
    """unit (PRE, layer index, POST) → stage, for ``capture.modules.stages_at``."""
    def stage_of(unit) -> int:
        if unit == PRE:
            return 0
        if unit == POST:
            return len(cuts) - 2
        return next(s for s in range(len(cuts) - 1) if cuts[s] <= unit < cuts[s + 1])

    return stage_of


# pricing -----------------------------------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class Candidate:
    """One point of the search, priced: what ``step_seconds`` and the memory constraint say of it."""

    ranks: int
    schedule: str
    microbatches: int
    layout: str
    cuts: list[int]
    global_batch: int
    world_size: int
    rows: list[StageRow] = field(default_factory=list)
    collectives: list[PlannedCollective] = field(default_factory=list)
    step_s: float = 0.0
    compute_s: float = 0.0
    """The schedule's time without the sends (forward + backward compute and the bubble)."""
    peak_memory: int = 0
    memory_breakdown: dict = field(default_factory=dict)
    placements: dict = field(default_factory=dict)
    """Parameter name → placement on the stage axis, for tensor-parallel stages."""

    @property
    def data_parallel(self) -> int:
        return self.world_size // self.ranks

    def describe(self) -> str:
        return (f"pp={self.ranks} x dp={self.data_parallel} {self.schedule} M={self.microbatches} "
                f"{self.layout} stages {self.step_s * 1e3:.3f} ms, {_bytes(self.peak_memory)}")


def _send_seconds(cost_model: CostModel, nbytes: float) -> float:
    """One point-to-point send between neighbouring pipeline ranks (mesh axis 1) over the cost model's link."""
    if nbytes == 0:
        return 0.0
    link = cost_model.link(1)
    return link.call_s + link.latency_s + nbytes / (link.bandwidth * cost_model.hardware.comm_efficiency)


def _stage_memory(param_bytes: int, activations: float, layout: str, dp: int) -> dict[str, int]:
    """A stage's bytes per rank: "fully_shard" holds a 1/dp shard of parameters, gradients and Adam state, the
    gathered parameters for the whole step and, as FSDP2 under a schedule does (``runtime.stage_sharding``),
    whole gradients accumulated over the micro-batches until the step's one reduce-scatter leaves their shard;
    "data_parallel" holds all of them whole."""
    held = param_bytes // dp if layout == "fully_shard" else param_bytes
    return {"parameters": held, "gathered_parameters": param_bytes - held,
            "gradients": held + (param_bytes if held != param_bytes else 0),
            "optimizer": ADAM_STATE_PER_PARAM * held, "activations": int(activations)}


def _tensor_parallel_memory(stage, split: tensor_parallel.TensorParallelLayout, activations: float) -> dict:
    """A tensor-parallel stage's bytes per rank: its pieces of the parameters, their gradients and Adam state,
    and every activation whole (an upper bound: the split ones are smaller)."""
    held = sum(split.held.get(name, entry[1]) for name, entry in stage.params.items())
    return {"parameters": held, "gathered_parameters": 0, "gradients": held, "optimizer": ADAM_STATE_PER_PARAM * held,
            "activations": int(activations)}


def _stage_optimizer(held: int, tensors: int, layout: str, cost_model: CostModel) -> float:
    """The optimizer step on a stage's ``held`` parameter bytes; a fully-sharded (FSDP2) or tensor-parallel stage
    keeps its parameters as DTensors, so each of its kernels goes through DTensor's dispatch too."""
    dispatch = pricing.ADAMW_UPDATE_OPS * tensors * cost_model.hardware.dtensor_overhead_s
    return pricing.optimizer_seconds(held, tensors, cost_model) + (0.0 if layout == "data_parallel" else dispatch)


def _shard_bytes(entry: tuple[int, int, int], dp: int) -> int:
    """Bytes of the largest of FSDP2's ``dp`` shards of one parameter ((elements, bytes, dim-0 rows)):
    ceil(rows / dp) rows; a 0-d parameter stays whole (``runtime.stage_sharding``)."""
    _, size, rows = entry
    return size if rows == 0 else -(-rows // dp) * (size // rows)


def _gathered_bytes(params: dict, dp: int) -> int:
    """What FSDP2's all_gather brings (and its reduce_scatter takes) for a stage: every sharded parameter's
    shards padded to the largest, times dp (0-d parameters are not sharded)."""
    return sum(_shard_bytes(entry, dp) * dp for entry in params.values() if entry[2])


def _stage_sync(nbytes: int, layout: str, cost_model: CostModel, where: str) -> list[PlannedCollective]:
    """Collectives over the data-parallel ranks (mesh axis 0) once per step: for a "fully_shard" stage one
    all_gather of its padded shards (the first micro-batch's forward; kept for the step) and one reduce_scatter
    (after the last backward), as FSDP2 runs one unit per stage; for a pipeline rank's gradients that no
    reduce_scatter reduces (every one of "data_parallel" stages, 0-d ones of "fully_shard" stages) one
    all_reduce (``runtime.pipeline`` reduces them in one flat buffer)."""
    if cost_model.mesh_shape[0] == 1 or nbytes == 0:
        return []
    kinds = [("all_gather", "forward"), ("reduce_scatter", "grad_sync")] if layout == "fully_shard" else \
        [("all_reduce", "grad_sync")]
    return [PlannedCollective(kind=kind, axis="dp", nbytes=nbytes, phase=phase, where=where,
                              seconds=cost_model.collective_time(kind, 0, nbytes)) for kind, phase in kinds]


def tied_axis(pipeline_ranks) -> str:
    """The plan's axis name of the group of pipeline ranks that hold copies of the same parameters."""
    return "tied" + ",".join(map(str, pipeline_ranks))


def rank_collectives(plan: Plan, pipeline_rank: int) -> list[PlannedCollective]:
    """The collectives (sends excluded) that pipeline rank ``pipeline_rank`` of every replica runs per step: its
    stages' synchronisation, the tied-parameter sums it takes part in, and the loss's average."""
    ranks = plan.mesh_shape[1]

    def runs_here(c: PlannedCollective) -> bool:
        if c.axis.startswith("tied"):
            return str(pipeline_rank) in c.axis.removeprefix("tied").split(",")
        stages = [int(w.removeprefix("stage")) for w in c.where.split(",") if w.startswith("stage")]
        return c.where == "loss" or any(s % ranks == pipeline_rank for s in stages)

    return [c for c in plan.collectives if c.kind != "send" and runs_here(c)]


def _tied_sync(stages: list, ranks: int, layout: str, dp: int, cost_model: CostModel,
               split: tensor_parallel.TensorParallelLayout | None = None) -> list[PlannedCollective]:
    """Per set of pipeline ranks holding the same parameter (an embedding tied to the output head): one
    all_reduce summing their copies' gradients (when fully sharded, of their shards: the largest shard's bytes,
    what the replica holding the first rows sends; tensor parallel, of the piece each rank holds)."""
    holders: dict[str, set[int]] = {}
    nbytes: dict[str, int] = {}
    for s, stage in enumerate(stages):
        for name, entry in stage.params.items():
            holders.setdefault(name, set()).add(s % ranks)
            nbytes[name] = _shard_bytes(entry, dp) if layout == "fully_shard" else \
                split.held[name] if split is not None else entry[1]
    shared: dict[tuple, int] = {}
    for name, held in holders.items():
        if len(held) > 1:
            key = tuple(sorted(held))
            shared[key] = shared.get(key, 0) + nbytes[name]
    return [PlannedCollective(kind="all_reduce", axis=tied_axis(key), nbytes=size, phase="grad_sync",
                              where=tied_axis(key), seconds=cost_model.collective_time("all_reduce", 1, size))
            for key, size in sorted(shared.items())]


@dataclass(frozen=True, kw_only=True, slots=True)
class _Stage:
    """What a stage holds whatever the schedule: its units, parameters and activations on the measured batch."""

    units: list
    params: dict[str, tuple[int, int, int]]
    """Parameter name → (elements, bytes, dim-0 rows; 0 for a 0-d parameter)."""
    activation_bytes: int

    @property
    def param_bytes(self) -> int:
        return sum(nbytes for _, nbytes, _ in self.params.values())


def _stages(measured: Measured, cuts: list[int], names: dict) -> list[_Stage]:
    stage_of, stages = stage_of_units(cuts), []
    for s in range(len(cuts) - 1):
        units = [u for u in names if stage_of(u) == s]
        params: dict[str, tuple[int, int, int]] = {}
        for u in units:
            params.update(measured.costs.get(u, UnitCost()).params or {})
        stages.append(_Stage(units=units, params=params, activation_bytes=sum(
            measured.costs.get(u, UnitCost()).activation_bytes for u in units)))
    return stages


def _sends(nbytes: int, s: int, microbatches: int, cost_model: CostModel) -> list[PlannedCollective]:
    """Stage s's activations to stage s + 1 and their gradients back, once per micro-batch each."""
    if nbytes == 0:
        return []
    return [PlannedCollective(kind="send", axis="pp", nbytes=nbytes, phase=phase, where=f"stage{s}->stage{s + 1}",
                              seconds=_send_seconds(cost_model, nbytes), count=microbatches)
            for phase in ("forward", "backward")]


def _loss_reduce(cost_model: CostModel) -> PlannedCollective:
    """The step's loss, averaged over every rank (the last stages' micro-batch means, zeros elsewhere): priced as
    an all-reduce over each mesh axis in turn."""
    seconds = sum(cost_model.collective_time("all_reduce", axis, LOSS_BYTES)
                  for axis, size in enumerate(cost_model.mesh_shape) if size > 1)
    return PlannedCollective(kind="all_reduce", axis="dp+pp", nbytes=LOSS_BYTES, phase="forward", where="loss",
                             seconds=seconds)


def price(measured: Measured, *, ranks: int, schedule: str, microbatches: int, layout: str, cuts: list[int],
          world_size: int, global_batch: int, hardware: HardwareProfile,
          split: tensor_parallel.TensorParallelLayout | None = None) -> Candidate:
    """Step time and per-rank memory of one point (the objective and constraint of the module docstring).
    split: for "tensor_parallel" stages, the parameters' layout over the stage's ranks and what it moves."""
    dp = world_size // ranks
    cost_model = CostModel(hardware, (dp, ranks))
    replicas = 1 if layout == "tensor_parallel" else dp  # tensor-parallel stage ranks pass the same batch
    scale = global_batch / replicas / measured.batch  # a replica's batch over the measured one
    per_layer = layer_seconds(measured, cost_model, scale / microbatches)
    if layout == "tensor_parallel":  # matrices split over the stage's ranks: their FLOPs are (priced as) shared
        per_layer = [seconds / dp for seconds in per_layer]
    names = unit_modules(measured.top, measured.unit)
    result = Candidate(ranks=ranks, schedule=schedule, microbatches=microbatches, layout=layout, cuts=cuts,
                       global_batch=global_batch, world_size=world_size,
                       placements=dict(split.placements) if split is not None else {})
    compute, sends, sync, optimizer = [0.0] * ranks, [0.0] * ranks, [0.0] * ranks, [0.0] * ranks
    memory: list[dict[str, int]] = [{} for _ in range(ranks)]
    stages = _stages(measured, cuts, names)
    for s, stage in enumerate(stages):
        rank, stage_compute = s % ranks, sum(per_layer[cuts[s]:cuts[s + 1]])
        in_flight = microbatches if schedule == "gpipe" else min(microbatches, ranks - rank)
        activations = stage.activation_bytes * scale * in_flight / microbatches
        if split is not None:
            stage_memory = _tensor_parallel_memory(stage, split, activations)
        else:
            stage_memory = _stage_memory(stage.param_bytes, activations, layout, dp)
        memory[rank] = {k: memory[rank].get(k, 0) + v for k, v in stage_memory.items()}
        moves = _sends(int(measured.crossing[cuts[s + 1]] * scale / microbatches), s, microbatches, cost_model)
        if layout == "fully_shard":
            moves += _stage_sync(_gathered_bytes(stage.params, dp), layout, cost_model, f"stage{s}")
        if split is not None:
            moves += tensor_parallel.stage_moves(split, s, microbatches)
        compute[rank] += stage_compute
        optimizer[rank] += _stage_optimizer(stage_memory["parameters"], len(stage.params),
                                            layout if dp > 1 else "data_parallel", cost_model)
        sends[rank] += sum(c.seconds * c.count / microbatches for c in moves if c.kind == "send" or c.phase in (
            "forward", "backward") and c.axis == tensor_parallel.AXIS)  # per micro-batch
        sync[rank] += sum(c.seconds * c.count for c in moves if c.kind != "send" and not (
            c.phase in ("forward", "backward") and c.axis == tensor_parallel.AXIS))
        result.collectives += moves
        result.rows.append(StageRow(index=s, layers=[n for u in stage.units for n in names[u]],
                                    num_params=sum(numel for numel, _, _ in stage.params.values()),
                                    compute_s=stage_compute * microbatches, memory_bytes=sum(stage_memory.values())))
    for rank in range(ranks if layout != "tensor_parallel" else 0):  # a tensor-parallel stage has no replicas
        mine = range(rank, len(stages), ranks)
        unreduced = {name: size for s in mine for name, (_, size, rows) in stages[s].params.items()
                     if layout == "data_parallel" or rows == 0}
        moves = _stage_sync(sum(unreduced.values()), "data_parallel", cost_model, ",".join(f"stage{s}" for s in mine))
        sync[rank] += sum(c.seconds for c in moves)
        result.collectives += moves
    for move in _tied_sync(stages, ranks, layout, dp, cost_model, split):
        for rank in map(int, move.axis.removeprefix("tied").split(",")):
            sync[rank] += move.seconds
        result.collectives.append(move)
    result.compute_s = step_seconds(compute, microbatches, schedule) + max(optimizer)
    result.collectives.append(_loss_reduce(cost_model))
    result.step_s = (step_seconds([c + s for c, s in zip(compute, sends)], microbatches, schedule)
                     + max(s + o for s, o in zip(sync, optimizer)) + result.collectives[-1].seconds)
    result.memory_breakdown = max(memory, key=lambda m: sum(m.values()))
    result.peak_memory = sum(result.memory_breakdown.values())
    return result


# searching ---------------------------------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(measured: Measured, options: PipelineOptions, *, world_size: int, global_batch: int,
           hardware: HardwareProfile, layouts=SEARCHED_LAYOUTS) -> list[Candidate]:
    """Every (pipeline ranks, schedule, micro-batches, stage layout) point ``options`` allows, priced."""
    cuts_for: dict[int, list[int]] = {}
    candidates = []
    for ranks in _divisors(world_size)[1:]:
        dp = world_size // ranks
        if global_batch % dp:
            continue
        replica = global_batch // dp
        for schedule in [options.schedule] if options.schedule else SEARCHED_SCHEDULES:
            stages = ranks * VIRTUAL_STAGES[schedule]
            if stages > measured.num_layers:
                continue
            if stages not in cuts_for:
                cuts_for[stages] = balanced_cuts(layer_seconds(measured, CostModel(hardware, (1,)), 1.0), stages)
            counts = [options.microbatches] if options.microbatches else _divisors(replica)
            for microbatches in counts:
                if replica % microbatches or not runs_with(schedule, microbatches, ranks):
                    continue
                for layout in layouts if dp > 1 else layouts[:1]:
                    candidates.append(price(measured, ranks=ranks, schedule=schedule, microbatches=microbatches,
                                            layout=layout, cuts=cuts_for[stages], world_size=world_size,
                                            global_batch=global_batch, hardware=hardware))
    return candidates


def best_candidate(candidates: list[Candidate], budget: int) -> Candidate | None:
    """The fastest candidate within ``budget`` (ties: fewer pipeline ranks, then fewer micro-batches)."""
    fitting = [c for c in candidates if c.peak_memory <= budget]
    return min(fitting, key=lambda c: (c.step_s, c.ranks, c.microbatches), default=None)


def _summary(candidates: list[Candidate], budget: int) -> str:
    """The best candidate per pipeline size (within the budget where one fits), for the plan's notes."""
    by_ranks: dict[int, list[Candidate]] = {}
    for c in candidates:
        by_ranks.setdefault(c.ranks, []).append(c)
    parts = []
    for ranks, group in sorted(by_ranks.items()):
        best = best_candidate(group, budget) or min(group, key=lambda c: c.peak_memory)
        parts.append(best.describe() + ("" if best.peak_memory <= budget else " (over budget)"))
    return "; ".join(parts) or "none (no pipeline size divides the ranks and the batch with a layer per stage)"


# plans -------------------------------------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class PipelineLayout:
    """A pipeline plan and what the runtime needs to build its stages from the traced forward."""

    plan: Plan
    top: TopLevel
    unit: dict
    cuts: list[int]


def pipeline_plan(model, args: tuple, options: PipelineOptions, *, world_size: int, hardware: HardwareProfile,
                  batch_per_rank: int, dp_share: int = 1, given: Plan | None = None,
                  layout: str = "data_parallel") -> PipelineLayout:
    """Price and cut ``model`` into ``options.stages`` stages (``layout`` inside) for ``world_size`` ranks.

    args: one batch, ``dp_share`` times what each data-parallel rank passes (1 in compile: this rank's slice;
    the data-parallel size in autopar.plan: the global batch). given: a pipelined Plan to follow (its stages
    and its stage layout)."""
    if given is not None:
        layout = stage_layout(given)
    measured = measure(model, args, batch_per_rank * dp_share)
    check_layers(measured.num_layers, options.stages, options.schedule)
    microbatches = choose_microbatches(options, batch_per_rank)
    dp = world_size // options.ranks
    cuts = cuts_from_plan(given, measured.top) if given is not None else balanced_cuts(
        layer_seconds(measured, CostModel(hardware, (1,)), 1.0), options.stages)
    split = None
    if layout == "tensor_parallel" and dp > 1:
        microbatch = tuple(a.chunk(dp_share)[0].chunk(microbatches)[0] if isinstance(a, torch.Tensor) else a
                           for a in args)
        stages = stages_at(measured.top, measured.unit, stage_of_units(cuts), microbatch)
        split = tensor_parallel.layout(model, stages, microbatch, size=dp, hardware=hardware)
    candidate = price(measured, ranks=options.ranks, schedule=options.schedule, microbatches=microbatches,
                      layout=layout, cuts=cuts, world_size=world_size,
                      global_batch=batch_per_rank * (1 if layout == "tensor_parallel" else dp), hardware=hardware,
                      split=split)
    return PipelineLayout(plan=_plan(model, candidate, hardware), top=measured.top, unit=measured.unit, cuts=cuts)


@dataclass(kw_only=True, slots=True)
class SearchResult:
    """What ``searched_plan`` found: the fastest pipelined plan within the budget (None if none fits)."""

    layout: PipelineLayout | None
    summary: str
    """The candidates compared, for the chosen plan's notes."""
    stats: dict
    """candidates, fitting, seconds (the search's own time), best_step_s / best_peak_memory (None if none fits)."""


def searched_plan(model, args: tuple, options: PipelineOptions, *, world_size: int, hardware: HardwareProfile,
                  batch: int, global_batch: int, budget: int, layouts=SEARCHED_LAYOUTS) -> SearchResult:
    """Search the pipelined plans of ``model`` for ``world_size`` ranks and ``global_batch`` samples.

    args: one batch of ``batch`` samples (the global batch in autopar.plan, this rank's slice in compile)."""
    started = time.perf_counter()
    measured = measure(model, args, batch)
    candidates = search(measured, options, world_size=world_size, global_batch=global_batch, hardware=hardware,
                        layouts=layouts)
    best = best_candidate(candidates, budget)
    summary = (f"{len(candidates)} pipelined candidates (pipeline size x schedule x micro-batches x stage layout "
               f"{'/'.join(layouts)}), best per pipeline size: {_summary(candidates, budget)}")
    stats = {"candidates": len(candidates), "fitting": sum(c.peak_memory <= budget for c in candidates),
             "seconds": time.perf_counter() - started, "best_step_s": best.step_s if best else None,
             "best_peak_memory": best.peak_memory if best else None}
    if best is None:
        return SearchResult(layout=None, summary=summary, stats=stats)
    layout = PipelineLayout(plan=_plan(model, best, hardware), top=measured.top, unit=measured.unit, cuts=best.cuts)
    return SearchResult(layout=layout, summary=summary, stats=stats)


def choose(intra: Plan | None, intra_error: str | None, found: SearchResult,
           budget: int) -> tuple[Plan, PipelineLayout | None]:
    """Keep pipelining only when it estimates faster than the intra-op plan or that one does not fit; the
    chosen plan's notes say what was compared, its ``search_stats["pipeline_auto"]`` both estimates.
    (plan, the pipeline layout when pipelined)."""
    pipelined = found.layout
    if intra is None and pipelined is None:
        raise AutoparError(f"no plan fits the memory budget of {budget:,} bytes per device, with or without "
                           f"pipelining. Intra-op: {intra_error} Pipelined: {found.summary}. Raise memory_budget, "
                           "use more devices, or a smaller batch.")
    intra_text = (f"intra-op {intra.strategy} {intra.estimated_step_time * 1e3:.3f} ms, "
                  f"{_bytes(intra.peak_memory)}" + (f" ({intra.search_stats['candidate']})"
                                                    if intra.search_stats.get("candidate") else "")
                  if intra is not None else f"intra-op: nothing fits ({intra_error})")
    keep = pipelined is not None and (intra is None or pipelined.plan.estimated_step_time < intra.estimated_step_time)
    chosen = pipelined.plan if keep else intra
    chosen.notes.append(f"pipeline='auto' compared {intra_text} with {found.summary}; chose "
                        + ("the pipelined plan" if keep else "the intra-op plan"))
    if keep and intra is not None:
        chosen.notes += [f"intra-op: {note}" for note in intra.notes if note.startswith("auto compared")]
    chosen.search_stats["pipeline_auto"] = found.stats | {
        "chosen": "pipelined" if keep else "intra-op",
        "intra_op_step_s": intra.estimated_step_time if intra is not None else None,
        "intra_op_peak_memory": intra.peak_memory if intra is not None else None}
    return chosen, pipelined if keep else None


def stage_layout(plan: Plan) -> str:
    """The layout inside a pipelined plan's stages ("pipeline" alone: one rank per stage, whole)."""
    layout = plan.stage_layout
    if layout not in STAGE_LAYOUTS:
        raise AutoparError(f"this plan's stages are {layout} over their ranks ({plan.strategy}); the runtime runs "
                           f"stages laid out as one of {STAGE_LAYOUTS}. Plan with compile(..., pipeline='auto') or "
                           "pipeline=N, which choose stages that run.")
    return layout


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


def _plan(model, candidate: Candidate, hardware: HardwareProfile) -> Plan:
    params = {name: TensorInfo.of(p) for name, p in model.named_parameters()}
    dp, ranks = candidate.data_parallel, candidate.ranks

    def placement(info: TensorInfo) -> str:
        sharded = candidate.layout == "fully_shard" and dp > 1 and info.shape  # FSDP2 pads dim 0 to dp rows
        return "S(0)" if sharded else "R"

    exposed = candidate.step_s - candidate.compute_s
    split = candidate.layout == "tensor_parallel" and dp > 1
    if split:
        param_placements = {name: (candidate.placements.get(name, "R"), "R") for name in params}
    else:
        param_placements = {name: (placement(info), "R") for name, info in params.items()}
    return Plan(
        strategy="pipeline" if dp == 1 else f"pipeline+{candidate.layout}", mesh_shape=(dp, ranks),
        axis_names=(tensor_parallel.AXIS if split else "dp", "pp"), hardware=hardware.name,
        fingerprint=params_fingerprint(params), global_batch=candidate.global_batch,
        param_placements=param_placements, input_placements={0: ("R" if split else "S(0)", "R")}, grad_buckets=[],
        collectives=candidate.collectives, layers=[],
        replicated_ops={}, compute_time=candidate.compute_s, exposed_comm_time=exposed,
        estimated_step_time=candidate.step_s, peak_memory=candidate.peak_memory,
        memory_breakdown=candidate.memory_breakdown, pipeline_stages=len(candidate.rows),
        microbatches=candidate.microbatches, schedule=candidate.schedule, stages=candidate.rows,
        bubble_fraction=bubble_fraction(ranks, candidate.microbatches, candidate.schedule),
        notes=[f"stages are {candidate.layout.replace('_', '-')} over the {dp} ranks that hold them"
               + (" (matrices split Megatron-style, propagated by DTensor's rules; compute priced as 1/"
                  f"{dp} of the stage's)" if split else "") + "; stage times are "
               "forward + backward FLOPs priced by the roofline, plus the activation sends between stages and "
               "their gradients (point-to-point over the pipeline link)"])
