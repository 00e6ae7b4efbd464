"""The top-level forward at module granularity: which layers it calls, in which order, at what cost.

``trace_top_level(model, args)`` traces only the model's own ``forward`` with ``torch.fx``: every child module call
stays one ``call_module`` node (its forward runs as written, in eager mode, at run time) and a parameter the
forward reads directly (a tied output head: ``x @ self.tok.weight.t()``) is one ``get_attr`` node. Where torch.fx
cannot trace that forward (``transformers``' models: keyword-only signatures, cache objects, shape checks), the
forward is captured by dynamo instead, as ``torch.export`` captures it (``_compat.capture_forward``): a torch-level
graph of the whole forward at the shapes of ``args`` (``TopLevel.at`` captures it again for other shapes), each
node knowing the modules it ran in (with ``use_cache=False`` where the forward takes it: a pipeline trains and
keeps no key/value cache); the stages then run that graph's ops, not the model's Python. The layers are
the members of one ``nn.ModuleList`` (or of a top-level ``nn.Sequential``): the list with the most members called,
as ``capture.layers`` names layer instances. ``assign_units`` puts every node in a unit: "pre" (before the first
layer), layer k (what the layer runs and the glue after it), "post" (after the last layer).
``measure_units`` prices each unit on fake tensors (forward FLOPs from ``torch.utils.flop_counter``'s formulas,
bytes of the tensors the forward creates) and ``split_stages`` turns a unit → stage map into one
``GraphModule`` per stage, sharing the user's own submodules (traced) or the user's parameters under their
names (captured) (values another stage needs are passed on, stage by stage, as contiguous tensors: what
point-to-point sends take). A captured stage runs at the shapes, and in the train/eval mode, of its capture
(``mode_dependent_ops`` lists what the mode changes). Must never change the model or its parameters.
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

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
    """The traced (or captured) top-level forward and its layer list."""

    graph_module: fx.GraphModule
    family: str
    """The ModuleList's qualified name ("blocks"; "" for a top-level Sequential)."""
    layers: list[str]
    """Qualified names of the layer modules in call order ("blocks.0", "blocks.1", ...)."""
    layer_of: dict[fx.Node, int]
    """The nodes that run layer k: its ``call_module`` node (traced), every node run inside it (captured)."""
    captured_from: torch.nn.Module | None = None
    """The model, when dynamo captured its forward at the shapes of one call (None: torch.fx traced it, and the
    graph runs at any shape)."""

    def at(self, args: tuple) -> "TopLevel":
        """This forward for inputs shaped like ``args``: itself when traced, captured again when captured."""
        if self.captured_from is None:
            return self
        return _captured_top_level(self.captured_from, args)

    def structured(self, output):
        """The model's own output from the graph's (a captured graph hands back its flat output leaves)."""
        if self.captured_from is None:
            return output
        leaves = list(output) if isinstance(output, (tuple, list)) else [output]
        return _compat.pytree().tree_unflatten(leaves, _compat.captured_output_spec(self.graph_module))


def trace_top_level(model: torch.nn.Module, args: tuple) -> TopLevel:
    """Trace ``model.forward`` with child modules as leaves, else capture it with dynamo on ``args`` (one call's
    inputs), and find its layer list (a clear error if none)."""
    try:
        graph = _ChildrenAsLeaves().trace(model)
    except Exception as traced:  # fx raises many types for Python it cannot trace symbolically
        return _captured_top_level(model, args, traced)
    gm = fx.GraphModule(model, graph, class_name=f"{type(model).__name__}TopLevel")
    family, layers = _layer_calls(gm)
    index_of = {name: i for i, name in enumerate(layers)}
    layer_of = {node: index_of[node.target] for node in gm.graph.nodes
                if node.op == "call_module" and node.target in index_of}
    return TopLevel(graph_module=gm, family=family, layers=layers, layer_of=layer_of)


def positional_inputs(model: torch.nn.Module, args: tuple, kwargs: dict | None) -> tuple:
    """One call's inputs as the positional tensors a pipeline's first stage takes: keywords bound to
    ``model.forward``'s parameters by name (``input_ids=..., attention_mask=...`` → the first two positions), every
    position up to the last one given holding a tensor. A clear error where keywords cannot be placed so."""
    if not kwargs:
        return tuple(args)
    signature = inspect.signature(model.forward)
    named = [name for name, parameter in signature.parameters.items()
             if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)]
    unknown = sorted(set(kwargs) - set(named))
    if unknown:
        raise AutoparError(f"pipeline=N binds keyword inputs to {type(model).__name__}.forward's positional "
                           f"parameters {named}; found keywords {unknown} that are none of them (keyword-only, or "
                           "taken by **kwargs). Pass only those parameters, or drop pipeline=.")
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError as error:
        raise AutoparError(f"pipeline=N could not bind the inputs to {type(model).__name__}.forward{signature}: "
                           f"{error}. Pass the arguments its forward takes.") from None
    last = max(named.index(name) for name in kwargs)
    inputs = []
    for name in named[:last + 1]:
        value = bound.arguments.get(name, signature.parameters[name].default)
        if not isinstance(value, torch.Tensor):
            found = "nothing" if value is inspect.Parameter.empty else type(value).__name__
            raise AutoparError(
                f"pipeline=N passes a model's inputs to its first stage as tensors in the order of its forward's "
                f"parameters; {type(model).__name__}.forward's parameter {name!r} would get {found} there, ahead "
                f"of the keyword {named[last]!r}. Expected a tensor for every parameter up to the last one given: "
                f"pass only the leading tensor inputs (e.g. {named[0]!r}), or drop pipeline=.")
        inputs.append(value)
    return tuple(inputs)


def _captured_top_level(model: torch.nn.Module, args: tuple, traced: Exception | None = None) -> TopLevel:
    """``model``'s forward captured by dynamo at the shapes of ``args`` (fake copies: nothing runs), its layers
    found from the modules each node ran in."""
    from torch_autopar.capture.program import _CapturableOutputs, fake_global_inputs

    if any(not isinstance(a, torch.Tensor) for a in args):
        raise AutoparError(f"pipeline=N passes only tensors between stages; {type(model).__name__} was called with "
                           f"positional inputs of types {[type(a).__name__ for a in args]}. Pass tensors only.")
    (fake_args, _) = fake_global_inputs(model, args, {}, 1)
    try:
        gm = _compat.capture_forward(_CapturableOutputs(model, _without_cache(model)), fake_args, names_from=model)
    except Exception as captured:  # dynamo's Unsupported/UserError, fake tensors' data-dependent errors, ...
        fx_reason = f"torch.fx could not trace it ({type(traced).__name__}: {traced}), and " if traced else ""
        raise AutoparError(
            f"pipeline=N cuts {type(model).__name__}.forward between layers and needs it as one graph: "
            f"{fx_reason}dynamo could not capture it: {_compat.graph_break_reason(captured)}. Remove or guard that "
            "line (for example `if not torch.compiler.is_compiling():`), or drop pipeline=.") from captured
    _one_read_per_use(gm)
    family, layers, layer_of = _captured_layers(model, gm)
    return TopLevel(graph_module=gm, family=family, layers=layers, layer_of=layer_of, captured_from=model)


def _without_cache(model: torch.nn.Module):
    """``model`` called with ``use_cache=False`` where its forward takes it (``transformers``' models; else None:
    called as it is). A pipeline trains and keeps no key/value cache, which would otherwise grow inside the
    graph (a cat onto an empty tensor per layer, which tensor-parallel stages cannot shard)."""
    return functools.partial(model, use_cache=False) if "use_cache" in inspect.signature(model.forward).parameters \
        else None


def _one_read_per_use(gm: fx.GraphModule) -> None:
    """Give every user of a parameter read its own ``get_attr`` node (dynamo reads a tied embedding once for
    the embedding and the output head): each stage then reads its own copy."""
    for node in list(gm.graph.find_nodes(op="get_attr")):
        for user in list(node.users)[1:]:
            with gm.graph.inserting_before(user):
                read = gm.graph.get_attr(node.target)
            read.meta = dict(node.meta)
            user.replace_input_with(node, read)
    gm.recompile()


_WRAPPER_PATH = re.compile(r"^(module|call\.func)\.?")  # _CapturableOutputs' path to the model


def _captured_layers(model: torch.nn.Module, gm: fx.GraphModule) -> tuple[str, list[str], dict[fx.Node, int]]:
    """(family, layer names in call order, node → layer index) from the modules each captured node ran in."""
    lists = {name for name, module in model.named_modules() if isinstance(module, torch.nn.ModuleList)}
    if isinstance(model, torch.nn.Sequential):
        lists.add("")
    found: dict[fx.Node, dict[str, str]] = {}  # node → {family: layer} of every layer it ran inside
    for node in gm.graph.nodes:
        if node.op == "get_attr":  # placed with its first user (assign_units); a shared read has many
            continue
        for path in _compat.module_paths(node):
            name = _WRAPPER_PATH.sub("", path)
            match = _LAYER_TARGET.match(name)
            if match and (match.group("family") or "") in lists:
                found.setdefault(node, {}).setdefault(match.group("family") or "", name)
    calls: dict[str, list[str]] = {}
    for members in found.values():
        for family, name in members.items():
            order = calls.setdefault(family, [])
            if not order or order[-1] != name:
                order.append(name)
    members = {name for order in calls.values() for name in order}  # a list inside a layer is not the layers
    calls = {family: order for family, order in calls.items()
             if not any(family.startswith(member + ".") for member in members)}
    family, layers = _one_family(calls, type(model).__name__)
    index_of = {name: i for i, name in enumerate(layers)}
    return family, layers, {node: index_of[members[family]] for node, members in found.items() if family in members}


def _layer_calls(gm: fx.GraphModule) -> tuple[str, list[str]]:
    calls: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        match = _LAYER_TARGET.match(node.target) if node.op == "call_module" else None
        if match:
            calls.setdefault(match.group("family") or "", []).append(node.target)
    return _one_family(calls, type(gm).__name__.removesuffix("TopLevel"))


def _one_family(calls: dict[str, list[str]], model_name: str) -> tuple[str, list[str]]:
    """The layer list called most often, from family → its members in call order (a member once per call)."""
    if not calls:
        raise AutoparError(
            f"pipeline=N cuts a model between the layers of one nn.ModuleList (e.g. self.blocks) called in its "
            f"forward; {model_name}.forward calls none. Hold the repeated blocks in an nn.ModuleList, or drop "
            "pipeline=.")
    family, layers = max(calls.items(), key=lambda item: len(item[1]))
    if len(set(layers)) != len(layers):
        raise AutoparError(f"pipeline=N: the layers of {family or 'the model'} must each be called once per forward; "
                           f"found calls {layers}. Call each block once, or drop pipeline=.")
    return family, layers


def assign_units(top: TopLevel) -> dict[fx.Node, object]:
    """Each node's unit: PRE before the first layer's nodes, layer k from its first node to the next layer's
    (the glue between layers follows the layer before it), POST after the last layer's last node. A ``get_attr``
    (a parameter the forward reads directly) belongs to the unit of its first user, so a tied output head reads
    its weight where it runs."""
    nodes = list(top.graph_module.graph.nodes)
    last = len(top.layers) - 1
    end = max(i for i, node in enumerate(nodes) if top.layer_of.get(node) == last)
    unit: dict[fx.Node, object] = {}
    current: object = PRE
    for i, node in enumerate(nodes):
        if node.op == "output":
            continue
        current = top.layer_of.get(node, current if i <= end else POST)
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
    uses (as a tuple of contiguous tensors; the model's own output for the last stage)."""
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
            _check_passable(live, s)  # sent and received as contiguous buffers (a captured value may be a view)
            graph.output(tuple(graph.call_function(_contiguous, (env[n],)) for n in live))
        modules.append(fx.GraphModule(top.graph_module, graph, class_name=f"Stage{s}"))
    return modules


def stages_at(top: TopLevel, unit: dict, stage_of_unit, args: tuple) -> list[fx.GraphModule]:
    """``split_stages`` of the forward as it runs on inputs shaped like ``args`` (one micro-batch: a captured
    forward is captured again at those shapes, its units found anew)."""
    shaped = top.at(args)
    return split_stages(shaped, unit if shaped is top else assign_units(shaped), stage_of_unit)


def _used_after(node: fx.Node, s: int, stage: dict) -> bool:
    return any(user.op == "output" or stage.get(user, -1) > s for user in node.users)


def _contiguous(value):
    """A value a stage sends: a tensor as a contiguous one (what point-to-point sends take)."""
    return value.contiguous() if isinstance(value, torch.Tensor) else value


def _check_passable(values: list[fx.Node], s: int) -> None:
    for value in values:
        if value.op == "get_attr":
            raise AssertionError(f"a parameter read {value.format_node()} crosses a stage boundary")
        example = value.meta.get("example_value", value.meta.get("val"))  # a captured node's value
        if value.type is not None and value.type is not torch.Tensor or \
                example is not None and not isinstance(example, torch.Tensor):
            kind = value.type.__name__ if value.type is not None else type(example).__name__
            raise AutoparError(f"pipeline stage {s} would pass {value.name} ({kind}) to the next stage; "
                               "only tensors travel between stages. Compute it inside the layers.")


_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
             torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout}


def mode_dependent_ops(graphs: list[fx.GraphModule]) -> list[str]:
    """The nodes of captured stages whose result depends on train/eval mode, which the capture fixed: dropout
    with p > 0 (attention's too) and batch norm (a captured graph runs ops, not modules, so ``model.eval()``
    does not reach them)."""
    found = []
    for graph in graphs:
        for node in graph.graph.nodes:
            if node.op != "call_function":
                continue
            p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
            attention_p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0)
            if (node.target in _DROPOUTS and p != 0 or node.target is F.scaled_dot_product_attention and attention_p
                    or node.target in (F.batch_norm, torch.batch_norm)):
                found.append(f"{node.target.__name__} ({node.name})")
    return found


def unit_modules(top: TopLevel, unit: dict) -> dict[object, list[str]]:
    """PRE, each layer index, POST (in that order) → the modules called and parameters read in it (a captured
    forward's layer by its name, not by its parameters')."""
    names: dict[object, list[str]] = {PRE: [], **{k: [] for k in range(len(top.layers))}, POST: []}
    for node, where in unit.items():
        if top.captured_from is not None and node in top.layer_of:
            name = top.layers[top.layer_of[node]]
        elif node.op in ("call_module", "get_attr"):
            name = node.target
        else:
            continue
        if name not in names[where]:
            names[where].append(name)
    return names
