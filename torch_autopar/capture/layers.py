"""Detect repeated layers (transformer blocks) in a captured graph so the search solves one and ties the rest.

Parameters named ``<family>.<index>.<rest>`` (an ``nn.ModuleList``) mark layer instances. Walking the graph in
order, every node belongs to the segment of the layer whose parameter (or mixed-precision copy of one) was last
consumed; a parameter's cast belongs to its parameter's layer (forward and backward segments are kept apart). A node of layer k > first is tied to the node at the same position of the first
layer's segment when both have the same signature (op, shapes, arguments); matching stops at the first
difference, so only truly identical nodes are tied. Must never change the graph.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch
import torch.fx as fx

from torch_autopar.capture.program import CapturedProgram

_LAYER_NAME = re.compile(r"^(?P<family>.+?)\.(?P<index>\d+)\.(?P<rest>.+)$")
CASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)
"""How a captured mixed-precision call casts a parameter (``runtime.precision.CastCall``): all at the top of the
forward, so a cast belongs to its parameter's layer and the layer's ops read the cast."""


def layer_of_param(name: str):
    """``("blocks", 3)`` for "blocks.3.attn.qkv.weight"; None for parameters outside a ModuleList."""
    match = _LAYER_NAME.match(name)
    return (match.group("family"), int(match.group("index"))) if match else None


def node_signature(node: fx.Node):
    """What must be equal for two nodes to be interchangeable: op, output shapes, constant arguments."""
    def describe(arg):
        if isinstance(arg, fx.Node):
            value = arg.meta.get("val")
            return ("node", tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__)
        return arg

    value = node.meta.get("val")
    out = tuple(value.shape) if isinstance(value, torch.Tensor) else repr(type(value))
    return (str(node.target), out, repr(fx.node.map_aggregate(node.args, describe)),
            repr(fx.node.map_aggregate(node.kwargs, describe)))


def _segments(program: CapturedProgram) -> dict[tuple, list[fx.Node]]:
    param_layer = {node: layer_of_param(name) for name, node in program.param_nodes.items()}
    segments: dict[tuple, list[fx.Node]] = defaultdict(list)  # insertion order: layer k before k + 1 in forward
    current = None
    for node in program.graph.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in CASTS and len(node.all_input_nodes) == 1 and node.all_input_nodes[0] in param_layer:
            param_layer[node] = param_layer[node.all_input_nodes[0]]  # a parameter's low-precision copy
            segments[(param_layer[node], program.is_backward(node))].append(node)
            continue
        used = [param_layer[a] for a in node.all_input_nodes if a in param_layer]
        if used:
            current = used[0]
        segments[(current, program.is_backward(node))].append(node)
    return segments


def find_repeated_layers(program: CapturedProgram) -> dict[fx.Node, fx.Node]:
    """Map each tied node (and parameter) to its representative: the matching node of the layer that comes
    first in graph order (layer 0 in forward, the last layer in backward).

    Each layer's segment is compared with the segment of the same phase (``tie_phases``: every layer, or every
    other bare linear layer) before it in graph order, so an odd layer only breaks the chain there."""
    representative: dict[fx.Node, fx.Node] = {}
    previous_of: dict[tuple, list[fx.Node]] = {}
    phases = tie_phases(program)
    for (layer, backward), nodes in _segments(program).items():
        if layer is None:
            continue
        key = (layer[0], phases.get(layer, 0), backward)
        previous = previous_of.get(key)
        previous_of[key] = nodes
        for node, ref in zip(nodes, previous or ()):
            if node_signature(node) != node_signature(ref):
                break
            representative[node] = representative.get(ref, ref)
    _tie_parameters(program, representative)
    return _earliest_representatives(program, representative)


def _earliest_representatives(program: CapturedProgram, representative: dict) -> dict:
    """Re-root every tie class at its earliest node in graph order (the search assigns nodes in that order)."""
    position = {node: i for i, node in enumerate(program.graph.graph.nodes)}
    classes: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node, rep in representative.items():
        classes[rep].append(node)
    result = {}
    for rep, members in classes.items():
        everyone = members + [rep]
        root = min(everyone, key=position.__getitem__)
        result.update({node: root for node in everyone if node is not root})
    return result


def tie_phases(program: CapturedProgram) -> dict[tuple, int]:
    """Layer ``(family, index)`` → the phase the search ties it by: layers of one family and phase share their
    layouts. Where each layer of a family holds a single matrix (bare linear layers, as in ``nn.Sequential(Linear,
    ReLU, Linear, ...)``), the phase alternates (0, 1, 0, ...) in layer order, so consecutive layers can pair up
    column- then row-parallel as Megatron's MLP does; else every layer is phase 0."""
    matrices: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for name, node in program.param_nodes.items():
        layer = layer_of_param(name)
        if layer is not None:
            matrices[layer[0]][layer[1]] += node.meta["val"].ndim >= 2
    phases = {}
    for family, counts in matrices.items():
        alternate = len(counts) > 2 and all(n == 1 for n in counts.values())
        phases.update({(family, index): ordinal % 2 if alternate else 0
                       for ordinal, index in enumerate(sorted(counts))})
    return phases


def _tie_parameters(program: CapturedProgram, representative: dict) -> None:
    by_key = {}
    phases = tie_phases(program)
    for name, node in program.param_nodes.items():
        layer = layer_of_param(name)
        if layer is None:
            continue
        key = (layer[0], phases[layer], _LAYER_NAME.match(name).group("rest"),
               tuple(node.meta["val"].shape))
        if key in by_key:
            representative[node] = by_key[key]
        else:
            by_key[key] = node


def forward_layer_nodes(program: CapturedProgram) -> dict[tuple[str, int], list[fx.Node]]:
    """Repeated layer ``(family, index)`` → the ops of its forward segment, in graph order (the segments of
    ``find_repeated_layers``: from the first op reading one of its parameters to the next layer's)."""
    return {layer: nodes for (layer, backward), nodes in _segments(program).items()
            if layer is not None and not backward}


def node_weights(program: CapturedProgram, folding) -> dict[fx.Node, int]:
    """How many real nodes each captured node stands for under ``folding`` (absent: 1)."""
    if folding is None or not folding.lengths:
        return {}
    weights = {}
    for (layer, _), nodes in _segments(program).items():
        if layer is not None and (weight := folding.layer_weight(*layer)) != 1:
            weights.update({node: weight for node in nodes})
    for name, node in program.param_nodes.items():
        layer = layer_of_param(name)
        if layer is not None and (weight := folding.layer_weight(*layer)) != 1:
            weights[node] = weight
    return weights


def reshard_groups(names) -> dict[str, list[str]]:
    """Module name → the parameters gathered together by a fully-sharded plan that reshards after forward: each
    layer instance ("blocks.3": an element of an ``nn.ModuleList``, what FSDP2 users wrap one by one); in a model
    without one, each module that directly owns parameters. Parameters left out (embeddings, final norm, head:
    parameters of the root) form the root group, gathered for the whole step (FSDP2's root does not reshard
    after forward: backward needs it at once)."""
    names = list(names)
    layered = any(layer_of_param(name) for name in names)
    groups: dict[str, list[str]] = {}
    for name in names:
        layer = layer_of_param(name)
        owner = f"{layer[0]}.{layer[1]}" if layer else (name.rpartition(".")[0] if not layered else "")
        if owner:
            groups.setdefault(owner, []).append(name)
    return groups
