"""Execution modes: "eager" (PyNative: the user's Python forward runs op by op) and "graph" (torch.compile).

Global default from ``set_mode`` or the environment variable ``AUTOPAR_MODE``; ``mode(...)`` switches it for
a block. Must never hold per-model state.
"""

from __future__ import annotations

import contextlib
import os
import threading

from torch_autopar.errors import AutoparError

MODES = ("eager", "graph")
_state = threading.local()


def _check(name: str, where: str) -> str:
    if name not in MODES:
        raise AutoparError(f"{where} expected a mode in {MODES}, got {name!r}; use 'eager' to debug, 'graph' for speed.")
    return name


def get_mode() -> str:
    """The mode in force: the innermost ``mode(...)`` block, else ``set_mode``'s, else $AUTOPAR_MODE, else eager."""
    current = getattr(_state, "mode", None)
    if current is not None:
        return current
    return _check(os.environ.get("AUTOPAR_MODE", "eager"), "the environment variable AUTOPAR_MODE")


def set_mode(name: str) -> None:
    """Set the default mode for compiled models called without an explicit ``mode=``."""
    _state.mode = _check(name, "set_mode()")


@contextlib.contextmanager
def mode(name: str):
    """Run the block in the given mode, then restore the previous one."""
    previous = getattr(_state, "mode", None)
    _state.mode = _check(name, "mode()")
    try:
        yield
    finally:
        _state.mode = previous
