"""Cost-model fidelity: the planner's predicted step time (from a measured profile) against the measured one.

    python bench/bench_fidelity.py            # ~3-4 min on 2 CPU cores; writes bench/results/fidelity.json
    python bench/bench_fidelity.py --quick    # < 1 min: the same configurations, fewer steps

For each (model, strategy, ranks) configuration: ``autopar.profile()`` is measured once per job (every rank of
the job calls it; under 2 gloo ranks it also times all_reduce / all_gather over the group), then
``autopar.compile(model, local_batch, strategy=..., hardware=profile, mode="eager")`` plans the model and
``plan.estimated_step_time`` is the prediction. The measured step is what the estimate covers: forward +
backward + gradient synchronisation, timed from a barrier to the end of ``backward()`` (no optimizer step,
which the estimate leaves out). The loss (MSE or cross-entropy on the model's output) is outside the captured
graph, so it is timed but not predicted; ``--loss-free`` replaces it by ``output.sum()`` to check its weight.

Timing follows ``bench_dp.py``: one thread per process (2 ranks on 2 cores), warm-up steps, then the
configurations of a job alternate in rounds (the order rotating each round) so that drift in the machine's
speed falls on all of them alike; each step counts as its slower rank's time; the median over the timed steps
is reported, with the median CPU time of the process per step (wall >> CPU means waiting for the core or for
the other rank). Targets of issue 5: Spearman rank correlation >= 0.8, median |relative error| <= 25%.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

import torch_autopar as autopar  # noqa: E402
from torch_autopar.testing import run_on_ranks  # noqa: E402
from torch_autopar.testing.models import GPT, MLP, GPTConfig, gpt_loss  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fidelity.json")
TARGET_RHO, TARGET_MEDIAN_ERROR = 0.8, 0.25


@dataclass(frozen=True, kw_only=True)
class Config:
    name: str
    kind: str
    """"gpt" or "mlp"."""
    width: int
    layers: int
    local_batch: int
    """Samples per rank per step."""
    strategy: str
    ranks: int
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

    def loss(self, output, target, loss_free: bool):
        if loss_free:
            return output.sum()
        return gpt_loss(output, target) if self.kind == "gpt" else F.mse_loss(output, target)


def _mlp(width, layers, batch, strategy, ranks):
    return Config(name=f"mlp{layers}x{width} b{batch} {strategy} x{ranks}", kind="mlp", width=width, layers=layers,
                  local_batch=batch, strategy=strategy, ranks=ranks)


def _gpt(width, layers, batch, strategy, ranks, seq=64):
    return Config(name=f"gpt{layers}x{width} b{batch} {strategy} x{ranks}", kind="gpt", width=width, layers=layers,
                  local_batch=batch, seq=seq, strategy=strategy, ranks=ranks)


CONFIGS = (
    _mlp(256, 4, 16, "stand_alone", 1),
    _mlp(1024, 4, 64, "stand_alone", 1),
    _mlp(1024, 4, 512, "stand_alone", 1),
    _mlp(2048, 4, 256, "stand_alone", 1),
    _gpt(128, 2, 8, "stand_alone", 1),
    _gpt(128, 2, 16, "stand_alone", 1),
    _mlp(256, 4, 16, "data_parallel", 2),
    _mlp(1024, 4, 64, "data_parallel", 2),
    _mlp(1024, 4, 512, "data_parallel", 2),
    _mlp(1024, 4, 64, "fully_shard", 2),
    _mlp(1024, 4, 64, "tensor_parallel", 2),
    _mlp(1024, 4, 512, "auto", 2),
    _gpt(128, 2, 8, "data_parallel", 2),
    _gpt(128, 2, 16, "data_parallel", 2),
    _gpt(128, 2, 8, "fully_shard", 2),
    _gpt(128, 2, 8, "tensor_parallel", 2),
)


def quiet() -> None:
    for category in (DeprecationWarning, FutureWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category)


def prepare(config: Config, hardware, rank: int) -> dict:
    """Compile one configuration on this rank; its plan's figures and the pieces a step needs."""
    inputs, target = config.batch(seed=1000 + rank)
    started = time.perf_counter()
    network = autopar.compile(config.build(), (inputs,), strategy=config.strategy, hardware=hardware, mode="eager")
    plan = network.plan
    counts = {f"{kind}@{axis}": n for (kind, axis), n in plan.collective_counts().items()}
    return {"network": network, "inputs": inputs, "target": target, "compile_s": time.perf_counter() - started,
            "plan": {"strategy": plan.strategy, "chosen": plan.search_stats.get("candidate", plan.strategy),
                     "mesh_shape": list(plan.mesh_shape), "estimated_step_ms": plan.estimated_step_time * 1e3,
                     "compute_ms": plan.compute_time * 1e3, "exposed_comm_ms": plan.exposed_comm_time * 1e3,
                     "collectives": counts, "grad_buckets": len(plan.grad_buckets),
                     "param_placements": sorted({"/".join(p) for p in plan.param_placements.values()})}}


def step(config: Config, entry: dict, loss_free: bool) -> None:
    """Forward + loss + backward (gradient synchronisation included); no optimizer step."""
    network = entry["network"]
    loss = config.loss(network(entry["inputs"]), entry["target"], loss_free)
    loss.backward()


def timed_steps(config: Config, entry: dict, steps: int, loss_free: bool) -> list[tuple[float, float]]:
    """(wall seconds, CPU seconds of this process) of each step, each starting after a barrier."""
    samples = []
    for _ in range(steps):
        entry["network"].zero_grad(set_to_none=True)
        if dist.is_initialized():
            dist.barrier()
        cpu, started = time.process_time(), time.perf_counter()
        step(config, entry, loss_free)
        samples.append((time.perf_counter() - started, time.process_time() - cpu))
    return samples


def measure(configs: list[Config], rank: int, options: dict) -> dict:
    """Profile, compile every configuration, then time them alternating in rounds; slowest rank per step."""
    quiet()
    torch.set_num_threads(1)
    started = time.perf_counter()
    hardware = autopar.profile()
    profile_s = time.perf_counter() - started
    entries = {c.name: prepare(c, hardware, rank) for c in configs}
    by_name = {c.name: c for c in configs}
    for name, entry in entries.items():
        for _ in range(options["warmup"]):
            entry["network"].zero_grad(set_to_none=True)
            step(by_name[name], entry, options["loss_free"])
    names = list(entries)
    times: dict[str, list] = {name: [] for name in names}
    for round_index in range(options["rounds"]):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name] += timed_steps(by_name[name], entries[name], options["steps_per_round"], options["loss_free"])
    out = {}
    for name, samples in times.items():
        values = torch.tensor(samples, dtype=torch.float64)
        if dist.is_initialized():                 # a step takes as long as its slowest rank
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        entry = entries[name]
        out[name] = {"plan": entry["plan"], "compile_s": entry["compile_s"], "step_s": values.tolist()}
    return {"profile": json.loads(hardware.to_json()), "profile_s": profile_s, "configs": out}


def rank_job(rank: int, world: int, configs: list[Config], options: dict) -> dict:
    return measure(configs, rank, options)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarise(config: Config, raw: dict, profile: dict) -> dict:
    wall = [row[0] for row in raw["step_s"]]
    cpu = [row[1] for row in raw["step_s"]]
    measured_ms = statistics.median(wall) * 1e3
    predicted_ms = raw["plan"]["estimated_step_ms"]
    return {"config": asdict(config), "predicted_ms": predicted_ms, "measured_ms": measured_ms,
            "relative_error": (predicted_ms - measured_ms) / measured_ms,
            "measured_p10_p90_ms": [quantile(wall, 0.1) * 1e3, quantile(wall, 0.9) * 1e3],
            "measured_cpu_ms": statistics.median(cpu) * 1e3, "steps_timed": len(wall),
            "plan": raw["plan"], "compile_s": raw["compile_s"], "profile": profile["name"],
            "step_wall_ms": [w * 1e3 for w in wall]}


def table(rows: list[dict]) -> str:
    head = (f"{'configuration':<36}{'plan':>17}{'predicted':>12}{'measured':>12}{'p10-p90':>18}{'CPU':>10}"
            f"{'error':>9}")
    lines = [head]
    for r in rows:
        p10, p90 = r["measured_p10_p90_ms"]
        plan = "x".join(str(s) for s in r["plan"]["mesh_shape"]) + " " + str(r["plan"]["chosen"])[:12]
        lines.append(f"{r['config']['name']:<36}{plan:>17}{r['predicted_ms']:>9.2f} ms{r['measured_ms']:>9.2f} ms"
                     f"{p10:>8.1f}-{p90:<6.1f}ms{r['measured_cpu_ms']:>7.1f} ms{r['relative_error'] * 100:>+8.0f}%")
    return "\n".join(lines)


def verdict(rows: list[dict]) -> dict:
    predicted = [r["predicted_ms"] for r in rows]
    measured = [r["measured_ms"] for r in rows]
    rho, p_value = spearmanr(predicted, measured)
    errors = [abs(r["relative_error"]) for r in rows]
    by_ranks = {}
    for ranks in sorted({r["config"]["ranks"] for r in rows}):
        subset = [r for r in rows if r["config"]["ranks"] == ranks]
        sub_rho = spearmanr([r["predicted_ms"] for r in subset], [r["measured_ms"] for r in subset])[0] \
            if len(subset) > 2 else None
        by_ranks[str(ranks)] = {"spearman_rho": sub_rho, "configs": len(subset),
                                "median_abs_relative_error": statistics.median(abs(r["relative_error"]) for r in subset),
                                "median_signed_relative_error": statistics.median(r["relative_error"] for r in subset)}
    median_error = statistics.median(errors)
    return {"spearman_rho": float(rho), "spearman_p_value": float(p_value), "median_abs_relative_error": median_error,
            "median_signed_relative_error": statistics.median(r["relative_error"] for r in rows),
            "max_abs_relative_error": max(errors), "by_ranks": by_ranks,
            "targets": {"spearman_rho_min": TARGET_RHO, "median_abs_relative_error_max": TARGET_MEDIAN_ERROR},
            "rho_met": bool(rho >= TARGET_RHO), "median_error_met": bool(median_error <= TARGET_MEDIAN_ERROR)}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps (< 1 min)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per configuration (default 5, quick 2)")
    parser.add_argument("--rounds", type=int, default=None, help="default 6, quick 3")
    parser.add_argument("--steps-per-round", type=int, default=None, help="default 5, quick 3")
    parser.add_argument("--loss-free", action="store_true", help="loss = output.sum() instead of MSE/cross-entropy")
    parser.add_argument("--configs", default=None, help="comma-separated substrings selecting configurations")
    parser.add_argument("--output", default=RESULTS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    quiet()
    torch.set_num_threads(1)
    defaults = (2, 3, 3) if args.quick else (5, 6, 5)
    options = {"warmup": args.warmup if args.warmup is not None else defaults[0],
               "rounds": args.rounds if args.rounds is not None else defaults[1],
               "steps_per_round": args.steps_per_round if args.steps_per_round is not None else defaults[2],
               "loss_free": args.loss_free}
    configs = [c for c in CONFIGS if args.configs is None or any(s in c.name for s in args.configs.split(","))]
    started, load_before = time.perf_counter(), os.getloadavg()
    jobs = {}
    for ranks in sorted({c.ranks for c in configs}):
        subset = [c for c in configs if c.ranks == ranks]
        if ranks == 1:
            jobs[ranks] = measure(subset, 0, options)
        else:
            jobs[ranks] = run_on_ranks(rank_job, ranks, subset, options, timeout_s=600)[0]
    rows = [summarise(c, jobs[c.ranks]["configs"][c.name], jobs[c.ranks]["profile"]) for c in configs]
    print(f"predicted (plan.estimated_step_time, measured profile) vs measured median step "
          f"(forward + {'sum' if args.loss_free else 'loss'} + backward + grad sync; slowest rank; 1 thread/rank)")
    print(table(rows))
    summary = verdict(rows) if len(rows) >= 3 else {}
    if summary:
        print(f"\nSpearman rho {summary['spearman_rho']:.3f} (target >= {TARGET_RHO}: "
              f"{'met' if summary['rho_met'] else 'NOT met'}); median |error| "
              f"{summary['median_abs_relative_error'] * 100:.0f}% (target <= {TARGET_MEDIAN_ERROR * 100:.0f}%: "
              f"{'met' if summary['median_error_met'] else 'NOT met'}); median signed error "
              f"{summary['median_signed_relative_error'] * 100:+.0f}%")
        for ranks, s in summary["by_ranks"].items():
            rho = "n/a" if s["spearman_rho"] is None else f"{s['spearman_rho']:.3f}"
            print(f"  {ranks} rank(s): {s['configs']} configs, rho {rho}, median |error| "
                  f"{s['median_abs_relative_error'] * 100:.0f}%, median signed {s['median_signed_relative_error'] * 100:+.0f}%")
    for ranks, job in jobs.items():
        p = job["profile"]
        link = p["intra_node"]
        print(f"profile ({ranks} rank(s), {job['profile_s']:.1f} s): {p['flops']['float32'] / 1e9:.1f} GFLOP/s, "
              f"{p['memory_bandwidth'] / 1e9:.1f} GB/s, op overhead {p['op_overhead_s'] * 1e6:.2f} us, link alpha "
              f"{link['latency_s'] * 1e6:.1f} us, {link['bandwidth'] / 1e9:.2f} GB/s ({p['source']})")
    report = {
        "benchmark": "bench/bench_fidelity.py",
        "command": " ".join(["python"] + sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "torch_autopar": autopar.__version__, "python": platform.python_version(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "threads_per_rank": 1,
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "options": options,
        "measured_step": "forward + " + ("output.sum()" if args.loss_free else "loss (MSE / cross-entropy)")
                         + " + backward incl. gradient synchronisation; no optimizer step; median over timed steps "
                         "of the slower rank's wall time",
        "summary": summary,
        "profiles": {str(r): {"profile": j["profile"], "profile_s": j["profile_s"]} for r, j in jobs.items()},
        "results": rows,
        "wall_s": time.perf_counter() - started,
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as handle:
        json.dump(report, handle, indent=1)
    print(f"\nwrote {os.path.relpath(args.output)} in {report['wall_s']:.0f} s "
          f"(load average before {load_before[0]:.1f}, after {report['machine']['loadavg_after'][0]:.1f})")


if __name__ == "__main__":
    main()
