"""Activation checkpointing in a plan: which repeated layers recompute their activations in backward.

``apply_choice(plan, layers)`` prices a choice on the plan's per-layer figures (``Plan.layer_activations``, on
its local shards) with ``cost.pricing.recompute_memory``: the forward keeps less, the backward of a recomputed
layer makes its activations again, and each recomputed layer's forward runs once more. ``choose`` makes the
choice a policy asks for: none, every candidate ("full", "selective"), or for "auto" the fewest layers that bring
the plan within the memory budget, most bytes freed per second of recompute first (none when it fits as it is).
Must never change a layout.
"""

from __future__ import annotations

from torch_autopar.cost import pricing
from torch_autopar.search.plan import Plan

POLICIES = (None, "auto", "full", "selective")
"""What ``compile(activation_checkpointing=...)`` accepts."""


def recomputed(plan: Plan, layers: dict[str, str]) -> dict[str, tuple[int, float]]:
    """Layer → (bytes recomputing it frees, seconds it adds) for each layer of ``layers`` the plan has figures
    for, under its policy ("selective" keeps its matmul and attention outputs and does not redo them)."""
    figures = {}
    for name, how in layers.items():
        row = plan.layer_activations.get(name)
        if row is not None:
            figures[name] = ((row.freed_bytes, row.recompute_s) if how == "full"
                             else (row.selective_freed_bytes, row.selective_recompute_s))
    return figures


def apply_choice(plan: Plan, layers: dict[str, str]) -> None:
    """Make ``layers`` (module path → "full" | "selective") the plan's recomputed layers and price them in place:
    memory from ``cost.pricing.recompute_memory``; the step pays one more forward of each."""
    old, new = recomputed(plan, plan.activation_checkpointing), recomputed(plan, layers)
    seconds = sum(s for _, s in new.values()) - sum(s for _, s in old.values())
    plan.compute_time += seconds
    plan.estimated_step_time += seconds
    kept = plan.memory_breakdown.get("activations", 0) + sum(freed for freed, _ in old.values())
    rows = [(name, row.saved_bytes, new.get(name, (0, 0.0))[0]) for name, row in plan.layer_activations.items()]
    plan.memory_breakdown.update(pricing.recompute_memory(kept, rows, set(new)))
    if not plan.memory_breakdown["recomputed_layer"]:
        del plan.memory_breakdown["recomputed_layer"]
    plan.peak_memory = pricing.peak_bytes(plan.memory_breakdown, plan.search_stats.get("backward_frees", True))
    plan.activation_checkpointing = dict(layers)


def choose(plan: Plan, policy, candidates, budget: float) -> None:
    """Apply ``policy``'s choice among ``candidates`` (module paths of the layers the runtime can wrap) to
    ``plan``: a dict is the choice itself, None keeps every activation, "full" / "selective" recompute every
    candidate, "auto" adds the candidates one by one (most bytes freed per recompute second first) until the plan
    fits ``budget``, or all."""
    if isinstance(policy, dict):  # a choice already made (on another capture of the same model)
        apply_choice(plan, policy)
        return
    if policy != "auto":
        apply_choice(plan, {name: policy for name in candidates} if policy else {})
        return
    figures = plan.layer_activations
    order = sorted((name for name in candidates if name in figures and figures[name].freed_bytes > 0),
                   key=lambda name: -figures[name].freed_bytes / max(figures[name].recompute_s, 1e-12))
    chosen: dict[str, str] = {}
    apply_choice(plan, chosen)
    for name in order:
        if plan.peak_memory <= budget:
            break
        before = plan.peak_memory
        chosen[name] = "full"
        apply_choice(plan, chosen)
        if plan.peak_memory >= before:  # lowers nothing yet (remaking its activations is the new peak): skip it
            del chosen[name]
            apply_choice(plan, chosen)
    if plan.peak_memory > budget:  # a skipped layer may still help together with the rest: all of them
        greedy, peak = dict(chosen), plan.peak_memory
        chosen = {name: "full" for name in order}
        apply_choice(plan, chosen)
        if plan.peak_memory >= peak:  # no lower (the peak is the gradients' as backward ends): none more
            chosen = greedy
            apply_choice(plan, chosen)
    if chosen:
        plan.notes.append(f"activation_checkpointing='auto': {len(chosen)} of {len(order)} layers recompute to fit "
                          f"the memory budget of {budget:,.0f} bytes ({plan.peak_memory:,} bytes per device)")
