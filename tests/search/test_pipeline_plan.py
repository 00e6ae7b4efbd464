"""Pipeline planning without ranks: the balanced partition by hand, a model of unequal blocks cut where its
FLOPs say, the bubble formula, ``plan.explain()``, save / load (old plan files still load) and bad input."""

from __future__ import annotations

import json

import pytest
import torch

import torch_autopar as autopar
from torch_autopar.search.pipeline import balanced_cuts, bubble_fraction
from torch_autopar.testing.models import GPT
from tests.support import StackedMLP


def test_balanced_cuts_by_hand():
    assert balanced_cuts([1, 1, 1, 1], 2) == [0, 2, 4]
    assert balanced_cuts([4, 1, 1, 1, 1], 2) == [0, 1, 5]  # 4 | 4 beats 5 | 3
    assert balanced_cuts([1, 2, 3, 4, 5, 6], 3) == [0, 3, 5, 6]  # 6 | 9 | 6: no split has a smaller maximum
    assert balanced_cuts([4, 1, 1, 1, 1], 3) == [0, 1, 3, 5]  # 4 | 2 | 2, not 4 | 1 | 3 (same maximum)
    assert balanced_cuts([3, 3, 3], 3) == [0, 1, 2, 3]
    assert balanced_cuts([5], 1) == [0, 1]


def test_bubble_fraction():
    assert bubble_fraction(2, 4, "gpipe") == pytest.approx(1 / 5)
    assert bubble_fraction(4, 8, "1f1b") == pytest.approx(3 / 11)
    assert bubble_fraction(2, 4, "interleaved_1f1b") == pytest.approx(1 / 9)


def _unequal():
    """A first block four times as wide (four times the FLOPs) as the four after it; wide enough to be
    compute-bound on an h100 (the roofline then prices FLOPs, not bytes)."""
    return StackedMLP(widths=(4096, 1024, 1024, 1024, 1024), dim=1024, out=8)


def test_unequal_blocks_are_cut_by_flops():
    with torch.device("meta"):
        model = _unequal()
    x = torch.empty(4096, 1024, device="meta")
    plan = autopar.plan(model, x, mesh_shape=(2,), pipeline=2, microbatches=4, schedule="gpipe")
    # costs ~ [4, 1, 1, 1, 1] (+ the input layer and the head): the wide block alone is the best cut
    assert [row.layers for row in plan.stages] == [["inp", "blocks.0"],
                                                    ["blocks.1", "blocks.2", "blocks.3", "blocks.4", "head"]]
    assert plan.stage_of("blocks.3") == 1 and plan.stage_of("inp") == 0
    first, second = (row.compute_s for row in plan.stages)
    assert 0.9 < first / second < 1.35, (first, second)
    three = autopar.plan(model, x, mesh_shape=(6,), pipeline=3, microbatches=2, schedule="1f1b")
    assert [row.layers[-1] for row in three.stages] == ["blocks.0", "blocks.2", "head"]
    assert three.mesh_shape == (2, 3) and three.axis_names == ("dp", "pp")


def test_gpt_plan_explains_stages_and_round_trips(tmp_path):
    plan = autopar.plan(GPT(), torch.randint(0, 96, (8, 16)), mesh_shape=(4,), pipeline=2, microbatches=2,
                        schedule="1f1b", hardware="cpu-gloo")
    assert (plan.pipeline_stages, plan.microbatches, plan.schedule) == (2, 2, "1f1b")
    assert plan.stages[0].layers == ["tok", "pos", "blocks.0"]
    assert plan.stages[1].layers == ["blocks.1", "ln_f", "tok.weight"]  # the tied head reads tok.weight there
    assert plan.bubble_fraction == pytest.approx(1 / 3)
    assert not plan.is_data_parallel()  # replicated parameters, but each rank runs only its stage
    assert plan.estimated_step_time > 0 and plan.peak_memory == max(r.memory_bytes for r in plan.stages)
    text = plan.explain()
    assert ("2 stages on 2 pipeline ranks, each stage on a sub-mesh of 2 rank(s) (dp: data-parallel), "
            "schedule=1f1b, 2 micro-batches") in text and "bubble 33.3%" in text
    assert "blocks.1, ln_f, tok.weight" in text
    plan.save(tmp_path / "plan.json")
    loaded = autopar.Plan.load(tmp_path / "plan.json")
    assert loaded == plan and loaded.explain() == text


def test_tensor_parallel_stages_split_matrices_and_price_their_collectives(tmp_path):
    """pipeline=2 x tp=2 on 4 offline ranks: each stage's matrices split Megatron-style over its 2 ranks (the tied
    embedding / head the same way on both stages), the whole batch on every rank, each stage's collectives on
    the "tp" axis, and a rank holds a little over half of what a data-parallel stage's rank holds."""
    tokens = torch.randint(0, 96, (8, 16))
    split = autopar.plan(GPT(), tokens, mesh_shape=(4,), pipeline=2, microbatches=2, strategy="tensor_parallel",
                         hardware="cpu-gloo")
    whole = autopar.plan(GPT(), tokens, mesh_shape=(4,), pipeline=2, microbatches=2, hardware="cpu-gloo",
                         strategy="data_parallel")
    assert split.strategy == "pipeline+tensor_parallel" and split.axis_names == ("tp", "pp")
    assert split.mesh_shape == (2, 2) and split.global_batch == 8 and split.input_placements[0] == ("R", "R")
    placements = {name: where[0] for name, where in split.param_placements.items()}
    assert placements["blocks.0.fc.weight"] == "S(0)" and placements["blocks.0.out.weight"] == "S(1)"
    assert placements["blocks.1.fc.weight"] == "S(0)" and placements["blocks.1.out.weight"] == "S(1)"
    assert placements["blocks.0.ln1.weight"] == "R"
    for stage in ("stage0", "stage1"):
        moves = [c for c in split.collectives if c.where == stage and c.axis == "tp"]
        assert {c.phase for c in moves} >= {"forward", "backward"}, (stage, moves)
        assert all(c.count == 2 for c in moves if c.phase != "grad_sync"), moves  # once per micro-batch
    for part in ("parameters", "gradients", "optimizer"):  # half of each matrix; the vectors whole
        assert whole.memory_breakdown[part] / 2 < split.memory_breakdown[part] < whole.memory_breakdown[part], part
    assert "each stage on a sub-mesh of 2 rank(s) (tp: tensor-parallel)" in split.explain()
    split.save(tmp_path / "plan.json")
    assert autopar.Plan.load(tmp_path / "plan.json") == split


def test_plans_without_pipeline_and_old_files(tmp_path):
    plan = autopar.plan(GPT(), torch.randint(0, 96, (8, 16)), mesh_shape=(2,), strategy="data_parallel")
    assert (plan.pipeline_stages, plan.microbatches, plan.schedule, plan.stages) == (1, 1, None, [])
    assert plan.is_data_parallel()
    assert "pipeline" not in plan.explain()
    plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    for key in ("pipeline_stages", "microbatches", "schedule", "stages", "bubble_fraction"):
        del data[key]  # a file written before pipelining existed
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert autopar.Plan.load(tmp_path / "old.json") == plan


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(mesh_shape=(3,), pipeline=2), r"pipeline=2 must divide the 3 ranks"),
    (dict(mesh_shape=(4,), pipeline=4), r"needs 4 stages of at least one layer each; the model has 2 layers"),
    (dict(mesh_shape=(2,), pipeline=2, microbatches=3), r"microbatches=3 must divide each rank's batch"),
    (dict(mesh_shape=(2,), pipeline=2, schedule="dualpipe"), r"schedule='dualpipe': expected one of"),
    (dict(mesh_shape=(2,), microbatches=2), r"apply to pipelined models; found pipeline=None"),
    (dict(mesh_shape=(2,), pipeline="auto", strategy="tensor_parallel"), r"\(pipeline=N only\) tensor parallel"),
    (dict(mesh_shape=(2,), pipeline=2, strategy="fsdp_tp"), r"stages run whole"),
])
def test_bad_pipeline_input(kwargs, pattern):
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: .*" + pattern):
        autopar.plan(GPT(), torch.randint(0, 96, (8, 16)), **kwargs)


def test_compile_checks_pipeline_in_one_process():
    """One process: pipeline=2 cannot divide a world of 1; loss_fn without a pipeline is refused."""
    with pytest.raises(autopar.AutoparError, match=r"pipeline=2 must divide the 1 ranks"):
        autopar.compile(GPT(), pipeline=2)
    with pytest.raises(autopar.AutoparError, match=r"loss_fn= is for pipelined models"):
        autopar.compile(GPT(), loss_fn=torch.nn.functional.mse_loss)
