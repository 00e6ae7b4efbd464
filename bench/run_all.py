"""Run every benchmark of bench/ in sequence and summarise them: one command for the whole suite.

    python bench/run_all.py            # < 20 min on 2 CPU cores; writes bench/results/summary.json
    python bench/run_all.py --quick    # < 3 min: every part in its quick mode
    python bench/run_all.py --parts quality,overhead

Each part runs as its own subprocess (its output streamed through, prefixed with its name), so one that fails
or times out is reported and the others still run. Parts whose script does not exist are skipped with a note.
The summary picks the headline numbers out of each part's JSON (plan quality: wins / losses of `auto`; search
time; overhead and data-parallel ratios; for parts it does not know, the JSON's top-level scalars and any
"summary"). Must never judge a part by anything but its exit status and what it wrote.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

from provenance import code_state

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


@dataclass(frozen=True, kw_only=True)
class Part:
    name: str
    script: str
    results: tuple[str, ...]
    """JSON files under bench/results the part writes."""
    full: tuple[str, ...] = ()
    quick: tuple[str, ...] = ("--quick",)
    timeout_s: int = 900
    note: str = ""
    summarise: str = "generic"
    default: bool = True
    """False: runs only when named in --parts."""


PARTS = (
    Part(name="quality", script="bench_quality.py", results=("quality.json", "search_time.json"),
         summarise="quality", note="plan quality and search time (cost model, no devices)"),
    Part(name="overhead", script="bench_overhead.py", results=("overhead.json",), timeout_s=300,
         summarise="overhead", note="one process: autopar eager / graph / torch.compile(backend='autopar') vs plain"),
    Part(name="dp", script="bench_dp.py", results=("dp.json",), timeout_s=420, summarise="dp",
         full=("--skip-one-process",),
         quick=("--skip-one-process", "--rounds", "3", "--steps-per-round", "4", "--warmup", "2"),
         note="2 gloo ranks: autopar data_parallel vs DDP (its one-process part is bench_overhead's job)"),
    Part(name="speed", script="bench_speed.py", results=("speed.json",), timeout_s=600,
         note="measured speed vs DDP / FSDP2 / parallelize_module"),
    Part(name="fidelity", script="bench_fidelity.py", results=("fidelity.json",), timeout_s=420,
         note="cost-model fidelity: predicted vs measured step time"),
    Part(name="models", script="bench_models.py", results=("models.json",), timeout_s=300,
         note="capture time and joint-graph size of transformers models; LLaMA-3-8B (transformers) planned on meta"),
    Part(name="plan", script="bench_plan.py", results=("plan.json",), timeout_s=900, default=False,
         note="older plan-quality bench: GPT-2-XL / LLaMA-3-8B on h100, search time per phase of LLaMA-3 8B / 70B / 405B"),
)
"""bench_plan.py only with --parts ...,plan: bench_quality.py plans its models and meshes (and more) with the same
planner; its extra cases, search time at cluster scale (LLaMA-3 8B on 8x16, 70B on 8x8x16, 405B on 16x8x16: ~2.5
CPU minutes together), make its full run ~5 min."""


def run_part(part: Part, quick: bool) -> dict:
    """Run one part to completion (or its timeout), streaming its output; its status, time and files."""
    path = os.path.join(HERE, part.script)
    if not os.path.exists(path):
        print(f"[{part.name}] skipped: {part.script} does not exist", flush=True)
        return {"status": "skipped", "reason": f"{part.script} not found"}
    command = [sys.executable, path, *(part.quick if quick else part.full)]
    print(f"\n[{part.name}] {' '.join(command[1:])}  ({part.note})", flush=True)
    started, tail = time.time(), deque(maxlen=25)
    process = subprocess.Popen(command, cwd=os.path.dirname(HERE), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    status = _stream(process, part, tail, started)
    outcome = {"status": status, "returncode": process.returncode, "wall_s": time.time() - started,
               "command": " ".join(["python", os.path.relpath(path, os.path.dirname(HERE)), *command[2:]])}
    written = [f for f in part.results if _written_since(f, started)]
    outcome["results"] = written
    if status != "ok":
        outcome["output_tail"] = list(tail)
    elif len(written) < len(part.results):
        outcome["status"] = "incomplete"
        outcome["missing"] = [f for f in part.results if f not in written]
    print(f"[{part.name}] {outcome['status']} in {outcome['wall_s']:.0f} s", flush=True)
    return outcome


def _stream(process, part: Part, tail: deque, started: float) -> str:
    """Echo the child's output line by line; a timer kills it at its timeout (even if it prints nothing)."""
    timer = threading.Timer(part.timeout_s, process.kill)
    timer.start()
    try:
        for line in process.stdout:
            tail.append(line.rstrip("\n"))
            print(f"[{part.name}] {line}", end="", flush=True)
        process.wait()
    finally:
        timer.cancel()
    if time.time() - started >= part.timeout_s:
        return "timeout"
    return "ok" if process.returncode == 0 else "failed"


def _written_since(name: str, started: float) -> bool:
    path = os.path.join(RESULTS, name)
    return os.path.exists(path) and os.path.getmtime(path) >= started - 1


def _load(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as handle:
        return json.load(handle)


# headline numbers per part -------------------------------------------------------------------------------------
def headline_quality() -> dict:
    quality, search = _load("quality.json"), _load("search_time.json")
    slowest = max(search["rows"], key=lambda r: r["total_s"])
    return {"configs": quality["summary"]["overall"]["configs"], "overall": quality["summary"]["overall"],
            "per_model": quality["summary"]["per_model"], "defects": quality["defects"],
            "search_total_s_max": {"model": slowest["model"], "mesh": slowest["mesh"], "total_s": slowest["total_s"]},
            "search_total_s_sum": sum(r["total_s"] for r in search["rows"])}


def headline_overhead() -> dict:
    data = _load("overhead.json")["one_process"]
    return {w: {"median_ms": s["median_ms"], "ratios": s["ratios"], "cpu_ratios": s["cpu_ratios"]}
            for w, s in data.items()}


def headline_dp() -> dict:
    data = _load("dp.json")["data_parallel"]
    return {w: {"median_ms": s["median_ms"], "ratios": s["ratios"], "cpu_ratios": s["cpu_ratios"]}
            for w, s in data.items()}


def headline_generic(part: Part) -> dict:
    out = {}
    for name in part.results:
        data = _load(name)
        scalars = {k: v for k, v in data.items() if isinstance(v, (int, float, str, bool))}
        out[name] = scalars | ({"summary": data["summary"]} if "summary" in data else {})
    return out


def headline(part: Part, outcome: dict) -> dict | None:
    if outcome["status"] not in ("ok", "incomplete") or not outcome["results"]:
        return None
    try:
        if part.summarise == "generic":
            return headline_generic(part)
        return globals()[f"headline_{part.summarise}"]()
    except (KeyError, ValueError, OSError) as error:  # a part's JSON changed shape: report, do not fail the run
        return {"error": f"could not read the headline numbers: {type(error).__name__}: {error}"}


def print_summary(outcomes: dict, wall_s: float, quick: bool) -> None:
    print(f"\n==== bench summary ({'quick' if quick else 'full'}, {wall_s / 60:.1f} min) ====")
    for name, o in outcomes.items():
        line = f"{name:<9} {o['status']:<10}"
        if "wall_s" in o:
            line += f" {o['wall_s']:6.0f} s  {', '.join(o['results']) or '-'}"
        print(line + (f"  ({o.get('reason')})" if o.get("reason") else ""))
        for text in _headline_lines(name, o.get("headline")):
            print("    " + text)


def _headline_lines(name: str, head: dict | None) -> list[str]:
    if not head:
        return []
    if "error" in head:
        return [head["error"]]
    if name == "quality":
        o = head["overall"]
        ratios = (f"best/auto geomean {o['geomean_ratio']:.3f}, max {o['max_ratio']:.3f}" if o["max_ratio"]
                  else "no configuration with both a feasible baseline and auto")
        lines = [f"auto vs best baseline over {o['configs']} configs: {o['wins']} wins, {o['ties']} ties, "
                 f"{o['only_auto_fits']} only auto fits, {o['nothing_fits']} nothing fits, {o['losses']} LOSSES; "
                 + ratios]
        lines += [f"DEFECT: {d}" for d in head["defects"]]
        s = head["search_total_s_max"]
        return lines + [f"slowest auto search: {s['model']} on {s['mesh']}: {s['total_s']:.1f} s"]
    if name in ("overhead", "dp"):
        return [f"{w}: " + ", ".join(f"{k} {v:.3f} (CPU {s['cpu_ratios'][k]:.3f})" for k, v in s["ratios"].items())
                for w, s in head.items()]
    return [f"{file}: {json.dumps(content)[:300]}" for file, content in head.items()]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every part in its quick mode")
    parser.add_argument("--parts", default=",".join(p.name for p in PARTS if p.default),
                        help="comma-separated subset of " + ", ".join(p.name for p in PARTS)
                        + " (default: all but plan)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    chosen = args.parts.split(",")
    unknown = [name for name in chosen if name not in {p.name for p in PARTS}]
    if unknown:
        sys.exit(f"torch_autopar bench: unknown parts {unknown}; expected some of {[p.name for p in PARTS]}.")
    started, load_before, code = time.time(), os.getloadavg(), code_state()
    outcomes = {}
    for part in (p for p in PARTS if p.name in chosen):
        outcomes[part.name] = run_part(part, args.quick)
        outcomes[part.name]["headline"] = headline(part, outcomes[part.name])
    wall_s = time.time() - started
    print_summary(outcomes, wall_s, args.quick)
    summary = {"benchmark": "bench/run_all.py", "command": " ".join(["python"] + sys.argv), "quick": args.quick,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "python": platform.python_version(), "cpus": os.cpu_count(), "loadavg_before": load_before,
               "loadavg_after": os.getloadavg(), "code": code, "wall_s": wall_s, "parts": outcomes}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=1)
    print(f"wrote {os.path.relpath(os.path.join(RESULTS, 'summary.json'))}")
    sys.exit(0 if all(o["status"] in ("ok", "skipped") for o in outcomes.values()) else 1)


if __name__ == "__main__":
    main()
