"""Pipelining the models people bring: ``transformers``' GPT-2 (embedding tied to the head), LLaMA, Qwen2, BERT
and ViT cut between their layers (``pipeline=2``).

Their forwards do not trace with torch.fx (keyword-only signatures, cache objects, shape checks), so the
top-level forward is captured by dynamo as torch.export captures it, each node knowing the layer it ran in.

In one process: the stages of that capture, run one after the other on a micro-batch, give the model's own
output; each stage holds only its layers' parameters; an offline plan names the model's layers; a forward
neither torch.fx nor dynamo can take fails with both reasons; keyword inputs bind to the forward's positions
(one behind a parameter that would stay None is refused by name); the outermost layer list is cut (not a list
inside each layer), and a weight every layer reads does not repeat the layers; dropout fixed by the capture is
reported (``mode_dependent_ops``, which a pipelined model checks against ``model.training``).

On gloo ranks, 3 AdamW steps with ``pmodel.step`` equal one process (losses 1e-5 relative, full parameters
rtol 1e-4 / atol 1e-5): on 2 ranks (pp=2) GPT-2 1F1B eager, LLaMA GPipe graph, and LLaMA 1F1B eager called
with keywords and a padding attention_mask; on 4 ranks GPT-2 (1F1B: its (in, out) ``Conv1D`` weights, a boolean
attention mask crossing the stages) with tensor-parallel stages (pp=2 x tp=2, eager), and LLaMA's fully-sharded
stages (dp=2 x pp=2, 1F1B eager) trained and resumed exactly from a checkpoint (``save_checkpoint`` after one
step, a fresh model loading it); with ``-m slow`` also LLaMA fully-sharded without the resume and LLaMA (GPipe)
with tensor-parallel stages. A step at other shapes than the capture's fails with a ``torch_autopar:`` error on
every rank, before any collective. One spawned job per world size runs its default cases, another the slow ones.
"""

from __future__ import annotations

import inspect
import os
import re

import pytest
import torch

pytest.importorskip("transformers")

import torch_autopar as autopar  # noqa: E402
from torch_autopar.capture.modules import (assign_units, mode_dependent_ops, positional_inputs,  # noqa: E402
                                           stages_at, trace_top_level)
from torch_autopar.errors import AutoparError  # noqa: E402
from torch_autopar.search.pipeline import stage_of_units  # noqa: E402
from torch_autopar.testing import run_on_ranks  # noqa: E402
from torch_autopar.testing.hf_models import build_hf_model, hf_batch  # noqa: E402
from tests import support  # noqa: E402
from tests.models import hf_cases  # noqa: E402

SPLIT_MODELS = ("gpt2", "llama", "qwen2", "bert", "vit")
CASES = {
    2: [("gpt2", "1f1b", "eager", "auto"), ("llama", "gpipe", "graph", "auto"),
        ("llama", "1f1b", "eager", "auto", "masked")],
    4: [("gpt2", "1f1b", "eager", "tensor_parallel"), ("llama", "1f1b", "eager", "fully_shard", "resume")],
}
"""(model, schedule, mode, stage strategy[, "resume": checkpointed after the first step, a fresh model loads it;
"masked": keyword inputs with a padding attention_mask])"""
SLOW_CASES = {4: [("llama", "1f1b", "eager", "fully_shard"), ("llama", "gpipe", "eager", "tensor_parallel")]}
"""Run with ``-m slow`` in a job of their own (the resume case above also trains fully-sharded LLaMA stages)."""


def _first_input(name: str) -> torch.Tensor:
    batch = hf_batch(name, 4)
    return batch["pixel_values" if name == "vit" else "input_ids"]


@pytest.mark.parametrize("name", SPLIT_MODELS)
def test_stages_chain_to_the_model_output(name):
    model = build_hf_model(name)
    inputs = _first_input(name)
    top = trace_top_level(model, (inputs,))
    assert top.captured_from is model, "transformers' forwards are captured, not traced"
    assert len(top.layers) == 2, top.layers
    microbatch = inputs.chunk(2)[0]
    stages = stages_at(top, assign_units(top), stage_of_units([0, 1, 2]), (microbatch,))
    value = (microbatch,)
    with torch.no_grad():
        for stage in stages:
            value = stage(*value)
        expected = model(microbatch, **({"use_cache": False} if name in ("gpt2", "llama", "qwen2") else {}))
    torch.testing.assert_close(top.structured(value).logits, expected.logits)
    first, second = top.layers
    held = [{n for n, _ in stage.named_parameters()} for stage in stages]
    assert any(n.startswith(first + ".") for n in held[0]) and not any(n.startswith(second + ".") for n in held[0])
    assert any(n.startswith(second + ".") for n in held[1]) and not any(n.startswith(first + ".") for n in held[1])


def test_offline_plan_names_the_model_layers():
    plan = autopar.plan(build_hf_model("llama"), (_first_input("llama"),), mesh_shape=(1, 2), hardware="cpu-gloo",
                        pipeline=2)
    assert plan.pipeline_stages == 2
    assert "model.layers.0" in plan.stages[0].layers and "model.layers.1" in plan.stages[1].layers, \
        [row.layers for row in plan.stages]


class _Unpipelinable(torch.nn.Module):
    """A layer list, and a branch on a tensor's value in the top-level forward: neither torch.fx nor dynamo
    (on fake tensors) can make one graph of it."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        if x.sum().item() > 0:
            x = -x
        for block in self.blocks:
            x = block(x)
        return x


def test_a_forward_neither_fx_nor_dynamo_takes_names_both():
    with pytest.raises(AutoparError, match=r"torch\.fx could not trace it .* dynamo could not capture it"):
        trace_top_level(_Unpipelinable(), (torch.randn(2, 4),))


def test_keyword_inputs_take_the_forwards_positions():
    model = build_hf_model("llama")
    ids, mask = _first_input("llama"), torch.ones(4, 16, dtype=torch.long)
    bound = positional_inputs(model, (), {"attention_mask": mask, "input_ids": ids})
    assert len(bound) == 2 and bound[0] is ids and bound[1] is mask
    assert positional_inputs(model, (ids,), {"attention_mask": mask})[1] is mask


def test_a_keyword_behind_a_defaulted_parameter_is_refused_by_name():
    """GPT-2's forward has its cache parameter between input_ids and attention_mask: no positional tensor can
    stand for it, so the error names both and the way out."""
    model = build_hf_model("gpt2")
    name = list(inspect.signature(model.forward).parameters)[1]
    with pytest.raises(AutoparError, match=rf"parameter '{name}' .* ahead of the keyword 'attention_mask'.*"
                                           r"'input_ids'"):
        positional_inputs(model, (), {"input_ids": _first_input("gpt2"),
                                      "attention_mask": torch.ones(4, 16, dtype=torch.long)})


def test_auto_keeps_the_intra_op_plan_for_keywords_no_pipeline_takes():
    keywords = {"input_ids": _first_input("gpt2"), "attention_mask": torch.ones(4, 16, dtype=torch.long)}
    plan = autopar.plan(build_hf_model("gpt2"), (), example_kwargs=keywords, mesh_shape=(2,), hardware="cpu-gloo",
                        pipeline="auto", strategy="data_parallel")
    assert plan.pipeline_stages == 1
    assert any("kept the intra-op plan" in note and "'attention_mask'" in note for note in plan.notes), plan.notes


class _Blocks(torch.nn.Module):
    """Layers that each hold a ModuleList of sublayers, all reading one shared weight, called from a forward
    torch.fx cannot trace (a branch on ``x.dim()``): captured, cut between the blocks, not the sublayers."""

    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Parameter(torch.randn(8, 8))
        self.blocks = torch.nn.ModuleList(_Block(self.shared) for _ in range(2))

    def forward(self, x):
        if x.dim() == 3:
            x = x.flatten(0, 1)
        for block in self.blocks:
            x = block(x)
        return x


class _Block(torch.nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.subs = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.shared = shared

    def forward(self, x):
        for sub in self.subs:
            x = torch.relu(sub(x))
        return x @ self.shared


def test_the_outermost_layer_list_is_cut_and_a_shared_read_does_not_repeat_layers():
    model = _Blocks()
    x = torch.randn(4, 8)
    top = trace_top_level(model, (x,))
    assert top.captured_from is model and (top.family, top.layers) == ("blocks", ["blocks.0", "blocks.1"])
    stages = stages_at(top, assign_units(top), stage_of_units([0, 1, 2]), (x,))
    with torch.no_grad():
        torch.testing.assert_close(top.structured(stages[1](*stages[0](x))), model(x))


def test_mode_dependent_ops_of_captured_stages():
    model = build_hf_model("gpt2")
    model.config.resid_pdrop = 0.1
    model = type(model)(model.config).train()  # GPT-2's default dropout
    inputs = _first_input("gpt2")
    top = trace_top_level(model, (inputs,))
    stages = stages_at(top, assign_units(top), stage_of_units([0, 1, 2]), (inputs,))
    assert any(op.startswith("dropout") for op in mode_dependent_ops(stages))
    llama = build_hf_model("llama")
    top = trace_top_level(llama, (inputs,))
    assert mode_dependent_ops(stages_at(top, assign_units(top), stage_of_units([0, 1, 2]), (inputs,))) == []


def _job(rank, world, cases, directory):
    return {case: support.outcome(hf_cases.run_pipeline_case, rank, world, *case[:4], masked="masked" in case,
                                  resume_from=os.path.join(directory, "-".join(case)) if "resume" in case else None)
            for case in cases}


@pytest.fixture(scope="module")
def jobs():
    return {}


@pytest.mark.parametrize(("world", "case"), [(w, c) for w, cases in CASES.items() for c in cases] + [
    pytest.param(w, c, marks=pytest.mark.slow) for w, cases in SLOW_CASES.items() for c in cases],
                         ids=lambda v: str(v) if isinstance(v, int) else "-".join(v))
def test_pipelined_equals_one_process(jobs, tmp_path_factory, world, case):
    key = (world, case not in CASES[world])  # the default job, or the slow cases' own
    if key not in jobs:
        cases = (SLOW_CASES if key[1] else CASES)[world]
        jobs[key] = run_on_ranks(_job, world, cases, str(tmp_path_factory.mktemp("checkpoints")), timeout_s=900)
    name, strategy = case[0], case[3]
    ref_losses, ref_params = hf_cases.pipeline_reference(name, "masked" in case)
    for rank, result in enumerate(jobs[key]):
        status, run = result[case]
        assert status == "ok", f"rank {rank} {case}: {status}: {run}"
        what = f"rank {rank} {case} (plan: {run['strategy']})"
        support.assert_losses_close(run["losses"], ref_losses, what=what)
        support.assert_params_close(run["params"], ref_params, what=what)
        assert run["output"] == type(build_hf_model(name)(_first_input(name))).__name__, what
        assert strategy == "auto" or run["strategy"] == f"pipeline+{strategy}", what
        assert len(run["stages"]) == 2, what
        assert re.search(r"were captured .* shaped \(\(\d+, 16\).*; found \(\(\d+, 8\)", run["other_shapes"]), what
