"""The named strategies' propagation (the planner's fast mode, taken when the exact problem is too large, as at
cluster scale) runs on ranks and equals one process: a LLaMA with grouped-query attention planned offline with
``solver="propagate"`` on a 2x2 dp x tp mesh, then compiled from that plan on 4 gloo ranks. Losses (1e-5
relative) and full parameters after 3 AdamW steps equal a one-process run, and the collectives counted each step
(kind, mesh axis, bytes) equal the plan's list. Before the sharding cache was keyed on each op's shape arguments,
graph mode crashed here (a view to ``(B*T, C)`` was given another view's output layout)."""

from __future__ import annotations

import functools

import pytest

import torch_autopar as autopar
from torch_autopar.testing import run_on_ranks
from tests import support

pytestmark = pytest.mark.timeout(900)

WORLD, MESH = 4, (2, 2)
CASES = (("fsdp_tp", "graph"), ("tensor_parallel", "eager"))


def _plan(strategy: str, mode: str):
    x, _ = support.global_batch("llama", 0)
    return autopar.plan(support.build_model("llama"), x, mesh_shape=MESH, hardware="cpu-gloo", strategy=strategy,
                        solver="propagate", fold_layers=False, mode=mode)


def _run(rank, world, plan, mode):
    import torch
    torch._dynamo.reset()
    model = support.build_model("llama")
    x, _ = support.global_batch("llama", 0)
    pmodel = autopar.compile(model, x.chunk(world)[rank], strategy=plan, mesh=MESH, mode=mode)
    return support.counted_training(pmodel, model, "llama", rank, world, mode)


def _job(rank, world, plans):
    return {case: support.outcome(_run, rank, world, plans[case], case[1]) for case in CASES}


@functools.cache
def _plans() -> dict:
    return {case: _plan(*case) for case in CASES}


@pytest.fixture(scope="module")
def results():
    return support.by_case(run_on_ranks(_job, WORLD, _plans(), timeout_s=600))


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_propagated_plan_equals_one_process_and_its_collectives(results, case):
    plan = _plans()[case]
    assert plan.search_stats["mode"] == "propagation" and not plan.replicated_ops, plan.replicated_ops
    # the propagation's own choices are what runs: matrices split Megatron-style on tp
    assert plan.param_placements["layers.0.wq.weight"][1] == "S(0)"
    assert plan.param_placements["layers.0.wo.weight"][1] == "S(1)"
    model = support.build_model("llama")
    ref_losses = support.train_steps(model, "llama", support.make_optimizer("adamw", model.parameters()))
    run = support.assert_ranks_equal_one_process(results[case], (ref_losses, support.params_of(model)), str(case))
    for rank, (_, each) in enumerate(results[case]):
        for step, counted in enumerate(each["counted"]):
            assert counted == each["planned"], (f"rank {rank} step {step} {case}: collectives run "
                                                f"{sorted(counted.items())} vs planned {sorted(each['planned'].items())}")
    assert run["planned"], "a propagated plan on 2x2 moves something"
