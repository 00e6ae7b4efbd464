"""Sharded plans on 2 gloo ranks: full state dicts out and in, gradient-norm clipping across shards, an
optimizer built before planning, and clear errors for plans that do not fit the model or the job."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

import torch_autopar as autopar
from torch_autopar.testing import run_on_ranks
from tests import support

WORLD = 2


def _state_round_trip(rank, world):
    model = support.build_model("mlp")
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = support.global_batch("mlp", 0)
    pmodel = autopar.compile(model, x.chunk(world)[rank], strategy="fully_shard")
    saved = pmodel.state_dict()
    sharded = pmodel.sharded_state_dict()
    optimizer = torch.optim.SGD(pmodel.parameters(), lr=0.5)
    support.loss_fn("mlp", pmodel(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    optimizer.step()
    trained = pmodel.state_dict()
    pmodel.load_state_dict(initial)
    reloaded = pmodel.state_dict()
    plain = support.build_model("mlp", seed=5)
    plain.load_state_dict(trained)  # a one-process model takes the full tensors as they are
    return {"saved": saved, "initial": initial, "reloaded": reloaded, "trained": trained,
            "plain": {k: v.clone() for k, v in plain.state_dict().items()},
            "saved_types": {k: type(v).__name__ for k, v in saved.items()},
            "sharded_types": {k: type(v).__name__ for k, v in sharded.items()}}


def _clipping(rank, world):
    model = support.build_model("gpt")
    x, y = support.global_batch("gpt", 0)
    pmodel = autopar.compile(model, x.chunk(world)[rank], strategy="fully_shard")
    support.loss_fn("gpt", pmodel(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    sharded = sum(isinstance(p.grad, DTensor) and any(pl.is_shard() for pl in p.grad.placements)
                  for p in pmodel.parameters())
    norm = autopar.clip_grad_norm_(pmodel.parameters(), 0.5)
    grads = {n: support.full(p.grad).clone() for n, p in model.named_parameters()}
    return {"norm": float(norm), "grads": grads, "sharded_grads": sharded}


def _optimizer_before_planning(rank, world):
    model = support.build_model("mlp")
    optimizer = support.make_optimizer("adamw", model.parameters())  # holds the original parameters
    pmodel = autopar.compile(model, strategy="fully_shard")  # plans (and shards) at the first call
    losses = support.train_steps(pmodel, "mlp", optimizer, rank, world)
    return {"losses": losses, "params": {k: v for k, v in pmodel.state_dict().items()}}


def _bad_plans(rank, world):
    model = support.build_model("mlp")
    x, _ = support.global_batch("mlp", 0)
    other = autopar.plan(support.build_model("gpt"), support.global_batch("gpt", 0)[:1], mesh_shape=(world,),
                         strategy="fully_shard", hardware="cpu-gloo")
    wrong_world = autopar.plan(model, (x,), mesh_shape=(world,), strategy="fully_shard", hardware="cpu-gloo")
    wrong_world.mesh_shape = (4,)  # as saved by a 4-rank job (Plan.load of its file)
    return {
        "other_model": support.outcome(autopar.compile, support.build_model("mlp"), x.chunk(world)[rank], strategy=other),
        "wrong_world": support.outcome(autopar.compile, support.build_model("mlp"), x.chunk(world)[rank],
                                       strategy=wrong_world),
        "wrong_mesh": support.outcome(autopar.compile, support.build_model("mlp"), x.chunk(world)[rank],
                                      strategy="fully_shard", mesh=(2, 2)),
        "unequal": support.outcome(autopar.compile(support.build_model("mlp"), x.chunk(world)[rank],
                                                   strategy="fully_shard"), x[:3] if rank == 0 else x[:2]),
    }


def _data_dependent_branch(rank, world):
    """A sharded plan needs the captured graph: a forward with Python control flow on tensor values cannot be
    captured, and compile says so (data parallelism would still run it in eager mode)."""
    x, _ = support.global_batch("branchy", 0)
    return {mode: support.outcome(autopar.compile, support.build_model("branchy"), x.chunk(world)[rank],
                                  strategy="fully_shard", mode=mode) for mode in ("eager", "graph")}


def _job(rank, world):
    return {name: support.outcome(fn, rank, world) for name, fn in
            (("state", _state_round_trip), ("clip", _clipping), ("early_optimizer", _optimizer_before_planning),
             ("bad", _bad_plans), ("branchy", _data_dependent_branch))}


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_job, WORLD, timeout_s=600)


def _value(results, name):
    values = []
    for rank, result in enumerate(results):
        status, value = result[name]
        assert status == "ok", f"rank {rank} {name}: {status}: {value}"
        values.append(value)
    return values


def test_state_dict_is_full_and_loads_back(results):
    for value in _value(results, "state"):
        assert set(value["saved_types"].values()) == {"Tensor"}, value["saved_types"]
        assert "DTensor" in value["sharded_types"].values(), value["sharded_types"]
        support.assert_params_close(value["saved"], value["initial"], what="state_dict before training")
        support.assert_params_close(value["reloaded"], value["initial"], what="after load_state_dict(initial)")
        support.assert_params_close(value["plain"], value["trained"], what="plain model loading the full state")
        assert any(not torch.equal(value["trained"][k], value["initial"][k]) for k in value["initial"])


def test_clip_grad_norm_uses_the_global_norm(results):
    model = support.build_model("gpt")
    x, y = support.global_batch("gpt", 0)
    support.loss_fn("gpt", model(x), y).backward()
    expected = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
    for value in _value(results, "clip"):
        assert value["sharded_grads"] > 0, "the fully-sharded plan should shard gradients"
        assert value["norm"] == pytest.approx(expected, rel=1e-5)
        for name, p in model.named_parameters():
            torch.testing.assert_close(value["grads"][name], p.grad, rtol=1e-4, atol=1e-6)


def test_optimizer_built_before_planning_trains_the_shards(results):
    ref_losses, ref_params = support.reference_run("mlp", "adamw")
    runs = _value(results, "early_optimizer")
    mean = [sum(r["losses"][s] for r in runs) / WORLD for s in range(support.STEPS)]
    support.assert_losses_close(mean, ref_losses, what="optimizer created before compile")
    for run in runs:
        support.assert_params_close(run["params"], ref_params, what="optimizer created before compile")


def test_plans_that_do_not_fit_fail_clearly(results):
    for value in _value(results, "bad"):
        status, message = value["other_model"]
        assert status == "AutoparError" and "another model" in message, value["other_model"]
        status, message = value["wrong_world"]
        assert status == "AutoparError" and "needs 4 ranks" in message, value["wrong_world"]
        status, message = value["wrong_mesh"]
        assert status == "AutoparError" and "mesh" in message, value["wrong_mesh"]
        status, message = value["unequal"]
        assert status == "AutoparError" and "unequal size" in message and "sum over 2 ranks: 5" in message, \
            value["unequal"]


def test_sharded_plans_refuse_data_dependent_branches_clearly(results):
    for value in _value(results, "branchy"):
        for mode in ("eager", "graph"):
            status, message = value[mode]
            assert status == "AutoparError" and "could not capture" in message, value[mode]
            assert "data-dependent" in message and "support.py:" in message, value[mode]  # dynamo's reason, the line
            assert "strategy='data_parallel'" in message, value[mode]  # what still runs it
