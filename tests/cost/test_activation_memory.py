"""The activation memory model (``cost.pricing``: what autograd keeps from the forward for backward, and what
recomputing a repeated layer frees) against the allocator's record (``testing.memory.kept_bytes``: bytes a
forward allocated and still holds when it returns), in one process: every layer keeping its activations, some
and all of them recomputing, all of them recomputing selectively (``runtime.recompute.apply_plan``), on the
project's GPT and the block MLP, within 15%. And the pricing functions by hand: a recomputed layer's backward
makes its activations again while the layers before it still hold theirs.
"""

from __future__ import annotations

import pytest
import torch

import torch_autopar as autopar
from torch_autopar.cost import pricing
from torch_autopar.runtime.precision import CastCall, resolve
from torch_autopar.runtime.recompute import apply_plan
from torch_autopar.search.recompute import recomputed
from torch_autopar.testing.memory import kept_bytes
from torch_autopar.testing.models import GPT, BlockMLP, GPTConfig

TOLERANCE = 0.15


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_embd=64, block_size=64)), torch.randint(0, 96, (8, 64))


def _blocks():
    torch.manual_seed(0)
    return BlockMLP(n_blocks=6, dim=64, hidden=256), torch.randn(64, 64)


MODELS = {"gpt": _gpt, "blocks": _blocks}


def _plan(name, policy=None):
    model, x = MODELS[name]()
    return autopar.plan(model, (x,), mesh_shape=(1,), hardware="h100", fold_layers=False,
                        activation_checkpointing=policy)


def _measured(name, layers: dict) -> int:
    model, x = MODELS[name]()
    apply_plan(model, layers)
    outputs = []
    return kept_bytes(lambda: outputs.append(model(x)))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_predicted_activations_match_the_allocator_with_and_without_recomputation(name):
    plan = _plan(name)
    layers = list(plan.layer_activations)
    assert len(layers) >= 4, layers
    for chosen in ({}, {n: "full" for n in layers[:2]}, {n: "full" for n in layers}, {n: "selective" for n in layers}):
        predicted = plan.memory_breakdown["activations"] - sum(f for f, _ in recomputed(plan, chosen).values())
        measured = _measured(name, chosen)
        assert abs(predicted - measured) <= TOLERANCE * measured, (name, chosen, predicted, measured)


def test_full_recomputation_priced_in_the_plan():
    keep, full = _plan("gpt"), _plan("gpt", "full")
    figures = keep.layer_activations
    assert full.activation_checkpointing == {name: "full" for name in figures}
    freed = sum(row.freed_bytes for row in figures.values())
    assert full.memory_breakdown["activations"] == keep.memory_breakdown["activations"] - freed
    assert full.memory_breakdown["recomputed_layer"] == max(row.freed_bytes for row in figures.values())
    assert full.peak_memory < keep.peak_memory
    seconds = sum(row.recompute_s for row in figures.values())
    assert full.compute_time == pytest.approx(keep.compute_time + seconds, rel=1e-12)
    assert full.estimated_step_time == pytest.approx(keep.estimated_step_time + seconds, rel=1e-12)


def test_recompute_memory_by_hand():
    layers = [("a", 100, 90), ("b", 100, 90), ("c", 100, 90)]
    assert pricing.recompute_memory(1000, layers, set()) == {"activations": 1000, "recomputed_layer": 0}
    # "a" alone: its backward runs after b and c freed theirs (200 bytes), so making 90 again stays below
    assert pricing.recompute_memory(1000, layers, {"a"}) == {"activations": 910, "recomputed_layer": 0}
    # "c" alone: its backward comes first, with a and b still held
    assert pricing.recompute_memory(1000, layers, {"c"}) == {"activations": 910, "recomputed_layer": 90}
    # all: c's backward makes 90 again over the kept 1000 - 270
    assert pricing.recompute_memory(1000, layers, {"a", "b", "c"}) == {"activations": 730, "recomputed_layer": 90}


def test_bf16_layers_free_what_recomputation_frees():
    """Under mixed precision every parameter is cast at the top of the forward; a layer's ops read the casts, and
    still belong to their layer: recomputing layers frees their bf16 activations (the allocator agrees; it also
    holds the bf16 weight copies autograd keeps, which the model leaves out: a few percent here)."""
    model, x = _gpt()
    plan = autopar.plan(model, (x,), mesh_shape=(1,), hardware="h100", fold_layers=False, mixed_precision="bf16")
    layers = list(plan.layer_activations)
    assert len(layers) == 4 and all(row.freed_bytes > 0 for row in plan.layer_activations.values()), layers
    for chosen in ({}, {n: "full" for n in layers[:2]}, {n: "full" for n in layers}):
        predicted = plan.memory_breakdown["activations"] - sum(f for f, _ in recomputed(plan, chosen).values())
        model, x = _gpt()
        apply_plan(model, chosen)
        call, outputs = CastCall(model, resolve("bf16")), []
        measured = kept_bytes(lambda: outputs.append(call(x)))
        assert abs(predicted - measured) <= TOLERANCE * measured, (chosen, predicted, measured)
