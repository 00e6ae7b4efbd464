"""Hardware profiles: built-in names, JSON files, and a clear error for anything else."""

from __future__ import annotations

import dataclasses

import pytest

import torch_autopar as autopar
from torch_autopar.cost import PROFILES, HardwareProfile, get_profile


@pytest.mark.parametrize("name", ["cpu-gloo", "a100", "h100", "h200", "ascend-910b"])
def test_builtin_profiles(name):
    profile = get_profile(name)
    assert profile.name == name and profile.memory_bytes > 0 and profile.peak_flops("float32") > 0
    assert profile.intra_node.bandwidth >= profile.inter_node.bandwidth


def test_default_and_instance():
    assert get_profile(None) is PROFILES["cpu-gloo"]
    assert get_profile(PROFILES["h100"]) is PROFILES["h100"]
    assert PROFILES["h100"].peak_flops("float8") == PROFILES["h100"].peak_flops("float32")


def test_profile_json_file_round_trip(tmp_path):
    custom = dataclasses.replace(PROFILES["h100"], name="my-cluster", memory_bytes=40 << 30)
    path = tmp_path / "profile.json"
    path.write_text(custom.to_json())
    assert get_profile(str(path)) == custom
    assert get_profile(path) == custom
    assert isinstance(get_profile(path), HardwareProfile)


def test_unknown_hardware_raises():
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: hardware='tpu': expected one of .*'h100'"):
        get_profile("tpu")
