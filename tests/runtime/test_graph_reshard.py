"""Graph mode's ``reshard_after_forward`` (``rewrite.reshard``, ``strategies.param_gathers``): on 2 gloo ranks a
fully_shard plan that gathers the BlockMLP's weights (a batch large enough that the search gathers weights, not
activations) runs 3 AdamW steps equal to one process with and without resharding; the collectives counted each
step equal the plan's list; resharding runs one more all_gather (in backward) per group of parameters
(``rewrite.gather_buckets``: a block, the root) that backward reads, and its measured peak (``testing.memory``, the least of steps 2-3) is lower than keeping the gathered weights.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import torch_autopar as autopar
from torch_autopar.runtime.comm_count import planned_summary
from torch_autopar.testing import run_on_ranks
from torch_autopar.testing.memory import step_peak_bytes
from torch_autopar.testing.models import BlockMLP
from tests import support

pytestmark = pytest.mark.timeout(900)

WORLD, STEPS, BATCH, BLOCKS = 2, 3, 256, 4
EPS = 1e-6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return BlockMLP(n_blocks=BLOCKS)


def _batch(step: int):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 128, generator=generator), torch.randn(BATCH, 8, generator=generator)


def _train(module, rank: int = 0, world: int = 1, count=None):
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.1, eps=EPS)
    losses, peaks, counted = [], [], []
    for step in range(STEPS):
        x, y = (t.chunk(world)[rank] for t in _batch(step))
        optimizer.zero_grad(set_to_none=True)
        if count is not None and step == 0:  # compiles and counts; peaks from the steps after
            loss, ran = count(module, optimizer, x, y)
            losses.append(loss)
            counted.append(ran)
            continue

        def one_step():
            loss = F.mse_loss(module(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())

        peaks.append(step_peak_bytes(one_step, module, optimizer))
    return losses, peaks, counted


def _job(rank: int, world: int) -> dict:
    results = {}
    for reshard in (True, False):
        torch._dynamo.reset()
        model = _model()
        x = _batch(0)[0].chunk(world)[rank]
        pmodel = autopar.compile(model, x, strategy="fully_shard", mode="graph", hardware="cpu-gloo",
                                 reshard_after_forward=reshard)

        def count(module, optimizer, x, y):
            return support.counted_step(module, "mlp", optimizer, x, y, "graph")

        losses, peaks, counted = _train(pmodel, rank, world, count)  # "mlp": support's loss is mse
        x, y = (t.chunk(world)[rank] for t in _batch(0))
        counted.append(support.counted_step(pmodel, "mlp", torch.optim.SGD(pmodel.parameters(), lr=0.0), x, y,
                                            "graph")[1])
        state = pmodel.state_dict()
        results[reshard] = {"losses": losses, "peak": min(peaks), "predicted": pmodel.plan.peak_memory,
                            "counted": [dict(c) for c in counted], "planned": dict(planned_summary(pmodel.plan)),
                            "params": {n: state[n].clone() for n, _ in model.named_parameters()}}
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_job, WORLD, timeout_s=600)


def _one_process():
    model = _model()
    losses, _, _ = _train(model)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("reshard", (True, False), ids=("reshard", "keep_gathered"))
def test_adamw_steps_equal_one_process(ranks, reshard):
    ref_losses, ref_params = _one_process()
    mean = [sum(r[reshard]["losses"][s] for r in ranks) / WORLD for s in range(STEPS)]
    for step, (loss, ref) in enumerate(zip(mean, ref_losses)):
        assert abs(loss - ref) <= 1e-5 * abs(ref), f"reshard={reshard} step {step}: {loss} vs {ref}"
    for rank, r in enumerate(ranks):
        for name, value in r[reshard]["params"].items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"reshard={reshard} rank {rank} {name}: {m}")


@pytest.mark.parametrize("reshard", (True, False), ids=("reshard", "keep_gathered"))
def test_collectives_counted_equal_the_plan(ranks, reshard):
    for rank, r in enumerate(ranks):
        for step, counted in enumerate(r[reshard]["counted"]):
            assert counted == r[reshard]["planned"], \
                f"reshard={reshard} rank {rank} step {step}: ran {sorted(counted.items())}, " \
                f"planned {sorted(r[reshard]['planned'].items())}"


def test_resharding_gathers_each_weight_backward_reads_once_more(ranks):
    gathers = lambda planned: Counter({k: n for k, n in planned.items() if k[0] == "all_gather"})  # noqa: E731
    for rank, r in enumerate(ranks):
        extra = gathers(r[True]["planned"]) - gathers(r[False]["planned"])
        # each block's group, whose weights backward reads (the first block's second), and the root's (the head's
        # weight), each gathered whole again: the very gather of its forward
        assert sum(extra.values()) == BLOCKS + 1, f"rank {rank}: {sorted(extra.items())}"
        assert not extra - gathers(r[False]["planned"]), f"rank {rank}: {sorted(extra.items())}"
        assert not gathers(r[False]["planned"]) - gathers(r[True]["planned"]), f"rank {rank}"


def test_resharding_lowers_the_measured_peak(ranks):
    for rank, r in enumerate(ranks):
        what = (f"rank {rank}: reshard {r[True]['peak']:,} B (planned {r[True]['predicted']:,}), keep gathered "
                f"{r[False]['peak']:,} B (planned {r[False]['predicted']:,})")
        print(what)
        assert r[True]["peak"] < r[False]["peak"], what
