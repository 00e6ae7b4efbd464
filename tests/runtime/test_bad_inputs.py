"""Bad input gives a clear ``torch_autopar:`` error, never silently wrong gradients; models with data-dependent
control flow train in eager mode, and in graph mode under data parallelism (compiled pieces, as torch.compile).

One spawned 2-rank job tries every multi-rank case and reports each outcome as data (both ranks fail the same
way, so no rank is left waiting in a collective); the tests below check the outcomes.
"""

from __future__ import annotations

import pytest
import torch

import torch_autopar as autopar
from torch_autopar.testing import run_on_ranks
from tests import support
from tests.support import outcome

UNEQUAL_GLOBAL_BATCH = 5
"""Split 3 + 2 over two ranks."""


def _unequal_step(rank, mode, dtype=torch.float32):
    """One step with local batches of 3 and 2; returns the stage reached when it raised, and the outcome."""
    model = support.build_model("mlp").to(dtype)
    pmodel = autopar.compile(model, strategy="data_parallel", mode=mode)
    x = torch.randn(UNEQUAL_GLOBAL_BATCH, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
    local = x[:3] if rank == 0 else x[3:]
    stage = ["forward"]

    def step():
        output = pmodel(local)
        stage[0] = "backward"
        output.float().square().mean().backward()

    result = outcome(step)
    # the job goes on: the next step, with equal slices, works
    equal = outcome(lambda: pmodel(x[:4].chunk(2)[rank]).float().square().mean().backward())
    return {"outcome": result, "stage": stage[0], "next_equal_step": equal[0]}


def _train_branchy(rank, world, strategy, mode):
    model = support.build_model("branchy")
    pmodel = autopar.compile(model, strategy=strategy, mode=mode)
    optimizer = support.make_optimizer("sgd", pmodel.parameters())
    return support.train_steps(pmodel, "branchy", optimizer, rank, world), support.params_of(model)


def _bad_inputs_job(rank, world):
    x, _ = support.global_batch("mlp", 0)
    straight_x, _ = support.global_batch("straight", 0)
    plan = autopar.plan(support.build_model("straight"), straight_x, mesh_shape=(world,), strategy="data_parallel")
    return {
        "unequal": {mode: _unequal_step(rank, mode) for mode in ("eager", "graph")},
        "unequal_bfloat16": {mode: _unequal_step(rank, mode, torch.bfloat16) for mode in ("eager", "graph")},
        "full_batch_indivisible": outcome(lambda: autopar.compile(support.build_model("mlp"), strategy="data_parallel",
                                                                  full_batch=True)(x[:5])),
        "mesh_too_large": outcome(autopar.compile, support.build_model("mlp"), mesh=(2 * world,)),
        "mesh_2d_too_large": outcome(autopar.compile, support.build_model("mlp"), mesh=(world, 2)),
        "branchy_plan_eager": outcome(_train_branchy, rank, world, plan, "eager"),
        "branchy_plan_graph": outcome(_train_branchy, rank, world, plan, "graph"),
        "branchy_data_parallel_eager": outcome(_train_branchy, rank, world, "data_parallel", "eager"),
    }


@pytest.fixture(scope="module")
def job():
    return run_on_ranks(_bad_inputs_job, 2, timeout_s=240)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_unequal_local_batches_raise_at_backward(job, mode):
    """Both modes compare the slices' sizes alongside the step (eager: in the first gradient bucket; graph: a
    check issued with the forward) and raise as backward ends, before an optimizer step."""
    for rank, result in enumerate(job):
        entry = result["unequal"][mode]
        support.assert_autopar_error(entry["outcome"], "unequal size", f"this rank: {3 if rank == 0 else 2}",
                              f"sum over 2 ranks: {UNEQUAL_GLOBAL_BATCH}")
        assert entry["stage"] == "backward"
        assert entry["next_equal_step"] == "ok"


@pytest.mark.parametrize("mode", [
    "eager",
    "graph"])
def test_unequal_local_batches_raise_for_a_bfloat16_model(job, mode):
    for result in job:
        support.assert_autopar_error(result["unequal_bfloat16"][mode]["outcome"], "unequal size")


def test_full_batch_with_indivisible_global_batch_raises(job):
    for result in job:
        support.assert_autopar_error(result["full_batch_indivisible"], "full_batch=True", "5")


@pytest.mark.parametrize("key", ["mesh_too_large", "mesh_2d_too_large"])
def test_mesh_not_covering_the_job_raises(job, key):
    for result in job:
        support.assert_autopar_error(result[key], "4 devices", "2 ranks")


def _assert_branchy_equals_one_process(job, key):
    ref_losses, ref_params = support.reference_run("branchy", "sgd")
    results = [result[key] for result in job]
    assert all(kind == "ok" for kind, _ in results), results
    mean = [sum(value[0][s] for _, value in results) / len(results) for s in range(support.STEPS)]
    support.assert_losses_close(mean, ref_losses, what=key)
    for rank, (_, (_, params)) in enumerate(results):
        support.assert_params_close(params, ref_params, what=f"{key} rank {rank}")


def test_data_dependent_control_flow_trains_in_eager_mode_with_a_plan(job):
    """A plan made for a model with the same parameters skips capture; eager runs the Python branch."""
    _assert_branchy_equals_one_process(job, "branchy_plan_eager")


def test_data_dependent_control_flow_trains_in_graph_mode_in_compiled_pieces(job):
    """Data parallelism in graph mode runs the pieces dynamo compiles with the Python branch in between, as
    torch.compile does (every step's branch is the same on each rank's slice and on the whole batch)."""
    _assert_branchy_equals_one_process(job, "branchy_plan_graph")


def test_data_dependent_control_flow_trains_in_eager_mode_with_explicit_strategy(job):
    _assert_branchy_equals_one_process(job, "branchy_data_parallel_eager")


def test_graph_mode_runs_data_dependent_control_flow_with_default_strategy():
    for step in range(2):  # both branches
        x, _ = support.global_batch("branchy", step)
        output = autopar.compile(support.build_model("branchy"), mode="graph")(x)
        torch.testing.assert_close(output, support.build_model("branchy")(x), rtol=0, atol=0)


def test_eager_mode_runs_data_dependent_control_flow_with_default_strategy():
    x, _ = support.global_batch("branchy", 0)
    output = autopar.compile(support.build_model("branchy"), mode="eager")(x)
    torch.testing.assert_close(output, support.build_model("branchy")(x), rtol=0, atol=0)


def test_graph_and_eager_mode_run_data_dependent_control_flow_in_one_process():
    x, _ = support.global_batch("branchy", 0)
    plan = autopar.plan(support.build_model("straight"), x, mesh_shape=(1,), strategy="data_parallel")
    graph = autopar.compile(support.build_model("branchy"), strategy=plan, mode="graph")
    eager = autopar.compile(support.build_model("branchy"), strategy=plan, mode="eager")
    for step in range(2):  # both branches
        x, _ = support.global_batch("branchy", step)
        torch.testing.assert_close(eager(x), support.build_model("branchy")(x), rtol=0, atol=0)
        torch.testing.assert_close(graph(x), support.build_model("branchy")(x), rtol=0, atol=0)
