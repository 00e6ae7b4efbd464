"""Shared fixtures: every test starts and ends without a process group, with the default mode, no
$AUTOPAR_MODE and a clean dynamo cache, so tests cannot leak state into each other (a leaked process group
would also make ``autopar.plan`` plan inside it)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from torch_autopar.cost.job_profile import CACHE_ENV
from torch_autopar.runtime import modes


@pytest.fixture(autouse=True, scope="session")
def clean_environment(tmp_path_factory):
    """No $AUTOPAR_MODE and no torchrun variables, also for the ranks module-scoped fixtures spawn; an empty
    profile cache, so that a profile measured on this machine never changes what tests plan."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("AUTOPAR_MODE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            patch.delenv(name, raising=False)
        patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("profile-cache")))
        yield


@pytest.fixture(autouse=True)
def isolated_state(monkeypatch):
    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("a process group was already initialised when the test started")
    monkeypatch.delenv("AUTOPAR_MODE", raising=False)
    saved_mode = getattr(modes._state, "mode", None)
    modes._state.mode = None
    yield
    modes._state.mode = saved_mode
    torch._dynamo.reset()
    leaked = dist.is_initialized()
    if leaked:
        dist.destroy_process_group()
    assert not leaked, "the test left a process group initialised"
