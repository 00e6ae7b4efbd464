"""Module boundaries of a plan, for eager mode: where each submodule's inputs enter and its outputs leave.

Eager mode runs the user's Python with DTensor choosing each op's layout from its inputs' layouts. To make it
run the plan, ``rewrite.module_hooks`` redistributes, at every once-called submodule (``capture.scopes``), each
tensor input to the layout the plan's first op inside wants and each output to the layout the plan gives it;
between those boundaries DTensor's rules decide, and the planner prices exactly that by propagating DTensor's
rules with the same boundaries pinned (``pins``, used by ``Planner.executed``).

  module_layouts  the plan's node layouts → per submodule path, the ``ModuleLayout`` the hooks apply
  compute_layouts the plan's node layouts → per parameter, the layout its first forward op takes it in,
                  through views and casts (what eager mode moves it to before the forward)
  pins            module layouts → the per-(module, value) layouts propagation applies at each boundary
Must never choose a layout: it only reads the plan's.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from torch_autopar.capture import CapturedProgram
from torch_autopar.capture.layers import CASTS
from torch_autopar.capture.scopes import in_forward, module_scopes
from torch_autopar.search.plan import ModuleLayout, NodeLayout, is_one_tensor_layout
from torch_autopar.strategies.param_gathers import is_element_view, root_target
from torch_autopar.strategies.placements import format_placements, parse_placements
from torch_autopar.strategies.propagate import ModulePins


def _tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def module_layouts(program: CapturedProgram, layouts: dict[str, NodeLayout]) -> dict[str, ModuleLayout]:
    """Per once-called submodule, the layouts its tensor inputs enter and its outputs leave in (the plan's)."""
    scopes = module_scopes(program)
    weights = {node for node in list(program.param_nodes.values()) + list(program.buffer_nodes.values())}
    entering: dict[str, dict[fx.Node, tuple]] = {}
    leaving: dict[str, dict[fx.Node, tuple]] = {}
    returned = set(program.output_nodes.values()) | set(program.buffer_updates.values())
    for node, scope in scopes.items():
        layout = layouts.get(node.name)
        if layout is None or not in_forward(node):
            continue
        for position, value in enumerate(node.all_input_nodes):
            wanted = layout.inputs[position] if position < len(layout.inputs) else None
            if value in weights or not _tensor(value) or not is_one_tensor_layout(wanted):
                continue
            for path in scope:
                if path not in scopes.get(value, ()):
                    entering.setdefault(path, {}).setdefault(value, wanted)
        for user in node.users:
            if not (in_forward(user) or user.op == "output" and node in returned):
                continue  # a value saved for backward, or a gradient, leaves no module
            outside = [path for path in scope if path not in scopes.get(user, ())]
            own = layout.output
            if outside and _tensor(node) and is_one_tensor_layout(own):
                for path in outside:
                    leaving.setdefault(path, {}).setdefault(node, own)
    paths = sorted(set(entering) | set(leaving), key=lambda p: (p.count("."), p))
    order = {node: i for i, node in enumerate(program.graph.graph.nodes)}
    entry = lambda node, placements: (node.name, tuple(int(s) for s in node.meta["val"].shape), placements)  # noqa: E731
    return {path: ModuleLayout(
        inputs=tuple(entry(n, p) for n, p in entering.get(path, {}).items()),
        outputs=tuple(entry(n, p) for n, p in sorted(leaving.get(path, {}).items(), key=lambda item: order[item[0]])))
        for path in paths}


def compute_layouts(program: CapturedProgram, layouts: dict[str, NodeLayout]) -> dict[str, tuple]:
    """Parameter name (as captured) → the layout the plan's first forward op using it takes it in. An op that
    reads the parameter through element views or its cast (a linear's transposed weight) takes it as
    ``strategies.param_gathers`` gathers it: replicated on each axis where the op takes the view whole."""
    params = {node: name for name, node in program.param_nodes.items()}
    root_of: dict[fx.Node, fx.Node] = {}
    """View or cast node → the parameter it reads (``gathered_root``'s chains)."""
    computed = {}
    for node in program.graph.graph.nodes:
        if node.op != "call_function" or not in_forward(node):
            continue
        inputs = node.all_input_nodes
        source = inputs[0] if len(inputs) == 1 else None
        root = source if source in params else root_of.get(source)
        if root is not None and (node.target in CASTS or is_element_view(node)):
            root_of[node] = root
            continue
        layout = layouts.get(node.name)
        for position, value in enumerate(inputs):
            param = value if value in params else root_of.get(value)
            if param is None or params[param] in computed or layout is None:
                continue
            wanted = layout.inputs[position]
            if value is not param:
                wanted = _gathered_root_layout(layouts, param, value, wanted)
            if is_one_tensor_layout(wanted):
                computed[params[param]] = wanted
    return computed


def _gathered_root_layout(layouts: dict[str, NodeLayout], param: fx.Node, view: fx.Node, wanted) -> tuple | None:
    """The layout ``param`` is taken in when an op takes its view ``view`` in ``wanted``: as stored, with each
    axis the move gathers replicated (``param_gathers.root_target``)."""
    stored, held = layouts.get(param.name), layouts.get(view.name)
    if stored is None or held is None or not all(map(is_one_tensor_layout, (stored.output, held.output, wanted))):
        return None
    target = root_target(parse_placements(held.output), parse_placements(wanted), parse_placements(stored.output))
    return format_placements(target) if target is not None else stored.output


def pins(program: CapturedProgram, layouts: dict[str, ModuleLayout]) -> ModulePins | None:
    """The boundaries propagation pins for ``layouts`` (None when there are none)."""
    if not layouts:
        return None
    by_name = {node.name: node for node in program.graph.graph.nodes}
    entering, leaving = {}, {}
    for path, layout in layouts.items():
        for name, _, placements in layout.inputs:
            if name in by_name:
                entering[(path, by_name[name])] = placements
        for name, _, placements in layout.outputs:
            if name in by_name:
                leaving[(path, by_name[name])] = placements
    return ModulePins(scopes=module_scopes(program), entering=entering, leaving=leaving)
