"""Graph mode with gradient buckets on 2 gloo ranks equals one process (losses and parameters after 3 AdamW steps,
fp32), for a data-parallel, a fully-sharded and a tensor-parallel plan; the collectives counted each step equal
the plan's list, and bucketing (the default cap) runs fewer collectives than one per gradient
(``bucket_cap_bytes=0``) wherever two gradients are reduced the same way one after the other.

One spawned job runs every case (each plans, compiles and trains its own module).
"""

from __future__ import annotations

import pytest
import torch

import torch_autopar as autopar
from torch_autopar.runtime.comm_count import CollectiveCounter, planned_summary
from torch_autopar.testing import run_on_ranks
from tests import support

WORLD = 2
CASES = [("mlp", "data_parallel"), ("gpt", "fully_shard"), ("gpt", "tensor_parallel")]
CAPS = (None, 0)
"""None: compile's default cap; 0: one collective per gradient (the behaviour before buckets)."""


def _counted_step(pmodel, model_name, optimizer, x, y):
    """(loss, collectives counted): a sharded plan's as ``support.counted_step`` counts them; data parallelism's
    backward graph (its all-reduces) counted by kind and bytes."""
    if pmodel.mesh is not None:
        return support.counted_step(pmodel, model_name, optimizer, x, y, "graph")
    optimizer.zero_grad(set_to_none=True)
    loss = support.loss_fn(model_name, pmodel(x), y)
    with CollectiveCounter() as counter:
        loss.backward()
    optimizer.step()
    return loss.item(), _tally(counter.records)


def _tally(records) -> dict:
    counts: dict = {}
    for r in records:
        counts[(r.kind, r.nbytes)] = counts.get((r.kind, r.nbytes), 0) + 1
    return counts


def _planned(plan, sharded: bool) -> dict:
    if sharded:
        return dict(planned_summary(plan))
    counts: dict = {}
    for c in plan.collectives:
        if c.phase == "grad_sync":
            counts[(c.kind, c.nbytes)] = counts.get((c.kind, c.nbytes), 0) + c.count
    return counts


def _run_case(rank, model_name, strategy, cap):
    torch._dynamo.reset()
    model = support.build_model(model_name)
    x, _ = support.global_batch(model_name, 0)
    options = {} if cap is None else {"bucket_cap_bytes": cap}
    pmodel = autopar.compile(model, x.chunk(WORLD)[rank], strategy=strategy, mode="graph", hardware="cpu-gloo",
                             **options)
    optimizer = support.make_optimizer("adamw", pmodel.parameters())
    losses, counts = [], []
    for step in range(support.STEPS):
        x, y = support.global_batch(model_name, step)
        loss, counted = _counted_step(pmodel, model_name, optimizer, x.chunk(WORLD)[rank], y.chunk(WORLD)[rank])
        losses.append(loss)
        counts.append(dict(counted))
    state = pmodel.state_dict()
    sharded = pmodel.mesh is not None
    return {"losses": losses, "params": {name: state[name].clone() for name, _ in model.named_parameters()},
            "counted": counts, "planned": _planned(pmodel.plan, sharded), "sharded": sharded,
            "buckets": pmodel.plan.grad_buckets}


def _job(rank, world):
    return {(model, strategy, cap): support.outcome(_run_case, rank, model, strategy, cap)
            for model, strategy in CASES for cap in CAPS}


@pytest.fixture(scope="module")
def results():
    return support.by_case(run_on_ranks(_job, WORLD, timeout_s=600))


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_buckets_equal_one_process_and_the_plan(results, case):
    model_name, strategy = case
    reference = support.reference_run(model_name, "adamw")
    total = {}
    for cap in CAPS:
        what = f"{case} graph mode, bucket_cap_bytes={cap}"
        run = support.assert_ranks_equal_one_process(results[(model_name, strategy, cap)], reference, what)
        assert run["sharded"] == (strategy != "data_parallel"), what
        for rank, (_, each) in enumerate(results[(model_name, strategy, cap)]):
            for step, counted in enumerate(each["counted"]):
                assert counted == each["planned"], (f"rank {rank} step {step} {what}: ran {sorted(counted.items())}, "
                                                    f"planned {sorted(each['planned'].items())}")
        total[cap] = sum(run["planned"].values())
        if cap == 0:
            assert all(len(bucket) == 1 for bucket in run["buckets"]), what
    if strategy == "tensor_parallel":  # its gradients alternate between reductions and gathers: no two share one
        assert total[None] <= total[0], f"{case}: {total[None]} collectives with buckets, {total[0]} without"
    else:
        assert total[None] < total[0], f"{case}: {total[None]} collectives with buckets, {total[0]} without"
