"""A dead or stalled rank ends the job with a ``torch_autopar:`` error naming the step and the missing rank,
within the process-group timeout ``autopar.init(timeout=...)`` sets: never a hang.

Each test trains 2 gloo ranks; after step 2, rank 1 is killed with a real SIGKILL or sleeps instead of calling
the next collective. Times are measured (and printed with -s) but only checked against generous bounds: this
machine is shared.
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F

import torch_autopar as autopar
from torch_autopar.errors import RankFailureError
from torch_autopar.launch import faults
from torch_autopar.launch.init import DEFAULT_TIMEOUT_S
from torch_autopar.testing import run_on_ranks
from tests import support

SHORT_TIMEOUT_S = 5.0
FAULT_STEP = 3
"""Rank 1 completes steps 1 and 2, then dies or stalls instead of step 3."""


def _stamp(directory: str, name: str) -> None:
    with open(os.path.join(directory, name), "w") as handle:
        handle.write(repr(time.time()))


def _read_stamp(directory, name: str) -> float:
    with open(os.path.join(directory, name)) as handle:
        return float(handle.read())


def _fault(kind: str, directory: str, timeout: float) -> str:
    """Rank 1's misbehaviour: die at once, or sleep until rank 0 has given up (at most a minute past the
    timeout)."""
    _stamp(directory, "fault")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + timeout + 60
    while not os.path.exists(os.path.join(directory, "failed")) and time.monotonic() < deadline:
        time.sleep(0.1)
    return "slept"


def _train_until_fault(rank, world, kind, strategy, mode, timeout, directory):
    autopar.init(timeout=timeout)
    pmodel = autopar.compile(support.build_model("mlp"), strategy=strategy, mode=mode)
    optimizer = torch.optim.SGD(pmodel.parameters(), lr=0.1)
    for step in range(1, 6):
        if rank == 1 and step == FAULT_STEP:
            return _fault(kind, directory, timeout or DEFAULT_TIMEOUT_S)
        x, y = support.global_batch("mlp", step)
        try:
            loss = F.mse_loss(pmodel(x.chunk(world)[rank]), y.chunk(world)[rank])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        except autopar.AutoparError as error:
            _stamp(directory, "failed")
            return {"type": type(error).__name__, "message": str(error), "step": getattr(error, "step", None),
                    "missing": getattr(error, "missing_ranks", None), "failed_at": time.time()}
    return "finished all steps"


def _run_fault(tmp_path, kind, strategy, mode, timeout):
    limit = (timeout or DEFAULT_TIMEOUT_S) + 90
    results = run_on_ranks(_train_until_fault, 2, kind, strategy, mode, timeout, str(tmp_path),
                           timeout_s=limit, init=False, allow_death=True)
    exited_at = time.time()
    fault_at = _read_stamp(tmp_path, "fault")
    return results, results[0]["failed_at"] - fault_at, exited_at - fault_at


def _assert_names_step_and_rank(result, phase):
    assert isinstance(result, dict), result
    assert result["type"] == "RankFailureError", result
    message = result["message"]
    assert message.startswith(f"torch_autopar: step {FAULT_STEP} ({phase}"), message
    assert "rank 1 did not answer" in message, message
    assert "autopar.init(timeout=...)" in message, message
    assert result["step"] == FAULT_STEP and result["missing"] == [1], result


@pytest.mark.parametrize(("strategy", "mode", "phase"), [
    ("data_parallel", "eager", "backward: gradient all-reduce"),
    ("fully_shard", "graph", "forward"),
])
def test_killed_rank_ends_the_other_with_an_error(tmp_path, strategy, mode, phase):
    results, to_error, to_exit = _run_fault(tmp_path, "kill", strategy, mode, SHORT_TIMEOUT_S)
    print(f"\nkill -9 ({strategy}, {mode}, timeout {SHORT_TIMEOUT_S:g} s): error after {to_error:.2f} s, "
          f"process exit after {to_exit:.2f} s")
    assert results[1] is None  # killed: no result
    _assert_names_step_and_rank(results[0], phase)
    assert to_error < SHORT_TIMEOUT_S, f"a dead peer should be noticed before the timeout: {to_error:.1f} s"


DEFAULT = pytest.param(None, marks=[pytest.mark.slow, pytest.mark.timeout(600)], id="default")


@pytest.mark.parametrize("timeout", [SHORT_TIMEOUT_S, DEFAULT])
def test_stalled_rank_ends_the_other_with_an_error(tmp_path, timeout):
    """None: the default timeout (5 minutes; a slow test, run with -m slow to measure it)."""
    results, to_error, to_exit = _run_fault(tmp_path, "sleep", "data_parallel", "eager", timeout)
    configured = timeout or DEFAULT_TIMEOUT_S
    print(f"\nstall (data_parallel, eager, timeout {configured:g} s): error after {to_error:.2f} s, "
          f"process exit after {to_exit:.2f} s")
    assert results[1] == "slept"
    _assert_names_step_and_rank(results[0], "backward: gradient all-reduce")
    grace = faults.roll_call_grace_s(configured)
    assert configured * 0.9 <= to_error < configured + grace + 20, to_error  # generous: shared machine


@pytest.mark.slow
def test_killed_rank_with_the_default_timeout(tmp_path):
    results, to_error, to_exit = _run_fault(tmp_path, "kill", "data_parallel", "eager", None)
    print(f"\nkill -9 (data_parallel, eager, default timeout {DEFAULT_TIMEOUT_S:g} s): error after "
          f"{to_error:.2f} s, process exit after {to_exit:.2f} s")
    _assert_names_step_and_rank(results[0], "backward: gradient all-reduce")


# no ranks needed ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("timeout", "timeout_s", "expected"), [
    (None, None, 300.0), (7, None, 7.0), (datetime.timedelta(minutes=2), None, 120.0), (None, 30, 30.0)])
def test_init_timeout_spellings(timeout, timeout_s, expected):
    from torch_autopar.launch.init import DEFAULT_TIMEOUT_S, _timeout_seconds

    assert DEFAULT_TIMEOUT_S == 300.0
    assert _timeout_seconds(timeout, timeout_s) == expected


@pytest.mark.parametrize("bad", [0, -1, "5", True])
def test_init_refuses_a_bad_timeout(bad):
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: init\(timeout=.*positive number of seconds"):
        autopar.init(timeout=bad)


def test_init_refuses_both_spellings():
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: .*give one of them"):
        autopar.init(timeout=5, timeout_s=5)


@pytest.mark.parametrize(("error", "expected"), [
    (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5011"), True),
    (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"), False),
    (autopar.AutoparError("ranks were given batches of unequal size"), False),
    (ValueError("Connection closed by peer"), False),
])
def test_which_errors_are_collective_failures(error, expected):
    assert faults.is_collective_failure(error) is expected


def test_the_error_outside_a_job_says_the_store_cannot_tell():
    failure = faults.collective_failure(RuntimeError("Timed out waiting 5000ms for recv"), 7, "forward", 5.0)
    assert isinstance(failure, RankFailureError) and failure.step == 7 and failure.missing_ranks is None
    assert str(failure).startswith("torch_autopar: step 7 (forward) on rank 0: a collective failed")
    assert faults.collective_failure(RuntimeError("shapes differ"), 7, "forward") is None
