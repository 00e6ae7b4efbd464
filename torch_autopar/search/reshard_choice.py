"""The choice of ``reshard_after_forward`` under the memory budget (``compile``/``plan`` with
``reshard_after_forward="auto"``): the plan that keeps every fully-sharded group gathered from its forward to its
backward (one all_gather per group and step fewer) when it fits and is faster, else the plan that frees each group
after its forward and gathers it again for its backward (FSDP2's default). Both are whole plans, searched and priced
as they run by the same planner (``Planner.plan``); this module only compares them. Must never price anything
itself.
"""

from __future__ import annotations

from typing import Callable

from torch_autopar.errors import AutoparError
from torch_autopar.search.plan import Plan

CHOICES = (True, False, "auto")


def check_reshard_after_forward(value) -> None:
    if not (value is True or value is False or value == "auto"):
        raise AutoparError(f"reshard_after_forward={value!r}: expected True (free each fully-sharded layer after its "
                           "forward, gather it again for backward), False (keep it gathered until backward) or "
                           "'auto' (the faster of the two that fits memory_budget).")


def chosen(planned: Callable[[bool], Plan]) -> Plan:
    """The faster of ``planned(True)`` and ``planned(False)`` among those that fit the budget (``planned`` raises
    when nothing fits); resharding on a tie (it holds less). Raises what ``planned(True)`` raises when neither
    fits: keeping groups gathered never needs less memory."""
    resharding = planned(True)
    try:
        keeping = planned(False)
    except AutoparError as error:
        keeping, why = None, str(error).removeprefix("torch_autopar: ")
    faster = keeping is not None and keeping.estimated_step_time < resharding.estimated_step_time
    best = keeping if faster else resharding
    kept = (f"keeping them gathered {keeping.estimated_step_time * 1e3:.3f} ms, {keeping.peak_memory:,} bytes"
            if keeping is not None else f"keeping them gathered: {why[:160]}")
    best.notes.append(f"reshard_after_forward='auto': resharding after forward "
                      f"{resharding.estimated_step_time * 1e3:.3f} ms, {resharding.peak_memory:,} bytes per device; "
                      f"{kept}; chose {'to keep them gathered' if faster else 'to reshard'}")
    return best
