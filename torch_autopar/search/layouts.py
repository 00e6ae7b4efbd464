"""Every node's layout, from a placement of the captured program (``Sharding``) to the plan (``NodeLayout``).

A node's output layout is its spec's placements; each input's layout is the target of the redistribution the
placement records on that edge, else the producer's own layout (nothing moves). Must never choose a layout.
"""

from __future__ import annotations

import torch

from torch_autopar.capture import CapturedProgram
from torch_autopar.search.plan import NodeLayout
from torch_autopar.strategies import Sharding, format_placements


def _placements(spec):
    placements = getattr(spec, "placements", None)
    return None if placements is None else format_placements(placements)


def _output(spec):
    if isinstance(spec, (tuple, list)):
        return tuple(_placements(s) for s in spec)
    return _placements(spec)


def node_layouts(program: CapturedProgram, sharding: Sharding) -> dict[str, NodeLayout]:
    """Name → layout for every node of ``program`` whose output ``sharding`` places (tensor-valued nodes)."""
    moved = {(r.node, r.arg_index): format_placements(r.target) for r in sharding.redistributions}
    layouts = {}
    for node in program.graph.graph.nodes:
        spec = sharding.specs.get(node)
        if spec is None or not isinstance(node.meta.get("val"), (torch.Tensor, tuple, list)):
            continue
        inputs = tuple(moved.get((node.name, position), _output(sharding.specs.get(producer)))
                       for position, producer in enumerate(node.all_input_nodes))
        layouts[node.name] = NodeLayout(output=_output(spec), inputs=inputs)
    return layouts
