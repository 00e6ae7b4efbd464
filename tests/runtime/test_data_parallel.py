"""Data parallel on 2 and 4 gloo ranks equals a one-process run: losses and parameters after 3 optimizer steps,
SGD and AdamW, MLP and GPT, eager and graph mode (ARCHITECTURE.md: gradients equal DDP's, i.e. the average
over ranks of each slice's gradient, which for equal slices and a mean loss is the global batch's gradient).

One spawned job per world size runs every case; the tests below check its results case by case. To keep the job
short, each model is planned and graph-compiled once: its cases run one after another on the same compiled
module, reset with ``load_state_dict``, the mode switched by ``autopar.mode(...)`` (MLP) or ``autopar.set_mode``
(GPT). ``compile(..., mode=...)`` is what the full-batch and batch-norm cases (2 ranks) use.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter

import pytest
import torch

import torch_autopar as autopar
from torch_autopar.runtime.comm_count import CollectiveCounter
from torch_autopar.testing import run_on_ranks
from tests import support

MODELS = ("mlp", "gpt")
OPTIMIZERS = ("sgd", "adamw")
MODES = ("eager", "graph")
CASES = [(m, o, mode) for m in MODELS for o in OPTIMIZERS for mode in MODES]
BUFFER_STEPS = 3
GPT_BUCKET_CAP = 64 * 1024
"""Small enough that the GPT's gradients are synchronised in several buckets (the MLP's fit in one)."""


def _train_model(rank, world, model_name):
    """Every (optimizer, mode) case of one model with one compiled module (one plan, one graph compile):
    before each case the parameters are reset to the seeded initial ones with ``load_state_dict``."""
    model = support.build_model(model_name)
    initial = support.build_model(model_name).state_dict()
    cap = {"bucket_cap_bytes": GPT_BUCKET_CAP} if model_name == "gpt" else {}
    pmodel = autopar.compile(model, strategy="data_parallel", **cap)
    results = {}
    for optimizer_name in OPTIMIZERS:
        for mode in MODES:
            pmodel.load_state_dict(initial)
            optimizer = support.make_optimizer(optimizer_name, pmodel.parameters())
            if model_name == "gpt":  # the global default mode
                autopar.set_mode(mode)
                losses = support.train_steps(pmodel, model_name, optimizer, rank, world)
            else:  # the mode switched for a block
                with autopar.mode(mode):
                    losses = support.train_steps(pmodel, model_name, optimizer, rank, world)
            results[(model_name, optimizer_name, mode)] = {
                "losses": losses, "params": support.params_of(model), "strategy": pmodel.plan.strategy,
                "buckets": len(pmodel.plan.grad_buckets), "stats": dict(pmodel.stats),
                "global_batch": pmodel.plan.global_batch}
    autopar.set_mode("eager")
    return results


def _full_batch_case(rank, world, mode):
    """full_batch=True: every rank passes the whole global batch and gets the whole output back."""
    model = support.build_model("mlp")
    pmodel = autopar.compile(model, strategy="data_parallel", full_batch=True, mode=mode)
    x, y = support.global_batch("mlp", 0)
    support.loss_fn("mlp", pmodel(x), y).backward()  # plans and sets up (collectives of its own)
    pmodel.zero_grad(set_to_none=True)
    # a dispatch mode cannot run inside torch.compile: graph mode's collectives are not counted
    with CollectiveCounter(None) if mode == "eager" else contextlib.nullcontext() as counter:
        output = pmodel(x)
        support.loss_fn("mlp", output, y).backward()
    return {"output": output.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "counted": Counter((r.kind, r.nbytes) for r in counter.records) if counter else None,
            "planned": Counter({(c.kind, c.nbytes): c.count for c in pmodel.plan.collectives})}


def _buffers_case(rank, world, mode):
    """Batch norm: buffers are broadcast from rank 0 before each forward (as DDP does), then updated locally."""
    torch.manual_seed(0)
    model = support.BatchNormNet()
    pmodel = autopar.compile(model, strategy="data_parallel", mode=mode)
    optimizer = torch.optim.SGD(pmodel.parameters(), lr=0.1)
    buffers = []
    for step in range(BUFFER_STEPS):
        x, y = support.batch_norm_batch(step)
        loss = support.loss_fn("mlp", pmodel(x.chunk(world)[rank]), y.chunk(world)[rank])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        buffers.append({name: b.clone() for name, b in model.named_buffers()})
    return {"buffers": buffers, "params": support.params_of(model)}


def _default_strategy_case(rank, world):
    """``compile(model)`` with the default strategy ("auto"): one backward's gradients and the plan's strategy."""
    model = support.build_model("mlp")
    pmodel = autopar.compile(model)
    x, y = support.global_batch("mlp", 0)
    support.loss_fn("mlp", pmodel(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    return {"grads": {n: support.full(p.grad).clone() for n, p in model.named_parameters()}, "strategy": pmodel.plan.strategy}


class _TwiceCheckpointed(torch.nn.Module):
    """One linear layer applied in two reentrant checkpointed segments: its parameters' post-accumulate-grad
    hooks run once per segment's backward."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = checkpoint(self.layer, x, use_reentrant=True)
        return checkpoint(self.layer, x, use_reentrant=True)


def _reentrant_case(rank, world):
    """A gradient accumulated again after its bucket was sent: a clear error, not a silently dropped part."""
    torch.manual_seed(0)
    pmodel = autopar.compile(_TwiceCheckpointed(), strategy="data_parallel")
    x = torch.randn(4, 8, requires_grad=True)
    try:
        pmodel(x).sum().backward()
    except autopar.AutoparError as error:
        return str(error)
    return None


def _dispatch_mode_case(rank, world):
    """Graph mode under a dispatch mode (FlopCounterMode), which makes dynamo run the forward's Python: one
    backward's gradients."""
    from torch.utils.flop_counter import FlopCounterMode

    model = support.build_model("mlp")
    pmodel = autopar.compile(model, strategy="data_parallel", mode="graph")
    x, y = support.global_batch("mlp", 0)
    with FlopCounterMode(display=False):
        support.loss_fn("mlp", pmodel(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _sharded_dispatch_mode_case(rank, world):
    """A sharded plan in graph mode under FlopCounterMode: the first call, which captures the program, is refused
    with the cause; after one call outside it, a step under it gives one backward's gradients."""
    from torch.utils.flop_counter import FlopCounterMode

    model = support.build_model("mlp")
    pmodel = autopar.compile(model, strategy="fully_shard", mode="graph")
    x, y = (t.chunk(world)[rank] for t in support.global_batch("mlp", 0))
    with FlopCounterMode(display=False):
        try:
            pmodel(x)
            refused = None
        except autopar.AutoparError as error:
            refused = str(error)
    support.loss_fn("mlp", pmodel(x), y).backward()
    pmodel.zero_grad()
    with FlopCounterMode(display=False) as counter:
        support.loss_fn("mlp", pmodel(x), y).backward()
    return {"refused": refused, "flops": counter.get_total_flops(),
            "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()}}


def _data_parallel_job(rank, world, extras):
    launched = {"init": autopar.init(), "rank": autopar.get_rank(), "world": autopar.get_world_size()}
    result = {"launched": launched,
              "cases": {key: value for name in MODELS for key, value in _train_model(rank, world, name).items()}}
    if extras:  # checked on 2 ranks only, to keep the 4-rank job short
        result["full_batch"] = {mode: _full_batch_case(rank, world, mode) for mode in MODES}
        result["default_strategy"] = _default_strategy_case(rank, world)
        result["buffers"] = {mode: _buffers_case(rank, world, mode) for mode in MODES}
        result["reentrant"] = _reentrant_case(rank, world)
        result["dispatch_mode"] = _dispatch_mode_case(rank, world)
        result["sharded_dispatch_mode"] = _sharded_dispatch_mode_case(rank, world)
    return result


@pytest.fixture(scope="module")
def job2():
    return 2, run_on_ranks(_data_parallel_job, 2, True, timeout_s=300)


@pytest.fixture(scope="module")
def job4():
    return 4, run_on_ranks(_data_parallel_job, 4, False, timeout_s=400)


@pytest.fixture(params=[2, 4], ids=lambda w: f"{w}ranks")
def job(request):
    return request.getfixturevalue(f"job{request.param}")


@functools.cache
def reference(model_name, optimizer_name):
    return support.reference_run(model_name, optimizer_name)


def test_init_inside_a_job_reports_rank_and_world(job):
    world, results = job
    assert [r["launched"] for r in results] == [{"init": True, "rank": r, "world": world} for r in range(world)]


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_matches_one_process_run(job, case):
    world, results = job
    ref_losses, ref_params = reference(*case[:2])
    mean_losses = [sum(r["cases"][case]["losses"][s] for r in results) / world for s in range(support.STEPS)]
    support.assert_losses_close(mean_losses, ref_losses, what=f"{case} on {world} ranks")
    for rank, result in enumerate(results):
        support.assert_params_close(result["cases"][case]["params"], ref_params, what=f"{case} rank {rank}/{world}")
        assert result["cases"][case]["strategy"] == "data_parallel"
        assert result["cases"][case]["global_batch"] == support.GLOBAL_BATCH  # planned for the global batch


@pytest.mark.parametrize("case", [c for c in CASES if c[2] == "graph"], ids="-".join)
def test_graph_mode_inserts_one_all_reduce_per_bucket(job, case):
    world, results = job
    for result in results:
        entry = result["cases"][case]
        assert entry["stats"]["all_reduces_per_backward"] == entry["buckets"]
        expected_bytes = sum(p.numel() * p.element_size() for p in entry["params"].values())
        assert entry["stats"]["synced_bytes_per_backward"] == expected_bytes
    if case[0] == "gpt":
        assert results[0]["cases"][case]["buckets"] > 1


@pytest.mark.parametrize("model_optimizer", [(m, o) for m in MODELS for o in OPTIMIZERS], ids="-".join)
def test_eager_and_graph_losses_agree(job, model_optimizer):
    world, results = job
    for rank, result in enumerate(results):
        eager = result["cases"][(*model_optimizer, "eager")]["losses"]
        graph = result["cases"][(*model_optimizer, "graph")]["losses"]
        support.assert_losses_close(graph, eager, what=f"graph vs eager {model_optimizer} rank {rank}/{world}")


@pytest.mark.parametrize("mode", MODES)
def test_full_batch_returns_whole_output_and_global_gradients(job2, mode):
    world, results = job2
    model = support.build_model("mlp")
    x, y = support.global_batch("mlp", 0)
    output = model(x)
    support.loss_fn("mlp", output, y).backward()
    for rank, result in enumerate(results):
        entry = result["full_batch"][mode]
        torch.testing.assert_close(entry["output"], output.detach(), rtol=1e-5, atol=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(entry["grads"][name], p.grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{mode} rank {rank}/{world} grad of {name}: {m}")


def test_full_batch_moves_what_the_plan_says(job2):
    """Eager mode: the 32-byte check that every rank passed the same batch, the output gathered whole in forward
    (nothing moves back in backward) and the gradients' all-reduce, which carries the local batch size (8 bytes
    more than planned)."""
    world, results = job2
    for rank, result in enumerate(results):
        entry = result["full_batch"]["eager"]
        counted, planned = entry["counted"], entry["planned"]
        assert sorted(kind for kind, _ in counted.elements()) == sorted(kind for kind, _ in planned.elements()), \
            f"rank {rank}: counted {dict(counted)}, planned {dict(planned)}"
        assert 0 <= sum(n for _, n in counted.elements()) - sum(n for _, n in planned.elements()) <= 8, \
            f"rank {rank}: counted {dict(counted)}, planned {dict(planned)}"
        assert sum(1 for kind, _ in counted.elements() if kind == "all_gather") == 1, dict(counted)


def test_a_gradient_accumulated_after_its_bucket_was_sent_is_an_error(job2):
    world, results = job2
    for rank, result in enumerate(results):
        assert result["reentrant"] is not None and result["reentrant"].startswith(
            "torch_autopar: a parameter's gradient was accumulated again after"), \
            f"rank {rank}: {result['reentrant']}"


@functools.cache
def _one_process_grads() -> dict:
    """The MLP's gradients of one backward on the whole first batch, in one process."""
    model = support.build_model("mlp")
    x, y = support.global_batch("mlp", 0)
    support.loss_fn("mlp", model(x), y).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _assert_one_process_grads(grads: dict, what: str) -> None:
    for name, grad in _one_process_grads().items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{what} grad of {name}: {m}")


def test_graph_mode_under_a_dispatch_mode_still_averages_gradients(job2):
    """A FLOP counter around a graph-mode step: dynamo runs the Python, eager mode's reducer averages."""
    world, results = job2
    for rank, result in enumerate(results):
        _assert_one_process_grads(result["dispatch_mode"], f"rank {rank}/{world}")


def test_sharded_graph_mode_under_a_dispatch_mode_names_the_cause_then_runs_its_program(job2):
    world, results = job2
    for rank, result in enumerate(results):
        case = result["sharded_dispatch_mode"]
        assert case["refused"] is not None, f"rank {rank}"
        assert case["refused"].startswith("torch_autopar: could not capture MLP.forward under the dispatch mode")
        assert "make those calls outside the mode" in case["refused"] and "module_tracker" in case["refused"]
        assert case["flops"] > 0
        _assert_one_process_grads(case["grads"], f"rank {rank}/{world}")


def test_default_strategy_averages_gradients_over_ranks(job2):
    world, results = job2
    for rank, result in enumerate(results):
        entry = result["default_strategy"]
        _assert_one_process_grads(entry["grads"], f"rank {rank}/{world} ({entry['strategy']})")


def _simulate_ddp_with_buffers(world):
    """DDP by hand in one process: replicas with equal parameters; before each forward every replica takes
    rank 0's buffers; each computes its slice (batch norm with its local batch statistics); gradients averaged."""
    replicas = []
    for _ in range(world):
        torch.manual_seed(0)
        replicas.append(support.BatchNormNet())
    optimizers = [torch.optim.SGD(r.parameters(), lr=0.1) for r in replicas]
    history = []
    for step in range(BUFFER_STEPS):
        x, y = support.batch_norm_batch(step)
        with torch.no_grad():
            for replica in replicas[1:]:
                for mine, first in zip(replica.buffers(), replicas[0].buffers()):
                    mine.copy_(first)
        for rank, replica in enumerate(replicas):
            replica.zero_grad()
            support.loss_fn("mlp", replica(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        for params in zip(*(r.parameters() for r in replicas)):
            mean = sum(p.grad for p in params) / world
            for p in params:
                p.grad = mean.clone()
        for optimizer in optimizers:
            optimizer.step()
        history.append([{name: b.clone() for name, b in r.named_buffers()} for r in replicas])
    return history, support.params_of(replicas[0])


@pytest.mark.parametrize("mode", MODES)
def test_buffers_broadcast_from_rank_0_before_each_forward(job2, mode):
    world, results = job2
    history, params = _simulate_ddp_with_buffers(world)
    for rank, result in enumerate(results):
        entry = result["buffers"][mode]
        support.assert_params_close(entry["params"], params, what=f"{mode} rank {rank}")
        for step in range(BUFFER_STEPS):
            for name, expected in history[step][rank].items():
                torch.testing.assert_close(entry["buffers"][step][name], expected, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{mode} rank {rank} step {step} {name}: {m}")
    # the ranks' statistics really differ after a step (each uses its own slice), so the check above has teeth
    assert not torch.allclose(results[0]["buffers"][mode]["buffers"][0]["bn.running_mean"],
                              results[1]["buffers"][mode]["buffers"][0]["bn.running_mean"])
