"""Plan quality and search time: `auto` against every named strategy, on meta-device models.

    python bench/bench_plan.py            # full: GPT-2-XL and LLaMA-3-8B shapes on h100 meshes 8, 2x4, 8x8,
                                          # plus search time per phase for LLaMA-3 8B on 8x16, 70B on 8x8x16 and
                                          # 405B on 16x8x16 (one sequence of 2,048 tokens per device, bf16,
                                          # every layer recomputed)
    python bench/bench_plan.py --quick    # GPT-2-small shape only
    python bench/bench_plan.py --scale    # only the search times at scale, for auto and each named strategy
    python bench/bench_plan.py --scale --sequences 16   # the same with 16 sequences per step on every mesh

Estimated step time and peak memory per device come from torch_autopar's cost model (no devices are used).
Prints a table and writes bench/results/plan.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

import torch

import torch_autopar as autopar
from torch_autopar.errors import AutoparError
from torch_autopar.testing.models import GPT, GPT2_SMALL, GPT2_XL, LLAMA3_405B, LLAMA3_70B, LLAMA3_8B, Llama

STRATEGIES = ("data_parallel", "fully_shard", "tensor_parallel", "fsdp_tp", "auto")
SCALE = (("llama3-8b", (8, 16)), ("llama3-70b", (8, 8, 16)), ("llama3-405b", (16, 8, 16)))
PHASES = ("capture_s", "strategy_generation_s", "problem_build_s", "solve_s")
"""Planning phases timed by ``plan.search_stats`` (the chosen plan's solve; the rest of the time is "other":
propagation, estimates, the candidates compared)."""


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
        if name == "llama3-405b":
            return Llama(LLAMA3_405B), 2048
    raise ValueError(name)


def _plan(model, tokens, mesh, strategy, hardware="h100", budget=None, **training):
    started, cpu = time.perf_counter(), time.process_time()
    try:
        plan = autopar.plan(model, tokens, mesh_shape=mesh, hardware=hardware, strategy=strategy,
                            memory_budget=budget, **training)
    except AutoparError as error:
        return {"strategy": strategy, "error": str(error)[:200], "seconds": time.perf_counter() - started,
                "cpu_s": time.process_time() - cpu}
    stats = plan.search_stats
    return {"strategy": strategy, "step_s": plan.estimated_step_time, "peak_memory_gib": plan.peak_memory / 2**30,
            "comm_gib": plan.comm_bytes() / 2**30, "seconds": time.perf_counter() - started,
            "cpu_s": time.process_time() - cpu,  # steadier than wall time on a shared machine (one thread)
            **{phase: stats.get(phase) for phase in PHASES}, "mode": stats.get("mode", "propagation"),
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


SCALE_TRAINING = {"mixed_precision": "bf16", "activation_checkpointing": "full"}
"""How the scale cases train, as large models are trained (in fp32 without recomputation a 70B step's
activations alone are ~200 GiB per device at one sequence each)."""


def search_time(cases, strategies=("auto",), sequences: str = "world") -> list[dict]:
    """Planning time per phase, estimated step time and memory per device for each (model, mesh, strategy), on
    ``sequences`` sequences per step ("world": one per device, a batch every named strategy can split), trained
    as ``SCALE_TRAINING`` says."""
    rows = []
    print(f"{'model':<12} {'mesh':<8} {'strategy':<16} {'total':>7} " + " ".join(f"{p[:-2][:10]:>10}" for p in PHASES)
          + f" {'other':>7} {'cpu':>7}  {'step':>10} {'memory':>10}  mode", flush=True)
    for name, mesh in cases:
        model, seq = _model(name)
        batch = math.prod(mesh) if sequences == "world" else int(sequences)
        tokens = torch.empty(batch, seq, dtype=torch.long, device="meta")
        for strategy in strategies:
            row = _plan(model, tokens, mesh, strategy, **SCALE_TRAINING) | {
                "model": name, "mesh": "x".join(map(str, mesh)), "sequences": batch}
            row["other_s"] = row["seconds"] - sum(row.get(phase) or 0.0 for phase in PHASES)
            rows.append(row)
            _print_time_row(row)
    return rows


def _print_time_row(row: dict) -> None:
    phases = " ".join(f"{row.get(phase) or 0.0:10.1f}" for phase in PHASES)
    result = (f"{row['step_s']:9.3f}s {row['peak_memory_gib']:6.1f} GiB  {row['mode']}"
              + (f" (chose {row['candidate']})" if row.get("candidate") else "")) if "step_s" in row else row["error"][15:135]
    print(f"{row['model']:<12} {row['mesh']:<8} {row['strategy']:<16} {row['seconds']:7.1f} {phases} "
          f"{row['other_s']:7.1f} {row.get('cpu_s', 0.0):7.1f}  {result}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--scale", action="store_true", help="only the search times at scale, every strategy")
    parser.add_argument("--out", default=None, help="default: bench/results/plan.json (--scale: plan_scale.json)")
    parser.add_argument("--sequences", default="world",
                        help="sequences of 2,048 tokens per step at scale: 'world' (one per device) or a number")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        rows = quality(["gpt2-small"], [(8,), (2, 4)])
        times = []
    elif args.scale:
        rows = []
        times = search_time(SCALE, ("auto", "fully_shard", "tensor_parallel", "fsdp_tp"), args.sequences)
    else:
        rows = quality(["gpt2-xl", "llama3-8b"], [(8,), (2, 4), (8, 8)])
        times = search_time(SCALE, sequences=args.sequences)
    args.out = args.out or os.path.join(os.path.dirname(__file__), "results", "plan_scale.json" if args.scale else "plan.json")
    problems = check_auto(rows + times)
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
