"""Pipelined models (pipeline=2) on 2 gloo ranks (pp=2) and 4 ranks (dp=2 x pp=2) equal a one-process run:
losses (1e-5 relative) and full parameters (rtol 1e-4, atol 1e-5) after 3 AdamW steps with ``pmodel.step``,
for the GPT (embedding tied to the output head across the two stages) and an MLP of identical blocks, GPipe and
1F1B, eager and graph mode, and the MLP under pipeline="auto"; on 4 ranks also with fully-sharded stages
(strategy="fully_shard": FSDP2 over each stage's 2 data-parallel ranks, each rank holding half of its stage's
parameters), one of them accumulating two half-batches per step and reloaded from its full state_dict;
``autopar.Model.train`` drives ``step``; ``state_dict`` gathers the whole model; bad inputs fail with
torch_autopar errors before any collective.

One spawned job per (world, layout) runs every case.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch.distributed.tensor import DTensor

import torch_autopar as autopar
from torch_autopar.cost import Link, get_profile
from torch_autopar.testing import run_on_ranks
from tests import support

SLOW_LINK = dataclasses.replace(get_profile("cpu-gloo"), name="cpu-gloo-slow-link", intra_node=Link(1e-5, 1e6),
                                inter_node=Link(1e-5, 1e6))

CASES = {
    2: [(model, schedule, mode) for model in ("gpt", "blocks") for schedule in ("gpipe", "1f1b")
        for mode in ("eager", "graph")] + [("blocks", "interleaved_1f1b", "eager")],
    4: [("gpt", "gpipe", "eager"), ("gpt", "1f1b", "graph"), ("blocks", "1f1b", "eager"),
        ("blocks", "gpipe", "graph"), ("gpt", "gpipe", "eager", "fully_shard"),
        ("gpt", "1f1b", "graph", "fully_shard"), ("blocks", "1f1b", "eager", "fully_shard")],
}


def _train_case(rank, world, model_name, schedule, mode, strategy="auto"):
    torch._dynamo.reset()
    model = support.build_model(model_name)
    dp = world // 2
    x, _ = support.global_batch(model_name, 0)
    loss_fn = functools.partial(support.loss_fn, model_name)
    pmodel = autopar.compile(model, x.chunk(dp)[rank // 2], pipeline=2, schedule=schedule, loss_fn=loss_fn,
                             mode=mode, strategy=strategy)
    return _train(pmodel, model, model_name, dp)


def _sharded_accumulate_case(rank, world):
    """Fully-sharded stages (blocks, GPipe) stepping on two half-batches per optimizer step (``loss_scale=1/2``:
    gradients set aside and added back), then a fresh model compiled with the same plan loads the full state."""
    model = support.build_model("blocks")
    dp = world // 2
    x, _ = support.global_batch("blocks", 0)
    loss_fn = functools.partial(support.loss_fn, "blocks")
    pmodel = autopar.compile(model, x.chunk(dp)[rank // 2], pipeline=2, schedule="gpipe", microbatches=2,
                             loss_fn=loss_fn, strategy="fully_shard")
    run = _train(pmodel, model, "blocks", dp, accumulate=2)
    given = autopar.compile(support.build_model("blocks", seed=1), x.chunk(dp)[rank // 2], strategy=pmodel.plan,
                            loss_fn=loss_fn)
    given.load_state_dict(pmodel.state_dict())
    reloaded = given.state_dict()
    return run | {"reloaded": {n: reloaded[n].clone() for n, _ in model.named_parameters()},
                  "given": given.plan.strategy}


def _auto_case(rank, world):
    """pipeline='auto' under a budget below the intra-op plans but data-parallel, on a link slow enough
    that sharding loses: the search builds 2 stages; example inputs are this rank's data-parallel slice."""
    model = support.build_model("blocks")
    x, _ = support.global_batch("blocks", 0)
    pmodel = autopar.compile(model, x.chunk(world)[rank], pipeline="auto", hardware=SLOW_LINK,
                             memory_budget=200 * 1024, loss_fn=functools.partial(support.loss_fn, "blocks"))
    return _train(pmodel, model, "blocks", pmodel.data_parallel_size) | {"notes": pmodel.plan.notes}


def _auto_intra_case(rank, world):
    """pipeline='auto' where the intra-op plan estimates faster (the cpu-gloo profile): the module built is the
    intra-op one and trains as DDP would (each rank its slice, gradients of the global batch)."""
    model = support.build_model("blocks")
    x, _ = support.global_batch("blocks", 0)
    pmodel = autopar.compile(model, x.chunk(world)[rank], pipeline="auto")
    optimizer = support.make_optimizer("adamw", pmodel.parameters())
    for step in range(support.STEPS):
        x, y = support.global_batch("blocks", step)
        optimizer.zero_grad(set_to_none=True)
        support.loss_fn("blocks", pmodel(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        optimizer.step()
    state = pmodel.state_dict()
    return {"stages": pmodel.plan.pipeline_stages, "notes": pmodel.plan.notes, "has_step": hasattr(pmodel, "step"),
            "params": {n: state[n].clone() for n, _ in model.named_parameters()}}


def _train(pmodel, model, model_name, dp, accumulate=1):
    optimizer = support.make_optimizer("adamw", pmodel.parameters())
    slot = pmodel.data_parallel_rank
    losses = []
    for step in range(support.STEPS):
        x, y = support.global_batch(model_name, step)
        optimizer.zero_grad(set_to_none=True)
        parts = zip(x.chunk(dp)[slot].chunk(accumulate), y.chunk(dp)[slot].chunk(accumulate))
        losses.append(sum(pmodel.step(xs, ys, loss_scale=1 / accumulate).item() for xs, ys in parts) / accumulate)
        optimizer.step()
    state = pmodel.state_dict()
    output = pmodel(x.chunk(dp)[slot])
    params = dict(pmodel.named_parameters())  # this rank's stage (tied copies too): shards if fully sharded
    held = sum(_local(p).numel() for p in params.values())
    local = {n: _whole(p) for n, p in params.items()}
    return {"losses": losses, "params": {n: state[n].clone() for n, _ in model.named_parameters()}, "local": local,
            "dp": (pmodel.data_parallel_rank, pmodel.data_parallel_size), "output": output,
            "plan": (pmodel.plan.pipeline_stages, pmodel.plan.microbatches, pmodel.plan.schedule),
            "held": (held, sum(p.numel() for p in params.values())), "strategy": pmodel.plan.strategy,
            "planned": sorted({(c.kind, c.axis, c.where) for c in pmodel.plan.collectives if c.kind != "send"})}


def _local(param):
    return param.to_local() if isinstance(param, DTensor) else param


def _whole(param):
    return param.detach().full_tensor() if isinstance(param, DTensor) else param.detach().clone()


def _trainer_case(rank, world):
    """autopar.Model(pmodel, loss_fn, optimizer).train uses step: one epoch of 3 global batches of 8."""
    model = support.build_model("gpt")
    xs, ys = zip(*(support.global_batch("gpt", step) for step in range(support.STEPS)))
    pmodel = autopar.compile(model, pipeline=2, schedule="1f1b", microbatches=2)
    optimizer = support.make_optimizer("adamw", pmodel.parameters())
    trainer = autopar.Model(pmodel, functools.partial(support.loss_fn, "gpt"), optimizer)
    metrics = trainer.train(1, (torch.cat(xs), torch.cat(ys)), batch_size=support.GLOBAL_BATCH, shuffle=False,
                            progress=False)
    state = pmodel.state_dict()
    plan = autopar.plan(model, torch.cat(xs[:1]), mesh_shape=(world,), pipeline=2, microbatches=2)
    given = autopar.compile(support.build_model("gpt"), xs[0], strategy=plan, loss_fn=support.gpt_loss)
    given.load_state_dict(state)  # full tensors in: each stage keeps its part
    reloaded = given.state_dict()
    return {"metrics": metrics, "params": {n: state[n].clone() for n, _ in model.named_parameters()},
            "given": ([r.layers for r in given.plan.stages] == [r.layers for r in plan.stages],
                      given.plan.microbatches),
            "reloaded": {n: reloaded[n].clone() for n, _ in model.named_parameters()},
            "checkpoint": support.outcome(autopar.save_checkpoint, "/nonexistent/ckpt", pmodel)}


def _bad_inputs(rank, world):
    model = support.build_model("gpt")
    x, y = support.global_batch("gpt", 0)
    return {
        "no_loss_fn": support.outcome(lambda: autopar.compile(model, x, pipeline=2).step(x, y)),
        "more_stages_than_layers": support.outcome(autopar.compile, model, x, pipeline=2,
                                                   schedule="interleaved_1f1b", loss_fn=support.gpt_loss),
        "microbatches": support.outcome(autopar.compile, model, x, pipeline=2, microbatches=3,
                                        loss_fn=support.gpt_loss),
        "world": support.outcome(autopar.compile, model, x, pipeline=3, loss_fn=support.gpt_loss),
        "sharded_stages": support.outcome(autopar.compile, model, x, pipeline=2, strategy="tensor_parallel"),
    }


def _job(rank, world):
    results = {case: support.outcome(_train_case, rank, world, *case) for case in CASES[world]}
    if world == 2:
        results["auto"] = support.outcome(_auto_case, rank, world)
        results["auto_intra"] = support.outcome(_auto_intra_case, rank, world)
        results["trainer"] = support.outcome(_trainer_case, rank, world)
        results["bad"] = support.outcome(_bad_inputs, rank, world)
    if world == 4:
        results["sharded_accumulate"] = support.outcome(_sharded_accumulate_case, rank, world)
    return results


@pytest.fixture(scope="module")
def jobs():
    return {}


def _results(jobs, world):
    if world not in jobs:
        jobs[world] = run_on_ranks(_job, world, timeout_s=600)
    return jobs[world]


@functools.cache
def _reference(model_name):
    return support.reference_run(model_name, "adamw")


def _ok(results, key):
    values = []
    for rank, result in enumerate(results):
        status, value = result[key]
        assert status == "ok", f"rank {rank} {key}: {status}: {value}"
        values.append(value)
    return values


ALL = [(world, case) for world in CASES for case in CASES[world]]


@pytest.mark.parametrize("item", ALL, ids=lambda item: f"{item[0]}ranks-" + "-".join(item[1]))
def test_pipeline_matches_one_process(jobs, item):
    world, case = item
    model_name = case[0]
    runs = _ok(_results(jobs, world), case)
    ref_losses, ref_params = _reference(model_name)
    model = support.build_model(model_name)
    x, _ = support.global_batch(model_name, support.STEPS - 1)
    for rank, run in enumerate(runs):
        what = f"rank {rank} {case} on {world} ranks"
        assert run["dp"] == (rank // 2, world // 2), what
        assert run["plan"][0] == (4 if case[1] == "interleaved_1f1b" else 2) and run["plan"][2] == case[1], what
        _check_layout(run, case[3] if len(case) > 3 else "data_parallel", what)
        support.assert_losses_close(run["losses"], ref_losses, what=what)
        support.assert_params_close(run["params"], ref_params, what=what)
        support.assert_params_close(run["local"], {n: ref_params[n] for n in run["local"]}, what=f"{what} (local)")
        if model_name == "gpt":  # the embedding tied to the head: a copy on each stage, kept equal
            assert "tok.weight" in run["local"], f"{what}: {sorted(run['local'])}"
        model.load_state_dict(run["params"])
        expected = model(x.chunk(world // 2)[rank // 2])
        torch.testing.assert_close(run["output"], expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {m}")


def _check_layout(run, layout, what):
    """The plan names the stage layout and its collectives; a fully-sharded rank holds half its stage."""
    held, whole = run["held"]
    if layout == "fully_shard":
        assert run["strategy"] == "pipeline+fully_shard", f"{what}: {run['strategy']}"
        assert {kind for kind, _, _ in run["planned"]} == {"all_gather", "reduce_scatter"}, f"{what}: {run['planned']}"
        assert abs(held - whole / 2) <= 0.05 * whole, f"{what}: holds {held} of its stage's {whole} parameter elements"
    else:
        assert run["strategy"] in ("pipeline", "pipeline+data_parallel") and held == whole, f"{what}: {run}"


def test_sharded_stages_accumulate_and_reload(jobs):
    """Two half-batches per step on fully-sharded stages equal the one-process run; the full state_dict loads
    into a fresh model compiled with the same plan (each rank keeping its shards) and gathers back equal."""
    ref_losses, ref_params = _reference("blocks")
    for rank, run in enumerate(_ok(_results(jobs, 4), "sharded_accumulate")):
        what = f"rank {rank} fully-sharded stages, accumulate=2"
        _check_layout(run, "fully_shard", what)
        support.assert_losses_close(run["losses"], ref_losses, what=what)
        support.assert_params_close(run["params"], ref_params, what=what)
        assert run["given"] == "pipeline+fully_shard", f"{what}: {run['given']}"
        support.assert_params_close(run["reloaded"], ref_params, what=f"{what} (reloaded)")


def test_auto_pipeline_matches_one_process(jobs):
    ref_losses, ref_params = _reference("blocks")
    for rank, run in enumerate(_ok(_results(jobs, 2), "auto")):
        what = f"rank {rank} pipeline='auto'"
        assert run["plan"][0] == 2 and run["dp"] == (0, 1), f"{what}: {run['plan']} {run['dp']} {run['notes']}"
        assert any(note.endswith("chose the pipelined plan") for note in run["notes"]), run["notes"]
        support.assert_losses_close(run["losses"], ref_losses, what=what)
        support.assert_params_close(run["params"], ref_params, what=what)


def test_auto_keeps_the_faster_intra_op_plan(jobs):
    _, ref_params = _reference("blocks")
    for rank, run in enumerate(_ok(_results(jobs, 2), "auto_intra")):
        assert run["stages"] == 1 and not run["has_step"], run
        assert run["notes"][-1].endswith("chose the intra-op plan"), run["notes"]
        support.assert_params_close(run["params"], ref_params, what=f"rank {rank} pipeline='auto', intra-op")


def test_model_train_uses_step(jobs):
    runs = _ok(_results(jobs, 2), "trainer")
    ref_losses, ref_params = _reference("gpt")
    for rank, run in enumerate(runs):
        metrics = run["metrics"][0]
        assert metrics["samples"] == support.STEPS * support.GLOBAL_BATCH, metrics
        assert abs(metrics["loss"] - sum(ref_losses) / len(ref_losses)) <= 1e-5 * abs(metrics["loss"]), metrics
        support.assert_params_close(run["params"], ref_params, what=f"rank {rank} Model.train")
        assert run["given"] == (True, 2), f"rank {rank}: a pipelined Plan passed as strategy= is followed"
        support.assert_params_close(run["reloaded"], ref_params, what=f"rank {rank} load_state_dict")
        assert run["checkpoint"][0] == "AutoparError" and "not yet supported" in run["checkpoint"][1], run



@pytest.mark.parametrize("case,words", [
    ("no_loss_fn", "loss_fn"), ("more_stages_than_layers", "4 stages"), ("microbatches", "microbatches=3"),
    ("world", "pipeline=3 must divide the 2 ranks"), ("sharded_stages", "strategy='tensor_parallel'"),
])
def test_bad_inputs_fail_before_any_collective(jobs, case, words):
    for rank, bad in enumerate(_ok(_results(jobs, 2), "bad")):
        status, message = bad[case]
        assert status == "AutoparError" and message.startswith("torch_autopar:") and words in message, \
            f"rank {rank} {case}: {status}: {message}"
