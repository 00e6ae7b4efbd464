"""One-process overhead: torch_autopar's stand-alone module against the plain model and torch.compile.

    python bench/bench_overhead.py            # ~1 min on 2 CPU cores; writes bench/results/overhead.json
    python bench/bench_overhead.py --quick    # ~30 s: 4 rounds x 5 steps (20 timed steps per variant)

One process, no process group (world size 1, so autopar plans ``stand_alone``). Four variants of the same model
(own copy each, same seed, same data): the plain ``nn.Module`` in eager mode; ``autopar.compile(model,
mode="eager")``; ``autopar.compile(model, mode="graph")``; ``torch.compile(model, backend="autopar")`` (the
backend on its own, without autopar's module). Time of one training step (forward + backward + AdamW step),
warm-up first (graph variants compile there), then the variants alternate in rounds (10 x 5 steps) with the order rotating
each round (the timing helpers of bench_dp.py). Reported: median wall time over all timed steps, p10/p90,
median CPU time, page faults, and ratios of medians (CPU-time ratios in brackets). After timing, every
variant's parameters are compared with the plain model's (they took the same steps on the same data): a
variant that skipped work would look fast, so a large difference is reported.
Workloads: bench_dp.py's ``gpt_small`` (testing.models.GPT, 4 layers x 128, 16 x 64 tokens) and
``mlp_4x1024``. Must never start a process group or change the library.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import torch

import torch_autopar as autopar
from bench_dp import WORKLOADS, alternate, make_variant, quiet, summarise
import provenance  # noqa: E402
from provenance import code_state

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "overhead.json")
VARIANTS = ("plain", "autopar_eager", "autopar_graph", "torch_compile_autopar")
RATIOS = (("autopar_eager", "plain"), ("autopar_graph", "plain"), ("torch_compile_autopar", "plain"),
          ("autopar_graph", "torch_compile_autopar"))


def build_variant(name: str, workload, example):
    """(module, AdamW) for one variant; the autopar ones through bench_dp.make_variant (stand_alone plan)."""
    if name != "torch_compile_autopar":
        return make_variant(name, workload, example, bucket_cap_mb=25.0)
    model = workload.build()
    return torch.compile(model, backend="autopar"), torch.optim.AdamW(model.parameters(), lr=1e-4)


@torch.no_grad()
def divergence_from_plain(variants: dict) -> dict:
    """Largest |parameter - plain's parameter| per variant after the same steps on the same data."""
    def flat(module):
        module = getattr(module, "_orig_mod", getattr(module, "module", module))
        return torch.cat([p.detach().reshape(-1) for p in module.parameters()])

    reference = flat(variants["plain"][0])
    return {name: float((flat(net) - reference).abs().max()) for name, (net, _) in variants.items()}


def measure(workloads, options: dict) -> dict:
    out = {}
    for workload in workloads:
        inputs, target = workload.batch(seed=1000)
        variants = {name: build_variant(name, workload, inputs) for name in VARIANTS}
        started = time.perf_counter()
        times = alternate(variants, workload, inputs, target, warmup=options["warmup"], rounds=options["rounds"],
                          steps_per_round=options["steps_per_round"])
        out[workload.name] = {"step_s": times, "divergence_from_plain": divergence_from_plain(variants),
                              "plans": {n: v[0].plan.strategy for n, v in variants.items() if hasattr(v[0], "plan")},
                              "measure_s": time.perf_counter() - started}
        print(f"{workload.name}: measured in {out[workload.name]['measure_s']:.0f} s", flush=True)
    return out


def table(summary: dict) -> str:
    """Per workload and variant: median, p10-p90 and CPU ms, page faults, ratio to plain (CPU-time ratio)."""
    lines = ["one process, time of one step (forward + backward + AdamW), median over all timed steps",
             f"{'workload':<11} {'variant':<22} {'median':>9} {'p10-p90':>15} {'CPU':>9} {'faults':>7}  vs plain"]
    for workload, s in summary.items():
        for name in VARIANTS:
            ratio = f"{name}/plain"
            versus = f"{s['ratios'][ratio]:.3f} ({s['cpu_ratios'][ratio]:.3f})" if ratio in s["ratios"] else "1"
            low, high = s["p10_p90_ms"][name]
            spread = f"{low:.1f}-{high:.1f} ms"
            lines.append(f"{workload:<11} {name:<22} {s['median_ms'][name]:>6.1f} ms {spread:>15} "
                         f"{s['median_cpu_ms'][name]:>6.1f} ms {s['median_page_faults'][name]:>7.0f}  {versus}")
        ratio = "autopar_graph/torch_compile_autopar"
        lines.append(f"{'':<11} {ratio}: {s['ratios'][ratio]:.3f} ({s['cpu_ratios'][ratio]:.3f})")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 rounds x 5 steps, 3 warm-up steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per variant (graph modes compile here)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps-per-round", type=int, default=5, help="timed steps per variant per round")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier timings)")
    parser.add_argument("--workloads", default=",".join(w.name for w in WORKLOADS),
                        help="comma-separated subset of " + ", ".join(w.name for w in WORKLOADS))
    parser.add_argument("--output", default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps_per_round, args.warmup = 4, 5, 3
    return args


def main() -> None:
    args = parse_args()
    quiet()
    torch.set_num_threads(args.threads)
    names = args.workloads.split(",")
    unknown = [n for n in names if n not in {w.name for w in WORKLOADS}]
    if unknown:
        raise autopar.AutoparError(f"unknown workloads {unknown}; expected some of {[w.name for w in WORKLOADS]}.")
    options = {"warmup": args.warmup, "rounds": args.rounds, "steps_per_round": args.steps_per_round,
               "threads": args.threads, "workloads": names}
    started, load_before, code = time.perf_counter(), os.getloadavg(), code_state()
    summary = summarise(measure([w for w in WORKLOADS if w.name in names], options), list(RATIOS))
    print(table(summary))
    for name, s in summary.items():
        print(f"  {name}: max |param - plain's| after the same steps: "
              + ", ".join(f"{k} {v:.2g}" for k, v in s["divergence_from_plain"].items()))
    report = {
        "benchmark": "bench/bench_overhead.py", "command": " ".join(["python"] + sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "torch_autopar": autopar.__version__, "python": platform.python_version(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "threads": args.threads,
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "options": options, "workloads": {w.name: repr(w) for w in WORKLOADS if w.name in names},
        "one_process": summary, "code": code, "wall_s": time.perf_counter() - started,
    }
    provenance.write_report(report, args.output, load_before)


if __name__ == "__main__":
    main()
