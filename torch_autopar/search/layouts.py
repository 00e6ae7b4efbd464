"""Every node's layout, from a placement of the captured program (``Sharding``) to the plan (``NodeLayout``)
and back, and the moves graph mode's program adds at its boundary.

A node's output layout is its spec's placements; each input's layout is the target of the redistribution the
placement records on that edge, else the producer's own layout (nothing moves). Must never choose a layout.
"""

from __future__ import annotations

import torch

from torch_autopar.capture import CapturedProgram
from torch_autopar.capture.program import tensor_nbytes
from torch_autopar.search.plan import NodeLayout, is_one_tensor_layout
from torch_autopar.strategies import Redistribution, Sharding, boundary, format_placements, parse_placements
from torch_autopar.strategies.propagate import follow_layouts


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


def sharding_from_layouts(program: CapturedProgram, layouts: dict[str, NodeLayout], mesh,
                          full_batch: bool = False) -> Sharding:
    """What graph mode's program does with ``layouts`` (hand edits included: ``strategies.follow_layouts``),
    with each user input's move from the layout it arrives in."""
    sharding = follow_layouts(program, mesh, layouts)
    for node in program.input_nodes.values():
        layout, value = layouts.get(node.name), node.meta.get("val")
        if layout is not None and isinstance(value, torch.Tensor) and is_one_tensor_layout(layout.output):
            move = _move(node, boundary.arrival(value, mesh.ndim, full_batch), parse_placements(layout.output), False)
            sharding.redistributions += [move] if move is not None else []
    return sharding


def _move(node, source, target, backward: bool) -> Redistribution | None:
    if tuple(source) == tuple(target):
        return None
    return Redistribution(node=node.name, arg_index=-1, source=tuple(source), target=tuple(target),
                          global_nbytes=tensor_nbytes(node.meta["val"]), backward=backward)


def leaving_moves(program: CapturedProgram, sharding: Sharding, ndim: int, global_batch: int | None,
                  full_batch: bool = False) -> list[Redistribution]:
    """The forward moves of the program's outputs from their layouts to the ones they leave in
    (``strategies.boundary.leaving``): graph mode's program boundary, and data parallelism's whole-batch outputs
    with ``full_batch`` (``runtime.parallel_module``'s gather)."""
    moves = []
    for output in program.output_nodes.values():
        spec = sharding.specs.get(output)
        if isinstance(output.meta.get("val"), torch.Tensor) and hasattr(spec, "placements"):
            leaving = boundary.leaving(output.meta["val"], ndim, global_batch, full_batch)
            moves.append(_move(output, spec.placements, leaving, False))
    return [m for m in moves if m is not None]


def with_program_boundary(program: CapturedProgram, sharding: Sharding, ndim: int, global_batch: int | None,
                          full_batch: bool = False) -> Sharding:
    """``sharding`` plus the moves graph mode's per-rank program makes at its boundary (``strategies.boundary``):
    each output from its layout to the one it leaves in, its gradient from that layout to the tangent's, new
    buffer values (running statistics) replicated. Replaces the search's direct output → tangent edge."""
    tangents = {tangent.name for tangent in program.tangent_nodes}
    moves = [r for r in sharding.redistributions if r.node not in tangents]
    moves += leaving_moves(program, sharding, ndim, global_batch, full_batch)
    for tangent, index in program.tangent_nodes.items():
        output, spec = program.output_nodes.get(index), sharding.specs.get(tangent)
        if output is not None and hasattr(spec, "placements"):
            moves.append(_move(tangent, boundary.leaving(output.meta["val"], ndim, global_batch, full_batch), spec.placements,
                               True))
    for update in program.buffer_updates.values():
        spec = sharding.specs.get(update)
        if hasattr(spec, "placements"):
            moves.append(_move(update, spec.placements, boundary.replicated(ndim), False))
    return Sharding(specs=sharding.specs, redistributions=[m for m in moves if m is not None],
                    replicated_ops=sharding.replicated_ops)
