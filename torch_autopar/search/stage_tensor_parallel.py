"""Tensor-parallel pipeline stages: the layout of each stage's parameters over the ranks that hold it, and the
collectives that layout makes the stage run.

Per stage, the project's tensor-parallel role (``search.role_seeds``: matrices split Megatron-style by the
forward data flow from the stage's inputs, vectors replicated) propagated through the stage's captured joint
graph for one micro-batch by DTensor's own sharding rules (``Planner.role_propagated``), on a mesh of one axis,
"tp", of the stage's ranks, with inputs arriving and outputs leaving whole on every rank (``full_batch``, the
previous stage's outputs needing gradients): exactly what DTensor runs inside each stage
(``runtime.stage_tensor_parallel``), forward and backward collectives once per micro-batch, gradient ones once
per step.
Priced once per pipeline plan (a capture and a propagation): ``pipeline=N`` only; ``pipeline="auto"`` does not
search tensor-parallel stages.
Must never run a collective or change the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from torch_autopar import _compat, launch
from torch_autopar.capture import capture
from torch_autopar.cost import HardwareProfile
from torch_autopar.errors import AutoparError
from torch_autopar.search.executed import BATCH_CHECKS
from torch_autopar.search.plan import PlannedCollective

AXIS = "tp"
"""The plan's name of the stage axis of tensor-parallel stages."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorParallelLayout:
    """A model's parameters over a stage's ranks and what each stage moves."""

    placements: dict[str, str]
    """Parameter name (every name of a tied parameter) → its placement on the stage axis ("S(0)", "S(1)", "R")."""
    held: dict[str, int]
    """Parameter name (every name of a tied parameter) → bytes each rank holds."""
    moves: list[list[PlannedCollective]]
    """Per stage, its collectives for one micro-batch (phase "forward" / "backward") and one step ("grad_sync")."""


def layout(model: torch.nn.Module, stages: list[torch.fx.GraphModule], microbatch: tuple, *, size: int,
           hardware: HardwareProfile) -> TensorParallelLayout:
    """Plan each stage's tensor-parallel layout over ``size`` ranks for one micro-batch ``microbatch`` of the
    inputs of ``model`` (cut into ``stages``; every rank of a stage passes it whole; stage s > 0 gets the previous
    one's outputs, whole, and returns their gradients). A parameter is one placement under all its names: an
    output head tied to the embedding (``head.weight = tok.weight``) is split alike on both stages."""
    from torch_autopar.search.planner import Planner  # the planner imports the pipeline search

    placed: dict[int, tuple[str, str]] = {}
    """id(parameter) → (its placement, the stage name that placed it first)."""
    moves: list[list[PlannedCollective]] = []
    fake = _compat.FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        values = tuple(fake.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in microbatch)
    for s, stage in enumerate(stages):
        program = capture(stage, values)
        with launch.mesh.planning_mesh((size,), (AXIS,)) as mesh:
            planner = Planner(program, mesh, (AXIS,), hardware=hardware, global_batch=None, solver="propagate",
                              full_batch=True)
            laid = planner.role_propagated("tensor_parallel")  # the layout: parameters' placements
            plan = planner.executed(dataclasses.replace(laid, node_layouts={}, module_layouts={}))  # as DTensor runs it
        for name, where in plan.param_placements.items():
            first, first_name = placed.setdefault(id(stage.get_parameter(name)), (where[0], name))
            if first != where[0]:
                raise AutoparError(
                    f"parameter {first_name} (also {name}) is shared by two pipeline stages that split it differently "
                    f"({first} and {where[0]}) under tensor parallelism; expected one layout for it. Use strategy="
                    "'data_parallel' or 'fully_shard' stages, or cut the pipeline elsewhere.")
        # the sharded runtime's input checks: a stage's inputs come from the schedule, equal on its ranks
        moves.append([c for c in plan.collectives if c.where not in BATCH_CHECKS])
        with fake:
            outputs = _compat.fake_copy(stage, fake)(*values)
        values = tuple(_needing_grad(v) for v in (outputs if isinstance(outputs, tuple) else (outputs,)))
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update((name, p) for stage in stages for name, p in stage.named_parameters(remove_duplicate=False))
    placements = {name: placed.get(id(param), ("R",))[0] for name, param in params.items()}
    held = {name: _held_bytes(param, placements[name], size) for name, param in params.items()}
    return TensorParallelLayout(placements=placements, held=held, moves=moves)


def _needing_grad(value):
    """A stage's output as the next stage receives it: a floating tensor whose gradient is sent back."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().requires_grad_(True)
    return value.detach() if isinstance(value, torch.Tensor) else value


def _held_bytes(param: torch.Tensor, placement: str, size: int) -> int:
    nbytes = param.numel() * param.element_size()
    if placement.startswith("S("):
        dim = int(placement[2:-1])
        return -(-param.shape[dim] // size) * (nbytes // max(1, param.shape[dim]))
    return nbytes


def stage_moves(found: TensorParallelLayout, stage: int, microbatches: int) -> list[PlannedCollective]:
    """Stage ``stage``'s collectives, per micro-batch ones counted ``microbatches`` times."""
    return [dataclasses.replace(move, where=f"stage{stage}", axis=AXIS,
                                count=move.count * (1 if move.phase == "grad_sync" else microbatches))
            for move in found.moves[stage]]
