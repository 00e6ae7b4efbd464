"""The choice of ``reshard_after_forward`` under the memory budget (``compile``/``plan`` with
``reshard_after_forward="auto"``), per fully-sharded group (``capture.layers.reshard_groups``: FSDP2's units).

Keeping a group gathered from its forward to its backward saves one all_gather of it per step and holds its whole
parameters for that time. The candidates are whole plans, each searched and priced as it runs by the planner
(``Planner.plan``): every group resharding (FSDP2's default), every group kept (``reshard_after_forward=False``),
and, when keeping every group does not fit the budget, the last ``k`` groups of the forward kept
(``Plan.kept_gathered``: backward needs them first), ``k`` found by bisection on whether the plan fits. The
fastest candidate that fits is returned, resharding on a tie. A folded capture (offline ``fold_layers``) is not priced as it runs, so it gets no
choice (``unchosen``). This module only compares plans; it must never price anything itself.
"""

from __future__ import annotations

from typing import Callable

from torch_autopar.errors import AutoparError
from torch_autopar.search.plan import Plan

def check_reshard_after_forward(value) -> None:
    if not (value is True or value is False or value == "auto"):
        raise AutoparError(f"reshard_after_forward={value!r}: expected True (free each fully-sharded layer after its "
                           "forward, gather it again for backward), False (keep it gathered until backward) or "
                           "'auto' (per layer, the fastest setting that fits memory_budget).")


def chosen(planned: Callable[[bool, tuple], Plan], groups: list[str]) -> Plan:
    """The fastest plan that fits among ``planned(True, ())``, ``planned(False, ())`` and, when keeping every
    group does not fit, ``planned(True, kept)`` for kept = the last groups of ``groups`` (forward order) that fit;
    ``planned`` raises when nothing fits, and the resharding plan's error is raised when no candidate fits."""
    resharding, why = _fitting(planned, True, ())
    keeping, _ = _fitting(planned, False, ())
    candidates = [plan for plan in (resharding, keeping) if plan is not None]
    if keeping is None and len(groups) > 1:
        fits, over = 0, len(groups)  # keeping the last `fits` groups fits (0: none kept); the last `over` does not
        while over - fits > 1:
            middle = (fits + over) // 2
            plan, _ = _fitting(planned, True, tuple(groups[-middle:]))
            if plan is None:
                over = middle
            else:
                fits = middle
                candidates.append(plan)
    if not candidates:
        raise why
    best = min(candidates, key=lambda plan: plan.estimated_step_time)  # the first (resharding) on a tie
    best.notes.append("reshard_after_forward='auto': " + "; ".join(_described(plan) for plan in candidates)
                      + ("" if keeping is not None else "; keeping every group gathered does not fit the budget")
                      + f"; chose {_setting(best)}")
    return best


def unchosen(plan: Plan) -> Plan:
    """``reshard_after_forward="auto"`` on a folded capture: the solver's plan (every group resharding), which
    prices no choice, says so."""
    plan.notes.append("reshard_after_forward='auto' chooses per group on the whole model: planned resharding every "
                      "group; plan with fold_layers=False (as compile does) for the choice")
    return plan


def _fitting(planned, reshard: bool, kept: tuple) -> tuple[Plan | None, AutoparError | None]:
    try:
        return planned(reshard, kept), None
    except AutoparError as error:  # over the budget
        return None, error


def _setting(plan: Plan) -> str:
    if not plan.reshard_after_forward:
        return "to keep every group gathered"
    if plan.kept_gathered:
        return f"to keep {', '.join(plan.kept_gathered)} gathered and reshard the rest"
    return "to reshard every group"


def _described(plan: Plan) -> str:
    return f"{_setting(plan)}: {plan.estimated_step_time * 1e3:.3f} ms, {plan.peak_memory:,} bytes per device"
