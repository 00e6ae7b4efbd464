"""The bad-input catalogue (README "Bad input"): each entry gives a ``torch_autopar:`` error saying what was
expected, what was found and how to fix it — or, for changed sizes, keeps the plan and says so once.

Entries already covered elsewhere: unequal slices, full_batch with an indivisible batch and meshes that do not
cover the job (tests/runtime/test_bad_inputs.py, tests/search/test_errors.py); plan files of another format
version or for another model (tests/search/test_errors.py). One spawned 2-rank job tries the multi-rank
entries; every case fails the same way on both ranks, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_autopar as autopar
from torch_autopar.cost import hardware
from torch_autopar.runtime import checks
from torch_autopar.testing import run_on_ranks
from torch_autopar.testing.models import MLP
from tests import support
from tests.support import outcome

PREFIX = r"^torch_autopar: "


def _x(batch=8, *, dtype=torch.float32, width=32):
    return torch.randn(batch, width, generator=torch.Generator().manual_seed(0)).to(dtype)


# multi-rank entries ---------------------------------------------------------------------------------------------
def _step(pmodel, x, y):
    loss = F.mse_loss(pmodel(x), y)
    loss.backward()
    return loss.item()


def _parameter_added_after_compile(rank, world):
    model = support.build_model("mlp")
    pmodel = autopar.compile(model, strategy="data_parallel")
    x, y = support.global_batch("mlp", 0)
    _step(pmodel, x.chunk(world)[rank], y.chunk(world)[rank])
    model.extra = nn.Parameter(torch.zeros(3))
    return _step(pmodel, x.chunk(world)[rank], y.chunk(world)[rank])


def _layer_removed_after_compile(rank, world):
    model = support.build_model("mlp")
    pmodel = autopar.compile(model, _x(4), strategy="fully_shard")
    del model.layers[2]
    return pmodel(_x(4, width=32))


def _full_batch(rank, world, how):
    """Each rank passes the global batch: the same one, a different one, or the same samples shuffled."""
    pmodel = autopar.compile(support.build_model("mlp"), strategy="data_parallel", full_batch=True)
    x, y = support.global_batch("mlp", 0)
    if how == "different" and rank == 1:
        x = x + 1e-3
    if how == "shuffled" and rank == 1:
        x = x.flip(0)
    return _step(pmodel, x, y)


def _optimizer_on_originals_after_compile(rank, world):
    """An optimizer made after compile from parameters listed before it: it trains the shards."""
    model = support.build_model("mlp")
    originals = list(model.parameters())
    pmodel = autopar.compile(model, _x(4), strategy="fully_shard")
    optimizer = torch.optim.SGD(originals, lr=0.1)
    before = [support.full(p).clone() for p in model.parameters()]
    x, y = support.global_batch("mlp", 0)
    _step(pmodel, x.chunk(world)[rank], y.chunk(world)[rank])
    optimizer.step()
    return all(not torch.equal(support.full(p), b) for p, b in zip(model.parameters(), before))


def _optimizer_with_state_on_originals(rank, world):
    """An optimizer that already stepped the plain model, then kept after compile: refused at its step."""
    model = support.build_model("mlp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    x, y = support.global_batch("mlp", 0)
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    pmodel = autopar.compile(model, _x(4), strategy="fully_shard")
    optimizer.zero_grad()
    _step(pmodel, x.chunk(world)[rank], y.chunk(world)[rank])
    optimizer.step()


def _catalogue_job(rank, world):
    return {
        "parameter_added": outcome(_parameter_added_after_compile, rank, world),
        "layer_removed": outcome(_layer_removed_after_compile, rank, world),
        "full_batch_same": outcome(_full_batch, rank, world, "same"),
        "full_batch_different": outcome(_full_batch, rank, world, "different"),
        "full_batch_shuffled": outcome(_full_batch, rank, world, "shuffled"),
        "optimizer_after_compile": outcome(_optimizer_on_originals_after_compile, rank, world),
        "optimizer_with_state": outcome(_optimizer_with_state_on_originals, rank, world),
        "mesh_not_dividing": outcome(autopar.compile, support.build_model("mlp"), mesh=(3,)),
    }


@pytest.fixture(scope="module")
def job():
    return run_on_ranks(_catalogue_job, 2, timeout_s=240)


def test_parameter_added_after_compile(job):
    for result in job:
        support.assert_autopar_error(result["parameter_added"], "changed after autopar.compile planned it",
                              "added ['extra']", "compile the changed model again")


def test_layer_removed_after_compile(job):
    for result in job:
        support.assert_autopar_error(result["layer_removed"], "removed ['layers.2.bias', 'layers.2.weight']")


def test_full_batch_with_different_batches_on_the_ranks(job):
    for result in job:
        assert result["full_batch_same"][0] == "ok", result["full_batch_same"]
        for key in ("full_batch_different", "full_batch_shuffled"):
            support.assert_autopar_error(result[key], "full_batch=True expects every rank to pass the same global batch",
                                  "input tensor 0 (shape (8, 32)) differs between the 2 ranks", "same seed")


def test_optimizer_created_on_the_original_parameters_after_compile(job):
    for result in job:
        assert result["optimizer_after_compile"] == ("ok", True), result["optimizer_after_compile"]
        support.assert_autopar_error(result["optimizer_with_state"], "already holds state",
                              "create the optimizer after the first forward")


def test_mesh_that_does_not_divide_the_world_size(job):
    for result in job:
        support.assert_autopar_error(result["mesh_not_dividing"], "mesh=(3,) has 3 devices but this job has 2 ranks",
                              "--nproc-per-node")


# inputs unlike the planned ones (one process) -------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_input_of_another_dtype(mode):
    pmodel = autopar.compile(MLP(), _x(), mode=mode)
    with pytest.raises(autopar.AutoparError, match=PREFIX + re.escape("input [0][0] of MLP was planned as "
                       "torch.float32 but is torch.float64; cast it (e.g. x.to(torch.float32))")):
        pmodel(_x(dtype=torch.float64))


def test_input_on_another_device():
    pmodel = autopar.compile(MLP(), _x())
    with pytest.raises(autopar.AutoparError, match=PREFIX + r"input \[0\]\[0\] of MLP was planned on device cpu "
                       r"but is on meta; move it"):
        pmodel(torch.empty(8, 32, device="meta"))


def test_input_with_another_number_of_dims():
    pmodel = autopar.compile(MLP(), _x())
    with pytest.raises(autopar.AutoparError, match=PREFIX + r"input \[0\]\[0\] of MLP was planned with 2 dims "
                       r"\(8, 32\) but has 3 dims \(2, 8, 32\)"):
        pmodel(_x().expand(2, 8, 32))


def test_batch_size_changes_freely():
    pmodel = autopar.compile(MLP(), _x())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for batch in (8, 3, 5):
            assert pmodel(_x(batch)).shape == (batch, 8)


def test_other_sizes_keep_the_plan_and_say_so_once():
    model = nn.Sequential(nn.Linear(6, 4))
    pmodel = autopar.compile(model, torch.randn(2, 5, 6))  # (batch, sequence, features)
    plan = pmodel.plan
    with pytest.warns(UserWarning, match=r"^torch_autopar: input \[0\]\[0\] of Sequential has shape \(2, 9, 6\), "
                      r"the plan was made for \(2, 5, 6\): the plan is kept"):
        pmodel(torch.randn(2, 9, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pmodel(torch.randn(2, 7, 6))  # warned once per module
    assert pmodel.plan is plan


def test_graph_mode_refuses_too_many_shapes(monkeypatch):
    monkeypatch.setattr(checks, "MAX_GRAPH_SHAPES", 2)
    pmodel = autopar.compile(MLP(), _x(), mode="graph")
    pmodel(_x(8))
    pmodel(_x(4))
    pmodel(_x(8))  # seen: no new compilation
    with pytest.raises(autopar.AutoparError, match=PREFIX + r"graph mode compiles MLP once per input shape and "
                       r"has compiled 2; .*pad or bucket the inputs .*or run it in eager mode"):
        pmodel(_x(3))


# plan files -------------------------------------------------------------------------------------------------------
def _saved_plan(tmp_path, mesh=(1,)):
    path = tmp_path / "plan.json"
    autopar.plan(MLP(), _x(), mesh_shape=mesh, strategy="data_parallel").save(path)
    return path, json.loads(path.read_text())


@pytest.mark.parametrize(("edit", "pattern"), [
    (lambda d: d.pop("param_placements"), r"missing fields \['param_placements'\]"),
    (lambda d: d.update(pickle="cos\nsystem\n"), r"unknown fields \['pickle'\]"),
    (lambda d: d["param_placements"].update({"layers.0.weight": ["X"]}),
     r"plan field param_placements\['layers.0.weight'\] is \['X'\]; expected placements written as 'R'"),
    (lambda d: d["param_placements"].update({"layers.0.weight": ["R", "R"]}),
     r"is \['R', 'R'\]; expected one placement per mesh axis \(1\)"),
    (lambda d: d.update(mesh_shape=[0]), r"plan field mesh_shape is \[0\]; expected a list of positive integers"),
    (lambda d: d.update(axis_names=["dp", "tp"]), r"plan field axis_names is \['dp', 'tp'\]; expected 1 axis"),
    (lambda d: d.update(estimated_step_time="fast"), r"plan field estimated_step_time is 'fast'; expected a "
                                                     r"non-negative number"),
])
def test_tampered_plan_file_is_refused(tmp_path, edit, pattern):
    path, data = _saved_plan(tmp_path)
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(autopar.AutoparError, match=PREFIX + ".*" + pattern):
        autopar.Plan.load(path)


def test_hand_edited_placement_of_a_missing_dim_is_refused_by_compile(tmp_path):
    path, data = _saved_plan(tmp_path)
    data["param_placements"]["layers.0.bias"] = ["S(1)"]  # a 1-D bias: well formed, but no dim 1
    path.write_text(json.dumps(data))
    plan = autopar.Plan.load(path)
    with pytest.raises(autopar.AutoparError, match=PREFIX + r"plan: parameter 'layers.0.bias' is placed S\(1\) "
                       r"but has 1 dims \(shape \(64,\)\); expected S\(0\)..S\(0\) or 'R'"):
        autopar.compile(MLP(), _x(), strategy=plan)


# profile files ----------------------------------------------------------------------------------------------------
def _profile_file(tmp_path, edit):
    data = json.loads(hardware.PROFILES["h100"].to_json())
    edit(data)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("edit", "pattern"), [
    (lambda d: d.pop("memory_bandwidth"), r"missing fields \['memory_bandwidth'\]"),
    (lambda d: d["intra_node"].pop("bandwidth"), r"missing fields \['intra_node.bandwidth'\]"),
    (lambda d: d.update(flops={"bfloat16": 1e15}), r"missing fields \['flops.float32'\]"),
    (lambda d: d.update(inter_node=25e9), r"not objects of latency_s and bandwidth \['inter_node'\]"),
    (lambda d: d.update(colour="green"), r"unknown fields \['colour'\]"),
])
def test_profile_file_with_missing_fields(tmp_path, edit, pattern):
    path = _profile_file(tmp_path, edit)
    with pytest.raises(autopar.AutoparError, match=PREFIX + r"hardware='.*profile.json' is not a complete hardware "
                       r"profile \(.*" + pattern + r".*Measure it again with autopar.profile\(path\)"):
        autopar.plan(MLP(), _x(), mesh_shape=(2,), hardware=path)


def test_profile_file_that_is_not_json(tmp_path):
    path = tmp_path / "profile.json"
    path.write_bytes(b"\x80\x04\x95 a pickle, not JSON")
    with pytest.raises(autopar.AutoparError, match=PREFIX + r"hardware='.*': could not read a profile"):
        autopar.plan(MLP(), _x(), mesh_shape=(2,), hardware=str(path))


def test_complete_profile_file_still_loads(tmp_path):
    path = _profile_file(tmp_path, lambda d: None)
    assert hardware.get_profile(str(path)) == hardware.PROFILES["h100"]
