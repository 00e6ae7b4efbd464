"""``Plan``: JSON save / load round trip, garbage files, ``explain()``, memory estimates and the memory budget,
checked on a small MLP whose figures can be worked out by hand."""

from __future__ import annotations

import json

import pytest
import torch

import torch_autopar as autopar
from torch_autopar.testing.models import MLP

DIMS = (32, 64, 64, 8)
PARAM_BYTES = 4 * sum(a * b + b for a, b in zip(DIMS[:-1], DIMS[1:]))  # 27,168


def _x(batch=16):
    return torch.randn(batch, DIMS[0], generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def dp_plan():
    return autopar.plan(MLP(DIMS), _x(), mesh_shape=(8,), strategy="data_parallel", hardware="h100")


def test_save_load_round_trip(dp_plan, tmp_path):
    path = tmp_path / "plan.json"
    dp_plan.save(path)
    loaded = autopar.Plan.load(path)
    assert loaded == dp_plan
    assert loaded.explain() == dp_plan.explain()
    data = json.loads(path.read_text())
    assert data["strategy"] == "data_parallel" and data["mesh_shape"] == [8]
    loaded.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == path.read_text()


def test_loaded_plan_runs(dp_plan, tmp_path):
    """A plan saved by autopar.plan for one device is accepted by compile in a one-process job."""
    one = autopar.plan(MLP(DIMS), _x(), mesh_shape=(1,), strategy="data_parallel")
    one.save(tmp_path / "one.json")
    torch.manual_seed(0)
    pmodel = autopar.compile(MLP(DIMS), strategy=autopar.Plan.load(tmp_path / "one.json"))
    torch.manual_seed(0)
    torch.testing.assert_close(pmodel(_x(4)), MLP(DIMS)(_x(4)), rtol=0, atol=0)


def _write(path, content):
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return path


@pytest.mark.parametrize("content", ["", "not json at all", "{\"strategy\": \"data_parallel\", "],
                         ids=["empty", "text", "truncated"])
def test_load_garbage_raises(tmp_path, content):
    path = _write(tmp_path / "garbage.json", content)
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: could not read a plan from .*Plan.save"):
        autopar.Plan.load(path)


def test_load_missing_file_raises(tmp_path):
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: could not read a plan"):
        autopar.Plan.load(tmp_path / "nowhere.json")


def test_load_other_format_version_raises(dp_plan, tmp_path):
    dp_plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    data["version"] = 999
    path = _write(tmp_path / "future.json", json.dumps(data))
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: plan format version 999 is not supported"):
        autopar.Plan.load(path)


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "[1, 2, 3]", "{\"version\": 1}"],
                         ids=["binary", "json-list", "json-missing-fields"])
def test_load_other_garbage_raises(tmp_path, content):
    path = _write(tmp_path / "garbage.json", content)
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: "):
        autopar.Plan.load(path)


def test_memory_estimate_by_hand(dp_plan):
    breakdown = dp_plan.memory_breakdown
    assert breakdown["parameters"] == PARAM_BYTES  # replicated on every device
    assert breakdown["gradients"] == PARAM_BYTES
    assert breakdown["optimizer"] == 2 * PARAM_BYTES  # Adam's two moments
    assert breakdown["activations"] > 0
    # the activations are freed as backward makes the gradients: the peak holds the larger (pricing.peak_bytes)
    larger = max(breakdown["activations"], breakdown["gradients"])
    assert dp_plan.peak_memory == 3 * PARAM_BYTES + larger + sum(
        v for k, v in breakdown.items() if k not in ("parameters", "gradients", "optimizer", "activations"))


def test_grad_sync_time_by_hand(dp_plan):
    """All-reduce of one bucket of 27,168 bytes over 8 H100s in a node: 2(p-1)·alpha + 2(p-1)/p·n/(bw·eff)."""
    (collective,) = dp_plan.collectives
    assert (collective.kind, collective.phase, collective.nbytes) == ("all_reduce", "grad_sync", PARAM_BYTES)
    expected = 2 * 7 * 3e-6 + 2 * 7 / 8 * PARAM_BYTES / (450e9 * 0.8)
    assert collective.seconds == pytest.approx(expected, rel=1e-12)
    assert dp_plan.exposed_comm_time >= collective.seconds * (1 - 1e-12)  # the last bucket cannot hide
    assert dp_plan.estimated_step_time == pytest.approx(dp_plan.compute_time + dp_plan.exposed_comm_time, rel=1e-12)


def test_memory_budget(dp_plan):
    exact = autopar.plan(MLP(DIMS), _x(), mesh_shape=(8,), strategy="data_parallel", hardware="h100",
                         memory_budget=dp_plan.peak_memory)
    assert exact.peak_memory == dp_plan.peak_memory
    with pytest.raises(autopar.AutoparError) as info:
        autopar.plan(MLP(DIMS), _x(), mesh_shape=(8,), strategy="data_parallel", hardware="h100",
                     memory_budget=dp_plan.peak_memory - 1)
    message = str(info.value)
    assert message.startswith("torch_autopar: no plan fits the memory budget")
    assert f"{dp_plan.peak_memory - 1:,} bytes" in message
    assert f"needs {dp_plan.peak_memory:,} bytes" in message


def test_explain_contents(dp_plan):
    lines = dp_plan.explain().splitlines()
    assert lines[0].startswith("torch_autopar plan: strategy=data_parallel")
    assert "dp=8" in lines[0] and "hardware=h100" in lines[0] and "global batch=16" in lines[0]
    text = "\n".join(lines)
    for index, (a, b) in enumerate(zip(DIMS[:-1], DIMS[1:])):
        row = next(line for line in lines if line.startswith(f"layers.{index} "))
        assert f"{a * b + b:,}" in row
    assert "all_reduce" in text and "grad_sync" in text
    assert "gradient buckets: 1" in text
    assert "estimated step time:" in text and "peak memory per device:" in text
    assert "ops replicated for lack of a sharding rule: none" in text


def test_stand_alone_plan_has_no_collectives():
    plan = autopar.plan(MLP(DIMS), _x(), mesh_shape=(1,), strategy="stand_alone")
    assert plan.collectives == [] and plan.exposed_comm_time == 0
    assert plan.param_placements == {name: ("R",) for name, _ in MLP(DIMS).named_parameters()}


def test_check_compatible(dp_plan):
    dp_plan.check_compatible(dp_plan.fingerprint, 8)
    with pytest.raises(autopar.AutoparError, match="another model"):
        dp_plan.check_compatible("0" * 16, 8)
    with pytest.raises(autopar.AutoparError, match="needs 8 ranks"):
        dp_plan.check_compatible(dp_plan.fingerprint, 4)


def test_every_node_of_the_joint_graph_has_a_layout_that_round_trips(tmp_path):
    """The plan carries what graph mode's per-rank program runs: an output layout for every op of the captured
    forward+backward (a tensor-parallel search on 4 ranks shards some of them) and the input layouts each op's
    strategy needs; save/load keeps them exactly."""
    plan = autopar.plan(MLP(DIMS), _x(), mesh_shape=(4,), strategy="fully_shard", hardware="h100", fold_layers=False)
    layouts = plan.node_layouts
    assert {"addmm", "mm", "t"} <= set(layouts), sorted(layouts)[:10]
    assert layouts["addmm"].inputs and all(len(p) == 1 for p in layouts["addmm"].inputs if p is not None)
    assert any("S(0)" in layout.output for layout in layouts.values() if isinstance(layout.output[0], str))
    plan.save(tmp_path / "plan.json")
    assert autopar.Plan.load(tmp_path / "plan.json").node_layouts == layouts
