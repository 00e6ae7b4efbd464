"""``Plan``: what the search decided, in a form that is saved, loaded, validated and explained.

A plan names the placements of every parameter and user input on each mesh axis, the gradient buckets, the
collectives it implies (kind, axis, bytes, phase) and its estimates. It holds no tensors and no graph.
Must never run anything.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from torch_autopar.capture.layers import reshard_groups
from torch_autopar.errors import AutoparError
from torch_autopar.search.plan_check import check_fields, check_shard_dims, check_values

PLAN_FORMAT_VERSION = 1


def params_of_groups(groups, names) -> frozenset[str]:
    """Of the parameter ``names``, those of ``groups`` (``capture.layers.reshard_groups``): which parameters
    ``Plan.kept_gathered`` keeps, for the planner's graph-mode pricing and graph mode's program (eager mode's
    groups are ``runtime.fsdp``'s, by the same ``reshard_groups``)."""
    members = reshard_groups(list(names))
    return frozenset(name for group in groups for name in members.get(group, ()))


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedCollective:
    kind: str
    """all_reduce | all_gather | reduce_scatter | all_to_all"""
    axis: str
    nbytes: int
    """Full buffer bytes on one rank."""
    phase: str
    """forward | backward | grad_sync | background (issued ahead, waited for as backward ends: data parallelism's
    batch check)"""
    where: str
    """The graph node or gradient bucket it belongs to."""
    seconds: float
    """Per instance."""
    count: int = 1
    """Instances per step (a folded middle layer's collective stands for one per real layer)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerRow:
    name: str
    """The module owning the parameters (one row per module with parameters)."""
    num_params: int
    placements: str
    grad_sync_bytes: int
    memory_bytes: int
    compute_s: float = 0.0
    """Forward + backward compute of the nodes attributed to this module (those using its parameters first)."""
    comm_s: float = 0.0
    """Collectives of those nodes plus this module's share of gradient synchronisation."""
    activations: str = ""
    """Layouts of those nodes' outputs and how many lie in each ("S(0) x12, P(sum) x2, R x3")."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StageRow:
    """One pipeline stage: which modules it runs and what it is estimated to cost per training step."""

    index: int
    layers: list[str]
    """Qualified names of the modules the stage calls, in order (modules before the first layer join stage 0,
    after the last the last stage); a parameter read directly by the forward (a tied head) is listed too."""
    num_params: int
    compute_s: float
    """Forward + backward compute of the whole local batch (all micro-batches)."""
    memory_bytes: int
    """Parameters, gradients, Adam state and the activations in flight under the schedule."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerActivations:
    """One repeated layer as activation checkpointing prices it: bytes per device on the plan's local shards."""

    saved_bytes: int
    """Activations its forward keeps for backward."""
    freed_bytes: int
    """Of those, what recomputing it frees (all but what ops after it read: its output, kept by the next layer)."""
    recompute_s: float
    """Seconds of one more forward of it: what recomputing it adds to backward."""
    selective_freed_bytes: int = 0
    """What "selective" recomputation frees: ``freed_bytes`` less its matmul and attention outputs, which it keeps."""
    selective_recompute_s: float = 0.0
    """Seconds "selective" recomputation adds: the forward of all but those ops."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeLayout:
    """Where one node of the captured joint graph lives: its output's placements (one tuple per mesh axis, e.g.
    ("S(0)", "R"); for an op with several outputs, one such tuple or None per output) and the placements each
    of its inputs (``node.all_input_nodes``, in order) must be moved to before it runs (None: not a tensor)."""

    output: tuple
    inputs: tuple


def is_one_tensor_layout(layout) -> bool:
    """Whether a NodeLayout entry is one tensor's placements (not None, nor a multi-output node's tuple)."""
    return isinstance(layout, tuple) and all(isinstance(p, str) for p in layout)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModuleLayout:
    """The boundary of one submodule (called once per forward) in eager mode: each entry is (node name, global
    shape, placements). ``inputs``: the tensors it receives from outside (parameters aside), in order of first
    use, and the layout its first op wants each in; ``outputs``: its values used after it returns, in graph
    order, and the layout the plan gives each."""

    inputs: tuple
    outputs: tuple


@dataclass(kw_only=True)
class Plan:
    strategy: str
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    hardware: str
    fingerprint: str
    """Identifies the model (parameter names, shapes, dtypes) the plan was made for."""
    global_batch: int | None
    param_placements: dict[str, tuple[str, ...]]
    input_placements: dict[int, tuple[str, ...]]
    grad_buckets: list[list[str]]
    collectives: list[PlannedCollective]
    layers: list[LayerRow]
    replicated_ops: dict[str, int]
    compute_time: float
    exposed_comm_time: float
    estimated_step_time: float
    """Seconds per training step: forward + backward + gradient synchronisation not hidden by backward."""
    peak_memory: int
    """Bytes per device: parameters, gradients, optimizer state (Adam) and activations kept for backward."""
    memory_breakdown: dict[str, int] = field(default_factory=dict)
    search_stats: dict = field(default_factory=dict)
    """How the plan was found: mode (exact / propagation), problem size, timings."""
    notes: list[str] = field(default_factory=list)
    version: int = PLAN_FORMAT_VERSION
    pipeline_stages: int = 1
    """Pipeline stages (1: not pipelined); the mesh is then (stage ranks: "dp" or "tp", pipeline)."""
    microbatches: int = 1
    """Micro-batches each rank's batch is cut into per step (pipelined plans)."""
    schedule: str | None = None
    """The pipeline schedule ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"); None when not pipelined."""
    stages: list[StageRow] = field(default_factory=list)
    bubble_fraction: float = 0.0
    """Predicted share of a step each stage idles: (stages - 1) / (microbatches + stages - 1) for GPipe/1F1B."""
    reshard_after_forward: bool = True
    """Fully-sharded parameters (sharded over a batch axis) are gathered per group (each layer of a ModuleList;
    ``capture.layers.reshard_groups``) around its forward and again for its backward, instead of once per step
    and kept until backward (False, FSDP2's ``reshard_after_forward=False``). Graph mode's program gathers each
    parameter once for forward and, when set, again for backward (``rewrite.reshard``), except those of the
    groups ``kept_gathered``."""
    kept_gathered: tuple[str, ...] = ()
    """Groups (``capture.layers.reshard_groups``: "blocks.7") kept gathered from their forward to their backward
    although ``reshard_after_forward`` is set: ``reshard_after_forward="auto"`` keeps the last groups of the
    forward that the memory budget allows (``search.reshard_choice``). Their parameters are gathered once per
    step, as with ``reshard_after_forward=False``; every other group reshards."""
    node_layouts: dict[str, NodeLayout] = field(default_factory=dict)
    """Every node of the captured joint graph (by name) → its layout: what graph mode's per-rank program runs
    (empty for a plan made from the parameter list alone)."""
    full_batch: bool = False
    """Every rank passes the whole batch (``compile(full_batch=True)``): inputs arrive and outputs leave
    replicated (``strategies.boundary``); otherwise each rank passes its slice."""
    param_compute_placements: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Parameter → the layout eager mode computes with (its first op's input layout in the plan; gathered
    where the storage layout is sharded over the batch); empty: the fully-sharded rule
    (``strategies.boundary.compute_layouts``)."""
    local_compute: bool = False
    """Eager mode runs every op on local tensors, as FSDP2 does, instead of through DTensor's dispatch: set by the
    planner where that computes what DTensor would (each parameter whole where computed, the batch split on
    every axis, no collective but parameter gathers, gradient syncs and the batch check, no random op;
    ``search.executed``), and priced without DTensor's per-op dispatch."""
    module_layouts: dict[str, ModuleLayout] = field(default_factory=dict)
    """Submodule path ("blocks.0.attn") → the layouts its inputs enter and its outputs leave in: what eager
    mode's hooks redistribute to (empty where eager mode runs DTensor's own choices)."""
    activation_checkpointing: dict[str, str] = field(default_factory=dict)
    """Repeated layer (module path, "blocks.3") → how it recomputes its activations in backward ("full" or
    "selective", ``runtime.recompute``): the runtime wraps exactly these; empty: every activation is kept.
    Priced in ``peak_memory`` and ``estimated_step_time`` (``search.recompute``)."""
    layer_activations: dict[str, LayerActivations] = field(default_factory=dict)
    """Repeated layer (module path) → what recomputing it frees and costs, in forward order."""

    def stage_of(self, layer: str) -> int:
        """The pipeline stage that runs module ``layer`` (0 when not pipelined)."""
        return next((row.index for row in self.stages if layer in row.layers), 0)

    @property
    def world_size(self) -> int:
        size = 1
        for axis_size in self.mesh_shape:
            size *= axis_size
        return size

    @property
    def stage_layout(self) -> str:
        """A pipelined plan's layout inside its stages, from its strategy ("pipeline+<layout>"; "pipeline" alone:
        each stage whole on one rank, "data_parallel")."""
        return self.strategy.removeprefix("pipeline").removeprefix("+") or "data_parallel"

    def is_data_parallel(self) -> bool:
        """Parameters replicated on every axis and some input split: each rank runs the whole model on its slice
        and gradients are averaged (whatever the plan is named: "auto" often chooses this). A pipelined plan is
        not: each rank runs only its stages."""
        replicated = all(all(p == "R" for p in placements) for placements in self.param_placements.values())
        split = any(any(p.startswith("S(") for p in placements) for placements in self.input_placements.values())
        return replicated and (split or not self.input_placements) and self.world_size > 1 and self.pipeline_stages == 1

    def collective_counts(self) -> dict[tuple[str, str], int]:
        """How many collectives of each (kind, phase) one training step runs."""
        counts: dict[tuple[str, str], int] = {}
        for collective in self.collectives:
            key = (collective.kind, collective.phase)
            counts[key] = counts.get(key, 0) + collective.count
        return counts

    def comm_bytes(self) -> int:
        """Bytes per rank moved by collectives in one step."""
        return sum(c.nbytes * c.count for c in self.collectives)

    def check_compatible(self, fingerprint: str, world_size: int, shapes: dict | None = None) -> None:
        """Raise a clear error when this plan was made for another model or another number of ranks.

        shapes: parameter name → shape, to check each 'S(dim)' names a dim of its parameter (hand edits)."""
        if fingerprint != self.fingerprint:
            raise AutoparError(
                f"this plan was made for another model (fingerprint {self.fingerprint}, this model has "
                f"{fingerprint}): parameter names, shapes or dtypes differ. Plan again for this model "
                "with autopar.plan(...) or strategy='auto'."
            )
        if world_size != self.world_size:
            raise AutoparError(
                f"this plan needs {self.world_size} ranks (mesh {self.mesh_shape}) but the job has {world_size}; "
                "launch with a matching --nproc-per-node or plan again for this world size."
            )
        if shapes is not None:
            check_shard_dims(self.param_placements, shapes)

    def save(self, path) -> None:
        with open(path, "w") as handle:
            json.dump(asdict(self), handle, indent=1)

    @staticmethod
    def load(path) -> "Plan":
        try:
            with open(path) as handle:
                data = json.load(handle)
            return Plan.from_dict(data)
        except AutoparError:
            raise
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:  # ValueError: bad JSON/UTF-8
            raise AutoparError(f"could not read a plan from {path!r}: {type(error).__name__}: {error}. Expected a file "
                               "written by Plan.save().") from error

    @staticmethod
    def from_dict(data: dict) -> "Plan":
        if not isinstance(data, dict):
            raise AutoparError(f"a plan is a JSON object written by Plan.save(); found a {type(data).__name__}.")
        if data.get("version") != PLAN_FORMAT_VERSION:
            raise AutoparError(
                f"plan format version {data.get('version')!r} is not supported (expected {PLAN_FORMAT_VERSION}); "
                "plan again with this version of torch_autopar."
            )
        check_fields(data, Plan)
        check_values(data)
        data = dict(data)
        data["mesh_shape"] = tuple(data["mesh_shape"])
        data["axis_names"] = tuple(data["axis_names"])
        data["param_placements"] = {k: tuple(v) for k, v in data["param_placements"].items()}
        data["input_placements"] = {int(k): tuple(v) for k, v in data["input_placements"].items()}
        data["collectives"] = [PlannedCollective(**c) for c in data["collectives"]]
        data["layers"] = [LayerRow(**row) for row in data["layers"]]
        data["stages"] = [StageRow(**row) for row in data.get("stages", [])]  # files before pipelining have none
        data["node_layouts"] = {name: NodeLayout(output=_tuples(layout["output"]), inputs=_tuples(layout["inputs"]))
                                for name, layout in data.get("node_layouts", {}).items()}
        data["param_compute_placements"] = {k: tuple(v) for k, v in data.get("param_compute_placements", {}).items()}
        data["kept_gathered"] = tuple(data.get("kept_gathered", ()))
        data["module_layouts"] = {path: ModuleLayout(inputs=_tuples(layout["inputs"]), outputs=_tuples(layout["outputs"]))
                                  for path, layout in data.get("module_layouts", {}).items()}
        data["layer_activations"] = {path: LayerActivations(**row)
                                     for path, row in data.get("layer_activations", {}).items()}
        return Plan(**data)

    def explain(self) -> str:
        from torch_autopar.search.explain import explain

        return explain(self)

    def _repr_html_(self) -> str:
        """Jupyter shows a plan as its explanation with the per-layer table as an HTML table."""
        from torch_autopar.search.explain import explain_html

        return explain_html(self)


def _tuples(value):
    """JSON lists back into the tuples a NodeLayout holds (None stays None)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
