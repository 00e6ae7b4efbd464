"""Sharded plans (fully-sharded, tensor-parallel, 2-D dp × tp, and whatever "auto" picks) on 2 and 4 gloo ranks
equal a one-process run: losses (1e-5 relative) and full parameters after 3 optimizer steps (SGD and AdamW),
MLP, GPT (embedding, causal attention, layer norm, tied head, cross-entropy) and a CNN with batch norm, eager
and graph mode. The collectives that run each step (kind, mesh axis, bytes) are counted and must equal the
plan's list exactly.

Batch norm: a sharded plan computes batch statistics over the global batch (as SyncBatchNorm; DTensor runs
the op on the whole batch), so it equals one process; data parallelism computes them per rank, as
DistributedDataParallel does, and is checked against DDP (``test_data_parallel.py`` and below).

One spawned job per (world, mesh) runs every default case (the 4-rank cases behind ``-m slow`` in jobs of their
own); each case plans, compiles and trains its own module.
"""

from __future__ import annotations

import functools

import pytest
import torch

import torch_autopar as autopar
from torch_autopar.runtime.comm_count import planned_summary
from torch_autopar.testing import run_on_ranks
from tests import support

MODELS = ("mlp", "gpt", "cnn")
MODES = ("eager", "graph")
OPTIMIZER_OF = {"mlp": "adamw", "gpt": "adamw", "cnn": "sgd", "uneven": "adamw"}
LAYOUTS = {
    # (world, mesh): strategies
    (2, (2,)): ("fully_shard", "tensor_parallel", "auto", "data_parallel", "megatron"),
    (4, (4,)): ("fully_shard", "tensor_parallel"),
    (4, (2, 2)): ("megatron", "fsdp_tp"),
}
""""megatron" is a hand-written Plan (column- then row-parallel linear layers on
tp, replicated on dp), passed to compile as ``strategy=``: the search's own "tensor_parallel" rightly keeps
these small models replicated on tp, which would not exercise 2-D execution."""
SGD_CASES = {(2, (2,), "gpt", "tensor_parallel"), (2, (2,), "mlp", "fully_shard"), (4, (2, 2), "mlp", "fsdp_tp")}
"""Cases also run with SGD + momentum (the rest use the model's optimizer above)."""
DEFAULT_4_RANKS = {
    (4,): {("uneven", "fully_shard", "eager", "adamw"), ("uneven", "tensor_parallel", "graph", "adamw"),
           ("mlp", "fully_shard", "graph", "adamw"), ("gpt", "tensor_parallel", "graph", "adamw"),
           ("cnn", "tensor_parallel", "eager", "sgd")},
    (2, 2): {("mlp", "megatron", "eager", "adamw"), ("gpt", "megatron", "eager", "adamw"),
             ("mlp", "fsdp_tp", "graph", "adamw"), ("mlp", "fsdp_tp", "eager", "sgd"), ("cnn", "fsdp_tp", "eager", "sgd")},
}
"""The 4-rank cases of the default suite (each layout, both modes among them; the uneven shards); the others run
with ``-m slow``, in jobs of their own."""


def _cases(world, mesh):
    cases = []
    for strategy in LAYOUTS[(world, mesh)]:
        for model_name in MODELS:
            for mode in MODES:
                if strategy == "data_parallel" and model_name != "cnn" or strategy == "megatron" and model_name == "cnn":
                    continue  # data parallelism on MLP/GPT is test_data_parallel.py's
                if world == 4 and mode == "graph" and model_name == "gpt" and strategy != "tensor_parallel":
                    continue  # keeps the 4-rank job within its time; GPT graph mode runs on 2x2 dp x tp
                cases.append((model_name, strategy, mode, OPTIMIZER_OF[model_name]))
                if (world, mesh, model_name, strategy) in SGD_CASES and mode == "eager":
                    cases.append((model_name, strategy, mode, "sgd"))
    if world == 4 and mesh == (4,):
        cases += [("uneven", "fully_shard", "eager", "adamw"), ("uneven", "tensor_parallel", "graph", "adamw")]
    return cases


def _run_case(rank, world, mesh, model_name, strategy, mode, optimizer_name):
    torch._dynamo.reset()
    model = support.build_model(model_name)
    x, _ = support.global_batch(model_name, 0)
    if strategy == "megatron":
        strategy = support.megatron_plan(model, x, mesh)
    pmodel = autopar.compile(model, x.chunk(world)[rank], strategy=strategy, mesh=mesh, mode=mode)
    optimizer = support.make_optimizer(optimizer_name, pmodel.parameters())
    losses, counts = [], []
    for step in range(support.STEPS):
        x, y = support.global_batch(model_name, step)
        loss, counted = support.counted_step(pmodel, model_name, optimizer, x.chunk(world)[rank], y.chunk(world)[rank],
                                             mode)
        losses.append(loss)
        counts.append(dict(counted))
    state = pmodel.state_dict()
    params = {name: state[name].clone() for name, _ in model.named_parameters()}
    buffers = {name: state[name].clone() for name, _ in model.named_buffers()}
    return {"losses": losses, "params": params, "buffers": buffers, "counted": counts,
            "planned": dict(planned_summary(pmodel.plan)), "sharded": pmodel.mesh is not None,
            "placements": pmodel.plan.param_placements, "chosen": pmodel.plan.search_stats.get("candidate")}


def _ddp_cnn(rank, world):
    """The batch-norm reference for data parallelism: DistributedDataParallel on the same ranks and data."""
    model = torch.nn.parallel.DistributedDataParallel(support.build_model("cnn"))
    optimizer = support.make_optimizer("sgd", model.parameters())
    losses = support.train_steps(model, "cnn", optimizer, rank, world)
    return {"losses": losses, "params": support.params_of(model.module),
            "buffers": {n: b.clone() for n, b in model.module.named_buffers()}}


def _slow(world, mesh, case) -> bool:
    return world == 4 and case not in DEFAULT_4_RANKS[mesh]


def _job(rank, world, mesh, slow):
    results = {case: support.outcome(_run_case, rank, world, mesh, *case) for case in _cases(world, mesh)
               if _slow(world, mesh, case) == slow}
    if mesh == (2,):
        results["ddp_cnn"] = support.outcome(_ddp_cnn, rank, world)
    return results


@pytest.fixture(scope="module")
def jobs():
    return {}


def _results(jobs, world, mesh, slow):
    if (world, mesh, slow) not in jobs:
        # spawned, not forked: each rank plans with a hash seed of its own, as under torchrun, so plans that
        # depended on set or dict order would differ between ranks here and fail
        jobs[(world, mesh, slow)] = run_on_ranks(_job, world, mesh, slow, timeout_s=900, start_method="spawn")
    return jobs[(world, mesh, slow)]


@functools.cache
def _reference(model_name, optimizer_name):
    model = support.build_model(model_name)
    losses = support.train_steps(model, model_name, support.make_optimizer(optimizer_name, model.parameters()))
    return losses, support.params_of(model), {n: b.clone() for n, b in model.named_buffers()}


ALL_CASES = [pytest.param((world, mesh, case), marks=[pytest.mark.slow] if _slow(world, mesh, case) else [])
             for (world, mesh) in LAYOUTS for case in _cases(world, mesh)]


def _id(item):
    world, mesh, case = item
    return f"{'x'.join(map(str, mesh))}-" + "-".join(case)


@pytest.mark.parametrize("item", ALL_CASES, ids=_id)
def test_matches_one_process_and_counts_match_plan(jobs, item):
    world, mesh, case = item
    model_name, strategy, mode, optimizer_name = case
    results = _results(jobs, world, mesh, _slow(world, mesh, case))
    outcomes = [r[case] for r in results]
    for rank, (status, value) in enumerate(outcomes):
        assert status == "ok", f"rank {rank} {case} on mesh {mesh}: {status}: {value}"
    runs = [value for _, value in outcomes]
    what = f"{case} on mesh {mesh} (plan: {runs[0]['chosen']}, {runs[0]['placements']})"
    if model_name == "cnn" and strategy == "auto":
        assert not runs[0]["sharded"], f"{what}: auto must keep DDP's per-rank batch statistics"
    if model_name == "cnn" and not runs[0]["sharded"]:  # per-rank batch statistics: DDP, rank by rank
        for rank, (run, result) in enumerate(zip(runs, results)):
            status, ddp = result["ddp_cnn"]
            assert status == "ok", ddp
            support.assert_losses_close(run["losses"], ddp["losses"], what=f"rank {rank} {what} vs DDP")
            support.assert_params_close(run["params"], ddp["params"], what=f"rank {rank} {what} vs DDP")
            support.assert_params_close(run["buffers"], ddp["buffers"], what=f"rank {rank} buffers {what} vs DDP")
        return
    else:
        ref_losses, ref_params, ref_buffers = _reference(model_name, optimizer_name)
        mean_losses = [sum(run["losses"][s] for run in runs) / world for s in range(support.STEPS)]
    support.assert_losses_close(mean_losses, ref_losses, what=what)
    for rank, run in enumerate(runs):
        support.assert_params_close(run["params"], ref_params, what=f"rank {rank} {what}")
        support.assert_params_close(run["buffers"], ref_buffers, what=f"rank {rank} buffers {what}")
    if strategy not in ("data_parallel", "auto"):
        assert runs[0]["sharded"], f"{what}: a {strategy} plan should shard something"
    if runs[0]["sharded"]:
        uneven = model_name == "uneven" or model_name == "cnn" and world == 4  # 10 classes on 4 ranks
        for rank, run in enumerate(runs):
            for step, counted in enumerate(run["counted"]):
                message = (f"rank {rank} step {step} {what}: collectives run {sorted(counted.items())} vs planned "
                           f"{sorted(run['planned'].items())}")
                if uneven:
                    _assert_equal_up_to_padding(counted, run["planned"], world, message)
                else:
                    assert counted == run["planned"], message


def _by_kind_axis(counts: dict) -> dict:
    grouped: dict = {}
    for (kind, axis, nbytes), count in counts.items():
        grouped.setdefault((kind, axis), []).extend([nbytes] * count)
    return {key: sorted(sizes) for key, sizes in grouped.items()}


def _assert_equal_up_to_padding(counted: dict, planned: dict, world: int, message: str) -> None:
    """Uneven shards: DTensor pads the short chunks before a collective, so a collective may move up to
    ``world - 1`` extra rows; the same collectives must run, each at least as large as planned."""
    ran, plan = _by_kind_axis(counted), _by_kind_axis(planned)
    assert ran.keys() == plan.keys(), message
    for key in plan:
        assert len(ran[key]) == len(plan[key]), message
        for actual, expected in zip(ran[key], plan[key]):
            assert expected <= actual <= expected * 2, message
