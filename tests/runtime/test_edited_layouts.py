"""A plan's node layouts are the program: edited by hand, they run, equal one process, and the plan prices
exactly the collectives the edit implies, in both modes.

On 2 gloo ranks, the test MLP's parameters are stored as fully_shard stores them (S(0)) and the search is left
free to compute with them sharded, as it does (activations S(1), gathered to R before each ReLU): fully_shard
itself gathers every parameter where it is used (``strategies.roles.gathered_uses``), which the search here is
relieved of, so that the edits below start from a plan that moves activations. Two edits:
  "weight gathered"  ``t`` (layers.0's weight, transposed) made replicated: graph mode gathers the weight after
                     the transpose (one forward all_gather of the 8 KiB weight); in eager mode ``t`` lies
                     inside layers.0, where DTensor places the ops, so nothing changes and ``t`` is listed as
                     run off-plan.
  "batch split"      ReLU and layers.1's output sharded on the batch dim: graph mode moves them there and
                     gathers them where the next op wants them replicated (two forward all_gathers of 2 KiB in
                     all); eager mode moves layers.1's output at its boundary and DTensor's backward follows.
Collectives counted at run time equal the plan's list in every case (kind, mesh axis, bytes, every step).
"""

from __future__ import annotations

import copy
from collections import Counter
from unittest import mock

import pytest

import torch_autopar as autopar
from torch_autopar.search.plan import NodeLayout
from torch_autopar.testing import run_on_ranks
from tests import support

WORLD = 2
MODES = ("eager", "graph")
EDITS = ("as searched", "weight gathered", "batch split")


def _edit(plan: autopar.Plan, edit: str) -> autopar.Plan:
    edited = copy.deepcopy(plan)
    layouts = edited.node_layouts
    assert layouts["t"].output == ("S(1)",) and layouts["relu"].output == ("R",), "the searched layout changed"
    if edit == "weight gathered":
        layouts["t"] = NodeLayout(output=("R",), inputs=layouts["t"].inputs)
    elif edit == "batch split":
        layouts["relu"] = NodeLayout(output=("S(0)",), inputs=(("S(0)",),))
        layouts["addmm_1"] = NodeLayout(output=("S(0)",), inputs=layouts["addmm_1"].inputs)
    return edited


def _run(rank, world, mode, edit):
    model = support.build_model("mlp")
    x, _ = support.global_batch("mlp", 0)
    with mock.patch("torch_autopar.search.planner.gathered_uses", lambda roles: lambda positions, strategies: None):
        # the solver's own layouts (a graph-mode plan runs them as they are), edited, then run in either mode
        searched = autopar.plan(model, (x,), mesh_shape=(world,), strategy="fully_shard", hardware="cpu-gloo",
                                fold_layers=False, mode="graph")
    pmodel = autopar.compile(model, x.chunk(world)[rank], strategy=_edit(searched, edit), mode=mode)
    return {**support.counted_training(pmodel, model, "mlp", rank, world, mode),
            "collectives": Counter((c.kind, c.nbytes, c.phase) for c in pmodel.plan.collectives for _ in range(c.count)),
            "off_plan": pmodel.plan.search_stats.get("off_plan_ops", [])}


def _job(rank, world):
    return {(mode, edit): support.outcome(_run, rank, world, mode, edit) for mode in MODES for edit in EDITS}


@pytest.fixture(scope="module")
def runs():
    return support.by_case(run_on_ranks(_job, WORLD, timeout_s=600))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("edit", EDITS)
def test_an_edited_plan_equals_one_process_and_runs_its_collectives(runs, mode, edit):
    what = f"fully_shard MLP, {edit}, {mode} mode"
    first = support.assert_ranks_equal_one_process(runs[(mode, edit)], support.reference_run("mlp", "adamw"), what)
    for rank, (_, run) in enumerate(runs[(mode, edit)]):
        for step, counted in enumerate(run["counted"]):
            assert counted == run["planned"], (f"rank {rank} step {step} {what}: ran {sorted(counted.items())}, "
                                               f"planned {sorted(run['planned'].items())}")
    assert first["planned"], what


def _extra(runs, mode, edit) -> Counter:
    searched, edited = runs[(mode, "as searched")][0][1], runs[(mode, edit)][0][1]
    return edited["collectives"] - searched["collectives"], searched["collectives"] - edited["collectives"]


def test_graph_mode_prices_exactly_the_moves_an_edit_implies(runs):
    added, removed = _extra(runs, "graph", "weight gathered")
    assert (added, removed) == (Counter({("all_gather", 8192, "forward"): 1}), Counter())
    added, removed = _extra(runs, "graph", "batch split")
    assert (added, removed) == (Counter({("all_gather", 2048, "forward"): 2}), Counter())


def test_eager_mode_lists_an_edit_inside_a_module_as_run_off_plan(runs):
    added, removed = _extra(runs, "eager", "weight gathered")
    assert (added, removed) == (Counter(), Counter())
    off_plan = runs[("eager", "weight gathered")][0][1]["off_plan"]
    assert any(entry.startswith("t: S(1) instead of R") for entry in off_plan), off_plan


def test_eager_mode_moves_a_module_output_edited_at_its_boundary(runs):
    added, _ = _extra(runs, "eager", "batch split")
    assert added[("all_gather", 2048, "forward")] == 1, added  # layers.1's output, gathered where relu_1 runs
