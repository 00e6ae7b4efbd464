"""The exact search at cluster scale (``-m slow``): LLaMA-3-8B, 16 sequences of 2,048 tokens, on an 8x16 h100 mesh,
planned offline on meta tensors (a fake process group: nothing is allocated).

  auto                      → the exact search, proven optimal, fits the budget
  each named strategy       → its own layout and estimate; auto is no slower than any of them
  auto skips the restrictions it dominates → it says so, and the restrictions planned by name confirm it
"""

from __future__ import annotations

import itertools

import pytest
import torch

import torch_autopar as autopar
from torch_autopar.cost import get_profile
from torch_autopar.testing.models import LLAMA3_8B, Llama

MESH = (8, 16)
NAMED = ("tensor_parallel", "fsdp_tp")
"""fully_shard splits the 16 sequences 128 ways: refused (test_fully_shard_refuses_16_sequences_on_128_devices)."""

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def plans():
    with torch.device("meta"):
        model = Llama(LLAMA3_8B)
    tokens = torch.empty(16, 2048, dtype=torch.long, device="meta")
    return {name: autopar.plan(model, tokens, mesh_shape=MESH, hardware="h100", strategy=name)
            for name in ("auto",) + NAMED}


def test_auto_is_the_proven_optimum_and_fits(plans):
    auto = plans["auto"]
    assert auto.search_stats["mode"] == "exact" and auto.search_stats["solver_optimal"], auto.search_stats
    assert auto.peak_memory <= get_profile("h100").memory_bytes
    solved = auto.estimated_step_time - auto.search_stats["optimizer_dispatch_s"]  # the constant the MILP leaves out
    assert auto.search_stats["objective_s"] == pytest.approx(solved, rel=1e-9)


def test_auto_is_no_slower_than_each_named_strategy(plans):
    auto = plans["auto"].estimated_step_time
    for name in NAMED:
        assert auto <= plans[name].estimated_step_time * (1 + 1e-9), {n: p.estimated_step_time for n, p in plans.items()}
    assert any("not solved" in note for note in plans["auto"].notes), plans["auto"].notes


def test_named_strategies_differ(plans):
    for a, b in itertools.combinations(NAMED, 2):
        assert plans[a].estimated_step_time != pytest.approx(plans[b].estimated_step_time, rel=1e-6), (a, b)
        assert plans[a].param_placements != plans[b].param_placements, (a, b)


def test_fully_shard_refuses_16_sequences_on_128_devices():
    with torch.device("meta"):
        model = Llama(LLAMA3_8B)
    tokens = torch.empty(16, 2048, dtype=torch.long, device="meta")
    with pytest.raises(autopar.AutoparError, match=r"'fully_shard' splits the batch over the mesh axes dp=8 x tp=16 "
                       r"\(128 pieces\), but the global batch has 16 samples"):
        autopar.plan(model, tokens, mesh_shape=MESH, hardware="h100", strategy="fully_shard")
