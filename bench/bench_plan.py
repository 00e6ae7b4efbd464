"""Plan quality and search time: `auto` against every named strategy, on meta-device models.

    python bench/bench_plan.py            # full: GPT-2-XL and LLaMA-3-8B shapes on h100 meshes 8, 2x4, 8x8,
                                          # plus search time for LLaMA-3-8B on 8x16 and LLaMA-3-70B on 8x8x16
    python bench/bench_plan.py --quick    # GPT-2-small shape only

Estimated step time and peak memory per device come from torch_autopar's cost model (no devices are used).
Prints a table and writes bench/results/plan.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

import torch_autopar as autopar
from torch_autopar.errors import AutoparError
from torch_autopar.testing.models import GPT, GPT2_SMALL, GPT2_XL, LLAMA3_70B, LLAMA3_8B, Llama

STRATEGIES = ("data_parallel", "fully_shard", "tensor_parallel", "fsdp_tp", "auto")


def _model(name: str):
    with torch.device("meta"):
        if name == "gpt2-small":
            return GPT(GPT2_SMALL), 1024
        if name == "gpt2-xl":
            return GPT(GPT2_XL), 1024
        if name == "llama3-8b":
            return Llama(LLAMA3_8B), 2048
        if name == "llama3-70b":
            return Llama(LLAMA3_70B), 2048
    raise ValueError(name)


def _plan(model, tokens, mesh, strategy, hardware="h100", budget=None):
    started = time.perf_counter()
    try:
        plan = autopar.plan(model, tokens, mesh_shape=mesh, hardware=hardware, strategy=strategy,
                            memory_budget=budget)
    except AutoparError as error:
        return {"strategy": strategy, "error": str(error)[:200], "seconds": time.perf_counter() - started}
    stats = plan.search_stats
    return {"strategy": strategy, "step_s": plan.estimated_step_time, "peak_memory_gib": plan.peak_memory / 2**30,
            "comm_gib": plan.comm_bytes() / 2**30, "seconds": time.perf_counter() - started,
            "capture_s": stats.get("capture_s"), "strategy_generation_s": stats.get("strategy_generation_s"),
            "solve_s": stats.get("solve_s"), "mode": stats.get("mode", "propagation"),
            "candidate": stats.get("candidate")}


def quality(models, meshes, batch_per_device: int = 1) -> list[dict]:
    rows = []
    for name in models:
        model, seq = _model(name)
        for mesh in meshes:
            devices = 1
            for size in mesh:
                devices *= size
            tokens = torch.empty(devices * batch_per_device, seq, dtype=torch.long, device="meta")
            for strategy in STRATEGIES:
                if strategy == "fsdp_tp" and len(mesh) < 2:
                    continue
                row = _plan(model, tokens, mesh, strategy) | {"model": name, "mesh": "x".join(map(str, mesh))}
                rows.append(row)
                _print_row(row)
    return rows


def _print_row(row: dict) -> None:
    if "error" in row:
        print(f"{row['model']:<11} {row['mesh']:<7} {row['strategy']:<16} infeasible: {row['error'][:70]}")
        return
    print(f"{row['model']:<11} {row['mesh']:<7} {row['strategy']:<16} step {row['step_s'] * 1e3:10.2f} ms  "
          f"mem {row['peak_memory_gib']:7.2f} GiB  comm {row['comm_gib']:8.3f} GiB  plan {row['seconds']:6.1f} s"
          + (f"  (auto chose {row['candidate']})" if row.get("candidate") else ""), flush=True)


def check_auto(rows: list[dict]) -> list[str]:
    """auto must never be slower than the best named strategy on the same (model, mesh)."""
    problems = []
    keys = {(r["model"], r["mesh"]) for r in rows}
    for key in sorted(keys):
        group = [r for r in rows if (r["model"], r["mesh"]) == key and "step_s" in r]
        auto = [r for r in group if r["strategy"] == "auto"]
        others = [r for r in group if r["strategy"] != "auto"]
        if auto and others and auto[0]["step_s"] > min(r["step_s"] for r in others) * (1 + 1e-9):
            problems.append(f"{key}: auto {auto[0]['step_s']:.4f} s > best {min(r['step_s'] for r in others):.4f} s")
    return problems


def search_time(cases) -> list[dict]:
    rows = []
    for name, mesh in cases:
        model, seq = _model(name)
        devices = 1
        for size in mesh:
            devices *= size
        tokens = torch.empty(mesh[0] * 2, seq, dtype=torch.long, device="meta")
        row = _plan(model, tokens, mesh, "auto") | {"model": name, "mesh": "x".join(map(str, mesh))}
        rows.append(row)
        print(f"search time {name} on {row['mesh']}: total {row['seconds']:.1f} s (capture {row.get('capture_s') or 0:.1f} s, "
              f"strategy generation {row.get('strategy_generation_s') or 0:.1f} s, last solve {row.get('solve_s') or 0:.1f} s, "
              f"mode {row.get('mode')})", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "plan.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        rows = quality(["gpt2-small"], [(8,), (2, 4)])
        times = []
    else:
        rows = quality(["gpt2-xl", "llama3-8b"], [(8,), (2, 4), (8, 8)])
        times = search_time([("llama3-8b", (8, 16)), ("llama3-70b", (8, 8, 16))])
    problems = check_auto(rows)
    print("auto never worse than the best named strategy:", "yes" if not problems else problems)
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "command": " ".join([sys.executable.rsplit("/", 1)[-1]] + sys.argv), "quality": rows,
              "search_time": times, "auto_problems": problems}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
