"""Fully-sharded pipeline stages: each stage module held as 1/dp shards over its data-parallel ranks (FSDP2).

A plan whose stages are "fully_shard" (``search.pipeline``: strategy "pipeline+fully_shard") runs each of this
rank's stage modules under ``torch.distributed.fsdp.fully_shard`` on a 1-D ``DeviceMesh`` of the ranks that
hold the same stage (the data-parallel group), as torchtitan composes FSDP2 with ``torch.distributed.pipelining``:

  unit       one FSDP unit per stage, the stage module itself, ``reshard_after_forward=False``: the first
             micro-batch's forward gathers the stage (ONE all_gather), the gathered parameters stay for every
             micro-batch's forward and backward, and the last backward's reduce-scatter frees them: exactly
             the plan's collectives (``search.pipeline._stage_sync``: one all_gather, one reduce_scatter per
             stage and step) and its memory (gathered parameters for the whole step).
  gradients  ``PipelineStage`` knows FSDP modules: it turns gradient sync off for each micro-batch's backward
             (unsharded gradients accumulate) and, once the last micro-batch is done (``perform_reduce_grad``),
             runs FSDP2's post-backward: one reduce-scatter leaving the mean over the dp ranks in each shard.
             So the runtime must not average over dp again (``dense_grads`` names what it still reduces:
             parameters FSDP2 leaves whole, 0-d ones).
  tied       a parameter on two stages (an embedding tied to the head) is sharded on each the same way (dim 0,
             ``torch.chunk``'s split over the same dp ranks), so the pipeline ranks' sum of a tied gradient
             runs on the shards (``local``), each pipeline rank's shard of the same rows.
  state      ``full_state`` gathers each sharded tensor (``DTensor.full_tensor``, over the dp group);
             ``load_full_state`` copies each shard's rows from a full tensor, with no collective.

Why FSDP2 rather than the project's own ``runtime.fsdp`` (flat groups driven by ``ParallelModule``'s runner):
the schedule drives the stage, not our runner; ``PipelineStage`` and the schedules already call FSDP2's
unshard/reshard and its deferred post-backward at the right points (per-micro-batch no-sync, one reduction
after the last backward, and UNSHARD/RESHARD actions in the interleaved runtime), which our groups would have
to re-implement inside torch's schedule.
Must never plan, change what a stage computes, or reduce a gradient FSDP2 already reduced.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from torch_autopar import launch
from torch_autopar.errors import AutoparError

SHARDED_STRATEGY = "pipeline+fully_shard"
"""The plan strategy whose stages run fully sharded (``search.pipeline._plan``)."""


def is_sharded(plan, data_parallel_size: int) -> bool:
    return plan.strategy == SHARDED_STRATEGY and data_parallel_size > 1


def check_no_shared_stages(stages: list[torch.nn.Module]) -> None:
    """A parameter can be one FSDP unit's only: two of this rank's stages sharing one cannot both shard it."""
    seen: dict[int, int] = {}
    for index, stage in enumerate(stages):
        for name, param in stage.named_parameters():
            if seen.setdefault(id(param), index) != index:
                raise AutoparError(
                    f"stages {seen[id(param)]} and {index} of this pipeline rank share parameter {name}; fully-sharded "
                    "stages shard each parameter in one stage. Expected no parameter shared between the stages of "
                    "one rank: use schedule='1f1b' or 'gpipe' (one stage per rank), or strategy='data_parallel'.")


def apply_fully_shard(stages: list[torch.nn.Module], dp_group, model: torch.nn.Module) -> None:
    """Shard each stage module over ``dp_group`` (one FSDP unit each, gathered once per step); in place.
    ``model`` (the user's module) then holds the sharded parameters too: FSDP2 replaces them in the stage's own
    modules, which are the user's modules for a traced forward but copies of their paths for a captured one."""
    check_no_shared_stages(stages)
    mesh = DeviceMesh.from_group(dp_group, launch.device_type())
    sharded: dict[int, torch.nn.Parameter] = {}
    for stage in stages:
        before = dict(stage.named_parameters(remove_duplicate=False))
        whole = {p for p in stage.parameters() if p.ndim == 0}  # FSDP2 shards dim 0: a 0-d one stays whole
        fully_shard(stage, mesh=mesh, reshard_after_forward=False, ignored_params=whole or None)
        for name, param in stage.named_parameters(remove_duplicate=False):
            if param is not before[name]:
                sharded[id(before[name])] = param
    for module in model.modules():
        for leaf, param in list(module._parameters.items()):
            if param is not None and id(param) in sharded:
                module._parameters[leaf] = sharded[id(param)]


def reshard(stages) -> None:
    """Free the gathered parameters a forward-only call left (the next step must gather fresh values)."""
    for stage in stages:
        if isinstance(stage, FSDPModule):
            stage.reshard()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (the tensor itself otherwise)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def replicas(tensor: torch.Tensor) -> int:
    """How many ranks hold each element of a DTensor (the sizes of the mesh axes it is replicated on)."""
    copies = 1
    for axis, placement in enumerate(tensor.placements):
        copies *= tensor.device_mesh.size(axis) if placement.is_replicate() else 1
    return copies


def dense_grads(params) -> list[torch.Tensor]:
    """The gradients FSDP2 did not reduce (of parameters it left whole): the runtime averages these over dp."""
    return [p.grad for p in params if p.grad is not None and not isinstance(p.grad, DTensor)]


def full_state(full: dict) -> None:
    """Replace each sharded tensor in ``full`` (the user's module's state dict, holding this rank's stages'
    shards, under every name of a tied one) by the whole tensor, gathered over the ranks of its stage (they hold
    the same stages, so their gathers pair up, in the state dict's order)."""
    for name, value in full.items():
        if isinstance(value, DTensor):
            full[name] = value.detach().full_tensor()


def load_full_state(graphs: list[torch.nn.Module], state_dict: dict) -> None:
    """Copy each shard's piece (its rows, or its columns for a tensor-parallel ``Shard(1)``) of the full tensors in
    ``state_dict`` into this rank's sharded stages (no collective)."""
    with torch.no_grad():
        for graph in graphs:
            for name, value in graph.state_dict(keep_vars=True).items():
                if isinstance(value, DTensor) and name in state_dict:
                    rows = distribute_tensor(state_dict[name].to(value.dtype), value.device_mesh, value.placements,
                                             src_data_rank=None)
                    value.to_local().copy_(rows.to_local())


def load_dense_state(module: torch.nn.Module, state_dict: dict, strict: bool):
    """Load ``state_dict`` into ``module``'s tensors that are not sharded (those of other stages, buffers); the
    sharded ones are left to ``load_full_state``. Returns ``load_state_dict``'s missing/unexpected keys."""
    own = module.state_dict(keep_vars=True)
    dense = {name: value for name, value in state_dict.items() if not isinstance(own.get(name), DTensor)}
    result = module.load_state_dict(dense, strict=False)
    missing = [name for name in own if name not in state_dict]
    unexpected = [name for name in state_dict if name not in own]
    if strict and (missing or unexpected):
        raise AutoparError(f"load_state_dict expected the keys of the whole model; missing {missing}, unexpected "
                           f"{unexpected}. Pass the state_dict() of this model (or strict=False).")
    return result._replace(missing_keys=missing, unexpected_keys=unexpected)
