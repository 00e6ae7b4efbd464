"""Eager fully-sharded plans whose ops move nothing but parameters compute on plain local tensors, as FSDP2 does
(``Plan.local_compute``): no DTensor dispatch per op, the same numbers.

On 2 gloo ranks: the fully_shard plans of a GPT and an MLP whose activations outweigh their parameters (the
search keeps the batch split, as FSDP does; on the suite's tiny models it gathers a small activation instead of
reduce-scattering larger gradients) are marked local, run every layer's forward on plain tensors (seen by a
forward pre-hook), equal one process over 3 AdamW steps (losses 1e-5 relative, parameters rtol 1e-4 / atol
1e-5), move exactly the plan's collectives, and their estimates leave out DTensor's dispatch. Plans that move
activations (tensor_parallel), take whole batches, or draw random numbers (dropout: DTensor draws a shard's
numbers as one process would, a local op would not) are not local and keep DTensor. A parameter's local view
that meets a DTensor gets the gradient DTensor placed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication

import torch_autopar as autopar
from torch_autopar.rewrite import placement
from torch_autopar.runtime.comm_count import planned_summary
from torch_autopar.testing import run_on_ranks
from torch_autopar.testing.models import GPT, MLP, GPTConfig
from tests import support

WORLD = 2
MODELS = ("gpt", "mlp")
BATCH = {"gpt": 32, "mlp": 512}
SEQUENCE = 64


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=SEQUENCE)) if name == "gpt" else MLP()


def _batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global (inputs, targets) of ``step``: the same on every rank."""
    generator = torch.Generator().manual_seed(2000 + step)
    if name == "gpt":
        tokens = torch.randint(0, 96, (BATCH[name], SEQUENCE + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(BATCH[name], 32, generator=generator), torch.randn(BATCH[name], 8, generator=generator)


def _one_process(name: str) -> tuple[list[float], dict]:
    model = _model(name)
    optimizer = support.make_optimizer("adamw", model.parameters())
    losses = []
    for step in range(support.STEPS):
        x, y = _batch(name, step)
        optimizer.zero_grad(set_to_none=True)
        loss = support.loss_fn(name, model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, support.params_of(model)


def _local_run(rank: int, world: int, name: str) -> dict:
    model = _model(name)
    x, _ = _batch(name, 0)
    pmodel = autopar.compile(model, x.chunk(world)[rank], strategy="fully_shard", mode="eager")
    seen = []
    first = next(m for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding)))
    first.register_forward_pre_hook(lambda _, args: seen.append(type(args[0]).__name__))
    optimizer = support.make_optimizer("adamw", pmodel.parameters())
    losses, counted = [], []
    for step in range(support.STEPS):
        x, y = _batch(name, step)
        loss, counts = support.counted_step(pmodel, name, optimizer, x.chunk(world)[rank], y.chunk(world)[rank],
                                            "eager")
        losses.append(loss)
        counted.append(dict(counts))
    state = pmodel.state_dict()
    return {"losses": losses, "params": {n: state[n].clone() for n, _ in model.named_parameters()},
            "local": pmodel.plan.local_compute, "seen": sorted(set(seen)), "counted": counted,
            "planned": dict(planned_summary(pmodel.plan)),
            "dispatch_priced": "dtensor_dispatch_s" in pmodel.plan.search_stats}


class _Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        for layer in self.layers:
            x = self.drop(torch.relu(layer(x)))
        return x


def _not_local(rank: int, world: int) -> dict:
    gpt, tokens = support.build_model("gpt"), support.global_batch("gpt", 0)[0]
    cases = {
        "tensor_parallel": autopar.compile(gpt, tokens.chunk(world)[rank], strategy="tensor_parallel", mode="eager"),
        "full_batch": autopar.compile(support.build_model("gpt"), tokens, strategy="fully_shard", mode="eager",
                                      full_batch=True),
        "dropout": autopar.compile(_Dropped(), torch.randn(8, 16).chunk(world)[rank], strategy="fully_shard",
                                   mode="eager"),
    }
    return {name: (pmodel.plan.local_compute, "dtensor_dispatch_s" in pmodel.plan.search_stats)
            for name, pmodel in cases.items()}


def _meets_a_dtensor(rank: int, world: int) -> list[float]:
    """A parameter's local view used with a batch-split DTensor (DTensor replicates the plain tensor): its
    gradient comes back as DTensor placed it; returned whole, next to the one-process gradient."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    weight, x = torch.randn(4, 3), torch.randn(8, 4)
    param = distribute_tensor(weight, mesh, [Replicate()]).requires_grad_()
    with implicit_replication():
        (distribute_tensor(x, mesh, [Shard(0)]) @ placement.local_view(param)).sum().backward()
    return [param.grad.full_tensor().tolist(), (x.T @ torch.ones(8, 3)).tolist()]


def _job(rank: int, world: int) -> dict:
    runs = {name: support.outcome(_local_run, rank, world, name) for name in MODELS}
    runs["not local"] = support.outcome(_not_local, rank, world)
    runs["meets a dtensor"] = support.outcome(_meets_a_dtensor, rank, world)
    return runs


@pytest.fixture(scope="module")
def runs():
    return support.by_case(run_on_ranks(_job, WORLD, timeout_s=600))


@pytest.mark.parametrize("name", MODELS)
def test_fully_shard_computes_locally_and_equals_one_process(runs, name):
    what = f"fully_shard {name}, eager, local compute"
    first = support.assert_ranks_equal_one_process(runs[name], _one_process(name), what)
    assert first["local"] and not first["dispatch_priced"], what
    assert first["seen"] == ["Tensor"], f"{what}: the first layer saw {first['seen']}"
    for rank, (_, run) in enumerate(runs[name]):
        for step, counted in enumerate(run["counted"]):
            assert counted == run["planned"], f"rank {rank} step {step} {what}: ran {sorted(counted.items())}"


def test_plans_that_move_activations_take_whole_batches_or_draw_random_numbers_keep_dtensor(runs):
    for rank, (status, cases) in enumerate(runs["not local"]):
        assert status == "ok", f"rank {rank}: {status}: {cases}"
        assert cases == {name: (False, True) for name in ("tensor_parallel", "full_batch", "dropout")}, cases


def test_a_local_view_met_by_a_dtensor_takes_the_gradient_dtensor_placed(runs):
    for rank, (status, (grad, expected)) in enumerate(runs["meets a dtensor"]):
        assert status == "ok", f"rank {rank}: {status}"
        torch.testing.assert_close(torch.tensor(grad), torch.tensor(expected))
