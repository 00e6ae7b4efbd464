"""Dead and stalled ranks: turn a failed collective into a ``torch_autopar:`` error that names the step.

When a rank dies, gloo's next collective on the others fails at once ("Connection closed by peer"); when a
rank stops calling collectives, theirs fail after the process-group timeout (``autopar.init(timeout=...)``).
``collective_failure`` recognises such errors and rewrites them; before it does, a short roll call on the job's
store (one key per rank, no collective) tells which ranks still answer, so the message can name the missing
rank. Must never start a collective, and never swallow an error it does not recognise.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from torch_autopar import _compat
from torch_autopar.errors import AutoparError, RankFailureError

_MARKERS = (
    "connection closed by peer", "connection reset by peer", "broken pipe", "timed out",
    "gloo/transport", "nccl", "hccl", "watchdog", "socket closed",
)
"""Fragments of the messages gloo, NCCL and HCCL raise when a peer is gone or late (lower case)."""

_ROLL_CALL_PREFIX = "torch_autopar/roll_call"


def is_collective_failure(error: BaseException) -> bool:
    """True for the errors a collective raises when a peer died, stalled or timed out."""
    if isinstance(error, AutoparError):  # ours already (and says what it is)
        return False
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    return isinstance(error, RuntimeError) and is_collective_failure_message(str(error))


def is_collective_failure_message(message: str) -> bool:
    """True for the message of an error a collective raises when a peer died, stalled or timed out."""
    text = message.lower()
    return any(marker in text for marker in _MARKERS)


def roll_call_grace_s(timeout_s: float | None) -> float:
    """How long survivors wait for each other's roll-call keys: a tenth of the timeout, 0.5 to 2 s."""
    return min(2.0, max(0.5, 0.1 * (timeout_s or 20.0)))


def missing_ranks(tag: str, grace_s: float) -> list[int] | None:
    """Ranks that do not sign the roll call ``tag`` within ``grace_s`` (None: the store cannot tell).

    Every surviving rank writes its key and waits for the others' keys; a dead or stalled rank never writes."""
    if not dist.is_initialized():
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    keys = [f"{_ROLL_CALL_PREFIX}/{tag}/{r}" for r in range(world)]
    try:
        store = _compat.default_store()
        store.set(keys[rank], "here")
        deadline = time.monotonic() + grace_s
        while True:
            present = [r for r, key in enumerate(keys) if store.check([key])]
            if len(present) == world or time.monotonic() >= deadline:
                return [r for r in range(world) if r not in present]
            time.sleep(0.05)
    except Exception:  # the store itself lived on the dead rank: it cannot tell
        return None


def _who(missing: list[int] | None) -> str:
    if missing is None:
        return "a rank stopped answering (the job's store is unreachable too, so it cannot tell which; rank 0 " \
               "hosts it)"
    if not missing:
        return "a peer stopped answering (all ranks signed the roll call afterwards, so one was late, not gone)"
    ranks = ", ".join(str(r) for r in missing)
    return f"rank {ranks} did not answer (died, or stopped calling collectives)"


def collective_failure(error: BaseException, step: int, phase: str, timeout_s: float | None = None):
    """A ``RankFailureError`` for ``error`` raised by a collective in ``phase`` of ``step``; None when ``error``
    is not a collective failure (the caller re-raises it unchanged)."""
    if not is_collective_failure(error):
        return None
    timeout_s = configured_timeout_s() if timeout_s is None else timeout_s
    missing = missing_ranks(f"{step}", roll_call_grace_s(timeout_s))
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    rank = dist.get_rank() if dist.is_initialized() else 0
    limit = f"the process-group timeout is {timeout_s:g} s" if timeout_s else "the process-group timeout applies"
    return RankFailureError(
        f"step {step} ({phase}) on rank {rank}: a collective failed; {_who(missing)}. Expected every rank to run "
        f"the same steps; found: {type(error).__name__}: {first_line}. Look at the missing rank's own log for its "
        f"error; {limit} (autopar.init(timeout=...) sets it), and a checkpoint lets the job restart.",
        step=step, missing_ranks=missing)


_TIMEOUT = {"seconds": None}


def set_configured_timeout_s(seconds: float | None) -> None:
    _TIMEOUT["seconds"] = seconds


def configured_timeout_s() -> float | None:
    """The process-group timeout ``autopar.init`` set (None when the group was created elsewhere)."""
    return _TIMEOUT["seconds"]
