"""``autopar.notebook_launcher(fn, nprocs=2)``: run ``fn`` on N ranks started from a Jupyter notebook.

The convention of accelerate's ``notebook_launcher``: the ranks are forked from the kernel (so ``fn`` may be
defined in the notebook), join a process group on loopback (127.0.0.1, a free port), and run ``fn(*args)``.
Every line a rank prints (stdout, stderr, progress bars) is shown in the cell, prefixed ``[rank r]``; a rank that
raises makes the launcher raise in the notebook with that rank's traceback; the values ``fn`` returns come back
in rank order. Must never bind anything but loopback unless told to, and never leave a rank running.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing
import os
import pickle
import selectors
import signal
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from torch_autopar.errors import AutoparError
from torch_autopar.launch.faults import is_collective_failure_message
from torch_autopar.launch.init import DEFAULT_TIMEOUT_S, init

LOOPBACK = "127.0.0.1"
FAILURE_GRACE_S = 10.0
"""After one rank fails, how long the others get to end on their own before they are stopped."""


class RankError(AutoparError):
    """A rank started by ``notebook_launcher`` raised; ``rank``, ``error_type`` and ``remote_traceback`` say
    where and what (the traceback is also chained as this error's cause, so Jupyter shows it)."""

    def __init__(self, message: str, *, rank: int, error_type: str, remote_traceback: str):
        super().__init__(message)
        self.rank, self.error_type, self.remote_traceback = rank, error_type, remote_traceback


class RemoteTraceback(Exception):
    """Carries a rank's formatted traceback (shown as the cause of a ``RankError``)."""

    def __str__(self) -> str:
        return self.args[0]


def notebook_launcher(fn, args: tuple = (), nprocs: int = 2, *, backend: str | None = None, timeout=None,
                      master_addr: str = LOOPBACK, master_port: int | None = None) -> list:
    """Run ``fn(*args)`` on ``nprocs`` ranks forked from this process; returns each rank's result in rank order.

    backend: as ``autopar.init`` (None: nccl with CUDA, else gloo); timeout: the process-group timeout (seconds).
    Output of every rank appears here prefixed by its rank; an exception in any rank is raised here as a
    ``RankError`` whose cause is that rank's traceback (the other ranks are stopped)."""
    _check_launchable(nprocs)
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="autopar-ranks-") as out_dir, _listen(master_addr, master_port) as sock:
        port, ranks = sock.getsockname()[1], []
        for rank in range(nprocs):
            read_fd, write_fd = os.pipe()
            env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
                   "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": master_addr, "MASTER_PORT": str(port)}
            process = context.Process(target=_rank_main,
                                      args=(fn, args, env, backend, timeout, write_fd, out_dir, sock.fileno()))
            process.start()
            os.close(write_fd)
            ranks.append((process, read_fd))
        sock.close()  # rank 0 serves the rendezvous store on its inherited copy
        try:
            _relay_output(ranks, out_dir)
        finally:
            _stop(ranks)
        return _results(out_dir, nprocs, [process.exitcode for process, _ in ranks])


def _check_launchable(nprocs: int) -> None:
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise AutoparError(f"notebook_launcher(nprocs={nprocs!r}): expected a positive number of ranks, e.g. 2.")
    if "fork" not in multiprocessing.get_all_start_methods():
        raise AutoparError("notebook_launcher forks the ranks from the notebook's kernel, which this platform "
                           "cannot do; run the function as a script under torchrun instead.")
    if dist.is_available() and dist.is_initialized():
        raise AutoparError("notebook_launcher starts its own ranks, but this kernel already joined a process "
                           "group; call it from a kernel without one (restart the kernel, skip autopar.init()).")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise AutoparError("notebook_launcher forks the ranks, which CUDA does not survive, and CUDA is already "
                           "initialised in this kernel; restart the kernel and keep CUDA work inside the "
                           "launched function.")


def _listen(address: str, port: int | None) -> socket.socket:
    """The rendezvous socket, bound to ``address`` only (loopback by default; a free port unless given): rank 0
    serves the job's store on it, so no port is picked free and then raced for."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((address, port or 0))
    sock.listen(128)
    return sock


def _store(env: dict, listen_fd: int, timeout):
    """The job's key-value store: served by rank 0 on the launcher's loopback socket, joined by the others."""
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else (timeout or DEFAULT_TIMEOUT_S)
    is_server = env["RANK"] == "0"
    return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_server,
                         datetime.timedelta(seconds=seconds), master_listen_fd=listen_fd if is_server else None)


def _rank_main(fn, args, env, backend, timeout, write_fd, out_dir, listen_fd) -> None:
    """A rank: its output to the launcher's pipe, a process group, ``fn``, its result or traceback to a file."""
    _redirect_output(write_fd)
    _forget_the_kernel()
    os.environ.update(env)
    try:
        if env["RANK"] != "0":
            os.close(listen_fd)
        init(backend, timeout=timeout, store=_store(env, listen_fd, timeout))
        result = {"ok": True, "value": fn(*args)}
    except BaseException as error:  # reported to the notebook, which raises it
        result = {"ok": False, "type": type(error).__name__, "message": str(error),
                  "traceback": traceback.format_exc()}
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    _write_result(out_dir, int(env["RANK"]), result)
    if dist.is_initialized():
        dist.destroy_process_group()


def _write_result(out_dir: str, rank: int, result: dict) -> None:
    try:
        payload = pickle.dumps(result)
    except Exception as error:  # an unpicklable return value: say so instead of losing the rank's answer
        payload = pickle.dumps({"ok": False, "type": type(error).__name__, "traceback": "",
                                "message": f"the function's return value could not be sent back: {error}"})
    with open(os.path.join(out_dir, f"{rank}.result"), "wb") as handle:
        handle.write(payload)


def _redirect_output(write_fd: int) -> None:
    """Send this process's stdout and stderr (Python's and the C++ libraries') into the launcher's pipe."""
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    with open(os.devnull) as null:
        os.dup2(null.fileno(), 0)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)


def _forget_the_kernel() -> None:
    """A forked rank must not talk to the notebook's kernel sockets: make IPython look absent (tqdm.auto then
    draws a text bar, which the launcher relays)."""
    shell_module = sys.modules.get("IPython.core.interactiveshell")
    if shell_module is not None:
        shell_module.InteractiveShell.clear_instance()


def _relay_output(ranks: list, out_dir: str) -> None:
    """Show every rank's output here, line by line, until all ranks end; stop them if one fails."""
    selector = selectors.DefaultSelector()
    buffers = {}
    for rank, (_, read_fd) in enumerate(ranks):
        os.set_blocking(read_fd, False)
        selector.register(read_fd, selectors.EVENT_READ, rank)
        buffers[rank] = b""
    failed_at, state = None, {"partial": None}
    while selector.get_map():
        for key, _ in selector.select(timeout=0.2):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                _show(key.data, buffers.pop(key.data), state, final=True)
                selector.unregister(key.fd)
                continue
            buffers[key.data] = _show(key.data, buffers[key.data] + chunk, state)
        failed_at = failed_at or _first_failure_time(ranks, out_dir)
        if failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
            _stop(ranks)
    selector.close()
    for process, _ in ranks:
        process.join()


def _show(rank: int, data: bytes, state: dict, final: bool = False) -> bytes:
    """Print each complete line of ``data`` prefixed by the rank; a progress bar's '\\r' updates redraw one line.
    Returns what is left of an incomplete line. ``state["partial"]``: the rank whose bar is drawn unfinished."""
    *lines, rest = data.split(b"\n")
    if final and rest:
        lines, rest = lines + [rest], b""
    prefix = f"[rank {rank}] "
    for line in lines:
        own_bar = state["partial"] == rank
        if own_bar and not line.strip(b"\r"):  # the newline that ends this rank's bar
            sys.stdout.write("\n")
        elif own_bar and line.startswith(b"\r"):  # the bar's last update, then its newline
            sys.stdout.write(f"\r{prefix}{_last_segment(line)}\n")
        else:
            if state["partial"] is not None:
                sys.stdout.write("\n")
            sys.stdout.write(f"{prefix}{_last_segment(line)}\n")
        state["partial"] = None
    if b"\r" in rest:  # a bar being drawn: show its latest state now
        text, rest = _last_segment(rest), b""
        if text:
            if state["partial"] not in (None, rank):
                sys.stdout.write("\n")
            sys.stdout.write(f"\r{prefix}{text}")
            state["partial"] = rank
    sys.stdout.flush()
    return rest


def _last_segment(line: bytes) -> str:
    segments = [s for s in line.decode(errors="replace").split("\r") if s]
    return segments[-1] if segments else ""


def _first_failure_time(ranks: list, out_dir: str) -> float | None:
    for rank, (process, _) in enumerate(ranks):
        if process.exitcode not in (None, 0) or _has_failed(out_dir, rank):
            return time.monotonic()
    return None


def _has_failed(out_dir: str, rank: int) -> bool:
    path = os.path.join(out_dir, f"{rank}.result")
    if not os.path.exists(path):
        return False
    result = _read_result(path)
    return result is not None and not result["ok"]


def _read_result(path: str) -> dict | None:
    try:
        with open(path, "rb") as handle:
            return pickle.load(handle)  # written by this launcher's own ranks, in its private directory
    except (EOFError, pickle.UnpicklingError):  # still being written
        return None


def _stop(ranks: list) -> None:
    for process, _ in ranks:
        if process.is_alive():
            os.kill(process.pid, signal.SIGTERM)
            process.join(5)
        if process.is_alive():
            process.kill()
            process.join()


def _results(out_dir: str, nprocs: int, exitcodes: list) -> list:
    results = []
    for rank in range(nprocs):
        path = os.path.join(out_dir, f"{rank}.result")
        result = _read_result(path) if os.path.exists(path) else None
        if result is None:
            results.append({"ok": False, "type": "RankDied", "traceback": "", "message":
                            f"rank {rank} ended without a result (exit code {exitcodes[rank]}; negative: killed "
                            "by that signal)"})
        else:
            results.append(result)
    _raise_first_failure(results, nprocs)
    return [result["value"] for result in results]


def _raise_first_failure(results: list, nprocs: int) -> None:
    failures = [(rank, r) for rank, r in enumerate(results) if not r["ok"]]
    if not failures:
        return
    origin = [(rank, r) for rank, r in failures if not _is_follow_on(r)] or failures
    rank, result = origin[0]
    others = [str(other) for other, _ in failures if other != rank]
    also = f" (rank {', '.join(others)} then failed too)" if others else ""
    error = RankError(
        f"rank {rank} of {nprocs} raised {result['type']}: {result['message']}{also}. Its traceback is shown "
        "above; the launched function must run on every rank without error.",
        rank=rank, error_type=result["type"], remote_traceback=result["traceback"])
    raise error from RemoteTraceback(f"\n\nTraceback of rank {rank}:\n{result['traceback']}")


def _is_follow_on(result: dict) -> bool:
    """A rank that failed only because another one did (its collective lost the peer: gloo says the connection
    was closed or reset, depending on which side saw the dead peer first)."""
    return result["type"] in ("RankFailureError", "RankDied") or "collective failed" in result["message"] or \
        ((result["type"] == "RuntimeError" or result["type"].startswith("Dist"))
         and is_collective_failure_message(result["message"]))
