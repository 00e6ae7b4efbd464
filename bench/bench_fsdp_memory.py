"""Fully-sharded memory and speed on real ranks: autopar's fully_shard (per-layer gathers, reshard after forward)
against itself gathering once per step (reshard_after_forward=False, what fully_shard did before), FSDP2, DDP
and autopar's data parallelism, side by side in one run.

    python bench/bench_fsdp_memory.py              # 2 gloo ranks; writes bench/results/fsdp_memory.json
    python bench/bench_fsdp_memory.py --worlds 2,4

Per workload (an 8-block residual MLP, the project's GPT with 8 blocks) and world size, every variant trains the
same model on the same global batch with AdamW, each rank its slice. Peak memory per rank: the allocator's
record of one training step once the optimizer state exists (``torch_autopar.testing.memory``), the median of
5 steps (a step's peak varies by a few parameter-sized buffers: when gloo releases a collective's buffers),
the highest of all ranks; for autopar also the plan's prediction (``plan.peak_memory``). Step time: rounds
alternating the variants (order rotating), each step after a barrier and counted as its slowest rank's time;
medians over ``rounds x steps_per_round`` timed steps after warm-up. Must never change what it measures.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import torch_autopar as autopar  # noqa: E402
from bench.provenance import code_state, write_report  # noqa: E402
from bench.timing import alternating_step_times  # noqa: E402
from torch_autopar.testing import run_on_ranks  # noqa: E402
from torch_autopar.testing.memory import step_peak_bytes  # noqa: E402
from torch_autopar.testing.models import GPT, BlockMLP, GPTConfig, gpt2_init, gpt_loss  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fsdp_memory.json")
VARIANTS = ("fully_shard", "kept_last", "before", "fsdp2", "ddp", "data_parallel")
"""fully_shard: autopar, reshard_after_forward=True (default); before: autopar, reshard_after_forward=False;
kept_last: autopar, reshard_after_forward="auto" under a memory budget of fully_shard's predicted peak plus 1.5
blocks (it keeps the blocks that budget allows gathered, the last ones of the forward: ``plan.kept_gathered``)."""
GPT_CONFIG = GPTConfig(vocab_size=96, block_size=8, n_layer=8, n_head=2, n_embd=192)


def _model(workload: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if workload == "mlp8":
        return BlockMLP()
    model = GPT(GPT_CONFIG)
    gpt2_init(model)
    return model


def _batch(workload: str):
    generator = torch.Generator().manual_seed(7)
    if workload == "gpt8":
        tokens = torch.randint(0, GPT_CONFIG.vocab_size, (4, GPT_CONFIG.block_size + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:], gpt_loss
    return torch.randn(8, 128, generator=generator), torch.randn(8, 8, generator=generator), F.mse_loss


def _variant(name: str, workload: str, x, world: int, resharding_peak: int | None = None):
    """(module to call, optimizer, predicted peak bytes or None); ``resharding_peak``: fully_shard's prediction."""
    model = _model(workload)
    if name == "kept_last":
        block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
        module = autopar.compile(model, x, strategy="fully_shard", mode="eager", reshard_after_forward="auto",
                                 memory_budget=resharding_peak + 3 * block // 2)
        predicted = module.plan.peak_memory
    elif name in ("fully_shard", "before", "data_parallel"):
        strategy = "data_parallel" if name == "data_parallel" else "fully_shard"
        module = autopar.compile(model, x, strategy=strategy, mode="eager", reshard_after_forward=name != "before")
        predicted = module.plan.peak_memory
    elif name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        module, predicted = fully_shard(model, mesh=mesh), None
    else:
        module, predicted = torch.nn.parallel.DistributedDataParallel(model), None
    return module, torch.optim.AdamW(module.parameters(), lr=1e-3, eps=1e-6), predicted


def _step(variant, x, y, loss_fn) -> None:
    module, optimizer, _ = variant
    optimizer.zero_grad(set_to_none=True)
    loss_fn(module(x), y).backward()
    optimizer.step()


def _peak(variant, x, y, loss_fn) -> int:
    module, optimizer, _ = variant
    optimizer.zero_grad(set_to_none=True)

    def train_step():
        loss_fn(module(x), y).backward()
        optimizer.step()

    return step_peak_bytes(train_step, module, optimizer)


def _times(variants: dict, x, y, loss_fn, options: dict) -> dict:
    steps = {name: functools.partial(_step, variant, x, y, loss_fn) for name, variant in variants.items()}
    return alternating_step_times(steps, options["rounds"], options["steps_per_round"])


def worker(rank: int, world: int, options: dict) -> dict:
    torch.set_num_threads(1)
    out = {}
    for workload in options["workloads"]:
        inputs, targets, loss_fn = _batch(workload)
        x, y = inputs.chunk(world)[rank], targets.chunk(world)[rank]
        variants = {"fully_shard": _variant("fully_shard", workload, x, world)}
        variants.update((name, _variant(name, workload, x, world, variants["fully_shard"][2]))
                        for name in VARIANTS[1:])
        for variant in variants.values():
            _step(variant, x, y, loss_fn)  # the optimizer state exists from here on
        peaks = {name: statistics.median(_peak(v, x, y, loss_fn) for _ in range(options["profiled_steps"]))
                 for name, v in variants.items()}
        for variant in variants.values():
            for _ in range(options["warmup"]):
                _step(variant, x, y, loss_fn)
        out[workload] = {"peak_bytes": peaks, "predicted_bytes": {n: v[2] for n, v in variants.items()},
                         "step_s": _times(variants, x, y, loss_fn, options),
                         "kept_gathered": list(variants["kept_last"][0].plan.kept_gathered)}
    return out


def summarise(results: list) -> dict:
    summary = {}
    for workload, data in results[0].items():
        peaks = {n: max(r[workload]["peak_bytes"][n] for r in results) for n in VARIANTS}
        medians = {n: statistics.median(v) for n, v in data["step_s"].items()}
        summary[workload] = {
            "peak_mib_per_rank": {n: peaks[n] / 2**20 for n in VARIANTS},
            "predicted_mib_per_rank": {n: p / 2**20 for n, p in data["predicted_bytes"].items() if p is not None},
            "predicted_over_measured": {n: p / peaks[n] for n, p in data["predicted_bytes"].items() if p is not None},
            "median_step_ms": {n: m * 1e3 for n, m in medians.items()},
            "steps_timed": {n: len(v) for n, v in data["step_s"].items()},
            "peak_ratios": {f"fully_shard/{n}": peaks["fully_shard"] / peaks[n] for n in VARIANTS[1:]},
            "step_time_ratio_after/before": medians["fully_shard"] / medians["before"],
            "kept_last_groups": data["kept_gathered"],
        }
    return summary


def table(world: int, summary: dict) -> str:
    lines = [f"\n== {world} gloo ranks: peak MiB per rank (predicted), median step ms"]
    for workload, data in summary.items():
        lines.append(f"{workload}:")
        for name in VARIANTS:
            predicted = data["predicted_mib_per_rank"].get(name)
            error = data["predicted_over_measured"].get(name, 1.0) - 1
            guess = f" (predicted {predicted:7.2f}, {error:+.1%})" if predicted else ""
            lines.append(f"  {name:14s} peak {data['peak_mib_per_rank'][name]:7.2f}{guess:34s} "
                         f"step {data['median_step_ms'][name]:8.2f} ms")
        lines.append("  " + ", ".join(f"{k} {v:.2f}" for k, v in data["peak_ratios"].items())
                     + f"; step time after/before {data['step_time_ratio_after/before']:.2f}; kept_last keeps "
                     + (", ".join(data["kept_last_groups"]) or "no group") + " gathered")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2", help="comma-separated world sizes (default 2)")
    args = parser.parse_args()
    options = {"workloads": ["mlp8", "gpt8"], "profiled_steps": 5, "warmup": 2, "rounds": 4, "steps_per_round": 3}
    started, load_before = time.perf_counter(), os.getloadavg()
    report = {"command": "python bench/bench_fsdp_memory.py --worlds " + args.worlds,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "code": code_state(), "options": options, "worlds": {}}
    for world in (int(w) for w in args.worlds.split(",")):
        report["worlds"][str(world)] = summarise(run_on_ranks(worker, world, options, timeout_s=1500))
        print(table(world, report["worlds"][str(world)]), flush=True)
    report["wall_s"] = time.perf_counter() - started
    report["machine"] = {"loadavg_after": os.getloadavg(), "cpus": os.cpu_count()}
    write_report(report, RESULTS, load_before)


if __name__ == "__main__":
    main()
