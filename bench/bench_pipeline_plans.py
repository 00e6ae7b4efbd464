"""pipeline="auto" on meta-device LLaMA shapes: the chosen plan against the intra-op plan, and planning time.

    python bench/bench_pipeline_plans.py            # LLaMA-3-8B on 8x16 and LLaMA-3-70B on 8x8x16, h100 and
                                                    # ascend-910b, 16 sequences of 2,048 tokens (~10 min here)
    python bench/bench_pipeline_plans.py --quick    # a 16-layer LLaMA (0.2 B) on 64 devices, 4 and 2 GiB budgets

Each row is one ``autopar.plan(..., pipeline="auto")``: the intra-op plan (``strategy="auto"``) and the
pipeline search over pipeline size x schedule x micro-batches x stage layout, on torch_autopar's cost model
(no devices are used). Prints a table and writes bench/results/pipeline_plans.json.
Must never change torch_autopar's planner or its results: it only calls it and reads what it returns.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time

import torch

import torch_autopar as autopar
from torch_autopar.errors import AutoparError
from torch_autopar.testing.models import LLAMA3_70B, LLAMA3_8B, Llama, LlamaConfig
from provenance import code_state, write_report

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SMALL = LlamaConfig(n_layer=16, dim=1024, n_head=16, n_kv_head=4, ffn_dim=4096, vocab_size=32000)
FULL = [("llama3-8b", LLAMA3_8B, (8, 16), hardware, None, 16, 2048) for hardware in ("h100", "ascend-910b")] + \
       [("llama3-70b", LLAMA3_70B, (8, 8, 16), hardware, None, 16, 2048) for hardware in ("h100", "ascend-910b")]
QUICK = [("llama-0.2b", SMALL, (64,), "h100", budget, 8, 1024) for budget in (4 * 2**30, 2 * 2**30)]


def plan_row(name, config, mesh, hardware, budget, sequences, length) -> dict:
    with torch.device("meta"):
        model = Llama(config)
    tokens = torch.empty(sequences, length, dtype=torch.long, device="meta")
    row = {"model": name, "mesh": "x".join(map(str, mesh)), "hardware": hardware, "budget": budget,
           "batch": f"{sequences}x{length}"}
    started = time.perf_counter()
    try:
        plan = autopar.plan(model, tokens, mesh_shape=mesh, hardware=hardware, memory_budget=budget,
                            pipeline="auto")
    except AutoparError as error:
        return row | {"error": str(error)[:300], "seconds": time.perf_counter() - started}
    compared = plan.search_stats["pipeline_auto"]
    return row | {"seconds": time.perf_counter() - started, "pipeline_search_s": compared["seconds"],
                  "chosen": compared["chosen"], "strategy": plan.strategy, "mesh_chosen": list(plan.mesh_shape),
                  "stages": plan.pipeline_stages, "microbatches": plan.microbatches, "schedule": plan.schedule,
                  "step_s": plan.estimated_step_time, "peak_memory": plan.peak_memory,
                  "intra_op_step_s": compared["intra_op_step_s"],
                  "intra_op_peak_memory": compared["intra_op_peak_memory"],
                  "pipelined_step_s": compared["best_step_s"], "pipelined_peak_memory": compared["best_peak_memory"],
                  "candidates": compared["candidates"], "notes": plan.notes}


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.1f}"


def _s(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def table(rows: list[dict]) -> str:
    lines = ["| model | mesh | hardware | budget GiB | chosen | pp x dp, schedule, M | step s | GiB | intra-op step s "
             "| intra-op GiB | best pipelined step s | GiB | plan s (pipeline search s) |",
             "|---|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        head = f"| {r['model']} | {r['mesh']} | {r['hardware']} | {_gib(r['budget']) if r['budget'] else '-'} "
        if "error" in r:
            lines.append(head + f"| nothing fits: {r['error'][:80]} |" + " |" * 8)
            continue
        shape = (f"{r['mesh_chosen'][1]} x {r['mesh_chosen'][0]}, {r['schedule']}, {r['microbatches']}"
                 if r["stages"] > 1 else "-")
        lines.append(head + f"| {r['chosen']} | {shape} | {_s(r['step_s'])} | {_gib(r['peak_memory'])} | "
                     f"{_s(r['intra_op_step_s'])} | {_gib(r['intra_op_peak_memory'])} | {_s(r['pipelined_step_s'])} "
                     f"| {_gib(r['pipelined_peak_memory'])} | {r['seconds']:.1f} ({r['pipeline_search_s']:.1f}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(RESULTS, "pipeline_plans.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before, started = os.getloadavg(), time.perf_counter()
    rows = []
    for case in QUICK if args.quick else FULL:
        rows.append(plan_row(*case))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
              "code": code_state(), "quick": args.quick, "rows": rows, "wall_s": time.perf_counter() - started,
              "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg())}}
    write_report(report, args.out, load_before)


if __name__ == "__main__":
    main()
