"""``autopar.profile()``: measured figures are positive and finite, in one process and on 2 gloo ranks (no
assertion on how fast this machine is); rates are work over the timed seconds; the alpha-beta fit recovers a
known link exactly; the saved JSON loads back with ``get_profile`` and plans; skinny matmuls are priced at the
fraction of the square rate their shape class reaches."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

import torch_autopar as autopar
from torch_autopar.cost import CostModel, HardwareProfile, Link, get_profile
from torch_autopar.cost.pricing import compute_seconds
from torch_autopar.cost.profile import Sample, fit_link, ring_terms
from torch_autopar.testing import run_on_ranks
from torch_autopar.testing.models import MLP

profile_module = importlib.import_module("torch_autopar.cost.profile")  # the package exports the function

SMALL = dict(sizes=(1 << 10, 1 << 14, 1 << 18), matmul_size=128, copy_bytes=4 << 20, repeats=3)
"""Problem sizes small enough for a busy 2-core machine."""


def _positive_finite(profile: HardwareProfile) -> None:
    figures = [profile.flops["float32"], profile.memory_bandwidth, profile.memory_bytes, profile.op_overhead_s,
               profile.intra_node.latency_s + profile.intra_node.call_s, profile.intra_node.bandwidth,
               profile.inter_node.latency_s + profile.inter_node.call_s, profile.inter_node.bandwidth]
    for value in figures:
        assert math.isfinite(value) and value > 0, profile
    for link in (profile.intra_node, profile.inter_node):  # a fitted hop or call latency may be 0, never negative
        assert link.latency_s >= 0 and link.call_s >= 0, link


# the fit -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4, 8])
def test_fit_recovers_the_link_the_cost_model_was_given(world):
    """Times made by CostModel.collective_time from a known link fit back to that link (both kinds mixed)."""
    link = Link(latency_s=7e-6, bandwidth=12e9, call_s=3e-5)
    hardware = HardwareProfile(name="known", flops={"float32": 1e12}, memory_bandwidth=1e12, memory_bytes=1 << 30,
                               devices_per_node=world, intra_node=link, inter_node=link, comm_efficiency=1.0)
    cost = CostModel(hardware, (world,))
    samples = [Sample(kind=kind, nbytes=n, world=world, seconds=cost.collective_time(kind, 0, n))
               for kind in ("all_reduce", "all_gather") for n in (1 << 10, 1 << 16, 1 << 22)]
    fitted = fit_link(samples)
    assert fitted.latency_s == pytest.approx(7e-6, rel=1e-9)
    assert fitted.call_s == pytest.approx(3e-5, rel=1e-9)
    assert fitted.bandwidth == pytest.approx(12e9, rel=1e-9)


def test_fit_tells_a_cost_per_call_from_a_cost_per_hop():
    """On 2 gloo ranks in a step an all_reduce (2 hops) takes what an all_gather (1 hop) of the same latency
    does: the fit puts the latency on the call, none on the hop."""
    samples = [Sample(kind=kind, nbytes=n, world=2, seconds=1.2e-3 + ring_terms(kind, 2)[1] * n * 1e-9)
               for kind in ("all_reduce", "all_gather") for n in (1 << 10, 1 << 16, 1 << 20)]
    link = fit_link(samples)
    assert link.call_s == pytest.approx(1.2e-3, rel=1e-6)
    assert link.latency_s == pytest.approx(0.0, abs=1e-12)
    assert link.bandwidth == pytest.approx(1e9, rel=1e-6)


def test_ring_terms_are_the_ring_formulas():
    assert ring_terms("all_reduce", 4) == pytest.approx((6, 1.5))
    assert ring_terms("all_gather", 4) == pytest.approx((3, 0.75))
    assert ring_terms("all_reduce", 2) == pytest.approx((2, 1.0))


def test_fit_keeps_both_coefficients_positive_on_noisy_data():
    """Times that fall with size (noise) would fit a negative beta: both figures stay positive and finite."""
    samples = [Sample(kind="all_reduce", nbytes=n, world=2, seconds=t)
               for n, t in [(1 << 10, 3e-4), (1 << 16, 2e-4), (1 << 20, 1e-4)]]
    link = fit_link(samples)
    latency, beta = link.call_s + 2 * link.latency_s, 1 / link.bandwidth  # 2 steps of an all_reduce on 2 ranks
    assert 0 < latency < math.inf and 0 < beta < math.inf
    assert 1e-4 <= latency <= 3e-4  # the latency term lies within the measured times
    assert beta <= 1e-4 / (1 << 20)  # at most what the largest message allows


# one process -------------------------------------------------------------------------------------------------
def test_profile_in_one_process_measures_compute_and_keeps_default_links(tmp_path):
    path = tmp_path / "measured.json"
    profile = autopar.profile(path, **SMALL)
    _positive_finite(profile)
    assert profile.name == "measured-gloo-1"
    base = get_profile("cpu-gloo")
    assert (profile.intra_node, profile.inter_node) == (base.intra_node, base.inter_node)
    assert profile.compute_efficiency == 1.0 and profile.comm_efficiency == 1.0
    assert get_profile(str(path)) == profile
    assert json.loads(path.read_text())["name"] == "measured-gloo-1"


def test_profile_turns_timings_into_the_rates_it_reports(monkeypatch):
    """With every timed call taking a known time, the figures are exactly the work divided by that time (no
    assertion on the speed of the machine running the test)."""
    seconds = 0.004
    monkeypatch.setattr(profile_module, "_best_time", lambda fn, device, repeats: seconds)
    profile = autopar.profile(**SMALL)
    n, copied = SMALL["matmul_size"], SMALL["copy_bytes"]
    assert profile.flops["float32"] == pytest.approx(2 * n**3 / seconds, rel=1e-6)  # fp32 round trip
    assert profile.memory_bandwidth == pytest.approx(2 * copied / seconds, rel=1e-6)
    assert profile.op_overhead_s == pytest.approx(seconds / 400, rel=1e-6)  # 200 links, forward and backward


def test_a_saved_profile_plans_by_path_and_by_object(tmp_path):
    path = tmp_path / "measured.json"
    profile = autopar.profile(path, **SMALL)
    x = torch.empty(16, 32, device="meta")
    with torch.device("meta"):
        model = MLP()
    by_path = autopar.plan(model, x, mesh_shape=(2,), hardware=str(path), strategy="data_parallel")
    by_object = autopar.plan(model, x, mesh_shape=(2,), hardware=profile, strategy="data_parallel")
    assert by_path.hardware == by_object.hardware == "measured-gloo-1"
    assert by_path.estimated_step_time == by_object.estimated_step_time > 0


@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"sizes": (4096,)}, r"at least two positive message sizes"),
    ({"sizes": (4096, 0)}, r"at least two positive message sizes"),
    ({"repeats": 0}, r"at least 1 timed repetition"),
])
def test_profile_checks_its_arguments(kwargs, pattern):
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: profile\(.*" + pattern):
        autopar.profile(**kwargs)


# two gloo ranks ----------------------------------------------------------------------------------------------
def _profile_on_rank(rank, world, path):
    return autopar.profile(path, **SMALL)


def test_profile_on_two_gloo_ranks(tmp_path):
    path = str(tmp_path / "measured2.json")
    profiles = run_on_ranks(_profile_on_rank, 2, path, timeout_s=120)
    assert profiles[0] == profiles[1], "ranks must agree on one profile"
    profile = profiles[0]
    _positive_finite(profile)
    assert profile.name == "measured-gloo-2"
    assert profile.devices_per_node == 2
    assert profile.intra_node != get_profile("cpu-gloo").intra_node  # measured, not the default
    assert profile.inter_node == get_profile("cpu-gloo").inter_node
    assert get_profile(path) == profile


# matmul shape classes ----------------------------------------------------------------------------------------
def test_profile_measures_the_fraction_of_the_square_rate_skinny_matmuls_reach(monkeypatch):
    """Every timed call taking the same time, a matmul with one dimension s instead of n reaches s / n of the
    square rate: the fractions come out exactly that, for both shape classes, ending at the square itself."""
    monkeypatch.setattr(profile_module, "_best_time", lambda fn, device, repeats: 0.004)
    n = SMALL["matmul_size"]
    rates = autopar.profile(**SMALL).matmul_rates
    expected = [[s, pytest.approx(s / n, rel=1e-9)] for s in profile_module.small_dimensions(n)] + [[n, 1.0]]
    assert rates == {"rows": expected, "inner": expected}


def test_matmul_fraction_reads_the_shape_class_of_the_small_dimension():
    hardware = dataclasses.replace(get_profile("cpu-gloo"), matmul_rates={
        "rows": [[16, 0.25], [256, 0.75], [1024, 1.0]], "inner": [[16, 0.5], [1024, 1.0]]})
    assert hardware.matmul_fraction(16, 1024, 1024) == 0.25  # few rows
    assert hardware.matmul_fraction(1024, 1024, 8) == 0.25  # few columns: same class, held flat below 16
    assert hardware.matmul_fraction(64, 1024, 1024) == pytest.approx(0.5)  # halfway from 16 to 256 in log
    assert hardware.matmul_fraction(1024, 16, 1024) == 0.5  # the summed dimension small
    assert hardware.matmul_fraction(4096, 4096, 4096) == 1.0
    assert get_profile("h100").matmul_fraction(16, 1024, 1024) == 1.0  # datasheet: no classes


def _mm_node(rows: int):
    graph = make_fx(torch.mm)(torch.empty(rows, 1024, device="meta"), torch.empty(1024, 1024, device="meta"))
    return next(n for n in graph.graph.nodes if n.target == torch.ops.aten.mm.default)


def test_a_skinny_matmul_is_priced_at_the_rate_its_shape_reaches():
    compute_bound = dict(memory_bandwidth=1e30, op_overhead_s=0.0)
    flat = dataclasses.replace(get_profile("cpu-gloo"), **compute_bound)
    classed = dataclasses.replace(flat, matmul_rates={"rows": [[16, 0.25], [1024, 1.0]], "inner": []})
    for rows, slower in ((16, 4.0), (1024, 1.0)):
        node = _mm_node(rows)
        times = [compute_seconds(node, 2 * rows * 1024 * 1024, [None, None], None, CostModel(h, (1,)))
                 for h in (flat, classed)]
        assert times[1] == pytest.approx(slower * times[0], rel=1e-12)
    node = _mm_node(32)  # 32 rows sharded over 2 ranks: each computes 16 rows
    sharded = [(Shard(0),), (Replicate(),)]
    flops = 2 * 32 * 1024 * 1024
    assert compute_seconds(node, flops, sharded, None, CostModel(classed, (2,))) == pytest.approx(
        4 * compute_seconds(node, flops, sharded, None, CostModel(flat, (2,))), rel=1e-12)
