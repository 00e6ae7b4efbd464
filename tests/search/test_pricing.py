"""One pricing function: the MILP's optimum is the estimate of the plan it returns (``cost.pricing`` prices both).

Every searched strategy on a 1-D and a 2-D fake mesh, with and without a memory budget that binds, on a wide MLP
and a small GPT (meta tensors: nothing is allocated).
"""

from __future__ import annotations

import pytest
import torch

from torch_autopar.capture import capture
from torch_autopar.capture.fold import folded_layers
from torch_autopar.cost import get_profile
from torch_autopar.launch import offline_mesh
from torch_autopar.search import Planner
from torch_autopar.testing.models import GPT, MLP, GPTConfig

MESHES = {(4,): ("dp",), (2, 2): ("dp", "tp")}


def _mlp():
    with torch.device("meta"):
        return capture(MLP((256, 1024, 1024, 256)), (torch.empty(64, 256, device="meta"),), {})


def _gpt():
    with torch.device("meta"):
        model = GPT(GPTConfig())
        tokens = torch.zeros(8, 32, dtype=torch.long, device="meta")
        return capture(model, (tokens,), {})


PROGRAMS = {"mlp": _mlp, "gpt": _gpt}


@pytest.fixture(scope="module", params=sorted(PROGRAMS))
def program(request):
    return PROGRAMS[request.param]()


def _searched(program, mesh_shape, strategy, budget=None):
    with offline_mesh(mesh_shape, MESHES[mesh_shape]) as mesh:
        planner = Planner(program, mesh, MESHES[mesh_shape], hardware=get_profile("h100"), memory_budget=budget)
        if strategy == "auto":
            return planner.searched_many(["auto"])["auto"]
        return planner.searched(strategy)


def _solved_part(plan):
    """The estimate less the one constant the MILP leaves out: DTensor's dispatch of the optimizer step."""
    return plan.estimated_step_time - plan.search_stats["optimizer_dispatch_s"]


def _strategies(mesh_shape):
    return ["auto", "fully_shard", "tensor_parallel"] + (["fsdp_tp"] if len(mesh_shape) > 1 else [])


@pytest.mark.parametrize("mesh_shape", sorted(MESHES), ids=lambda s: "x".join(map(str, s)))
def test_objective_equals_estimate_of_the_returned_plan(program, mesh_shape):
    for strategy in _strategies(mesh_shape):
        plan = _searched(program, mesh_shape, strategy)
        assert plan.search_stats["mode"] == "exact"
        assert plan.search_stats["objective_s"] == pytest.approx(_solved_part(plan), rel=1e-9), strategy


@pytest.mark.parametrize("mesh_shape", sorted(MESHES), ids=lambda s: "x".join(map(str, s)))
def test_objective_equals_estimate_under_a_budget_that_binds(program, mesh_shape):
    for strategy in _strategies(mesh_shape):
        free = _searched(program, mesh_shape, strategy)
        budget = free.peak_memory - 1
        try:
            plan = _searched(program, mesh_shape, strategy, budget)
        except Exception as error:  # the restriction has no plan under this budget: nothing to compare
            assert "fits the memory budget" in str(error), error
            continue
        assert plan.peak_memory <= budget
        assert plan.search_stats["objective_s"] == pytest.approx(_solved_part(plan), rel=1e-9), strategy


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_objective_prices_the_recomputation_of_a_fixed_policy(policy):
    """Every layer recomputes: the forward of each runs twice ("selective": all but its matmuls), which the
    search optimises as the estimate adds it, so auto's optimum still dominates the named restrictions."""
    program = _gpt()
    with offline_mesh((2, 2), MESHES[(2, 2)]) as mesh:
        planner = Planner(program, mesh, MESHES[(2, 2)], hardware=get_profile("h100"),
                          activation_checkpointing=policy)
        for strategy in _strategies((2, 2))[1:]:
            plan = planner.plan(strategy)
            assert set(plan.activation_checkpointing.values()) == {policy}, strategy
            assert plan.search_stats["objective_s"] == pytest.approx(_solved_part(plan), rel=1e-9), strategy
        compared = next(note for note in planner.plan("auto").notes if note.startswith("auto compared"))
        assert "fully_shard, tensor_parallel, fsdp_tp not solved" in compared, compared


def test_objective_prices_a_choice_of_some_folded_layers():
    """Folded layers: the captured middle block stands for 4 real ones, of which a chosen few recompute (one
    fully, one selectively): the search prices the share of each captured op that runs again, as the estimate
    adds each real layer's recompute."""
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=6))
        tokens = torch.zeros(8, 32, dtype=torch.long, device="meta")
        with folded_layers(model) as folding:
            program = capture(model, (tokens,), {})
    assert folding.lengths == {"blocks": 6}
    choice = {"blocks.0": "full", "blocks.2": "full", "blocks.4": "selective"}
    with offline_mesh((2, 2), MESHES[(2, 2)]) as mesh:
        planner = Planner(program, mesh, MESHES[(2, 2)], hardware=get_profile("h100"), folding=folding,
                          activation_checkpointing=choice)
        for strategy in _strategies((2, 2))[1:]:
            plan = planner.plan(strategy)
            assert plan.activation_checkpointing == choice, strategy
            assert plan.search_stats["objective_s"] == pytest.approx(_solved_part(plan), rel=1e-9), strategy
