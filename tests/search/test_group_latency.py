"""The latency of a collective made once per parameter group (``strategies.boundary.made_per_group``) is priced
once per group by the search, as the runtime of each mode makes it: graph mode buckets every parameter gather
and gradient reduction; eager mode only its fully-sharded flat groups' (Shard(0) -> Replicate gathers and the
reduce-scatters back), DTensor moving everything else on its own.

On gloo ranks that share two cores every collective costs milliseconds whatever its size (the measured 4-rank
profile: ~9 ms a call), so pricing one latency per gradient made ``fully_shard`` of the bench GPT move activations
and replicate backward (23.70 MiB per step, 1.75x FSDP2's step) to avoid 26 per-gradient reduce-scatters the
runtime never makes; priced per group it gathers weights, as FSDP2 does (19.19 MiB).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import torch_autopar as autopar
from torch_autopar.capture import capture
from torch_autopar.cost import Link, get_profile
from torch_autopar.launch import offline_mesh
from torch_autopar.search import Planner
from torch_autopar.strategies.boundary import made_per_group
from torch_autopar.testing.models import GPT, GPTConfig

S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial()


@pytest.mark.parametrize("kind, source, target", [
    ("all_gather", (S0,), (R,)), ("all_gather", (S1,), (R,)), ("reduce_scatter", (P,), (S0,)),
    ("reduce_scatter", (P,), (S1,)), ("all_reduce", (P,), (R,))])
def test_graph_mode_makes_every_parameter_gather_and_gradient_reduction_per_group(kind, source, target):
    assert made_per_group("graph", kind, 0, source, target)


def test_eager_mode_makes_only_its_flat_groups_collectives_per_group():
    assert made_per_group("eager", "all_gather", 0, (S0,), (R,))
    assert made_per_group("eager", "reduce_scatter", 0, (P,), (S0,))
    assert made_per_group("eager", "all_gather", 0, (S0, S1), (R, S1))  # the other axis unchanged, not dim 0
    assert not made_per_group("eager", "all_gather", 0, (S1,), (R,))  # a row-parallel weight: DTensor's own
    assert not made_per_group("eager", "reduce_scatter", 0, (P,), (S1,))
    assert not made_per_group("eager", "all_reduce", 0, (P,), (R,))  # a replicated parameter's gradient
    assert not made_per_group("eager", "all_gather", 0, (S0, S0), (R, S0))  # dim 0 split on the other axis too


CALL_BOUND = dataclasses.replace(get_profile("cpu-gloo"), name="call-bound",
                                 intra_node=Link(latency_s=0.0, bandwidth=3.1e9, call_s=9.3e-3))
"""The measured 4-rank gloo profile's shape: a 9.3 ms call per collective, 3.1 GB/s."""


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=256))


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_fully_shard_gathers_weights_when_every_collective_costs_a_call(gpt, mode):
    tokens = torch.zeros(16, 64, dtype=torch.long)
    plan = autopar.plan(gpt, tokens, mesh_shape=(4,), hardware=CALL_BOUND, strategy="fully_shard", mode=mode,
                        fold_layers=False)
    params = {name for name, _ in gpt.named_parameters()}
    assert set(plan.param_placements.values()) == {("S(0)",)}
    assert set(plan.param_compute_placements.values()) == {("R",)}  # every weight gathered where used
    moved = [c for c in plan.collectives if c.phase in ("forward", "backward") and c.where != "batch size check"]
    assert {c.kind for c in moved} == {"all_gather"}
    param_bytes = sum(p.numel() * p.element_size() for p in gpt.parameters())
    forward = sum(c.nbytes * c.count for c in moved if c.phase == "forward")
    assert forward == pytest.approx(param_bytes, rel=0.01), (forward, param_bytes)  # each weight once, no activation
    synced = [c for c in plan.collectives if c.phase == "grad_sync"]
    assert {c.kind for c in synced} == {"reduce_scatter"}
    # one per layer group (26 parameters); graph mode's buckets are runs of the ready order, so the root group's
    # gradients are two (ln_f's are ready first, the embeddings' last)
    assert len(synced) == (3 if mode == "eager" else 4), [c.where for c in synced]
    assert len(params) == 26


class _MixedBlock(torch.nn.Module):
    """An fp32 norm and a bf16 linear: one parameter group, gathered as two (one flat buffer per dtype)."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.linear = torch.nn.Linear(width, width).to(torch.bfloat16)

    def forward(self, x):
        return x + self.linear(self.norm(x).to(torch.bfloat16)).float()


class _Mixed(torch.nn.Module):
    def __init__(self, width: int = 256, blocks: int = 2):
        super().__init__()
        self.layers = torch.nn.ModuleList(_MixedBlock(width) for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


@pytest.mark.parametrize("strategy", ["fully_shard", "auto"])
def test_a_group_of_two_dtypes_pays_a_latency_per_dtype_in_search_and_estimate(strategy):
    """Each runtime gathers a group's parameters per dtype (``runtime.flat``, ``rewrite.gather_buckets``): the
    search prices a latency per group and dtype, as the estimate does, so the objective is still the estimate."""
    with torch.device("meta"):
        program = capture(_Mixed(), (torch.empty(64, 256, device="meta"),), {})
    with offline_mesh((4,), ("dp",)) as mesh:
        plan = Planner(program, mesh, ("dp",), hardware=get_profile("h100")).searched(strategy)
    assert plan.search_stats["mode"] == "exact"
    solved = plan.estimated_step_time - plan.search_stats["optimizer_dispatch_s"]
    assert plan.search_stats["objective_s"] == pytest.approx(solved, rel=1e-9)
