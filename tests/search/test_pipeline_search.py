"""``pipeline="auto"``: the inter-op search on fake process groups and meta tensors (no ranks, nothing allocated).

  the schedule formula and one candidate's price            → by hand
  memory binds (a LLaMA shape, 8 sequences on 64 devices)    → a pipelined plan that fits and estimates faster
                                                               than every intra-op plan, with or without a budget
  memory does not bind (a small GPT, 1,024 sequences)        → no pipeline; the note says what was compared
  LLaMA-3-70B on 8x8x16 with 80 GiB (``-m slow``)            → pipelined, fits, faster than intra-op
  the small GPT on 8x8x16 (``-m slow``)                      → no pipeline
"""

from __future__ import annotations

import re

import pytest
import torch

import torch_autopar as autopar
from torch_autopar.cost import CostModel, get_profile, pricing
from torch_autopar.search import pipeline as pipelining
from torch_autopar.testing.models import GPT, LLAMA3_70B, GPTConfig, Llama, LlamaConfig
from tests.support import StackedMLP

GIB = 2**30
BOUND = LlamaConfig(n_layer=16, dim=1024, n_head=16, n_kv_head=4, ffn_dim=4096, vocab_size=32000)
"""0.2 B parameters: data parallelism needs 3.3 GB of weights, gradients and Adam state per device."""


def test_step_seconds_by_hand():
    assert pipelining.step_seconds([1.0, 2.0, 1.0], 4, "gpipe") == pytest.approx(4 * 2 + (1 + 1))
    assert pipelining.step_seconds([1.0, 1.0], 4, "interleaved_1f1b") == pytest.approx(4 + 1 / 2)
    # fewer micro-batches than pipeline ranks: one micro-batch's path is critical, interleaving saves nothing
    assert pipelining.step_seconds([1.0, 1.0, 1.0], 2, "interleaved_1f1b") == pytest.approx(2 + 2)
    assert pipelining.step_seconds([1.0, 1.0], 4, "zero_bubble") == pytest.approx(4 + 1 / 6)  # ZB-H1: a third
    assert pipelining.bubble_fraction(2, 4, "zero_bubble") == pytest.approx(1 / (6 * 4 + 1))
    assert pipelining.bubble_fraction(3, 2, "interleaved_1f1b") == pytest.approx(2 / 4)
    assert not pipelining.runs_with("1f1b", 2, 4) and pipelining.runs_with("gpipe", 1, 4)


def test_one_candidate_priced_by_hand():
    """Four equal blocks on 2 stages x 2 data-parallel ranks, GPipe, 2 micro-batches: the step is
    M · t + t (two ranks of equal time t per micro-batch: compute + the send forward and its gradient back)
    + the all-reduce of a stage's gradients and its optimizer step + the loss's all-reduce; memory is weights, gradients and Adam state plus the activations
    of both micro-batches."""
    with torch.device("meta"):
        model = StackedMLP(widths=(256,) * 4, dim=256, out=256)
    x = torch.empty(64, 256, device="meta")
    measured = pipelining.measure(model, (x,), 64)
    assert measured.crossing == [0, 64 * 256 * 4, 64 * 256 * 4, 64 * 256 * 4, 0]  # x between the blocks
    hardware = get_profile("h100")
    candidate = pipelining.price(measured, ranks=2, schedule="gpipe", microbatches=2, layout="data_parallel",
                                 cuts=[0, 2, 4], world_size=4, global_batch=64, hardware=hardware)
    cost = CostModel(hardware, (2, 2))
    per_layer = pipelining.layer_seconds(measured, cost, 32 / 64 / 2)
    link = cost.link(1)
    send = link.latency_s + 16 * 256 * 4 / (link.bandwidth * hardware.comm_efficiency)
    first, second = sum(per_layer[:2]) + 2 * send, sum(per_layer[2:])
    stage_bytes = [4 * (2 * (2 * 256 * 256 + 2 * 256) + 256 * 256 + 256)] * 2  # two blocks + the input layer / head
    # each stage's gradients all-reduced, then the optimizer step on its 10 tensors (two blocks of two linears,
    # and the input layer or the head)
    sync = max(cost.collective_time("all_reduce", 0, b) + pricing.optimizer_seconds(b, 10, cost) for b in stage_bytes)
    loss = sum(cost.collective_time("all_reduce", axis, 4) for axis in (0, 1))  # the loss, over every rank
    assert candidate.step_s == pytest.approx(2 * max(first, second) + min(first, second) + sync + loss)
    assert [row.num_params * 4 for row in candidate.rows] == stage_bytes
    activations = [sum(measured.costs[u].activation_bytes for u in units) // 2
                   for units in (("pre", 0, 1), (2, 3, "post"))]
    assert candidate.peak_memory == max(4 * b + a for b, a in zip(stage_bytes, activations))


@pytest.fixture(scope="module")
def bound():
    with torch.device("meta"):
        model = Llama(BOUND)
    return model, torch.empty(8, 1024, dtype=torch.long, device="meta")


def test_memory_binds_pipelined_plan_fits_and_is_faster(bound):
    model, tokens = bound  # 5 GiB: the intra-op plan fits (5.34e9 bytes with activations as autograd keeps them)
    plan = autopar.plan(model, tokens, mesh_shape=(64,), hardware="h100", memory_budget=5 * GIB, pipeline="auto",
                        mode="graph")
    assert plan.pipeline_stages > 1 and plan.strategy.startswith("pipeline"), plan.explain()
    assert plan.peak_memory <= 5 * GIB
    compared = plan.search_stats["pipeline_auto"]
    assert compared["chosen"] == "pipelined" and compared["best_step_s"] == plan.estimated_step_time
    assert plan.estimated_step_time < compared["intra_op_step_s"], plan.explain()
    assert plan.world_size == 64 and plan.global_batch == 8
    text = plan.explain()
    assert re.search(r"pipeline='auto' compared intra-op auto [\d.]+ ms, .* with \d+ pipelined candidates", text)
    assert "chose the pipelined plan" in text and "intra-op: auto compared auto" in text
    # intra-op auto compares every named strategy that can split 8 samples: not data parallelism over 64 ranks
    assert "; data_parallel, fully_shard left out: each splits the batch into more pieces than its 8 samples" in text
    with pytest.raises(autopar.AutoparError, match=r"'data_parallel' splits the batch over the mesh axes dp=64 \(64 "
                       r"pieces\), but the global batch has 8 samples"):
        autopar.plan(model, tokens, mesh_shape=(64,), hardware="h100", strategy="data_parallel")


def test_nothing_fits_without_a_pipeline(bound):
    model, tokens = bound
    plan = autopar.plan(model, tokens, mesh_shape=(64,), hardware="h100", memory_budget=2 * GIB, pipeline="auto")
    assert plan.pipeline_stages > 1 and plan.peak_memory <= 2 * GIB
    assert "compared intra-op: nothing fits (" in plan.explain()
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: no plan fits .* with or without pipelining"):
        autopar.plan(model, tokens, mesh_shape=(64,), hardware="h100", memory_budget=GIB // 4, pipeline="auto")


@pytest.mark.parametrize("mesh,sequences", [((64,), 1024), pytest.param((8, 8, 16), 16384, marks=pytest.mark.slow)])
def test_small_model_is_not_pipelined(mesh, sequences):
    """A 4-layer GPT (3.4 M parameters) with a large batch: data parallelism fits and wins (on 8x8x16 the
    intra-op search takes about 2 minutes here)."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=1024, block_size=128, n_layer=4, n_head=4, n_embd=256))
    tokens = torch.empty(sequences, 128, dtype=torch.long, device="meta")
    plan = autopar.plan(model, tokens, mesh_shape=mesh, hardware="h100", pipeline="auto")
    assert plan.pipeline_stages == 1 and plan.strategy == "auto", plan.explain()
    note, compared = plan.notes[-1], plan.search_stats["pipeline_auto"]
    assert note.startswith("pipeline='auto' compared intra-op auto") and note.endswith("chose the intra-op plan")
    assert compared["chosen"] == "intra-op" and compared["intra_op_step_s"] == plan.estimated_step_time
    assert compared["fitting"] > 0 and compared["best_step_s"] > plan.estimated_step_time, note


def test_given_microbatches_and_schedule_bound_the_search(bound):
    model, tokens = bound
    measured = pipelining.measure(model, (tokens,), 8)
    options = pipelining.check_options("auto", 2, "gpipe", 64)
    found = pipelining.search(measured, options, world_size=64, global_batch=8, hardware=get_profile("h100"))
    assert found and {(c.schedule, c.microbatches) for c in found} == {("gpipe", 2)}
    assert {c.ranks for c in found} == {16}  # 4 replicas of 2 sequences: the only size whose replicas hold 2
    assert {c.layout for c in found} == set(pipelining.SEARCHED_LAYOUTS)


def test_zero_bubble_runs_when_asked_and_is_not_searched(bound):
    """Its estimate is the lowest, its measured step the slowest on CPU (``SEARCHED_SCHEDULES``): "auto" leaves
    it out; asked for, it is priced."""
    model, tokens = bound
    measured = pipelining.measure(model, (tokens,), 8)
    hardware = get_profile("h100")
    searched = pipelining.search(measured, pipelining.check_options("auto", None, None, 64), world_size=64,
                                 global_batch=8, hardware=hardware)
    assert searched and {c.schedule for c in searched} <= set(pipelining.SEARCHED_SCHEDULES) - {"zero_bubble"}
    asked = pipelining.search(measured, pipelining.check_options("auto", 4, "zero_bubble", 16), world_size=16,
                              global_batch=8, hardware=hardware)
    interleaved = pipelining.search(measured, pipelining.check_options("auto", 4, "interleaved_1f1b", 16),
                                    world_size=16, global_batch=8, hardware=hardware)
    assert asked and {c.schedule for c in asked} == {"zero_bubble"}
    assert min(c.step_s for c in asked) < min(c.step_s for c in interleaved)


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(pipeline="auto", strategy="tensor_parallel"), r"strategy='tensor_parallel' with pipeline=auto"),
    (dict(pipeline="sometimes"), r"pipeline='sometimes': expected None, 'auto' or a positive number"),
    (dict(pipeline="auto", activation_checkpointing="auto"), r"activation_checkpointing='auto' with pipeline="),
    (dict(pipeline=2, activation_checkpointing="full"), r"activation_checkpointing='full' with pipeline="),
])
def test_bad_auto_input(kwargs, pattern):
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: .*" + pattern):
        autopar.plan(GPT(), torch.randint(0, 96, (8, 16)), mesh_shape=(2,), **kwargs)


def test_compile_auto_in_one_process_and_its_errors():
    """One process: no pipeline size divides 1 rank with two stages, so the intra-op plan is built; auto needs
    example inputs; a plan with fully-sharded stages is followed, one with fsdp_tp stages refused (the
    runtime runs whole, fully-sharded or tensor-parallel stages)."""
    model = GPT()
    pmodel = autopar.compile(model, torch.randint(0, 96, (8, 16)), pipeline="auto")
    assert pmodel.plan.pipeline_stages == 1 and "chose the intra-op plan" in pmodel.plan.notes[-1]
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: pipeline='auto' .* needs example_inputs"):
        autopar.compile(GPT(), pipeline="auto")
    tokens = torch.randint(0, 96, (8, 16))
    sharded = autopar.plan(model, tokens, mesh_shape=(4,), pipeline=2, strategy="fully_shard")
    assert sharded.strategy == "pipeline+fully_shard" and sharded.param_placements["tok.weight"] == ("S(0)", "R")
    followed = autopar.plan(model, tokens, mesh_shape=(4,), strategy=sharded, pipeline=2)
    assert followed.strategy == "pipeline+fully_shard", followed.strategy
    sharded.strategy = "pipeline+fsdp_tp"
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: this plan's stages are fsdp_tp"):
        autopar.plan(model, tokens, mesh_shape=(4,), strategy=sharded, pipeline=2)


@pytest.mark.slow
def test_llama3_70b_on_8x8x16_is_pipelined():
    """The issue's shape: 16 sequences of 2,048 tokens on 1,024 devices of 80 GiB (about 2 minutes here). No
    intra-op plan exists: the exact problem is too large and every named layout splits 16 sequences 64 ways or
    more."""
    with torch.device("meta"):
        model = Llama(LLAMA3_70B)
    tokens = torch.empty(16, 2048, dtype=torch.long, device="meta")
    plan = autopar.plan(model, tokens, mesh_shape=(8, 8, 16), hardware="h100", pipeline="auto")
    assert plan.pipeline_stages > 1 and plan.peak_memory <= 80 * GIB, plan.explain()
    assert plan.search_stats["pipeline_auto"]["intra_op_step_s"] is None
    assert "intra-op: nothing fits (strategy 'auto' on mesh (8, 8, 16) propagates the named layouts" in plan.explain()
