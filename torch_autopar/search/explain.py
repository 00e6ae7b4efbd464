"""Human-readable explanation of a Plan: per-layer table, collectives, totals, replicated ops; as text
(``plan.explain()``) or as an HTML table (``plan._repr_html_()``, what Jupyter shows for a plan)."""

from __future__ import annotations

import html

from torch_autopar.cost import pricing
from torch_autopar.search.recompute import recomputed


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n}"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s"


def _layer_table(plan) -> list[str]:
    width = max([len(row.name) for row in plan.layers] + [5])
    lines = [f"{'layer':<{width}}  {'params':>12}  {'placement':<14}  {'compute':>11}  {'comm':>11}  "
             f"{'grad sync':>11}  {'memory':>11}  activations (op outputs per layout)"]
    for row in plan.layers:
        lines.append(f"{row.name:<{width}}  {row.num_params:>12,}  {row.placements:<14}  {_seconds(row.compute_s):>11}  "
                     f"{_seconds(row.comm_s):>11}  {_bytes(row.grad_sync_bytes):>11}  {_bytes(row.memory_bytes):>11}  "
                     f"{row.activations}")
    return lines


def _collective_summary(plan) -> list[str]:
    if not plan.collectives:
        return ["collectives per step: none"]
    lines = ["collectives per step (kind, phase, axis: count, bytes per rank, est. time):"]
    groups: dict[tuple, list] = {}
    for c in plan.collectives:
        groups.setdefault((c.kind, c.phase, c.axis), []).append(c)
    for (kind, phase, axis), items in sorted(groups.items()):
        count = sum(c.count for c in items)
        lines.append(f"  {kind:<14} {phase:<9} {axis:<6} x{count:<4} {_bytes(sum(c.nbytes * c.count for c in items)):>11}"
                     f"  {_seconds(sum(c.seconds * c.count for c in items))}")
    return lines


def _pipeline_lines(plan) -> list[str]:
    """Stages (modules, est. compute, memory), micro-batches, schedule and the predicted bubble."""
    layout = plan.stage_layout
    lines = [f"pipeline: {plan.pipeline_stages} stages on {plan.mesh_shape[-1]} pipeline ranks, each stage on a "
             f"sub-mesh of {plan.mesh_shape[0]} rank(s) ({plan.axis_names[0]}: {layout.replace('_', '-')}), "
             f"schedule={plan.schedule}, {plan.microbatches} micro-batches per rank and step, predicted bubble "
             f"{plan.bubble_fraction:.1%}"]
    width = max([len(", ".join(row.layers)) for row in plan.stages] + [6])
    lines.append(f"{'stage':>5}  {'modules':<{width}}  {'params':>12}  {'compute':>11}  {'memory':>11}")
    for row in plan.stages:
        lines.append(f"{row.index:>5}  {', '.join(row.layers):<{width}}  {row.num_params:>12,}  "
                     f"{_seconds(row.compute_s):>11}  {_bytes(row.memory_bytes):>11}")
    return lines


def _recompute_lines(plan) -> list[str]:
    """Which repeated layers recompute in backward (activation checkpointing), what it frees and costs."""
    chosen, figures = plan.activation_checkpointing, plan.layer_activations
    if not chosen:
        return [f"activation checkpointing: none ({len(figures)} repeated layers keep their activations)"] if figures else []
    priced = recomputed(plan, chosen)
    freed, seconds = sum(f for f, _ in priced.values()), sum(s for _, s in priced.values())
    names = list(chosen)
    shown = ", ".join(f"{name} ({how})" for name, how in list(chosen.items())[:8]) + (", ..." if len(names) > 8 else "")
    return [f"activation checkpointing: {len(names)} of {max(len(figures), len(names))} repeated layers recompute in "
            f"backward: {shown}; frees {_bytes(freed)} of activations per device, adds {_seconds(seconds)} of "
            "forward per step"]


def explain(plan) -> str:
    mesh = " x ".join(f"{name}={size}" for name, size in zip(plan.axis_names, plan.mesh_shape))
    lines = [f"torch_autopar plan: strategy={plan.strategy}  mesh: {mesh}  hardware={plan.hardware}"
             + (f"  global batch={plan.global_batch}" if plan.global_batch else "")]
    lines += _layer_table(plan) if plan.layers else []
    lines += _pipeline_lines(plan) if plan.pipeline_stages > 1 else []
    lines += _collective_summary(plan)
    lines.append(f"gradient buckets: {len(plan.grad_buckets)}")
    optimizer = plan.search_stats.get("optimizer_s")
    lines.append(f"estimated step time: {_seconds(plan.estimated_step_time)} (compute {_seconds(plan.compute_time)}"
                 + (f" with the optimizer step's {_seconds(optimizer)}" if optimizer else "")
                 + f", exposed communication {_seconds(plan.exposed_comm_time)})")
    breakdown = ", ".join(f"{k} {_bytes(v)}" for k, v in plan.memory_breakdown.items())
    frees = plan.pipeline_stages == 1 and plan.search_stats.get("backward_frees", True)
    at = f" as {pricing.peak_phase(plan.memory_breakdown)}s" if frees else ""
    lines.append(f"peak memory per device: {_bytes(plan.peak_memory)}{at} ({breakdown})")
    lines += _recompute_lines(plan)
    if plan.replicated_ops:
        ops = ", ".join(f"{op} x{n}" for op, n in sorted(plan.replicated_ops.items()))
        lines.append(f"ops replicated for lack of a sharding rule: {ops}")
    else:
        lines.append("ops replicated for lack of a sharding rule: none")
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


_HTML_COLUMNS = ("layer", "params", "placement", "compute", "comm", "grad sync", "memory", "activations")


def _html_row(cells, tag: str = "td") -> str:
    return "<tr>" + "".join(f"<{tag}>{html.escape(str(cell))}</{tag}>" for cell in cells) + "</tr>"


def explain_html(plan) -> str:
    """The per-layer table as an HTML table, the rest of ``explain`` (header, collectives, totals) around it."""
    lines = explain(plan).splitlines()
    rows = [_html_row(_HTML_COLUMNS, "th")]
    rows += [_html_row((row.name, f"{row.num_params:,}", row.placements, _seconds(row.compute_s),
                        _seconds(row.comm_s), _bytes(row.grad_sync_bytes), _bytes(row.memory_bytes), row.activations))
             for row in plan.layers]
    rest = lines[len(plan.layers) + 2:]
    return (f"<div class=\"torch-autopar-plan\"><p><b>{html.escape(lines[0])}</b></p>"
            f"<table>{''.join(rows)}</table>"
            f"<pre>{html.escape(chr(10).join(rest))}</pre></div>")
