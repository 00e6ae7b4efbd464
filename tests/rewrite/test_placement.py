"""The rewrite steps of sharded execution that need no ranks: where parameters compute, which mesh axes split
the batch, what an output's gradient layout is, and which collectives a layout change takes (DTensor's steps)."""

from __future__ import annotations

from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import torch_autopar as autopar
from torch_autopar.cost import CostModel, get_profile
from torch_autopar.launch.mesh import offline_mesh
from torch_autopar.rewrite.placement import gathered_parameters
from torch_autopar.strategies.boundary import batch_axes, compute_layouts
from torch_autopar.strategies.propagate import tangent_placements
from torch_autopar.testing.models import MLP

import torch


def test_parameters_sharded_over_a_batch_axis_are_gathered_and_others_compute_sharded():
    storage = {"a": (Shard(0), Shard(1)), "b": (Replicate(), Shard(0))}
    assert compute_layouts(storage, (Shard(0), Replicate()), {}) == {"a": (Replicate(), Shard(1)),
                                                                     "b": (Replicate(), Shard(0))}
    assert compute_layouts(storage, (Replicate(), Replicate()), {}) == storage
    assert compute_layouts(storage, (Shard(0), Shard(0)), {})["b"] == (Replicate(), Replicate())


def test_the_plans_own_compute_layout_wins_over_the_fully_sharded_rule():
    storage = {"a": (Shard(0),), "b": (Shard(0),)}
    assert compute_layouts(storage, (Shard(0),), {"a": (Shard(0),)}) == {"a": (Shard(0),), "b": (Replicate(),)}


def test_batch_axes_are_where_the_first_input_is_split_on_dim_0():
    assert batch_axes((Shard(0), Replicate())) == {0}
    assert batch_axes((Replicate(), Replicate())) == set()
    assert batch_axes((Shard(1), Shard(0))) == {1}


def test_eager_mode_gathers_what_the_plan_computes_with():
    plan = autopar.plan(MLP((8, 8)), (torch.randn(8, 8),), mesh_shape=(2,), strategy="data_parallel",
                        hardware="cpu-gloo")
    plan.input_placements = {0: ("S(0)",)}
    module = MLP((8, 8))
    with offline_mesh((2,)) as mesh:
        for name, param in list(module.named_parameters()):
            owner, leaf = module.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
            setattr(owner, leaf, torch.nn.Parameter(DTensor.from_local(param.detach(), mesh, (Shard(0),))))
        assert gathered_parameters(module, plan) == {"layers.0.weight": (Replicate(),), "layers.0.bias": (Replicate(),)}
        plan.param_compute_placements = {"layers.0.weight": ("S(0)",)}
        assert gathered_parameters(module, plan) == {"layers.0.bias": (Replicate(),)}


def test_the_gradient_of_a_partial_output_is_replicated():
    assert tangent_placements((Partial(), Shard(0))) == (Replicate(), Shard(0))


def test_moves_follow_dtensor_steps_with_local_buffer_sizes():
    with offline_mesh((2, 2)) as mesh:
        cost = CostModel(get_profile("h100"), (2, 2), mesh)
        gather_both = cost.moves((Shard(0), Shard(0)), (Replicate(), Replicate()), 1024)
        assert sorted((c.kind, c.axis, c.nbytes) for c in gather_both) == [("all_gather", 0, 1024),
                                                                           ("all_gather", 1, 512)]
        reduce_one = cost.moves((Partial(), Shard(1)), (Shard(0), Shard(1)), 1024)
        assert [(c.kind, c.axis, c.nbytes) for c in reduce_one] == [("reduce_scatter", 0, 512)]
        gloo = CostModel(get_profile("cpu-gloo"), (2, 2), mesh)
        assert [c.kind for c in gloo.moves((Shard(0), Replicate()), (Shard(1), Replicate()), 1024)] == ["all_gather"]
        assert [c.kind for c in cost.moves((Shard(0), Replicate()), (Shard(1), Replicate()), 1024)] == ["all_to_all"]
