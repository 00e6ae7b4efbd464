"""Seeds for the fast propagation mode from a named strategy's axis roles, so that a restriction takes effect on
every mesh axis even when the exact search is out of reach.

Per mesh axis (roles of ``strategies.roles``):
  dp    parameters replicated, user inputs split on dim 0
  fsdp  parameters split on dim 0 (where it has at least the axis's size), user inputs split on dim 0
  tp    user inputs replicated, matrices split Megatron-style: along dim 0 (column parallel) when the matrix
        widens or keeps its input (d -> 4d, the vocabulary head), along dim 1 (row parallel) when it narrows
        (4d -> d); vectors follow dim 0 where they are long enough
Buffers stay replicated. Must never look at costs.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from torch_autopar.capture import CapturedProgram


def _param_placement(role: str, value: torch.Tensor, size: int):
    if role == "dp" or value.ndim == 0:
        return Replicate()
    if role == "tp" and value.ndim == 2 and value.shape[0] < value.shape[1] and value.shape[1] >= size:
        return Shard(1)
    return Shard(0) if value.shape[0] >= size else Replicate()


def _input_placement(role: str, value) -> object:
    return Replicate() if role == "tp" or getattr(value, "ndim", 0) == 0 else Shard(0)


def role_seeds(program: CapturedProgram, roles: tuple[str, ...], mesh_shape: tuple[int, ...]) -> dict:
    """Placements of parameters, buffers and user inputs for propagation under ``roles`` (one per mesh axis)."""
    seeds = {}
    for node in program.param_nodes.values():
        value = node.meta["val"]
        seeds[node] = tuple(_param_placement(role, value, size) for role, size in zip(roles, mesh_shape))
    seeds.update({node: tuple(Replicate() for _ in roles) for node in program.buffer_nodes.values()})
    for node in program.input_nodes.values():
        seeds[node] = tuple(_input_placement(role, node.meta.get("val")) for role in roles)
    return seeds
