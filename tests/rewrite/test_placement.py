"""The rewrite steps of sharded execution that need no ranks: where parameters compute, which mesh axes split
the batch, what an output's gradient layout is, and which collectives a layout change takes (DTensor's steps)."""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard

import torch_autopar as autopar
from torch_autopar.cost import CostModel, get_profile
from torch_autopar.launch.mesh import offline_mesh
from torch_autopar.rewrite.placement import batch_axes, compute_placements
from torch_autopar.strategies.propagate import tangent_placements
from torch_autopar.testing.models import MLP

import torch


def test_parameters_sharded_over_a_batch_axis_are_gathered_and_others_compute_sharded():
    assert compute_placements((Shard(0), Shard(1)), {0}) == (Replicate(), Shard(1))
    assert compute_placements((Shard(0),), set()) == (Shard(0),)
    assert compute_placements((Replicate(), Shard(0)), {0, 1}) == (Replicate(), Replicate())


def test_batch_axes_are_where_the_first_input_is_split_on_dim_0():
    plan = autopar.plan(MLP((8, 8)), (torch.randn(8, 8),), mesh_shape=(2, 2), strategy="data_parallel",
                        hardware="cpu-gloo")
    plan.input_placements = {0: ("S(0)", "R")}
    assert batch_axes(plan) == {0}
    plan.input_placements = {0: ("R", "R")}
    assert batch_axes(plan) == set()


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
