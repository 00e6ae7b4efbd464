"""Tensor-parallel pipeline stages: each stage module's matrices split over the ranks that hold the stage.

A plan whose stages are "tensor_parallel" (``search.pipeline``: strategy "pipeline+tensor_parallel") stores each
parameter in the layout its ``param_placements`` give on the stage axis (Megatron's column/row split of the
matrices by the forward data flow, ``search.role_seeds.megatron_splits``; vectors and other parameters as the
plan says), as DTensors on a 1-D ``DeviceMesh`` of the stage's ranks. The ranks of a stage pass the same
micro-batch (no data parallelism inside the stage):

  boundary   ``TensorParallelStage`` takes the activations the schedule hands it as plain tensors, whole on every
             rank of the stage (``DTensor.from_local``, Replicate), and hands back plain whole tensors
             (``full_tensor``: a partial sum is all-reduced, a split one gathered), so ``PipelineStage`` sends and
             receives exactly what an unsharded stage would;
  inside     DTensor runs the user's layers op by op on the parameters' layouts (column-parallel outputs stay
             split into the row-parallel matmul, whose partial sum is reduced once);
  gradients  each parameter's gradient is left in its parameter's layout (``settle_grads``: a partial sum is
             reduced), so the tied sum and the optimizer work on local shards;
  state      ``stage_sharding.full_state`` / ``load_full_state`` gather and scatter the DTensors as for FSDP2.

Must never plan, choose a layout the plan does not give, or reduce a gradient twice.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from torch_autopar import _compat, launch
from torch_autopar.strategies.placements import parse_placement

pytree = _compat.pytree()
TENSOR_PARALLEL_STRATEGY = "pipeline+tensor_parallel"
"""The plan strategy whose stages run tensor parallel (``search.pipeline._plan``)."""


def is_tensor_parallel(plan, stage_ranks: int) -> bool:
    return plan.strategy == TENSOR_PARALLEL_STRATEGY and stage_ranks > 1


class TensorParallelStage(torch.nn.Module):
    """A stage module whose parameters are DTensors on ``mesh``, called with and returning plain whole tensors."""

    def __init__(self, stage: torch.nn.Module, mesh: DeviceMesh):
        super().__init__()
        self.stage = stage
        self._mesh = mesh

    def forward(self, *args):
        inputs = tuple(DTensor.from_local(a, self._mesh, [Replicate()], run_check=False)
                       if isinstance(a, torch.Tensor) else a for a in args)
        return pytree.tree_map(_whole, self.stage(*inputs))


def _whole(value):
    """A DTensor output as a plain whole tensor of its own (``full_tensor`` may return a view of DTensor's local
    tensor, and the zero-bubble schedule detaches stage outputs in place, which a view refuses)."""
    return value.full_tensor().clone() if isinstance(value, DTensor) else value


def stage_mesh(plan) -> DeviceMesh:
    """The 1-D mesh of this rank's stage ranks: the stage axis of the job's one (stage ranks, pipeline) mesh
    (``launch.mesh.job_mesh``, created once per shape: DTensor caches its redistribution plans by mesh equality,
    which ignores process groups, so a second equal mesh over new groups would run on the first one's)."""
    return launch.mesh.job_mesh(tuple(plan.mesh_shape), tuple(plan.axis_names))[plan.axis_names[0]]


def apply_tensor_parallel(stages: list[torch.nn.Module], mesh: DeviceMesh, placements: dict[str, str],
                          model: torch.nn.Module) -> list[torch.nn.Module]:
    """Store each parameter of ``stages`` as a DTensor on ``mesh`` in the placement ``placements`` names for it
    (the plan's stage-axis placement, "R" where absent), each rank keeping its own piece of the (equal) whole
    tensor: no collective. A parameter two stages share is converted once, and ``model`` (the user's module,
    whose modules the stages share) holds the converted one under every name, a tied name of another stage's
    module included. Returns the stages wrapped in ``TensorParallelStage``."""
    _compat.allow_implicit_replication()  # tensors the layers make (positions, masks) are whole on every rank
    converted: dict[int, torch.nn.Parameter] = {}
    for stage in stages:
        for module_name, module in stage.named_modules(remove_duplicate=False):
            for leaf, param in list(module._parameters.items()):
                if param is None:
                    continue
                name = f"{module_name}.{leaf}" if module_name else leaf
                if id(param) not in converted:
                    placement = parse_placement(placements.get(name, "R"))
                    shard = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=None)
                    converted[id(param)] = torch.nn.Parameter(shard, requires_grad=param.requires_grad)
                module._parameters[leaf] = converted[id(param)]
    for module in model.modules():  # e.g. an output head tied to this stage's embedding, run by another stage
        for leaf, param in list(module._parameters.items()):
            if param is not None and id(param) in converted:
                module._parameters[leaf] = converted[id(param)]
    return [TensorParallelStage(stage, mesh) for stage in stages]


def settle_grads(params) -> None:
    """Leave each DTensor gradient in its parameter's layout (reduce a partial sum the backward left)."""
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
            param.grad = grad.redistribute(param.device_mesh, param.placements)
