"""What mixed precision and activation checkpointing cost and save: step time and peak memory per rank of the
project's GPT trained by ``autopar.compile`` with each option, side by side in one run on gloo ranks.

    python bench/bench_training_options.py                 # 2 gloo ranks; writes bench/results/training_options.json
    python bench/bench_training_options.py --worlds 1,2 --strategies data_parallel,tensor_parallel

Per world size and strategy, every variant (fp32; ``mixed_precision="bf16"``; ``activation_checkpointing="full"``
and ``"selective"``; bf16 with full checkpointing) compiles the same model (eager mode) and trains on the same
global batch with AdamW, each rank its slice. Peak memory per rank: the allocator's record of one training step
once the optimizer state exists (``torch_autopar.testing.memory``), the least of ``profiled_steps`` steps (a buffer
gloo frees on its own thread is seen freed late, which only ever adds bytes), the highest of all ranks, beside the
plan's prediction (``plan.peak_memory``). Step time: rounds alternating the variants (order rotating), each step
after a barrier and counted as its slowest rank's time (``bench.timing``); medians over ``rounds x steps_per_round``
timed steps after warm-up, and each variant's ratio to fp32's. On CPU, bf16 matmuls have no fast path on most
cores: the step-time ratio there says what the casts cost, not what a GPU gains. Must never change the library.
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

import torch_autopar as autopar  # noqa: E402
from bench.provenance import code_state, write_report  # noqa: E402
from bench.timing import alternating_step_times  # noqa: E402
from torch_autopar.testing import run_on_ranks  # noqa: E402
from torch_autopar.testing.memory import step_peak_bytes  # noqa: E402
from torch_autopar.testing.models import GPT, GPTConfig, gpt2_init, gpt_loss  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "training_options.json")
VARIANTS = {"fp32": {}, "bf16": {"mixed_precision": "bf16"}, "ac_full": {"activation_checkpointing": "full"},
            "ac_selective": {"activation_checkpointing": "selective"},
            "bf16+ac_full": {"mixed_precision": "bf16", "activation_checkpointing": "full"}}
"""Variant name -> the ``autopar.compile`` options it adds."""
CONFIG = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256)
GLOBAL_BATCH = 8


def _tokens() -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.block_size + 1), generator=generator)


def _variant(strategy: str, options: dict, x: torch.Tensor):
    """(compiled module, its AdamW optimizer)."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    gpt2_init(model)
    module = autopar.compile(model, x, strategy=strategy, mode="eager", **options)
    return module, torch.optim.AdamW(module.parameters(), lr=1e-3, eps=1e-6)


def _step(variant, x, y) -> None:
    module, optimizer = variant
    optimizer.zero_grad(set_to_none=True)
    gpt_loss(module(x), y).backward()
    optimizer.step()


def _peak(variant, x, y) -> int:
    module, optimizer = variant
    optimizer.zero_grad(set_to_none=True)

    def train_step():
        gpt_loss(module(x), y).backward()
        optimizer.step()

    return step_peak_bytes(train_step, module, optimizer)


def worker(rank: int, world: int, options: dict) -> dict:
    torch.set_num_threads(1)
    tokens = _tokens().chunk(world)[rank]
    x, y = tokens[:, :-1], tokens[:, 1:]
    out = {}
    for strategy in options["strategies"]:
        variants = {name: _variant(strategy, extra, x) for name, extra in VARIANTS.items()}
        for variant in variants.values():
            for _ in range(1 + options["warmup"]):  # the optimizer state exists from the first step on
                _step(variant, x, y)
        peaks = {name: min(_peak(v, x, y) for _ in range(options["profiled_steps"])) for name, v in variants.items()}
        steps = {name: functools.partial(_step, variant, x, y) for name, variant in variants.items()}
        out[strategy] = {"peak_bytes": peaks,
                         "predicted_bytes": {name: v[0].plan.peak_memory for name, v in variants.items()},
                         "step_s": alternating_step_times(steps, options["rounds"], options["steps_per_round"])}
    return out


def summarise(results: list) -> dict:
    summary = {}
    for strategy, data in results[0].items():
        peaks = {name: max(r[strategy]["peak_bytes"][name] for r in results) for name in VARIANTS}
        medians = {name: statistics.median(times) for name, times in data["step_s"].items()}
        summary[strategy] = {
            "peak_mib_per_rank": {name: peaks[name] / 2**20 for name in VARIANTS},
            "predicted_mib_per_rank": {name: data["predicted_bytes"][name] / 2**20 for name in VARIANTS},
            "predicted_over_measured": {name: data["predicted_bytes"][name] / peaks[name] for name in VARIANTS},
            "median_step_ms": {name: medians[name] * 1e3 for name in VARIANTS},
            "step_time_over_fp32": {name: medians[name] / medians["fp32"] for name in VARIANTS},
            "peak_over_fp32": {name: peaks[name] / peaks["fp32"] for name in VARIANTS},
            "steps_timed": {name: len(times) for name, times in data["step_s"].items()},
        }
    return summary


def table(world: int, summary: dict) -> str:
    lines = [f"\n== {world} gloo rank(s), GPT {CONFIG.n_layer} x {CONFIG.n_embd}, {GLOBAL_BATCH} x "
             f"{CONFIG.block_size} tokens: median step ms, peak MiB per rank (predicted), ratios to fp32"]
    for strategy, data in summary.items():
        lines.append(f"{strategy}:")
        for name in VARIANTS:
            lines.append(f"  {name:13s} step {data['median_step_ms'][name]:8.2f} ms "
                         f"({data['step_time_over_fp32'][name]:.2f}x)   peak {data['peak_mib_per_rank'][name]:7.2f} "
                         f"({data['peak_over_fp32'][name]:.2f}x; predicted {data['predicted_mib_per_rank'][name]:7.2f},"
                         f" {data['predicted_over_measured'][name] - 1:+.1%})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2", help="comma-separated world sizes (default 2)")
    parser.add_argument("--strategies", default="data_parallel", help="comma-separated (fully_shard: see README)")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    options = {"strategies": args.strategies.split(","), "profiled_steps": 3, "warmup": 2, "rounds": args.rounds,
               "steps_per_round": 3}
    started, load_before = time.perf_counter(), os.getloadavg()
    report = {"command": "python bench/bench_training_options.py " + " ".join(sys.argv[1:]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "code": code_state(), "options": options,
              "model": {"n_layer": CONFIG.n_layer, "n_embd": CONFIG.n_embd, "block_size": CONFIG.block_size,
                        "global_batch": GLOBAL_BATCH}, "worlds": {}}
    for world in (int(w) for w in args.worlds.split(",")):
        report["worlds"][str(world)] = summarise(run_on_ranks(worker, world, options, timeout_s=1800))
        print(table(world, report["worlds"][str(world)]), flush=True)
    report["wall_s"] = time.perf_counter() - started
    report["machine"] = {"loadavg_after": os.getloadavg(), "cpus": os.cpu_count()}
    write_report(report, RESULTS, load_before)


if __name__ == "__main__":
    main()
