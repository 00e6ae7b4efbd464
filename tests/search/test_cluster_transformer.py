"""The fast propagation mode on a 3-D mesh with a transformer (a fake 4x4x4 process group, a meta LLaMA-style
model: nothing is allocated): tensor parallelism splits matrices Megatron-style by the data flow (column then
row), fully-sharded parameters are stored split and gathered at each use, each named strategy keeps its own
layout, and auto is no worse than any of them."""

from __future__ import annotations

import itertools

import pytest
import torch

import torch_autopar as autopar
from torch_autopar.testing.models import Llama, LlamaConfig

MESH = (4, 4, 4)
NAMED = ("data_parallel", "fully_shard", "tensor_parallel", "fsdp_tp")


@pytest.fixture(scope="module")
def plans():
    with torch.device("meta"):
        model = Llama(LlamaConfig(n_layer=2, dim=128, n_head=8, n_kv_head=4, ffn_dim=512, vocab_size=1024))
    tokens = torch.empty(64, 64, dtype=torch.long, device="meta")
    return {name: autopar.plan(model, tokens, mesh_shape=MESH, hardware="h100", strategy=name, solver="propagate")
            for name in NAMED + ("auto",)}


def test_tensor_parallel_pairs_column_and_row(plans):
    params = plans["tensor_parallel"].param_placements
    for name in ("wq", "wk", "wv"):
        assert params[f"layers.0.{name}.weight"][-1] == "S(0)", params
    assert params["layers.0.wo.weight"][-1] == "S(1)", params
    assert params["layers.0.attn_norm.weight"][-1] == "R", params


def test_fully_sharded_parameters_are_gathered_where_used(plans):
    fsdp, dp = plans["fully_shard"], plans["data_parallel"]
    assert fsdp.peak_memory < dp.peak_memory
    assert any(c.kind == "all_gather" and c.phase == "forward" for c in fsdp.collectives)


def test_named_layouts_differ_and_auto_is_no_worse(plans):
    for a, b in itertools.combinations(NAMED, 2):
        assert plans[a].param_placements != plans[b].param_placements, (a, b)
    best = min(plans[name].estimated_step_time for name in NAMED)
    assert plans["auto"].estimated_step_time <= best * (1 + 1e-9)
