"""The hardware profile a job plans with: a built-in or given one, or one measured on this machine and cached.

``job_profile(hardware)`` resolves ``compile``'s ``hardware=`` inside the job (every rank calls it, at the same
point of planning):
  a name, path or ``HardwareProfile``   that profile (``get_profile``);
  None                                  the profile measured earlier on this machine for this backend, device and
                                        number of ranks, if one is cached, else the device's built-in profile;
  "measured"                            the cached profile, measured now (``autopar.profile``) on first use.
The cache is one JSON file per (backend, device, world size, ranks per node) in ``$AUTOPAR_PROFILE_CACHE`` (else
``~/.cache/torch_autopar/profiles``): a measurement is the machine's, reused by later jobs of the same shape.
Ranks agree on one profile: it is used only when every rank finds it, and then rank 0's copy is the one read
(broadcast as JSON bytes: nothing is unpickled). Each node's local rank 0 writes it, atomically (a temporary
file renamed), so a job killed mid-write leaves no half-written profile. Must never plan anything.
"""

from __future__ import annotations

import json
import os
import platform
import re
from pathlib import Path

import torch
import torch.distributed as dist

from torch_autopar.cost.hardware import HardwareProfile, get_profile
from torch_autopar.cost.profile import base_profile, device_for_job, profile
from torch_autopar.launch import detect_backend

MEASURED = "measured"
"""``hardware=`` value that measures this machine on first use and reuses the measurement after."""

CACHE_ENV = "AUTOPAR_PROFILE_CACHE"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "torch_autopar" / "profiles")


def device_name(device: torch.device) -> str:
    """The model of the device ranks compute on (the CPU's model name on CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "npu":
        return torch.npu.get_device_name(device)  # type: ignore[attr-defined]
    try:
        with open("/proc/cpuinfo") as handle:
            names = [line.split(":", 1)[1] for line in handle if line.startswith("model name")]
        if names:
            return names[0].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def cache_path(device: torch.device, world: int, local_world: int) -> Path:
    """Where the profile of ``world`` ranks (``local_world`` per node) on ``device``'s kind is cached."""
    backend = dist.get_backend() if dist.is_initialized() else detect_backend()
    model = re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")
    return cache_dir() / f"{backend}-{model}-{world}x{local_world}.json"


def job_profile(hardware=None) -> HardwareProfile:
    """The profile ``hardware=`` names for this job (see the module docstring); every rank must call it."""
    if hardware is not None and not (isinstance(hardware, str) and hardware == MEASURED):
        return get_profile(hardware)
    device = device_for_job()
    world = dist.get_world_size() if dist.is_initialized() else 1
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    path = cache_path(device, world, local_world)
    cached = _agreed_cached(path, device)
    if cached is not None:
        return cached
    if hardware is None:
        return base_profile(None, device)
    measured = profile()
    if int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0)) == 0:
        _write_atomically(path, measured.to_json())
    if dist.is_initialized():
        dist.barrier()
    return measured


def _agreed_cached(path: Path, device: torch.device) -> HardwareProfile | None:
    """Rank 0's cached profile when every rank has one at ``path``, else None."""
    if not dist.is_initialized():
        return get_profile(str(path)) if path.is_file() else None
    everywhere = torch.tensor([int(path.is_file())], device=device)
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
    if not everywhere.item():
        return None
    payload = path.read_bytes() if dist.get_rank() == 0 else b""
    size = torch.tensor([len(payload)], device=device)
    dist.broadcast(size, src=0)
    data = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == 0:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(data, src=0)
    return HardwareProfile.from_dict(json.loads(bytes(data.cpu().tolist()).decode()),
                                     where=f"the cached profile {str(path)!r}")


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
