"""Where each named strategy pins placements before propagation decides the rest of the graph.

A seed gives placements for parameters and user inputs on every mesh axis; ``propagate`` derives all other
nodes from DTensor's rules. Must never look at costs.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard

from torch_autopar.capture import CapturedProgram
from torch_autopar.errors import AutoparError

STRATEGY_SEEDS = ("data_parallel", "stand_alone")
"""Strategies whose seeds are defined here; "auto" chooses among them (see search.planner)."""


def _batch_placements(ndim: int, mesh_ndim: int):
    return tuple(Shard(0) for _ in range(mesh_ndim)) if ndim >= 1 else tuple(Replicate() for _ in range(mesh_ndim))


def seed_placements(program: CapturedProgram, strategy: str, mesh_ndim: int) -> dict:
    """Placements for parameter, buffer and user-input nodes under ``strategy`` (a node → placements map).

    data_parallel: parameters and buffers replicated; every tensor input split on dim 0 (the batch) over all
    mesh axes. stand_alone: everything replicated (each rank computes alone, nothing is communicated).
    """
    if strategy not in STRATEGY_SEEDS:
        raise AutoparError(f"no seed for strategy {strategy!r}; seeded strategies are {STRATEGY_SEEDS}.")
    replicate = tuple(Replicate() for _ in range(mesh_ndim))
    seeds = {node: replicate for node in program.param_nodes.values()}
    seeds.update({node: replicate for node in program.buffer_nodes.values()})
    for node in program.input_nodes.values():
        value = node.meta.get("val")
        ndim = value.ndim if hasattr(value, "ndim") else 0
        seeds[node] = replicate if strategy == "stand_alone" else _batch_placements(ndim, mesh_ndim)
    return seeds
