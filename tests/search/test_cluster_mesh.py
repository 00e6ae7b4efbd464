"""Named restrictions take effect on a 3-D mesh, on every path: the exact search, the fast propagation mode, and
the fallback when the problem is too large to solve exactly (a fake 4x4x4 process group, a meta MLP: nothing is
allocated)."""

from __future__ import annotations

import itertools

import pytest
import torch

import torch_autopar as autopar
from torch_autopar.testing.models import MLP

MESH = (4, 4, 4)
NAMED = ("data_parallel", "fully_shard", "tensor_parallel", "fsdp_tp")


@pytest.fixture(scope="module")
def mlp():
    with torch.device("meta"):
        return MLP((1024, 4096, 1024))


def _plan(model, strategy, solver="auto"):
    x = torch.empty(64, 1024, device="meta")
    return autopar.plan(model, x, mesh_shape=MESH, hardware="h100", strategy=strategy, solver=solver)


def _layout(plan):
    return sorted(plan.param_placements.items()), sorted(plan.input_placements.items())


@pytest.mark.parametrize("solver", ["auto", "propagate"])
def test_each_named_strategy_has_its_own_layout_and_auto_is_no_worse(mlp, solver):
    plans = {name: _plan(mlp, name, solver) for name in NAMED}
    assert plans["fully_shard"].search_stats["mode"] == ("exact" if solver == "auto" else "propagation")
    for a, b in itertools.combinations(NAMED, 2):
        assert _layout(plans[a]) != _layout(plans[b]), (a, b, _layout(plans[a]))
    auto = _plan(mlp, "auto", solver)
    best = min(plan.estimated_step_time for plan in plans.values())
    assert auto.estimated_step_time <= best * (1 + 1e-9), {n: p.estimated_step_time for n, p in plans.items()}


def test_fast_path_on_an_oversized_problem_is_no_worse_than_a_named_layout(mlp, monkeypatch):
    """The exact limit lowered below this problem: every strategy falls back to propagation from its own roles,
    and auto to the best of those."""
    monkeypatch.setattr("torch_autopar.search.planner.MAX_EXACT_EDGE_VARIABLES", 10)
    named = {name: _plan(mlp, name) for name in NAMED}
    assert all(plan.search_stats.get("mode", "propagation") == "propagation" for plan in named.values())
    assert len({str(_layout(plan)) for plan in named.values()}) == len(NAMED)
    fast = _plan(mlp, "auto")
    for name, plan in named.items():
        assert fast.estimated_step_time <= plan.estimated_step_time * (1 + 1e-9), name
