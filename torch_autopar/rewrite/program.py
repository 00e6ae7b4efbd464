"""Graph mode's per-rank program: the captured joint graph rewritten into the layouts a Plan gives every node.

From the joint forward+backward graph (captured on global fake shapes, as the planner captured it) and each
node's ``NodeLayout``, ``trace_program`` traces a program on this rank's local shards:
  - each tensor enters in the layout it arrives in (parameters in their storage layout, buffers replicated, the
    batch split over every rank or, with ``plan.full_batch``, replicated; the gradient of an output in the
    layout that output leaves in) and is moved to the layout the plan gives its placeholder;
  - on every edge whose producer's layout differs from the one the consumer's strategy needs, the move runs as
    DTensor's redistribution planner orders it, which emits ``_c10d_functional`` collectives on the process
    group of each mesh axis; a value moved to one layout is moved once, whatever number of consumers need it;
  - a view of a parameter is moved as a view of its parameter's one gathered copy (``strategies.param_gathers``),
    which ``rewrite.reshard`` tags for recomputation in backward when the plan reshards after forward;
  - each op runs on local tensors with local shapes; an output that leaves the op in another layout than the
    plan's is moved to the plan's and reported (``unplanned``);
  - outputs with the batch as dim 0 leave as this rank's rows, others (and all of a full batch's) replicated
    (``placement.leaving``); each gradient leaves in its parameter's layout: the plan's buckets of gradients
    (``rewrite.grad_buckets``) are each reduced by one collective issued as soon as the bucket's last gradient
    is computed and waited for when the next bucket's is issued (the last at the output); a gradient outside them
    moves on its own as soon as it exists.
DTensor is used while tracing only: the traced program holds plain aten ops and functional collectives, so
nothing at run time can miss a sharding rule. AOTAutograd then partitions it into forward and backward graphs
for the backend's compilers. Must never choose a layout (the plan does) and never communicate while tracing.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torch_autopar import _compat
from torch_autopar.capture.program import _CapturableOutputs, fake_global_inputs
from torch_autopar.errors import AutoparError
from torch_autopar.rewrite import gather_buckets, placement, reshard
from torch_autopar.rewrite.grad_buckets import GradBuckets
from torch_autopar.search.plan import Plan, params_of_groups
from torch_autopar.strategies import boundary, param_gathers
from torch_autopar.strategies.placements import format_placements, parse_placements

pytree = _compat.pytree()  # torch.utils._pytree: no public equivalent in torch 2.13


@dataclass(kw_only=True)
class UnplannedMove:
    """An op's output left it in another layout than the plan's and was moved there."""

    node: str
    source: tuple[str, ...]
    target: tuple[str, ...]


@dataclass(kw_only=True)
class ProgramReport:
    """What tracing found: moves the plan did not foresee and nodes the plan has no layout for."""

    unplanned: list[UnplannedMove] = field(default_factory=list)
    unlaid: list[str] = field(default_factory=list)
    merged_gathers: int = 0
    """Parameter gathers made as part of their group's one gather (``rewrite.gather_buckets``)."""
    regathered: int = 0
    """Parameter gathers tagged to run again in backward (``rewrite.reshard``; ``Plan.reshard_after_forward``)."""


def _placeable(value) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor)


@dataclass(frozen=True, slots=True)
class _Tangent:
    """A tangent's local tensor, not yet entered into the program."""

    local: torch.Tensor


def _per_output(layout_output):
    """A multi-output node's layout, one entry per output (a single tuple of placements applies to each)."""
    if layout_output and isinstance(layout_output[0], str):
        return itertools.repeat(layout_output)
    return layout_output


class _Rewriter(fx.Interpreter):
    """Runs the joint graph on DTensors whose layouts follow the plan (under ``make_fx``: traced, not run)."""

    def __init__(self, graph_module: fx.GraphModule, plan: Plan, mesh: DeviceMesh, arrival: dict, leaving: dict,
                 batch_tangents: set, grads: dict, reduce_dtype: torch.dtype | None = None):
        super().__init__(graph_module, garbage_collect_values=True)
        self.plan, self.mesh, self.reduce_dtype = plan, mesh, reduce_dtype
        self.arrival, self.leaving, self.batch_tangents = arrival, leaving, batch_tangents
        self.grad_layouts = {node: placements for node, (_, placements) in grads.items()}
        self.buckets = GradBuckets(plan.grad_buckets, grads, mesh, reduce_dtype)
        self.moved: dict[tuple[fx.Node, tuple], DTensor] = {}
        self.roots: dict[fx.Node, DTensor] = {}
        """Parameters and their casts (``param_gathers.gathered_root``): what their views' moves gather."""
        self.report = ProgramReport()
        self.node: fx.Node | None = None

    def run_node(self, node: fx.Node):
        self.node = node
        value = super().run_node(node)
        if param_gathers.gathered_root(node, self._is_param) is node:  # kept for its views' gathers
            self.roots[node] = value
        return value

    # entering ----------------------------------------------------------------------------------------------------
    def placeholder(self, target, args, kwargs):
        local = super().placeholder(target, args, kwargs)
        node = self.node
        if not _placeable(local):
            return local
        if _compat.input_kind(node.meta["desc"]) == "tangent":
            return _Tangent(local)  # entered at its first use, so that its moves are traced as backward ops
        return self._enter(node, local)

    def _enter(self, node: fx.Node, local: torch.Tensor):
        if node in self.batch_tangents:  # each rank's loss is a mean over its slice: average, as DDP does
            local = local / self.mesh.size()
        value = node.meta["val"]
        entered = DTensor.from_local(local, self.mesh, self.arrival[node], run_check=False, shape=value.shape,
                                     stride=value.stride())
        layout = self.plan.node_layouts.get(node.name)  # the plan's own move of an input (a gather, a split)
        return self._move(node, entered, parse_placements(layout.output)) if layout is not None else entered

    def _value(self, node: fx.Node):
        value = self.env[node]
        if isinstance(value, _Tangent):
            value = self.env[node] = self._enter(node, value.local)
        return value

    def get_attr(self, target, args, kwargs):
        return self._conform(self.node, super().get_attr(target, args, kwargs))

    # ops -----------------------------------------------------------------------------------------------------------
    def call_function(self, target, args, kwargs):
        node = self.node
        if target is operator.getitem:
            return self._synced(node, self._conform(node, args[0][args[1]]))
        layout = self.plan.node_layouts.get(node.name)
        wanted = layout.inputs if layout is not None else (None,) * len(node.all_input_nodes)
        moved = {producer: self._move(producer, self._value(producer), want and parse_placements(want))
                 for producer, want in zip(node.all_input_nodes, wanted)}
        call_args, call_kwargs = fx.node.map_arg((node.args, node.kwargs), moved.__getitem__)
        return self._synced(node, self._conform(node, target(*call_args, **call_kwargs)))

    def _synced(self, node: fx.Node, output):
        """``output``; when it is a gradient, its collective issued as soon as it exists: its bucket's, once the
        bucket is complete (``rewrite.grad_buckets``), else its own move."""
        if node in self.grad_layouts and not self.buckets.add(node, output):
            self._move(node, output, self.grad_layouts[node])
        return output

    def _move(self, producer: fx.Node, value, wanted: tuple | None):
        """``value`` (produced by ``producer``) in layout ``wanted``, moved once per (producer, layout)."""
        if not isinstance(value, DTensor) or wanted is None or tuple(value.placements) == tuple(wanted):
            return value
        target = boundary.move_target(tuple(value.placements), tuple(wanted))
        if tuple(value.placements) == target:
            return value
        key = (producer, target)
        if key not in self.moved:
            moved = self.buckets.result(producer, target)
            moved = moved if moved is not None else self._from_gathered_root(producer, value, target)
            self.moved[key] = moved if moved is not None else self._redistribute(producer, value, target)
        return self.moved[key]

    def _from_gathered_root(self, producer: fx.Node, value: DTensor, target: tuple) -> DTensor | None:
        """``value`` in ``target`` as a view of its parameter's one gathered copy (``strategies.param_gathers``):
        the parameter gathered (once for all its views) and ``producer``'s views replayed on it; None when
        ``producer`` is no view of a parameter or the move is no gather."""
        root = param_gathers.gathered_root(producer, self._is_param)
        root_value = self.roots.get(root) if root is not producer else None
        if not isinstance(root_value, DTensor):
            return None
        wanted = param_gathers.root_target(tuple(value.placements), target, tuple(root_value.placements))
        if wanted is None:
            return None
        gathered = self._move(root, root_value, wanted)
        for view in param_gathers.views_from(root, producer):
            gathered = view.target(*fx.node.map_arg(view.args, lambda _: gathered), **view.kwargs)
        return gathered if tuple(gathered.placements) == target else None  # a view DTensor lays out otherwise

    @staticmethod
    def _is_param(node: fx.Node) -> bool:
        return node.op == "placeholder" and _compat.input_kind(node.meta["desc"]) == "param"

    def _redistribute(self, producer: fx.Node, value: DTensor, target: tuple) -> DTensor:
        """``value`` moved to ``target``; a gradient's partial sums are reduced in ``reduce_dtype`` (mixed
        precision, as the plan prices them) and cast back to the gradient's dtype."""
        dtype = self.reduce_dtype
        if (producer not in self.grad_layouts or dtype is None or dtype == value.dtype
                or not any(p.is_partial() for p in value.placements)):
            return value.redistribute(self.mesh, target)
        return value.to(dtype).redistribute(self.mesh, target).to(value.dtype)

    def _conform(self, node: fx.Node, output):
        """``output`` in the layout the plan gives ``node`` (a plain tensor, such as a factory op's, is
        replicated); a DTensor the op left elsewhere is moved there and reported."""
        layout = self.plan.node_layouts.get(node.name)
        if layout is None:
            if isinstance(output, torch.Tensor):
                self.report.unlaid.append(node.name)
            return self._replicated(output)
        if isinstance(output, (tuple, list)):
            return type(output)(self._conform_one(node, v, w) for v, w in zip(output, _per_output(layout.output)))
        return self._conform_one(node, output, layout.output)

    def _conform_one(self, node: fx.Node, value, wanted):
        value = self._replicated(value)
        if not isinstance(value, DTensor) or wanted is None:
            return value
        target = parse_placements(wanted)
        if tuple(value.placements) == target:
            return value
        if all(p.is_replicate() for p in value.placements) and not any(p.is_partial() for p in target):
            return value.redistribute(self.mesh, target)  # a local slice of a replicated value: no traffic
        self.report.unplanned.append(UnplannedMove(node=node.name, source=format_placements(value.placements),
                                                   target=tuple(wanted)))
        return value.redistribute(self.mesh, boundary.move_target(tuple(value.placements), target))

    def _replicated(self, value):
        if _placeable(value):
            return DTensor.from_local(value, self.mesh, placement.replicated(self.mesh), run_check=False)
        return value

    # leaving -------------------------------------------------------------------------------------------------------
    def output(self, target, args, kwargs):
        outputs = self.node.args[0]
        leaving = []
        for position, (producer, value) in enumerate(zip(outputs, args[0])):
            value = self._value(producer) if isinstance(value, _Tangent) else value
            if not isinstance(value, DTensor):
                leaving.append(value)
                continue
            wanted = self.leaving.get(position)
            if wanted is None:
                wanted = self.grad_layouts.get(producer, placement.replicated(self.mesh))
            leaving.append(self._move(producer, value, wanted).to_local())
        return leaving


def _arrivals(graph_module: fx.GraphModule, plan: Plan, mesh: DeviceMesh, leaving_of_output: dict) -> dict:
    """Placeholder → the layout its local tensor arrives in."""
    arrival = {}
    for node in graph_module.graph.find_nodes(op="placeholder"):
        desc, value = node.meta["desc"], node.meta.get("val")
        kind = _compat.input_kind(desc)
        if not isinstance(value, torch.Tensor):
            continue
        if kind == "param":
            arrival[node] = parse_placements(plan.param_placements[desc.target])
        elif kind == "input":
            arrival[node] = boundary.arrival(value, mesh.ndim, plan.full_batch)
        elif kind == "tangent":
            arrival[node] = leaving_of_output[_compat.tangent_output_index(desc)]
        else:  # buffers, constants
            arrival[node] = placement.replicated(mesh)
    return arrival


def _leaving(graph_module: fx.GraphModule, plan: Plan, mesh: DeviceMesh, global_batch: int | None):
    """(output position → layout of forward outputs, output index → the same, gradient node → (its parameter's
    name, that parameter's layout))."""
    output = graph_module.graph.find_nodes(op="output")[0]
    by_position, by_index, grads = {}, {}, {}
    for position, (producer, desc) in enumerate(zip(output.args[0], output.meta["desc"])):
        value = producer.meta.get("val") if isinstance(producer, fx.Node) else None
        if (index := _compat.output_index(desc)) is not None and isinstance(value, torch.Tensor):
            by_position[position] = by_index[index] = placement.leaving(value, mesh, global_batch, plan.full_batch)
        elif (name := _compat.grad_target(desc)) is not None and name in plan.param_placements:
            grads[producer] = (name, parse_placements(plan.param_placements[name]))
    return by_position, by_index, grads


def _local_value(value: torch.Tensor, mesh: DeviceMesh, placements: tuple) -> torch.Tensor:
    """A fake tensor with this rank's local shape of ``value`` (a fake global tensor) in ``placements``."""
    whole = DTensor.from_local(value, mesh, placement.replicated(mesh), run_check=False)
    return whole.redistribute(mesh, placements).to_local()


def _check_names(graph_module: fx.GraphModule, plan: Plan) -> None:
    names = {node.name for node in graph_module.graph.nodes if node.op == "call_function"}
    missing = sorted(names - set(plan.node_layouts))
    if missing and plan.node_layouts:
        raise AutoparError(
            f"the plan gives no layout for {len(missing)} nodes of this model's graph (first: {missing[0]!r}); "
            "it was made for a different capture (folded layers, another torch version or other input shapes). "
            "Plan again with autopar.plan(..., fold_layers=False) on the same inputs, or let compile plan.")


def _copy_boundary(old: fx.GraphModule, new: fx.GraphModule) -> None:
    """Placeholders keep their names and descriptors (AOTAutograd's partitioner finds tangents by name)."""
    for before, after in zip(old.graph.find_nodes(op="placeholder"), new.graph.find_nodes(op="placeholder")):
        after.meta["desc"] = before.meta["desc"]
        after.target = after.name = before.name
    new.graph.find_nodes(op="output")[0].meta["desc"] = old.graph.find_nodes(op="output")[0].meta["desc"]
    new.recompile()


def _rewrite(joint_graph: fx.GraphModule, plan: Plan, mesh: DeviceMesh, global_batch: int | None,
             reduce_dtype: torch.dtype | None = None):
    """The joint graph traced on local shards in the plan's layouts: (graph module, report)."""
    _check_names(joint_graph, plan)
    by_position, by_index, grads = _leaving(joint_graph, plan, mesh, global_batch)
    arrival = _arrivals(joint_graph, plan, mesh, by_index)
    batch_tangents = {node for node, layout in arrival.items()
                      if _compat.input_kind(node.meta["desc"]) == "tangent" and layout == placement.batch_arrival(mesh)}
    rewriter = _Rewriter(joint_graph, plan, mesh, arrival, by_position, batch_tangents, grads, reduce_dtype)
    local_inputs = [_local_value(n.meta["val"], mesh, arrival[n]) if n in arrival else n.meta.get("val")
                    for n in joint_graph.graph.find_nodes(op="placeholder")]
    graph = _compat.trace_local_joint(rewriter.run, local_inputs)
    _copy_boundary(joint_graph, graph)
    return graph, rewriter.report


class ShardedProgram:
    """The plan's per-rank program for inputs of one shape, compiled; called with this rank's slice.

    Built on every rank from the module (its DTensor parameters stand in as plain tensors of their global
    shapes while the joint graph is captured again, as the planner captured it: through ``call``, e.g. the
    mixed-precision cast, when given)."""

    def __init__(self, module: torch.nn.Module, plan: Plan, mesh: DeviceMesh, args: tuple, kwargs: dict, *,
                 compilers: tuple, call=None, reduce_dtype: torch.dtype | None = None):
        fake_args, fake_kwargs = fake_global_inputs(module, args, kwargs, 1 if plan.full_batch else mesh.size())
        with contextlib.ExitStack() as stack:  # the capture's tracing context, until compiled
            with placement.global_parameters(module):
                joint = _compat.joint_with_descriptors(stack, _CapturableOutputs(module, call), fake_args, fake_kwargs,
                                                       names_from=module)
            self.graph, self.report = _rewrite(joint.graph_module, plan, mesh,
                                               placement.batch_size(fake_args, fake_kwargs), reduce_dtype)
            groups = param_gathers.gather_groups(joint.params_spec)
            self.report.merged_gathers = gather_buckets.bucket_parameter_gathers(
                self.graph, lambda node: groups.get(_compat.param_target(node.meta["desc"]))
                if _Rewriter._is_param(node) else None)
            if plan.reshard_after_forward:  # gathered parameters freed after forward, gathered again for backward
                kept = params_of_groups(plan.kept_gathered, joint.params_spec)  # but those of the groups kept gathered
                self.report.regathered = reshard.recompute_parameter_gathers(
                    self.graph, lambda node: _Rewriter._is_param(node)
                    and _compat.param_target(node.meta["desc"]) not in kept)
            _compat.replace_joint_graph(joint, self.graph)
            self._compiled = _compat.compile_joint(joint, *compilers)
        self._params, self._buffers = list(joint.params_spec), list(joint.buffers_spec)

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict):
        params = [module.get_parameter(name).to_local() for name in self._params]
        buffers = [module.get_buffer(name).to_local() for name in self._buffers]
        contiguous = lambda leaf: leaf.contiguous() if isinstance(leaf, torch.Tensor) else leaf  # noqa: E731
        args, kwargs = pytree.tree_map(contiguous, (args, kwargs))  # as traced (compiled code assumes the strides)
        return self._compiled(*params, *buffers, *args, **kwargs)
