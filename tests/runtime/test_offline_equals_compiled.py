"""One plan: ``autopar.plan(..., mode=m)`` made offline in one process (a fake mesh) equals the plan
``autopar.compile(..., mode=m)`` makes on 2 real gloo ranks for the same model, mesh, hardware profile and global
batch, in both modes: every node's layout, every parameter's placement and the collectives (kind, axis, bytes)
that run, which are counted at run time too. In eager mode both are the plan as DTensor executes it between the
module boundaries the search chose (``Planner.executed``), not the solver's layouts."""

from __future__ import annotations

import pytest
import torch

import torch_autopar as autopar
from torch_autopar.runtime.comm_count import CollectiveCounter, planned_summary
from torch_autopar.testing import run_on_ranks
from tests import support

CASES = [(model, strategy, mode) for mode in ("graph", "eager")
         for model, strategy in (("mlp", "fully_shard"), ("gpt", "tensor_parallel"), ("gpt", "auto"))]


def _compiled(rank, world):
    plans = {}
    for model_name, strategy, mode in CASES:
        torch._dynamo.reset()
        model = support.build_model(model_name)
        x, y = support.global_batch(model_name, 0)
        pmodel = autopar.compile(model, x.chunk(world)[rank], strategy=strategy, mode=mode)
        loss = support.loss_fn(model_name, pmodel(x.chunk(world)[rank]), y.chunk(world)[rank])
        with CollectiveCounter(pmodel.mesh) as counter:
            loss.backward()
        plans[(model_name, strategy, mode)] = (pmodel.plan, counter.summary())
    return plans


@pytest.fixture(scope="module")
def compiled():
    return run_on_ranks(_compiled, 2, timeout_s=600)[0]


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_offline_plan_equals_the_compiled_plan(compiled, case):
    model_name, strategy, mode = case
    x, _ = support.global_batch(model_name, 0)
    offline = autopar.plan(support.build_model(model_name), x, mesh_shape=(2,), hardware="cpu-gloo",
                           strategy=strategy, fold_layers=False, mode=mode)
    plan, backward_counted = compiled[case]
    assert offline.param_placements == plan.param_placements
    assert offline.node_layouts == plan.node_layouts
    assert planned_summary(offline) == planned_summary(plan)
    assert offline.estimated_step_time == pytest.approx(plan.estimated_step_time, rel=1e-9)
    backward_planned = sum(c.count for c in plan.collectives if c.phase in ("backward", "grad_sync"))
    assert sum(backward_counted.values()) == backward_planned
