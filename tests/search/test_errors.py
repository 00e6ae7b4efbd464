"""Planning mistakes a user can make, each an ``AutoparError`` whose message starts with ``torch_autopar:`` and
says what was expected, what was found and how to fix it: infeasible budgets, meshes that do not match the
job, plans for another model, plan files of another format version."""

from __future__ import annotations

import json
import re

import pytest
import torch

import torch_autopar as autopar
from torch_autopar.launch import offline_mesh
from torch_autopar.testing.models import MLP

PREFIX = r"^torch_autopar: "


def _x(batch=16):
    return torch.randn(batch, 32, generator=torch.Generator().manual_seed(0))


# memory budget -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["data_parallel", "fully_shard", "auto"])
def test_infeasible_budget_names_the_budget_and_the_smallest_need(strategy):
    with pytest.raises(autopar.AutoparError, match=PREFIX + r"no .*fits the memory budget of 1,000 bytes") as info:
        autopar.plan(MLP(), _x(), mesh_shape=(2,), strategy=strategy, memory_budget=1000)
    message = str(info.value)
    needed = [int(n.replace(",", "")) for n in re.findall(r"(\d[\d,]*) bytes", message)]
    assert needed[0] == 1000 and needed[-1] > 1000, message
    assert "Raise memory_budget" in message


# meshes --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mesh", [(3,), (3, 1), 3, (2, 2)])
def test_compile_mesh_must_cover_this_one_process_job(mesh):
    shape = (mesh,) if isinstance(mesh, int) else mesh
    with pytest.raises(autopar.AutoparError, match=PREFIX + re.escape(f"mesh={shape} has ")
                       + r"\d+ devices but this job has 1 ranks"):
        autopar.compile(MLP(), mesh=mesh)


@pytest.mark.parametrize(("shape", "pattern"), [
    ((0,), r"found \(0,\)"),
    ((4, -2), r"found \(4, -2\)"),
    ((), r"found \(\)"),
])
def test_offline_mesh_refuses_bad_shapes(shape, pattern):
    expected = PREFIX + r"mesh_shape: expected a mesh shape of positive sizes such as \(8,\) .*" + pattern
    with pytest.raises(autopar.AutoparError, match=expected):
        with offline_mesh(shape):
            pass
    with pytest.raises(autopar.AutoparError, match=expected):
        autopar.plan(MLP(), _x(), mesh_shape=shape)


def test_offline_mesh_refuses_axis_names_of_another_length():
    with pytest.raises(autopar.AutoparError, match=PREFIX + r"axis_names \('dp', 'tp'\) must name each of the 3"):
        with offline_mesh((2, 2, 2), ("dp", "tp")):
            pass


@pytest.mark.parametrize("shape", [8, "8x8"])
def test_plan_mesh_shape_that_is_not_a_tuple(shape):
    try:
        plan = autopar.plan(MLP(), _x(), mesh_shape=shape, strategy="data_parallel")
    except autopar.AutoparError:
        return
    assert plan.world_size == (8 if shape == 8 else 64)


@pytest.mark.parametrize("shape", [(2.5,), (True, 2)])
def test_plan_mesh_sizes_must_be_integers(shape):
    with pytest.raises(autopar.AutoparError, match=PREFIX):
        autopar.plan(MLP(), _x(), mesh_shape=shape, strategy="data_parallel")


def test_plan_under_a_meta_default_device():
    with torch.device("meta"):
        model = MLP()
        plan = autopar.plan(model, torch.empty(16, 32), mesh_shape=(2,), strategy="data_parallel")
    assert plan.world_size == 2


# plans for another model / format ------------------------------------------------------------------------------
def test_plan_file_for_another_model_is_refused_by_compile(tmp_path):
    path = tmp_path / "mlp.json"
    autopar.plan(MLP(), _x(), mesh_shape=(1,), strategy="data_parallel").save(path)
    other = MLP(dims=(32, 48, 8))
    pmodel = autopar.compile(other, strategy=autopar.Plan.load(path))
    with pytest.raises(autopar.AutoparError, match=PREFIX + r"this plan was made for another model \(fingerprint "
                       r"[0-9a-f]{16}, this model has [0-9a-f]{16}\).*Plan again"):
        pmodel(_x())
    with pytest.raises(autopar.AutoparError, match=PREFIX + r"this plan was made for another model"):
        autopar.compile(other, _x(), strategy=autopar.Plan.load(path))


def test_plan_file_for_another_world_size_is_refused_by_compile(tmp_path):
    path = tmp_path / "four.json"
    autopar.plan(MLP(), _x(), mesh_shape=(4,), strategy="data_parallel").save(path)
    needs = r"this plan needs 4 ranks \(mesh \(4,\)\) but the job has 1"
    with pytest.raises(autopar.AutoparError, match=PREFIX + needs):
        autopar.compile(MLP(), _x(), strategy=autopar.Plan.load(path))


@pytest.mark.parametrize("version", [0, 2, "1", None, "missing"])
def test_plan_file_of_another_format_version(tmp_path, version):
    path = tmp_path / "plan.json"
    autopar.plan(MLP(), _x(), mesh_shape=(2,), strategy="data_parallel").save(path)
    data = json.loads(path.read_text())
    assert data["version"] == 1
    if version == "missing":
        del data["version"]
    else:
        data["version"] = version
    path.write_text(json.dumps(data))
    expected = repr(None if version == "missing" else version)
    with pytest.raises(autopar.AutoparError, match=PREFIX + re.escape(f"plan format version {expected} is not "
                       "supported (expected 1)") + r".*plan again"):
        autopar.Plan.load(path)


def test_a_plan_that_round_trips_still_loads(tmp_path):
    """Counter-check for the version tests: the untouched file loads and is used by compile."""
    path = tmp_path / "plan.json"
    plan = autopar.plan(MLP(), _x(), mesh_shape=(1,), strategy="data_parallel")
    plan.save(path)
    loaded = autopar.Plan.load(path)
    assert loaded == plan
    assert autopar.compile(MLP(), _x(), strategy=loaded).plan is loaded
