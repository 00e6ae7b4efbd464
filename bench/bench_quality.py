"""Plan quality and search time: the `auto` plan against every named strategy, on meta-device models.

    python bench/bench_quality.py            # ~5 min on 2 cores: 6 models x 4 meshes x 2 hardware x 3 budgets
    python bench/bench_quality.py --quick    # < 1 min: wide MLP and GPT-2 small, meshes 8 and 2x4, no 80 GiB

For every (model, mesh, hardware, per-device memory budget) it plans `auto` and the baselines `data_parallel`,
`fully_shard`, `tensor_parallel` (pure TP on a 1-D mesh, DP x TP on an N-D mesh: TP on the last axis) and
`fsdp_tp` (FSDP x TP, N-D meshes only) and compares torch_autopar's estimated step time and peak memory per
device. Plans that do not fit the budget are marked infeasible; a row where `auto` is slower than the best
feasible baseline (or infeasible while a baseline fits) is a defect and is listed as such, never hidden.
Search time (capture, strategy generation, problem build, solve) is recorded for every `auto` run.

How planning is shared (the same stages `autopar.plan` runs, see api._plan_on_mesh):
  * one capture per (model, number of devices): the program is the global-batch program, mesh-independent;
  * one `search.planner.Planner` per (mesh, hardware, budget); `auto` is planned first, from scratch, and
    timed; the baselines are then `Planner.plan(name)`, exactly `autopar.plan(strategy=name)` minus capture.
    `auto` plans every named strategy itself (`Planner.searched(name)` / `Planner.propagated(name)`, the same
    calls `plan(name)` makes); with `--baselines reuse` a baseline is that candidate, not solved twice. With
    `--baselines independent` every baseline is planned again on a fresh Planner and compared with auto's
    candidate. Default `checked`: independent on the first hardware and budget (h100, unlimited), reuse on
    the others. Independent baselines are what catches auto planning a strategy differently from
    `plan(strategy=name)`; they differ at all only where the MILP has tied optima (see bench/README.md).
What HiGHS prints to stdout while planning is counted (`solver_messages`) rather than shown.
Writes bench/results/quality.json, bench/results/search_time.json and bench/results/quality.png.
Must never change torch_autopar's planner or its results: it only calls it and reads what it returns.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import json
import math
import multiprocessing
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass

import torch

import torch_autopar as autopar
from torch_autopar import launch
from torch_autopar.capture import capture, fake_global_inputs
from torch_autopar.capture.fold import folded_layers
from torch_autopar.cost import get_profile
from torch_autopar.errors import AutoparError
from torch_autopar.search.planner import Planner
from torch_autopar.testing.models import GPT, GPT2_MEDIUM, GPT2_SMALL, GPT2_XL, LLAMA3_8B, MLP, Llama
from torch_autopar.testing.resnet import ResNet50
from provenance import code_state

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BASELINES = ("data_parallel", "fully_shard", "tensor_parallel", "fsdp_tp")
SHORT = {"data_parallel": "DP", "fully_shard": "FSDP", "tensor_parallel": "TP|DPxTP", "fsdp_tp": "FSDPxTP"}
MESHES = ((8,), (2, 4), (8, 8), (8, 16))
HARDWARE = ("h100", "ascend-910b")
BUDGETS = {"unlimited": math.inf, "80GiB": 80 * 2**30, "24GiB": 24 * 2**30}
LOSS_TOLERANCE = 1e-9
"""auto slower than the best baseline by more than this fraction is a loss."""
TIE_TOLERANCE = 1e-6


@dataclass(frozen=True, kw_only=True)
class Workload:
    name: str
    per_device: str
    """The per-device batch, in words (the global batch is this times the number of devices)."""

    def build(self) -> torch.nn.Module:
        with torch.device("meta"):
            return _BUILDERS[self.name]()

    def inputs(self, devices: int) -> tuple:
        return _INPUTS[self.name](devices)


_BUILDERS = {
    "mlp-4x8192": lambda: MLP((8192,) * 5), "gpt2-small": lambda: GPT(GPT2_SMALL),
    "gpt2-medium": lambda: GPT(GPT2_MEDIUM), "gpt2-xl": lambda: GPT(GPT2_XL),
    "llama3-8b": lambda: Llama(LLAMA3_8B), "resnet50": ResNet50,
}
_INPUTS = {
    "mlp-4x8192": lambda d: (torch.empty(32 * d, 8192, device="meta"),),
    "gpt2-small": lambda d: (torch.empty(8 * d, 1024, dtype=torch.long, device="meta"),),
    "gpt2-medium": lambda d: (torch.empty(8 * d, 1024, dtype=torch.long, device="meta"),),
    "gpt2-xl": lambda d: (torch.empty(8 * d, 1024, dtype=torch.long, device="meta"),),
    "llama3-8b": lambda d: (torch.empty(2 * d, 2048, dtype=torch.long, device="meta"),),
    "resnet50": lambda d: (torch.empty(32 * d, 3, 224, 224, device="meta"),),
}
WORKLOADS = {
    "mlp-4x8192": Workload(name="mlp-4x8192", per_device="32 samples of 8192 (4 linear layers 8192->8192)"),
    "gpt2-small": Workload(name="gpt2-small", per_device="8 sequences x 1024 tokens"),
    "gpt2-medium": Workload(name="gpt2-medium", per_device="8 sequences x 1024 tokens"),
    "gpt2-xl": Workload(name="gpt2-xl", per_device="8 sequences x 1024 tokens"),
    "llama3-8b": Workload(name="llama3-8b", per_device="2 sequences x 2048 tokens"),
    "resnet50": Workload(name="resnet50", per_device="32 images 3x224x224"),
}
COST_ORDER = ("llama3-8b", "resnet50", "gpt2-xl", "gpt2-medium", "gpt2-small", "mlp-4x8192")
"""Rough planning cost, largest first (jobs are started in this order so that two workers finish together)."""


class ReusingPlanner(Planner):
    """A Planner that runs each ``searched(name)`` / ``propagated(name)`` once and hands out that result (or
    error) again, and remembers the candidates ``auto`` compared. Nothing else differs from Planner."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.memo: dict = {}
        self.compared: list = []

    def _once(self, key, compute, strategy):
        if key not in self.memo:
            try:
                self.memo[key] = (compute(strategy), None)
            except AutoparError as error:
                self.memo[key] = (None, error)
        plan, error = self.memo[key]
        if error is not None:
            raise error
        return plan

    def searched(self, strategy):
        return self._once(("searched", strategy), super().searched, strategy)

    def propagated(self, strategy):
        return self._once(("propagated", strategy), super().propagated, strategy)

    def _within_budget(self, plans):
        self.compared = list(plans)
        return super()._within_budget(plans)


def mesh_label(mesh) -> str:
    return "x".join(map(str, mesh))


def _outcome(plan, strategy: str) -> dict:
    stats = plan.search_stats
    outcome = {"status": "ok", "step_s": plan.estimated_step_time, "peak_memory_gib": plan.peak_memory / 2**30,
               "comm_gib": plan.comm_bytes() / 2**30, "mode": stats.get("mode", "propagation"),
               "milp_objective_s": stats.get("objective_s"), "solver_status": stats.get("solver_status")}
    return outcome | ({"chose": stats.get("candidate")} if strategy == "auto" else {})


def _failure(error: BaseException) -> dict:
    text = str(error)
    if isinstance(error, AutoparError):
        status = "infeasible" if "memory budget" in text else "error"
    else:
        status = "crash"
        text = f"{type(error).__name__}: {text}\n{traceback.format_exc(limit=6)}"
    return {"status": status, "error": text[:1200]}


def _try_plan(planner: Planner, strategy: str) -> dict:
    try:
        return _outcome(planner.plan(strategy), strategy)
    except Exception as error:  # noqa: BLE001  a crash is a planner bug: recorded, never fatal to the bench
        return _failure(error)


def _search_stats(planner: ReusingPlanner, auto_s: float, capture_s: float) -> dict:
    """Stage times summed over every exact problem auto built (its candidates and its own search)."""
    stages = {"strategy_generation_s": 0.0, "problem_build_s": 0.0, "solve_s": 0.0}
    for plan in planner.compared:
        for key in stages:
            stages[key] += plan.search_stats.get(key) or 0.0
    return {"capture_s": capture_s, **stages, "other_s": auto_s - sum(stages.values()), "plan_s": auto_s,
            "total_s": capture_s + auto_s, "candidates": len(planner.compared)}


def plan_config(program, folding, mesh, names, global_batch, hardware, budget, capture_s, independent) -> dict:
    """auto and every baseline for one (mesh, hardware, budget) on an already captured program.

    independent: plan each baseline on a fresh Planner (what ``autopar.plan(strategy=name)`` does) and compare
    it with the candidate auto planned for the same name; otherwise the baseline is that candidate."""
    options = dict(hardware=get_profile(hardware), memory_budget=budget, global_batch=global_batch, folding=folding)
    planner = ReusingPlanner(program, mesh, names, **options)
    started = time.perf_counter()
    auto = _try_plan(planner, "auto")
    search = _search_stats(planner, time.perf_counter() - started, capture_s)
    candidates = {name: _try_plan(planner, name) for name in BASELINES if name != "fsdp_tp" or mesh.ndim >= 2}
    baselines = {name: {"status": "n/a", "error": "fsdp_tp needs a mesh of at least 2 axes"} for name in BASELINES}
    if not independent:
        return {"auto": auto, "baselines": baselines | candidates, "search": search, "independent": False}
    baselines |= {name: _try_plan(Planner(program, mesh, names, **options), name) for name in candidates}
    mismatches = {name: {"auto_candidate": candidates[name].get("step_s", candidates[name]["status"]),
                         "independent": baselines[name].get("step_s", baselines[name]["status"])}
                  for name in candidates if _differs(candidates[name], baselines[name])}
    return {"auto": auto, "baselines": baselines, "search": search, "independent": True,
            "candidate_mismatches": mismatches}


def _differs(one: dict, other: dict) -> bool:
    return one["status"] != other["status"] or one.get("step_s") != other.get("step_s")


@contextlib.contextmanager
def native_stdout_counted(counter: list):
    """Send what native code (HiGHS) prints to fd 1 to a file while planning; append its line count."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+") as sink:
        os.dup2(sink.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            sink.seek(0)
            counter.append(sum(1 for line in sink if line.strip()))


def verdict(auto: dict, baselines: dict) -> dict:
    """Best feasible baseline, ratio best/auto (> 1: auto is faster) and whether auto lost."""
    feasible = {name: b for name, b in baselines.items() if b["status"] == "ok"}
    best = min(feasible, key=lambda name: feasible[name]["step_s"]) if feasible else None
    result = {"best_baseline": best, "ratio": None, "defect": False}
    if auto["status"] != "ok":
        result["verdict"] = "LOSS: auto has no plan, a baseline fits" if best else "nothing fits"
        result["defect"] = best is not None or auto["status"] == "crash"
        return result
    if best is None:
        result["verdict"] = "only auto fits"
        return result
    result["ratio"] = feasible[best]["step_s"] / auto["step_s"]
    if auto["step_s"] > feasible[best]["step_s"] * (1 + LOSS_TOLERANCE):
        result.update(verdict="LOSS", defect=True)
    else:
        result["verdict"] = "tie" if result["ratio"] < 1 + TIE_TOLERANCE else "win"
    return result


def run_job(job: tuple) -> list[dict]:
    """One model on the meshes of one device count (one capture), every hardware and budget."""
    name, meshes, hardware, budgets, mode = job
    _quiet()
    torch.set_num_threads(1)
    workload, devices = WORKLOADS[name], math.prod(meshes[0])
    model = workload.build()
    started = time.perf_counter()
    fake_args, fake_kwargs = fake_global_inputs(model, workload.inputs(devices), {}, 1)
    with folded_layers(model) as folding:
        program = capture(model, fake_args, fake_kwargs)
    capture_s = time.perf_counter() - started
    rows = []
    for mesh_shape in meshes:
        with launch.offline_mesh(mesh_shape) as mesh:
            names = launch.default_axis_names(len(mesh_shape))
            for hw in hardware:
                for label in budgets:
                    config_started, printed = time.perf_counter(), []
                    independent = mode == "independent" or mode == "checked" and (hw, label) == (hardware[0],
                                                                                                  budgets[0])
                    with native_stdout_counted(printed):
                        result = plan_config(program, folding, mesh, names, int(fake_args[0].shape[0]), hw,
                                             BUDGETS[label], capture_s, independent)
                    rows.append({"model": name, "mesh": mesh_label(mesh_shape), "devices": devices, "hardware": hw,
                                 "memory": label, "global_batch": int(fake_args[0].shape[0]), **result,
                                 **verdict(result["auto"], result["baselines"]),
                                 "config_s": time.perf_counter() - config_started, "solver_messages": printed[0]})
    print(f"  done {name} on {', '.join(map(mesh_label, meshes))}: {len(rows)} configurations in "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    return rows


def _quiet() -> None:
    for category in (DeprecationWarning, FutureWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category)


def jobs_for(models, meshes, hardware, budgets, mode) -> list[tuple]:
    jobs = []
    for name in sorted(models, key=COST_ORDER.index):
        by_devices: dict[int, list] = {}
        for mesh in meshes:
            by_devices.setdefault(math.prod(mesh), []).append(mesh)
        for group in sorted(by_devices.values(), key=len, reverse=True):
            jobs.append((name, group, tuple(hardware), tuple(budgets), mode))
    return jobs


def run_jobs(jobs: list[tuple], workers: int) -> list[dict]:
    if workers <= 1:
        return [row for job in jobs for row in run_job(job)]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        return [row for rows in pool.map(run_job, jobs) for row in rows]


# output ----------------------------------------------------------------------------------------------------------
def _cell(outcome: dict) -> str:
    if outcome["status"] == "ok":
        return f"{outcome['step_s'] * 1e3:9.1f}/{outcome['peak_memory_gib']:5.1f}"
    return {"infeasible": "  over budget  ", "n/a": "      n/a      "}.get(outcome["status"], outcome["status"].upper())


def _row_line(row: dict) -> str:
    cells = "  ".join(f"{_cell(row['baselines'][name]):>15}" for name in BASELINES)
    ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else "-"
    chose = row["auto"].get("chose") or "-"
    return (f"{row['model']:<11} {row['mesh']:<5} {row['hardware']:<11} {row['memory']:<9} {cells}  "
            f"{_cell(row['auto']):>15}  {chose:<15} {ratio:>9}  {row['verdict']}")


def quality_table(rows: list[dict]) -> str:
    names = "  ".join(f"{SHORT[name]:>15}" for name in BASELINES)
    lines = [f"{'model':<11} {'mesh':<5} {'hardware':<11} {'memory':<9} {names}  {'auto':>15}  {'auto chose':<15} "
             f"{'best/auto':>9}  verdict"]
    return "\n".join(lines + [_row_line(row) for row in rows])


def sort_key(row: dict) -> tuple:
    return (COST_ORDER.index(row["model"]), [mesh_label(m) for m in MESHES].index(row["mesh"])
            if row["mesh"] in map(mesh_label, MESHES) else 99, HARDWARE.index(row["hardware"]),
            list(BUDGETS).index(row["memory"]))


def summarise(rows: list[dict]) -> dict:
    """Counts of wins / ties / losses, geometric-mean and largest ratio, per model and overall."""
    def stats(group):
        ratios = [r["ratio"] for r in group if r["ratio"] is not None]
        verdicts = [r["verdict"] for r in group]
        return {"configs": len(group), "wins": verdicts.count("win"), "ties": verdicts.count("tie"),
                "only_auto_fits": verdicts.count("only auto fits"), "nothing_fits": verdicts.count("nothing fits"),
                "losses": sum(r["defect"] for r in group),
                "geomean_ratio": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
                "max_ratio": max(ratios) if ratios else None}
    models = sorted({r["model"] for r in rows}, key=COST_ORDER.index)
    return {"overall": stats(rows), "per_model": {m: stats([r for r in rows if r["model"] == m]) for m in models}}


def summary_table(summary: dict) -> str:
    lines = [f"{'model':<12} {'configs':>7} {'wins':>5} {'ties':>5} {'only auto':>9} {'none fit':>8} "
             f"{'LOSSES':>6} {'geomean best/auto':>17} {'max best/auto':>13}"]
    for name, s in list(summary["per_model"].items()) + [("ALL", summary["overall"])]:
        geo = f"{s['geomean_ratio']:.3f}" if s["geomean_ratio"] else "-"
        top = f"{s['max_ratio']:.3f}" if s["max_ratio"] else "-"
        lines.append(f"{name:<12} {s['configs']:>7} {s['wins']:>5} {s['ties']:>5} {s['only_auto_fits']:>9} "
                     f"{s['nothing_fits']:>8} {s['losses']:>6} {geo:>17} {top:>13}")
    return "\n".join(lines)


def search_rows(rows: list[dict]) -> list[dict]:
    """Search time of auto per (model, mesh) on h100 without a budget (every run is in quality.json)."""
    picked = [r for r in rows if r["hardware"] == rows[0]["hardware"] and r["memory"] == rows[0]["memory"]]
    return [{"model": r["model"], "mesh": r["mesh"], "hardware": r["hardware"], "memory": r["memory"],
             "auto_mode": r["auto"].get("mode"), **r["search"]} for r in picked]


def search_table(rows: list[dict]) -> str:
    lines = [f"{'model':<12} {'mesh':<5} {'capture':>8} {'strat.gen':>9} {'build':>7} {'solve':>7} {'other':>7} "
             f"{'auto plan':>9} {'total':>7}  problems  (seconds)"]
    for r in rows:
        lines.append(f"{r['model']:<12} {r['mesh']:<5} {r['capture_s']:>8.2f} {r['strategy_generation_s']:>9.2f} "
                     f"{r['problem_build_s']:>7.2f} {r['solve_s']:>7.2f} {r['other_s']:>7.2f} {r['plan_s']:>9.2f} "
                     f"{r['total_s']:>7.2f}  {r['candidates']}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """Left: auto's against the best baseline's step time (log-log); right: best/auto per configuration."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    compared = [r for r in rows if r["ratio"] is not None]
    models = sorted({r["model"] for r in rows}, key=COST_ORDER.index)
    colours = dict(zip(models, plt.get_cmap("tab10").colors))
    figure, (left, right) = plt.subplots(1, 2, figsize=(14, 6))
    for r in compared:
        best = r["baselines"][r["best_baseline"]]["step_s"] * 1e3
        left.scatter(best, r["auto"]["step_s"] * 1e3, color=colours[r["model"]], s=18,
                     marker="o" if r["hardware"] == "h100" else "^", edgecolors="red" if r["defect"] else "none")
    if compared:
        values = [r["auto"]["step_s"] * 1e3 for r in compared]
        values += [r["baselines"][r["best_baseline"]]["step_s"] * 1e3 for r in compared]
        low, high = min(values) / 1.5, max(values) * 1.5
        left.plot([low, high], [low, high], "k--", linewidth=0.8, label="auto = best baseline")
    left.set(xscale="log", yscale="log", xlabel="best baseline: estimated step time (ms)",
             ylabel="auto: estimated step time (ms)", title="auto vs best baseline (o h100, ^ ascend-910b)")
    for name in models:
        left.scatter([], [], color=colours[name], label=name)
    left.legend(fontsize=8)
    ordered = sorted(compared, key=lambda r: r["ratio"])
    right.bar(range(len(ordered)), [r["ratio"] for r in ordered], color=[colours[r["model"]] for r in ordered])
    right.axhline(1.0, color="k", linewidth=0.8)
    right.set_ylim(bottom=min([0.95] + [r["ratio"] * 0.98 for r in ordered]))
    right.set(xlabel="configuration (sorted)", ylabel="best baseline / auto (> 1: auto faster)",
              title=f"{len(ordered)} configurations with a feasible baseline and auto plan")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="wide MLP and GPT-2 small on meshes 8 and 2x4, budgets unlimited and 24GiB only")
    parser.add_argument("--models", help="comma-separated subset of " + ", ".join(WORKLOADS))
    parser.add_argument("--meshes", help="comma-separated, e.g. 8,2x4")
    parser.add_argument("--hardware", help="comma-separated subset of " + ", ".join(HARDWARE))
    parser.add_argument("--budgets", help="comma-separated subset of " + ", ".join(BUDGETS))
    parser.add_argument("--baselines", choices=("checked", "reuse", "independent"), default="checked",
                        help="reuse: the candidates auto planned on the same Planner; independent: each baseline "
                        "on a fresh Planner; checked (default): independent for the first hardware and budget "
                        "(h100, unlimited), reuse for the others")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                        help="processes planning in parallel (default: 2, or 1 on a single core)")
    parser.add_argument("--out-dir", default=RESULTS)
    return parser.parse_args()


def selection(args) -> tuple:
    models = list(WORKLOADS) if not args.models else args.models.split(",")
    meshes = list(MESHES)
    if args.quick:
        models, meshes = (["mlp-4x8192", "gpt2-small"] if not args.models else models), [(8,), (2, 4)]
    if args.meshes:
        meshes = [tuple(int(size) for size in text.split("x")) for text in args.meshes.split(",")]
    hardware = args.hardware.split(",") if args.hardware else list(HARDWARE)
    budgets = args.budgets.split(",") if args.budgets else ["unlimited", "24GiB"] if args.quick else list(BUDGETS)
    for value, known, what in ((models, WORKLOADS, "model"), (hardware, HARDWARE, "hardware"),
                               (budgets, BUDGETS, "budget")):
        unknown = [v for v in value if v not in known]
        if unknown:
            raise AutoparError(f"unknown {what} {unknown}; expected some of {list(known)}.")
    return models, meshes, hardware, budgets


def report(args, selected, started, load_before, code: dict) -> dict:
    models, meshes, hardware, budgets = selected
    return {
        "benchmark": "bench/bench_quality.py", "command": " ".join(["python"] + sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "torch_autopar": autopar.__version__, "python": platform.python_version(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "workers": args.workers,
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "selection": {"models": {m: WORKLOADS[m].per_device for m in models}, "meshes": list(map(mesh_label, meshes)),
                      "hardware": hardware, "budgets_bytes": {b: None if math.isinf(BUDGETS[b]) else BUDGETS[b] for b in budgets},
                      "baselines": args.baselines},
        "code": code, "wall_s": time.perf_counter() - started,
    }


def main() -> None:
    args = parse_args()
    _quiet()
    selected = selection(args)
    started, load_before, code = time.perf_counter(), os.getloadavg(), code_state()
    jobs = jobs_for(*selected, args.baselines)
    print(f"planning {len(jobs)} jobs (model x device count) on {args.workers} worker(s)", flush=True)
    rows = sorted(run_jobs(jobs, args.workers), key=sort_key)
    print("\nestimated step ms / peak GiB per device; TP|DPxTP is tensor_parallel (pure TP on a 1-D mesh, "
          "DP x TP on an N-D mesh), FSDPxTP is fsdp_tp (n/a on a 1-D mesh)")
    print(quality_table(rows))
    summary = summarise(rows)
    defects = [{k: r[k] for k in ("model", "mesh", "hardware", "memory", "verdict", "ratio")} | {"auto": r["auto"]}
               for r in rows if r["defect"]]
    print("\nplan quality summary (ratio = best feasible baseline's step time / auto's; > 1: auto faster):")
    print(summary_table(summary))
    print("\nrows that are not ties:")
    print(quality_table([r for r in rows if r["verdict"] != "tie"]))
    print("\nDEFECTS (auto loses):" if defects else "\nauto never lost to the best feasible baseline.")
    for d in defects:
        print("  ", d)
    mismatches = [{k: r[k] for k in ("model", "mesh", "hardware", "memory", "candidate_mismatches")} for r in rows
                  if r.get("candidate_mismatches")]
    checked = sum(r["independent"] for r in rows)
    print(f"\nbaselines planned independently in {checked} configurations; auto's own candidate differed in "
          f"{len(mismatches)}:")
    for m in mismatches:
        print("  ", m)
    print(f"HiGHS printed {sum(r['solver_messages'] for r in rows)} lines to stdout while planning (hidden).")
    searches = search_rows(rows)
    print(f"\nsearch time of auto on {searches[0]['hardware']}, memory {searches[0]['memory']} (seconds; capture is "
          "per model and device count, shared by its meshes):")
    print(search_table(searches))
    os.makedirs(args.out_dir, exist_ok=True)
    meta = report(args, selected, started, load_before, code)
    _write(os.path.join(args.out_dir, "quality.json"),
           meta | {"summary": summary, "defects": defects, "candidate_mismatches": mismatches, "rows": rows})
    _write(os.path.join(args.out_dir, "search_time.json"), meta | {"rows": searches})
    plot(rows, os.path.join(args.out_dir, "quality.png"))
    print(f"wrote quality.json, search_time.json, quality.png in {os.path.relpath(args.out_dir)} "
          f"({meta['wall_s']:.0f} s, load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f})")


def _write(path: str, data: dict) -> None:
    with open(path, "w") as handle:
        json.dump(data, handle, indent=1)


if __name__ == "__main__":
    main()
