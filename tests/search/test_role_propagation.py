"""The named strategies' propagation (the fast mode at cluster scale) keeps what the strategy promises on every axis
of a 3-D mesh, on a folded LLaMA whose key/value heads are fewer than the tensor-parallel ways (as LLaMA-3-70B's 8
on a tp axis of 16): matrices stay split Megatron-style, attention stays split over the batch axes, weight
gradients come out split as their matrices (never a partial sum of the whole matrix), and a batch a strategy
cannot split is refused with a clear error (a fake 2x2x4 process group on meta tensors: nothing is allocated)."""

from __future__ import annotations

import pytest
import torch

import torch_autopar as autopar
from torch_autopar.testing.models import Llama, LlamaConfig

MESH = (2, 2, 4)
CONFIG = LlamaConfig(n_layer=4, dim=256, n_head=8, n_kv_head=2, ffn_dim=512, vocab_size=512)


@pytest.fixture(scope="module")
def llama():
    with torch.device("meta"):
        return Llama(CONFIG)


def _plan(model, strategy, batch=16, solver="propagate", mesh=MESH, **training):
    tokens = torch.empty(batch, 64, dtype=torch.long, device="meta")
    return autopar.plan(model, tokens, mesh_shape=mesh, hardware="h100", strategy=strategy, solver=solver,
                        fold_layers=True, **training)


@pytest.fixture(scope="module")
def propagated(llama):
    """Each strategy's propagated plan on 16 sequences, made once for the tests that read it."""
    return {strategy: _plan(llama, strategy) for strategy in ("fsdp_tp", "tensor_parallel")}


@pytest.mark.parametrize("strategy", ["fsdp_tp", "tensor_parallel"])
def test_matrices_stay_split_and_attention_stays_batch_split(propagated, strategy):
    plan = propagated[strategy]
    # the only ops replicated anywhere: the views regrouping 2 key/value heads split 4 ways, on the tp axis alone
    assert plan.search_stats["mode"] == "propagation"
    assert set(plan.replicated_ops) <= {"aten.view.default (on mesh axis 2)"}, plan.replicated_ops
    fsdp = "S(1)" if strategy == "fsdp_tp" else "R"  # a column-parallel matrix: fsdp takes the other dim
    row = "S(0)" if strategy == "fsdp_tp" else "R"
    for layer in ("layers.0", "layers.3"):
        for column in ("wq", "wk", "wv", "w1", "w3"):
            assert plan.param_placements[f"{layer}.{column}.weight"] == (fsdp, fsdp, "S(0)"), column
        for name in ("wo", "w2"):
            assert plan.param_placements[f"{layer}.{name}.weight"] == (row, row, "S(1)"), name
    # attention's batched products (forward and backward) run on the rank's own samples: split on both batch
    # axes (before, a split of fewer key/value heads than tp ways made every one of them replicated everywhere)
    products = {name: layout.output for name, layout in plan.node_layouts.items() if name.startswith("bmm")}
    assert products and all(out[:2] == ("S(0)", "S(0)") for out in products.values()), products


@pytest.mark.parametrize("strategy", ["fsdp_tp", "tensor_parallel"])
def test_weight_gradients_are_synced_split_as_their_matrices(llama, propagated, strategy):
    """The gradient sync over the batch axes moves each matrix's tensor-parallel shard, a quarter of the
    parameters' bytes (vectors, replicated on tp, are a few KiB), not the whole matrices a partial sum over a
    split sequence would leave; on the tp axis only the embedding's gradient is reduced (DTensor sums a
    vocabulary-parallel lookup's gradient whole)."""
    plan = propagated[strategy]
    params = sum(p.numel() * 4 for p in llama.parameters())
    for axis in ("dp", "cp"):  # the batch axes of a 3-D mesh's default names
        synced = [c for c in plan.collectives if c.phase == "grad_sync" and c.axis == axis]
        assert synced and sum(c.nbytes * c.count for c in synced) <= 0.3 * params, axis
    on_tp = sum(c.nbytes * c.count for c in plan.collectives if c.phase == "grad_sync" and c.axis == "tp")
    assert on_tp <= llama.tok.weight.numel() * 4 + 64 * 1024


def test_named_strategies_refuse_a_batch_they_cannot_split(llama):
    for strategy, pieces in (("data_parallel", 16), ("fully_shard", 16), ("tensor_parallel", 4), ("fsdp_tp", 4)):
        with pytest.raises(autopar.AutoparError, match=rf"^torch_autopar: strategy '{strategy}' splits the batch over "
                           rf"the mesh axes .*\({pieces} pieces\), but the global batch has 2 samples"):
            _plan(llama, strategy, batch=2, solver="auto")
    with pytest.raises(autopar.AutoparError, match=r"or a strategy that splits this batch \(tensor_parallel, "
                       r"fsdp_tp, or auto"):
        _plan(llama, "fully_shard", batch=4, solver="auto")
    # auto, on a 2x2 mesh, compares only the layouts that split 2 samples, and its own search
    plan = _plan(llama, "auto", batch=2, solver="auto", mesh=(2, 2))
    compared = next(note for note in plan.notes if note.startswith("auto compared"))
    assert compared.endswith("; data_parallel, fully_shard left out: each splits the batch into more pieces than its "
                             "2 samples"), compared


def test_auto_in_the_fast_mode_says_when_no_named_layout_splits_the_batch(llama, monkeypatch):
    monkeypatch.setattr("torch_autopar.search.planner.MAX_EXACT_EDGE_VARIABLES", 10)
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: strategy 'auto' on mesh \(2, 2, 4\) propagates "
                       r"the named layouts \(the unrestricted problem has more than 10 edge variables .*\), but each "
                       r"splits the batch into at least 4 pieces and the global batch has 2 samples"):
        _plan(llama, "auto", batch=2, solver="auto")
    with pytest.raises(autopar.AutoparError, match=r"\(solver='propagate' was asked for\)"):
        _plan(llama, "auto", batch=2)
    # a batch of 4 splits over tensor_parallel's and fsdp_tp's 4 pieces, not data parallelism's 16
    chosen = _plan(llama, "auto", batch=4)
    assert chosen.search_stats["seed"] in ("tensor_parallel", "fsdp_tp"), chosen.search_stats


def test_mixed_precision_gathers_each_parameter_cast_to_bf16(llama, propagated):
    """A fully-sharded parameter under a bf16 policy is cast on its shard and the cast gathered, as FSDP2 and both
    runtimes do: the forward and backward gathers (the parameters', and the activations', bf16 too under the
    policy) move half the bytes of fp32 training's, over the same axes."""
    def gathers(plan):
        return sorted((c.where, c.axis, c.phase, c.nbytes * c.count) for c in plan.collectives
                      if c.kind == "all_gather" and c.phase != "grad_sync")  # gradients: in the reduce dtype, fp32

    fp32, bf16 = propagated["fsdp_tp"], _plan(llama, "fsdp_tp", mixed_precision="bf16")
    assert len(gathers(bf16)) == len(gathers(fp32)) > 0
    assert sum(g[-1] for g in gathers(bf16)) * 2 == sum(g[-1] for g in gathers(fp32))
    assert {g[1:3] for g in gathers(bf16)} == {g[1:3] for g in gathers(fp32)}
