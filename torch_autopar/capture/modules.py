"""The top-level forward at module granularity: which child modules it calls, in which order, at what cost.

``trace_top_level(model)`` traces only the model's own ``forward`` with ``torch.fx``: every child module call
stays one ``call_module`` node (its forward runs as written, in eager mode, at run time) and a parameter the
forward reads directly (a tied output head: ``x @ self.tok.weight.t()``) is one ``get_attr`` node. The layers
are the calls to the members of one ``nn.ModuleList`` (or of a top-level ``nn.Sequential``): the list called
most often, as ``capture.layers`` names layer instances. ``assign_units`` puts every node in a unit: "pre"
(before the first layer), layer k (a layer call and the glue after it), "post" (after the last layer).
``measure_units`` prices each unit on fake tensors (forward FLOPs from ``torch.utils.flop_counter``'s formulas,
bytes of the tensors the forward creates) and ``split_stages`` turns a unit → stage map into one
``GraphModule`` per stage, sharing the user's own submodules and parameters (values another stage needs are
passed on, stage by stage). Must never change the model or its parameters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from torch_autopar import _compat
from torch_autopar.errors import AutoparError

_LAYER_TARGET = re.compile(r"^(?:(?P<family>.+)\.)?(?P<index>\d+)$")
PRE, POST = "pre", "post"


class _ChildrenAsLeaves(fx.Tracer):
    """Every module called from the top-level forward is a leaf: the trace never enters a child."""

    def is_leaf_module(self, module: torch.nn.Module, qualified_name: str) -> bool:
        return True


@dataclass(kw_only=True, slots=True)
class TopLevel:
    """The traced top-level forward and its layer list."""

    graph_module: fx.GraphModule
    family: str
    """The ModuleList's qualified name ("blocks"; "" for a top-level Sequential)."""
    layers: list[str]
    """Qualified names of the layer modules in call order ("blocks.0", "blocks.1", ...)."""


def trace_top_level(model: torch.nn.Module) -> TopLevel:
    """Trace ``model.forward`` with child modules as leaves and find its layer list (a clear error if none)."""
    try:
        graph = _ChildrenAsLeaves().trace(model)
    except Exception as error:  # fx raises many types for untraceable Python (data-dependent branches, ...)
        raise AutoparError(
            f"pipeline=N traces {type(model).__name__}.forward with torch.fx to cut it between layers, and the "
            f"trace failed: {type(error).__name__}: {error}. Expected a top-level forward without branches on "
            "tensor values; move that logic into a child module (its forward runs as written) or drop pipeline=."
        ) from error
    gm = fx.GraphModule(model, graph, class_name=f"{type(model).__name__}TopLevel")
    family, layers = _layer_calls(gm)
    return TopLevel(graph_module=gm, family=family, layers=layers)


def _layer_calls(gm: fx.GraphModule) -> tuple[str, list[str]]:
    calls: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        match = _LAYER_TARGET.match(node.target) if node.op == "call_module" else None
        if match:
            calls.setdefault(match.group("family") or "", []).append(node.target)
    if not calls:
        raise AutoparError(
            f"pipeline=N cuts a model between the layers of one nn.ModuleList (e.g. self.blocks) called in its "
            f"forward; {type(gm).__name__.removesuffix('TopLevel')}.forward calls none. Hold the repeated blocks "
            "in an nn.ModuleList, or drop pipeline=.")
    family, layers = max(calls.items(), key=lambda item: len(item[1]))
    if len(set(layers)) != len(layers):
        raise AutoparError(f"pipeline=N: the layers of {family or 'the model'} must each be called once per forward; "
                           f"found calls {layers}. Call each block once, or drop pipeline=.")
    return family, layers


def assign_units(top: TopLevel) -> dict[fx.Node, object]:
    """Each node's unit: PRE before the first layer call, layer k from its call to the next layer's call (the
    glue between layers follows the layer before it), POST after the last layer's call. A ``get_attr`` (a
    parameter the forward reads directly) belongs to the unit of its first user, so a tied output head reads
    its weight where it runs."""
    index_of = {name: i for i, name in enumerate(top.layers)}
    nodes = list(top.graph_module.graph.nodes)
    unit: dict[fx.Node, object] = {}
    current: object = PRE
    for node in nodes:
        if node.op == "call_module" and node.target in index_of:
            current = index_of[node.target]
            unit[node] = current
            if current == len(top.layers) - 1:
                current = POST
        elif node.op != "output":
            unit[node] = current
    position = {node: i for i, node in enumerate(nodes)}
    for node in nodes:
        if node.op == "get_attr" and node.users:
            unit[node] = unit.get(min(node.users, key=position.__getitem__), POST)
    return unit


@dataclass(kw_only=True, slots=True)
class UnitCost:
    """One unit's forward on one batch: FLOPs, bytes of the tensors it creates, its parameters."""

    flops: int = 0
    activation_bytes: int = 0
    """Bytes of every non-view tensor the forward creates (an upper bound of what backward keeps)."""
    params: dict[str, tuple[int, int, int]] | None = None
    """Qualified parameter name (a tied parameter's first) → (elements, bytes, dim-0 rows; 0 when 0-d), for the
    parameters of the modules the unit calls or reads."""


def _unit_params(top: TopLevel, unit: dict) -> dict[object, dict[str, tuple[int, int, int]]]:
    root = top.graph_module
    canonical = {id(p): n for n, p in root.named_parameters()}  # a tied parameter: its first name, wherever read
    found: dict[object, dict[str, tuple[int, int, int]]] = {}
    for node, where in unit.items():
        if node.op == "call_module":
            params = list(root.get_submodule(node.target).parameters())
        elif node.op == "get_attr" and isinstance(value := _attr(root, node.target), torch.nn.Parameter):
            params = [value]
        else:
            continue
        found.setdefault(where, {}).update({canonical[id(p)]: (p.numel(), p.numel() * p.element_size(),
                                                                p.shape[0] if p.ndim else 0) for p in params})
    return found


def _attr(root: torch.nn.Module, target: str):
    owner, _, name = target.rpartition(".")
    return getattr(root.get_submodule(owner) if owner else root, name)


class _UnitInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, unit: dict, costs: dict):
        super().__init__(gm)
        self.unit, self.costs, self.current = unit, costs, None

    def run_node(self, node: fx.Node):
        self.current = self.costs.setdefault(self.unit.get(node, POST), UnitCost())
        return super().run_node(node)

    def record(self, op, args, kwargs, out) -> None:
        if self.current is None:
            return
        self.current.flops += _compat.node_flops(op, args, kwargs, out)
        if not getattr(op, "is_view", False):
            self.current.activation_bytes += sum(t.numel() * t.element_size() for t in
                                                 _compat.pytree().tree_leaves(out) if isinstance(t, torch.Tensor))


def measure_units(top: TopLevel, unit: dict, args: tuple) -> dict[object, UnitCost]:
    """Each unit's cost for one forward on ``args`` (run on fake tensors: nothing is computed or allocated)."""
    costs: dict[object, UnitCost] = {}
    interpreter = _UnitInterpreter(top.graph_module, unit, costs)
    with _compat.FakeTensorMode(allow_non_fake_inputs=True) as fake:
        fake_args = [fake.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with torch.no_grad(), _compat.recording_ops(interpreter.record):
            interpreter.run(*fake_args)
    for where, params in _unit_params(top, unit).items():
        costs.setdefault(where, UnitCost()).params = params
    return costs


def split_stages(top: TopLevel, unit: dict, stage_of_unit) -> list[fx.GraphModule]:
    """One GraphModule per stage: stage s runs the nodes of the units ``stage_of_unit`` maps to s; its inputs
    are the previous stage's outputs (the model's inputs for stage 0), its outputs every value a later stage
    uses (as a tuple; the model's own output for the last stage)."""
    nodes = [n for n in top.graph_module.graph.nodes if n.op != "output"]
    output = next(n for n in top.graph_module.graph.nodes if n.op == "output")
    stage = {node: stage_of_unit(unit[node]) for node in nodes}
    count = max(stage.values()) + 1
    live = [p for p in nodes if p.op == "placeholder"]
    modules = []
    for s in range(count):
        graph, env = fx.Graph(), {}
        for value in live:
            env[value] = graph.placeholder(value.name)
        for node in nodes:
            if stage[node] == s and node.op != "placeholder":
                env[node] = graph.node_copy(node, env.__getitem__)
        if s == count - 1:
            graph.output(fx.node.map_arg(output.args[0], env.__getitem__))
        else:
            live = [n for n in nodes if n in env and _used_after(n, s, stage)]
            _check_passable(live, s)
            graph.output(tuple(env[n] for n in live))
        modules.append(fx.GraphModule(top.graph_module, graph, class_name=f"Stage{s}"))
    return modules


def _used_after(node: fx.Node, s: int, stage: dict) -> bool:
    return any(user.op == "output" or stage.get(user, -1) > s for user in node.users)


def _check_passable(values: list[fx.Node], s: int) -> None:
    for value in values:
        if value.op == "get_attr":
            raise AssertionError(f"a parameter read {value.format_node()} crosses a stage boundary")
        if value.type is not None and value.type is not torch.Tensor:
            raise AutoparError(f"pipeline stage {s} would pass {value.name} ({value.type}) to the next stage; "
                               "only tensors travel between stages. Compute it inside the layers.")


def unit_modules(top: TopLevel, unit: dict) -> dict[object, list[str]]:
    """PRE, each layer index, POST (in that order) → the modules called and parameters read in it."""
    names: dict[object, list[str]] = {PRE: [], **{k: [] for k in range(len(top.layers))}, POST: []}
    for node, where in unit.items():
        if node.op in ("call_module", "get_attr") and node.target not in names[where]:
            names[where].append(node.target)
    return names
