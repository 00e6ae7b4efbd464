"""Run a function on N gloo ranks (processes of their own) with a timeout, or plan on a fake process group.

``run_on_ranks(fn, world_size, *args)`` starts ``world_size`` processes (by default forked from a fork server that
has imported torch and torch_autopar once, ``PRELOADED``: a job starts in a fraction of a second, not the seconds
of CPU each rank's imports cost; each rank gets the caller's environment as it is at the call, and its working
directory and import path, as a spawned process does), initialises gloo with a ``timeout_s`` for every
collective, calls ``fn(rank, world_size, *args)`` in each, and returns the per-rank results in rank order.
A rank that raises, hangs or dies fails the whole call with that rank's traceback (``allow_death=True``: a
rank killed on purpose gives None instead, and the others run on); nothing is left running. Must never be
imported by library code.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import tempfile
import time
import traceback
from multiprocessing import connection as mp_connection

import torch.distributed as dist
import torch.multiprocessing as mp

from torch_autopar import _compat


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, timeout_s, fn, args, out_dir, env, init):
    os.environ.clear()  # the caller's environment at the call, not the fork server's from its start
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch

    torch.set_num_threads(1)
    result = {"ok": False}
    try:
        if init:
            dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        result = {"ok": True, "value": fn(rank, world_size, *args)}
    except BaseException:  # reported to the parent, which fails the test with it
        result = {"ok": False, "error": traceback.format_exc()}
    finally:
        with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as handle:
            pickle.dump(result, handle)
        if dist.is_initialized():
            dist.destroy_process_group()


class RankFailure(AssertionError):
    pass


def run_on_ranks(fn, world_size: int, *args, timeout_s: float = 120.0, env: dict | None = None,
                 init: bool = True, allow_death: bool = False, start_method: str = "forkserver") -> list:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results in rank order.

    init: False leaves the process group to ``fn`` (e.g. ``autopar.init(timeout=...)``; the torchrun variables
    are set). allow_death: a rank that ends without a result (killed by a signal) gives None rather than
    failing the call, and the others are waited for (up to ``timeout_s`` + 60 s).
    start_method: "forkserver" (ranks forked from a process that imported ``PRELOADED`` once: they share its
    Python hash seed, and variables torch reads at import come from its start) or "spawn" (fresh interpreters,
    each with a hash seed of its own, as torchrun's: slower, and what checks that ranks agree without sharing one).
    The rendezvous port is picked free and released before the ranks bind it; if another process took it in
    between ("address already in use"), the job is started once more on a new port."""
    options = (timeout_s, {**os.environ, **(env or {})}, init, allow_death, start_method)
    try:
        return _run_once(fn, world_size, args, *options)
    except RankFailure as error:
        if "address already in use" not in str(error).lower() and "eaddrinuse" not in str(error).lower():
            raise
        return _run_once(fn, world_size, args, *options)


PRELOADED = ("torch_autopar", "torch_autopar.testing.dist", "torch_autopar.testing.models")
"""What the fork server imports once, so that each rank starts from a fork of a process that has them (importing
torch and torch_autopar anew costs each rank seconds of CPU, the most of a small job's time on a few cores)."""


def _run_once(fn, world_size: int, args: tuple, timeout_s: float, env: dict, init: bool, allow_death: bool,
              start_method: str) -> list:
    mp.get_context("forkserver").set_forkserver_preload(list(PRELOADED))
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_worker, args=(world_size, _free_port(), timeout_s, fn, args, out_dir, env, init),
                                     nprocs=world_size, join=False, start_method=start_method)
        deadline = time.monotonic() + timeout_s + 60
        try:
            _wait_for_ranks(context.processes, deadline, out_dir, world_size, allow_death)
        finally:
            _kill_alive(context.processes)
        return _collect(out_dir, world_size, missing_ok=allow_death)


def _wait_for_ranks(processes, deadline: float, out_dir: str, world_size: int, allow_death: bool) -> None:
    """Wait until every rank has exited. A rank's exit is read from its exit code (``waitpid`` of a spawned rank,
    the fork server's report of a forked one), never only from its sentinel pipe, which a process the rank forked
    (a DataLoader worker) may still hold open after the rank ended. A rank that exits with an error without writing
    a result fails the call at once (its peers would wait for it until their collective timeout), unless
    ``allow_death``."""
    while True:
        codes = [process.exitcode for process in processes]
        dead = [rank for rank, code in enumerate(codes)
                if code not in (None, 0) and not os.path.exists(os.path.join(out_dir, f"{rank}.pkl"))]
        if dead and not allow_death:  # checked first: ranks that all died between two polls died all the same
            raise RankFailure(f"rank {dead[0]} died with exit code {codes[dead[0]]} and no result\n"
                              + _collect_errors(out_dir, world_size))
        if all(code is not None for code in codes):
            return
        if time.monotonic() > deadline:
            raise RankFailure(f"ranks {[r for r, c in enumerate(codes) if c is None]} still running at the "
                              f"deadline: killed. {_collect_errors(out_dir, world_size)}")
        mp_connection.wait([process.sentinel for process in processes if process.exitcode is None], timeout=0.5)


def _kill_alive(processes) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()


def _collect_errors(out_dir: str, world_size: int) -> str:
    messages = []
    for rank in range(world_size):
        path = os.path.join(out_dir, f"{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as handle:
                result = pickle.load(handle)
            if not result["ok"]:
                messages.append(f"rank {rank}:\n{result['error']}")
    return "\n".join(messages)


def _collect(out_dir: str, world_size: int, missing_ok: bool = False) -> list:
    results, errors = [], []
    for rank in range(world_size):
        path = os.path.join(out_dir, f"{rank}.pkl")
        if not os.path.exists(path) and missing_ok:
            results.append(None)
            continue
        if not os.path.exists(path):
            errors.append(f"rank {rank}: no result (killed or timed out)")
            continue
        with open(path, "rb") as handle:
            result = pickle.load(handle)
        if result["ok"]:
            results.append(result["value"])
        else:
            errors.append(f"rank {rank}:\n{result['error']}")
    if errors:
        raise RankFailure("\n".join(errors))
    return results


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0):
    """A fake process group of ``world_size`` ranks in this process (collectives do nothing)."""
    if dist.is_initialized():
        raise AssertionError("a process group is already initialised in this process")
    dist.init_process_group("fake", store=_compat.fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
