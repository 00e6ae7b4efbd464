"""``autopar.init()``: read torchrun's environment, choose hccl / nccl / gloo, join the process group.

Harmless in a single process (no torchrun variables: nothing is initialised, rank 0 of 1) and when called
twice. Must never import ``torch_npu`` at module import time: it is optional and breaks ``import torch``
where Ascend's CANN is missing.
"""

from __future__ import annotations

import datetime
import importlib
import os
import socket

import torch
import torch.distributed as dist

from torch_autopar.errors import AutoparError
from torch_autopar.launch.faults import set_configured_timeout_s

DEFAULT_TIMEOUT_S = 300.0
"""Five minutes: how long a collective waits for a late rank before every other rank fails with a
``torch_autopar:`` error (a dead rank is noticed at once). Long enough for one rank compiling a graph while
the others wait; short enough that a stalled job ends the same coffee break."""

_VALID_BACKENDS = ("gloo", "nccl", "hccl")
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _npu_available() -> bool:
    """True when the optional ``torch_npu`` imports and sees at least one Ascend NPU."""
    try:
        torch_npu = importlib.import_module("torch_npu")
    except Exception:  # ImportError, or a broken CANN install raising anything at import
        return False
    npu = getattr(torch_npu, "npu", None) or getattr(torch, "npu", None)
    try:
        return bool(npu is not None and npu.is_available() and npu.device_count() > 0)
    except Exception:
        return False


def detect_backend() -> str:
    """"hccl" with torch_npu and an NPU, "nccl" with CUDA, "gloo" otherwise."""
    if _npu_available():
        return "hccl"
    if torch.cuda.is_available():
        return "nccl"
    return "gloo"


def _launched_by_torchrun() -> bool:
    return all(name in os.environ for name in _TORCHRUN_VARS)


def _bind_local_device(backend: str) -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    elif backend == "hccl":
        torch.npu.set_device(local_rank)  # type: ignore[attr-defined]


def init(backend: str | None = None, *, timeout: float | datetime.timedelta | None = None,
         timeout_s: float | None = None, store=None) -> bool:
    """Join the process group torchrun set up; returns True when a process group is (now) initialised.

    backend: None picks by hardware (see ``detect_backend``); otherwise one of "gloo", "nccl", "hccl".
    timeout: seconds (or a timedelta) a collective waits for the other ranks before this rank fails with a
    ``torch_autopar:`` error naming the step and, where it can tell, the missing rank; default
    ``DEFAULT_TIMEOUT_S`` (5 minutes). ``timeout_s`` is the older spelling of the same setting. It applies to a
    process group this call creates (one that already exists keeps its own).
    store: a c10d ``Store`` to meet on instead of connecting to MASTER_ADDR:MASTER_PORT (rank and world size
    still come from RANK and WORLD_SIZE); ``notebook_launcher`` passes one bound to loopback.
    With MASTER_ADDR on loopback, gloo's transport is bound to the loopback interface too (unless
    GLOO_SOCKET_IFNAME says otherwise): a one-machine job listens on nothing another machine can reach.
    """
    if backend is not None and backend not in _VALID_BACKENDS:
        raise AutoparError(
            f"init(backend={backend!r}) expected one of {_VALID_BACKENDS} or None (auto-detect); "
            "pass a valid name or leave it out."
        )
    seconds = _timeout_seconds(timeout, timeout_s)
    if dist.is_available() and dist.is_initialized():
        return True
    if not _launched_by_torchrun():
        return False
    chosen = backend or detect_backend()
    if chosen == "hccl":
        importlib.import_module("torch_npu")
    _bind_local_device(chosen)
    _bind_gloo_to_loopback(chosen)
    where = {} if store is None else {"store": store, "rank": int(os.environ["RANK"]),
                                      "world_size": int(os.environ["WORLD_SIZE"])}
    dist.init_process_group(backend=chosen, timeout=datetime.timedelta(seconds=seconds), **where)
    set_configured_timeout_s(seconds)
    return True


_LOOPBACK_ADDRESSES = ("127.0.0.1", "localhost", "::1")


def _bind_gloo_to_loopback(backend: str) -> None:
    """A job whose rendezvous is on loopback runs on one machine: make gloo listen on loopback only."""
    if backend != "gloo" or os.environ.get("MASTER_ADDR") not in _LOOPBACK_ADDRESSES:
        return
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    if names:
        os.environ["GLOO_SOCKET_IFNAME"] = names[0]


def _timeout_seconds(timeout, timeout_s) -> float:
    """The process-group timeout in seconds from ``init``'s two spellings (at most one given)."""
    if timeout is not None and timeout_s is not None:
        raise AutoparError(f"init(timeout={timeout!r}, timeout_s={timeout_s!r}): give one of them (the same "
                           "setting), not both.")
    value = timeout if timeout is not None else timeout_s
    if value is None:
        return DEFAULT_TIMEOUT_S
    seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise AutoparError(f"init(timeout={value!r}): expected a positive number of seconds or a timedelta, "
                           "e.g. timeout=300.")
    return float(seconds)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's global rank; 0 outside a distributed job."""
    if is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def get_world_size() -> int:
    """Number of ranks in the job; 1 outside a distributed job."""
    if is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))
