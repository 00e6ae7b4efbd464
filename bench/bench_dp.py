"""Data-parallel step time: torch_autopar (eager and graph mode) against DistributedDataParallel.

    python bench/bench_dp.py                      # 2.5-3.5 min on 2 CPU cores; writes bench/results/dp.json

Part 1 spawns 2 gloo ranks (``torch_autopar.testing.run_on_ranks``, one thread each) and times one training
step (forward + backward + optimizer step) of the same model, ranks and data three ways: ``DistributedDataParallel``,
``autopar.compile(..., strategy="data_parallel")`` in eager mode and in graph mode. The variants alternate in
rounds (the order rotates each round) so that drift in the machine's speed falls on all of them alike; every
step starts after a barrier and counts as the slower rank's time; the medians over all timed steps are compared.
After timing, each variant's replicas are checked to be equal across ranks (a variant that does not average
gradients would otherwise look fast).

Part 2, one process: the compiled model (``stand_alone`` plan) in graph mode against eager mode, and in eager
mode against the plain model.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_autopar as autopar
from torch_autopar.testing import run_on_ranks
from torch_autopar.testing.models import GPT, MLP, GPTConfig, gpt_loss
import provenance  # noqa: E402  (bench/ is on sys.path when a bench script runs)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "dp.json")
DP_VARIANTS = ("ddp", "autopar_eager", "autopar_graph")
ONE_PROCESS_VARIANTS = ("plain", "autopar_eager", "autopar_graph")


@dataclass(frozen=True, kw_only=True)
class Workload:
    name: str
    kind: str
    """"gpt" or "mlp"."""
    local_batch: int
    """Samples per rank per step (the global batch is local_batch x ranks)."""
    width: int
    layers: int
    seq: int = 0
    """GPT only: tokens per sample."""

    def build(self) -> torch.nn.Module:
        torch.manual_seed(0)
        if self.kind == "gpt":
            return GPT(GPTConfig(vocab_size=96, block_size=self.seq, n_layer=self.layers, n_head=4, n_embd=self.width))
        return MLP((self.width,) * (self.layers + 1))

    def batch(self, seed: int):
        generator = torch.Generator().manual_seed(seed)
        if self.kind == "gpt":
            tokens = torch.randint(0, 96, (self.local_batch, self.seq + 1), generator=generator)
            return tokens[:, :-1], tokens[:, 1:]
        return (torch.randn(self.local_batch, self.width, generator=generator),
                torch.randn(self.local_batch, self.width, generator=generator))

    def loss(self, output, target):
        return gpt_loss(output, target) if self.kind == "gpt" else F.mse_loss(output, target)


WORKLOADS = (
    Workload(name="gpt_small", kind="gpt", local_batch=16, seq=64, width=128, layers=4),
    Workload(name="mlp_4x1024", kind="mlp", local_batch=64, width=1024, layers=4),
)


def selected(options: dict) -> list[Workload]:
    return [w for w in WORKLOADS if w.name in options["workloads"]]


def quiet() -> None:
    for category in (DeprecationWarning, FutureWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category)


def make_variant(name: str, workload: Workload, example, bucket_cap_mb: float):
    """(module to call, optimizer) for one variant, on its own copy of the model."""
    model = workload.build()
    if name == "plain":
        network = model
    elif name == "ddp":
        network = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    else:
        network = autopar.compile(model, example_inputs=(example,), strategy="data_parallel" if dist.is_initialized()
                                  else "stand_alone", mode=name.removeprefix("autopar_"),
                                  bucket_cap_bytes=int(bucket_cap_mb * 2**20))
    return network, torch.optim.AdamW(network.parameters(), lr=1e-4)


def train_step(network, optimizer, workload: Workload, inputs, target) -> None:
    loss = workload.loss(network(inputs), target)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def timed_steps(network, optimizer, workload, inputs, target, steps: int) -> list[tuple[float, float, float]]:
    """(wall seconds, CPU seconds of this process, minor page faults) of each step.

    CPU time counts every thread of the process (gloo's too) and, unlike wall time, hardly moves when other
    programs compete for the cores; page faults show fresh memory being touched.
    """
    samples = []
    for _ in range(steps):
        if dist.is_initialized():
            dist.barrier()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cpu, started = time.process_time(), time.perf_counter()
        train_step(network, optimizer, workload, inputs, target)
        samples.append((time.perf_counter() - started, time.process_time() - cpu,
                        resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
    return samples


def alternate(variants: dict, workload, inputs, target, *, warmup: int, rounds: int, steps_per_round: int) -> dict:
    """Warm every variant up, then time them in ``rounds`` rounds, rotating the order each round."""
    for network, optimizer in variants.values():
        for _ in range(warmup):
            train_step(network, optimizer, workload, inputs, target)
    names = list(variants)
    times: dict[str, list[tuple]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name] += timed_steps(*variants[name], workload, inputs, target, steps_per_round)
    return times


@torch.no_grad()
def replica_divergence(module: torch.nn.Module) -> float:
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    worst = (flat - reference).abs().max().reshape(1)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def dp_worker(rank: int, world: int, options: dict) -> dict:
    """Run on each rank: every workload, the three data-parallel variants alternating."""
    quiet()
    torch.set_num_threads(1)
    out = {}
    for workload in selected(options):
        inputs, target = workload.batch(seed=1000 + rank)
        variants = {name: make_variant(name, workload, inputs, options["bucket_cap_mb"]) for name in DP_VARIANTS}
        times = alternate(variants, workload, inputs, target, warmup=options["warmup"], rounds=options["rounds"],
                          steps_per_round=options["steps_per_round"])
        slowest = {}
        for name, values in times.items():     # a step takes as long as its slowest rank (per column)
            tensor = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            slowest[name] = [tuple(row) for row in tensor.tolist()]
        divergence = {name: replica_divergence(getattr(net, "module", net)) for name, (net, _) in variants.items()}
        plans = {name: net.plan.strategy for name, (net, _) in variants.items() if hasattr(net, "plan")}
        buckets = {name: len(net.plan.grad_buckets) for name, (net, _) in variants.items() if hasattr(net, "plan")}
        out[workload.name] = {"step_s": slowest, "replica_divergence": divergence, "plans": plans,
                              "autopar_buckets": buckets}
    return out


def one_process(options: dict) -> dict:
    torch.set_num_threads(1)
    out = {}
    for workload in selected(options):
        inputs, target = workload.batch(seed=1000)
        variants = {name: make_variant(name, workload, inputs, options["bucket_cap_mb"])
                    for name in ONE_PROCESS_VARIANTS}
        times = alternate(variants, workload, inputs, target, warmup=options["warmup"], rounds=options["rounds"],
                          steps_per_round=options["steps_per_round"])
        out[workload.name] = {"step_s": times, "plans": {n: v[0].plan.strategy for n, v in variants.items()
                                                          if hasattr(v[0], "plan")}}
    return out


def summarise(raw: dict, pairs: list[tuple[str, str]]) -> dict:
    summary = {}
    for workload, result in raw.items():
        wall = {name: [row[0] for row in rows] for name, rows in result["step_s"].items()}
        cpu = {name: [row[1] for row in rows] for name, rows in result["step_s"].items()}
        faults = {name: [row[2] for row in rows] for name, rows in result["step_s"].items()}
        medians = {name: statistics.median(values) for name, values in wall.items()}
        cpu_medians = {name: statistics.median(values) for name, values in cpu.items()}
        summary[workload] = {
            "median_ms": {k: v * 1e3 for k, v in medians.items()},
            "p10_p90_ms": {k: [quantile(v, 0.1) * 1e3, quantile(v, 0.9) * 1e3] for k, v in wall.items()},
            "median_cpu_ms": {k: v * 1e3 for k, v in cpu_medians.items()},
            "median_page_faults": {k: statistics.median(v) for k, v in faults.items()},
            "steps_timed": {k: len(v) for k, v in wall.items()},
            "ratios": {f"{a}/{b}": medians[a] / medians[b] for a, b in pairs},
            "cpu_ratios": {f"{a}/{b}": cpu_medians[a] / cpu_medians[b] for a, b in pairs},
        } | {k: v for k, v in result.items() if k != "step_s"}
    return summary


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def table(title: str, summary: dict, variants, ratio_names) -> str:
    """Median wall ms per variant, then ratios of wall medians (CPU-time ratios in brackets), page faults."""
    lines = [title, f"{'workload':<12}" + "".join(f"{v:>16}" for v in variants)
             + "".join(f"{r:>32}" for r in ratio_names) + "   page faults/step"]
    for workload, s in summary.items():
        lines.append(f"{workload:<12}" + "".join(f"{s['median_ms'][v]:>13.1f} ms" for v in variants)
                     + "".join(f"{s['ratios'][r]:>23.3f} ({s['cpu_ratios'][r]:.3f})" for r in ratio_names)
                     + "   " + " / ".join(f"{s['median_page_faults'][v]:.0f}" for v in variants))
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per variant (graph mode compiles here)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps-per-round", type=int, default=5, help="timed steps per variant per round")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                        help="gradient bucket cap for both DDP and autopar (both default to 25)")
    parser.add_argument("--workloads", default=",".join(w.name for w in WORKLOADS),
                        help="comma-separated subset of " + ", ".join(w.name for w in WORKLOADS))
    parser.add_argument("--skip-one-process", action="store_true")
    parser.add_argument("--output", default=RESULTS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    quiet()
    options = {"warmup": args.warmup, "rounds": args.rounds, "steps_per_round": args.steps_per_round,
               "bucket_cap_mb": args.bucket_cap_mb, "workloads": args.workloads.split(",")}
    started, load_before = time.perf_counter(), os.getloadavg()
    per_rank = run_on_ranks(dp_worker, args.ranks, options, timeout_s=600)
    dp = summarise(per_rank[0], [("autopar_eager", "ddp"), ("autopar_graph", "ddp")])
    print(table(f"{args.ranks} gloo ranks, median step time (forward+backward+AdamW), slowest rank", dp, DP_VARIANTS,
                ["autopar_eager/ddp", "autopar_graph/ddp"]))
    for name, s in dp.items():
        print(f"  {name}: replicas in step after timing: "
              + ", ".join(f"{k} {v:.2g}" for k, v in s["replica_divergence"].items()))
    single = {}
    if not args.skip_one_process:
        single = summarise(one_process(options), [("autopar_graph", "autopar_eager"), ("autopar_eager", "plain")])
        print(table("\none process, median step time", single, ONE_PROCESS_VARIANTS,
                    ["autopar_graph/autopar_eager", "autopar_eager/plain"]))
    report = {
        "benchmark": "bench/bench_dp.py",
        "command": " ".join(["python"] + sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "torch_autopar": autopar.__version__, "python": platform.python_version(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "threads_per_rank": 1,
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "options": options | {"ranks": args.ranks},
        "workloads": [asdict(w) for w in selected(options)],
        "data_parallel": dp, "one_process": single,
        "wall_s": time.perf_counter() - started,
    }
    provenance.write_report(report, args.output, load_before)


if __name__ == "__main__":
    main()
