"""The profile a job plans with: the device's built-in one until a measurement is cached, ``hardware="measured"``
measuring once per machine and job shape, ranks agreeing on rank 0's copy, and compile planning with it."""

from __future__ import annotations

import dataclasses
import importlib
import os

import pytest
import torch

import torch_autopar as autopar
from torch_autopar.cost import PROFILES
from torch_autopar.cost.job_profile import CACHE_ENV, MEASURED, cache_path, job_profile
from torch_autopar.testing import run_on_ranks
from torch_autopar.testing.models import MLP

job_profile_module = importlib.import_module("torch_autopar.cost.job_profile")
profile_module = importlib.import_module("torch_autopar.cost.profile")  # the package exports the function
SECONDS = 0.004
"""What every timed call of a patched measurement takes: profiles come out exact and fast."""


@pytest.fixture
def fast_measurements(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(profile_module, "_best_time", lambda fn, device, repeats: SECONDS)


def _no_measuring(*args, **kwargs):
    raise AssertionError("measured again although a profile is cached")


def test_without_a_cached_profile_a_job_plans_with_its_devices_built_in_profile(fast_measurements):
    assert job_profile(None) == PROFILES["cpu-gloo"]
    assert job_profile("h100") == PROFILES["h100"]


def test_measured_is_measured_once_then_read_from_the_cache(fast_measurements, monkeypatch):
    measured = job_profile(MEASURED)
    assert measured.name == "measured-gloo-1"
    assert measured.flops["float32"] == pytest.approx(2 * 1024**3 / SECONDS, rel=1e-6)
    path = cache_path(torch.device("cpu"), 1, 1)
    assert path.is_file() and not list(path.parent.glob(".*.tmp"))
    monkeypatch.setattr(job_profile_module, "profile", _no_measuring)
    assert job_profile(MEASURED) == measured
    assert job_profile(None) == measured  # the default picks the machine's measurement up


def test_a_damaged_cached_profile_is_named_in_the_error(fast_measurements):
    path = cache_path(torch.device("cpu"), 1, 1)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: hardware=.*could not read a profile"):
        job_profile(None)


# two gloo ranks ----------------------------------------------------------------------------------------------
def _cached_on_some_ranks(rank, world, root, cached_on):
    """Each rank has its own cache directory; the ranks in ``cached_on`` hold a profile there."""
    os.environ[CACHE_ENV] = os.path.join(root, f"rank{rank}")
    if rank in cached_on:
        path = cache_path(torch.device("cpu"), world, world)
        path.parent.mkdir(parents=True)
        path.write_text(dataclasses.replace(PROFILES["h100"], name=f"cached-on-rank{rank}").to_json())
    profile_module._best_time = lambda fn, device, repeats: SECONDS
    return job_profile(MEASURED).name, job_profile(None).name


def test_ranks_use_a_cached_profile_only_when_every_rank_has_one_and_then_rank_0s(tmp_path):
    both = run_on_ranks(_cached_on_some_ranks, 2, str(tmp_path / "both"), (0, 1), timeout_s=120)
    assert both == [("cached-on-rank0", "cached-on-rank0")] * 2
    one = run_on_ranks(_cached_on_some_ranks, 2, str(tmp_path / "one"), (1,), timeout_s=120)
    # rank 0 lacks it: both measure and agree on one measurement, which rank 0 caches; then every rank has one
    assert one == [("measured-gloo-2", "measured-gloo-2")] * 2


def _compile_with_measured(rank, world):
    profile_module._best_time = lambda fn, device, repeats: SECONDS
    torch.manual_seed(0)
    first = autopar.compile(MLP(), torch.randn(4, 32), strategy="data_parallel", hardware=MEASURED)
    job_profile_module.profile = _no_measuring
    again = autopar.compile(MLP(), torch.randn(4, 32), strategy="data_parallel")
    return first.plan.hardware, again.plan.hardware, first.plan.estimated_step_time == again.plan.estimated_step_time


def test_compile_measures_on_first_use_and_later_jobs_plan_with_the_measurement(tmp_path):
    results = run_on_ranks(_compile_with_measured, 2, timeout_s=180, env={CACHE_ENV: str(tmp_path)})
    assert results == [("measured-gloo-2", "measured-gloo-2", True)] * 2
