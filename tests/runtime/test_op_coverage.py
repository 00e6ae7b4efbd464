"""No op crashes a sharded run, and graph breaks are not the user's problem, on 2 gloo ranks against one process.

- A LLaMA-style model written by hand with ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` (CPU
  flash attention, whose rules torch_autopar registers) under tensor_parallel and fully_shard, eager and graph.
- An op with no sharding rule anywhere (a custom op registered here) runs replicated under tensor_parallel and
  is listed in ``plan.explain()``.
- A forward with real graph breaks (a ``print`` of a tensor value, a branch on ``.item()``): data parallelism in
  graph mode runs compiled pieces with Python in between and equals one process; a sharded strategy fails
  before any collective with a ``torch_autopar:`` error naming dynamo's reason and the user's line.

Losses 1e-5 relative, full parameters rtol 1e-4 / atol 1e-5, 3 steps. One spawned job runs every case.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_autopar as autopar
from torch_autopar.testing import run_on_ranks
from torch_autopar.testing.models import Llama
from tests import support

STEPS = 3
BATCH = 4


@torch.library.custom_op("autopar_test::scaled_sin", mutates_args=())
def scaled_sin(x: torch.Tensor) -> torch.Tensor:
    """An op DTensor has never heard of (nor has torch_autopar)."""
    return torch.sin(x) * 2


@scaled_sin.register_fake
def _scaled_sin_fake(x):
    return torch.empty_like(x)


def _scaled_sin_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _scaled_sin_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * 2 * torch.cos(x)


scaled_sin.register_autograd(_scaled_sin_backward, setup_context=_scaled_sin_setup)


class CustomOpNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 8)

    def forward(self, x):
        return self.down(scaled_sin(self.up(x)))


class GraphBreakNet(nn.Module):
    """A print of a tensor's value and a Python branch on ``.item()``: dynamo must break the graph twice. The
    branch reads a parameter, so every rank and one process take the same one (a branch on the batch would
    differ between a rank's slice and the whole batch, under DDP as here)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 8)

    def forward(self, x):
        h = self.up(x)
        print("activation mean", h.mean())
        if self.down.weight.sum().item() > 0:
            h = torch.relu(h)
        else:
            h = torch.tanh(h)
        return self.down(h)


def _build(name):
    torch.manual_seed(0)
    return {"llama": Llama, "custom_op": CustomOpNet, "graph_break": GraphBreakNet}[name]()


def _batch(name, step):
    generator = torch.Generator().manual_seed(500 + step)
    if name == "llama":
        tokens = torch.randint(0, 256, (BATCH, 17), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]
    x = torch.randn(BATCH, 32, generator=generator) * (1 if step % 2 == 0 else -1)
    return x, torch.randn(BATCH, 8, generator=generator)


def _loss(name, output, target):
    if name == "llama":
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    return F.mse_loss(output, target)


def _train(model, name, rank=0, world=1):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    losses = []
    for step in range(STEPS):
        x, y = _batch(name, step)
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(name, model(x.chunk(world)[rank]), y.chunk(world)[rank])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _run(rank, world, name, strategy, mode):
    torch._dynamo.reset()
    model = _build(name)
    pmodel = autopar.compile(model, _batch(name, 0)[0].chunk(world)[rank], strategy=strategy, mode=mode)
    losses = _train(pmodel, name, rank, world)
    state = pmodel.state_dict()
    return {"losses": losses, "params": {n: state[n].clone() for n, _ in model.named_parameters()},
            "sharded": pmodel.mesh is not None, "explain": pmodel.plan.explain(),
            "replicated_ops": dict(pmodel.plan.replicated_ops),
            "data_parallel": (pmodel.data_parallel_rank, pmodel.data_parallel_size)}


CASES = [("llama", "tensor_parallel", "eager"), ("llama", "tensor_parallel", "graph"),
         ("llama", "fully_shard", "eager"), ("llama", "fully_shard", "graph"),
         ("custom_op", "tensor_parallel", "eager"), ("custom_op", "tensor_parallel", "graph"),
         ("graph_break", "data_parallel", "graph"), ("graph_break", "fully_shard", "graph")]


def _job(rank, world):
    return {case: support.outcome(_run, rank, world, *case) for case in CASES}


@pytest.fixture(scope="module")
def job():
    return run_on_ranks(_job, 2, timeout_s=900)


@functools.cache
def _reference(name):
    model = _build(name)
    return _train(model, name), support.params_of(model)


def _assert_equal_to_one_process(job, case):
    return support.assert_ranks_equal_one_process([result[case] for result in job], _reference(case[0]), str(case))


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("strategy", ["tensor_parallel", "fully_shard"])
def test_sdpa_llama_equals_one_process(job, strategy, mode):
    run = _assert_equal_to_one_process(job, ("llama", strategy, mode))
    assert run["sharded"]
    assert not any("scaled_dot_product" in op for op in run["replicated_ops"]), run["replicated_ops"]


def test_every_rank_passes_its_own_slice(job):
    """ARCHITECTURE.md: data_parallel_rank / data_parallel_size say which slice a rank passes."""
    for rank, result in enumerate(job):
        for case in (("llama", "tensor_parallel", "eager"), ("graph_break", "data_parallel", "graph")):
            assert result[case][1]["data_parallel"] == (rank, 2), (case, result[case][1]["data_parallel"])


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_op_without_rule_runs_replicated_and_is_reported(job, mode):
    run = _assert_equal_to_one_process(job, ("custom_op", "tensor_parallel", mode))
    assert run["replicated_ops"].get("autopar_test.scaled_sin.default") == 1, run["replicated_ops"]
    assert "autopar_test.scaled_sin.default" in run["explain"]


def test_graph_break_runs_in_pieces_under_data_parallel(job):
    _assert_equal_to_one_process(job, ("graph_break", "data_parallel", "graph"))


def test_graph_break_under_a_sharded_strategy_names_reason_and_line(job):
    for result in job:
        kind, message = result[("graph_break", "fully_shard", "graph")]
        assert kind == "AutoparError", f"expected an AutoparError, got {kind}: {message}"
        assert message.startswith("torch_autopar: could not capture GraphBreakNet.forward"), message
        assert "print" in message and "test_op_coverage.py:" in message, message
