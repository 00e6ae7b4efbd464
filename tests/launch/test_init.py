"""``autopar.init()``: harmless in one process, joins the job torchrun describes, picks hccl / nccl / gloo.

torch_npu is never installed: a fake module stands in for it in ``sys.modules``.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import torch.distributed as dist

import torch_autopar as autopar
from torch_autopar.launch import detect_backend

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)


def _fake_torch_npu(available=True, count=1, raises=False):
    module = types.ModuleType("torch_npu")

    def is_available():
        if raises:
            raise RuntimeError("CANN driver not loaded")
        return available

    module.npu = types.SimpleNamespace(is_available=is_available, device_count=lambda: count)
    return module


def test_harmless_in_one_process(no_torchrun):
    assert autopar.init() is False
    assert autopar.init() is False  # twice
    assert not dist.is_initialized()
    assert autopar.get_rank() == 0 and autopar.get_world_size() == 1


def test_invalid_backend_raises(no_torchrun):
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: init\(backend='bogus'\) expected one of "
                                                   r"\('gloo', 'nccl', 'hccl'\)"):
        autopar.init(backend="bogus")


def test_detects_hccl_with_torch_npu_and_an_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu())
    assert detect_backend() == "hccl"


@pytest.mark.parametrize("fake", [None, "no-device", "zero-devices", "raising"])
def test_falls_back_without_a_usable_npu(monkeypatch, fake):
    modules = {None: None, "no-device": _fake_torch_npu(available=False),
               "zero-devices": _fake_torch_npu(count=0), "raising": _fake_torch_npu(raises=True)}
    monkeypatch.setitem(sys.modules, "torch_npu", modules[fake])  # None: `import torch_npu` raises ImportError
    assert detect_backend() == "gloo"  # this machine has no CUDA either
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert detect_backend() == "nccl"


def test_npu_wins_over_cuda(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert detect_backend() == "hccl"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_joins_the_job_torchrun_describes(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        assert autopar.init(timeout_s=30) is True
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert autopar.get_rank() == 0 and autopar.get_world_size() == 1
        assert autopar.init() is True  # twice
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_torchrun_two_ranks(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        import torch_autopar as autopar
        assert autopar.init() is True
        rank, world = autopar.get_rank(), autopar.get_world_size()
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)
        print(f"rank {rank}/{world} backend {dist.get_backend()} sum {value.item()}")
        dist.destroy_process_group()
    """))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(_free_port())]
    result = subprocess.run([*torchrun, str(script)], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    assert lines == ["rank 0/2 backend gloo sum 3.0", "rank 1/2 backend gloo sum 3.0"]
