"""``testing.run_on_ranks`` returns as soon as every rank has exited, even while a process a rank forked (as a
DataLoader worker is forked) still holds the rank's end of the pipe the parent waits on; and a rank that dies
without a result fails the call at once, naming it, rather than after its peers' collective timeout (ranks that
all died before the harness looked are reported dead too)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch.distributed as dist

from torch_autopar.testing import run_on_ranks
from torch_autopar.testing.dist import RankFailure, _wait_for_ranks


def _fork_a_sleeper(rank: int, world: int) -> int:
    child = os.fork()
    if child == 0:  # the forked process inherits every descriptor of the rank, then outlives it
        time.sleep(60)
        os._exit(0)
    return rank


@pytest.mark.parametrize("start_method", ("forkserver", "spawn"))
def test_returns_when_ranks_exit_though_a_forked_child_still_runs(start_method):
    started = time.monotonic()
    assert run_on_ranks(_fork_a_sleeper, 2, timeout_s=120, start_method=start_method) == [0, 1]
    assert time.monotonic() - started < 45


def _rank_one_dies(rank: int, world: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0 would wait here until the 120 s collective timeout


def test_a_rank_that_dies_without_a_result_fails_the_call_at_once():
    started = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 died with exit code -9"):
        run_on_ranks(_rank_one_dies, 2, timeout_s=120)
    assert time.monotonic() - started < 60



class _Exited:
    """A rank's process as ``_wait_for_ranks`` sees it, already ended."""

    def __init__(self, exitcode: int):
        self.exitcode, self.sentinel = exitcode, None


def test_ranks_that_all_died_before_the_first_look_are_reported_dead(tmp_path):
    """Not as "no result (killed or timed out)": the exit codes are read before concluding that all ranks ended."""
    with pytest.raises(RankFailure, match="rank 0 died with exit code -9"):
        _wait_for_ranks([_Exited(-9), _Exited(-9)], time.monotonic() + 60, str(tmp_path), 2, allow_death=False)
    _wait_for_ranks([_Exited(-9), _Exited(0)], time.monotonic() + 60, str(tmp_path), 2, allow_death=True)
