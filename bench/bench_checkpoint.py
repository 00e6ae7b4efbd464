"""Checkpoint save and load time and size: the project's GPT on 2 gloo ranks, one row per strategy.

    python bench/bench_checkpoint.py            # ~1 min on 2 CPU cores; writes bench/results/checkpoint.json
    python bench/bench_checkpoint.py --rounds 2

For each model (testing.models.GPT at its default size, and bench_dp's ``gpt_small``: 4 layers x 128) and each
strategy (data_parallel, fully_shard, tensor_parallel): compile on 2 ranks, one AdamW step (so the optimizer holds
state), then ``rounds`` times ``autopar.save_checkpoint`` and ``autopar.load_checkpoint`` into the same model and
optimizer (median wall time on rank 0, each timed from a barrier to a barrier, so the slower rank counts), the
checkpoint's size on disk (all files) and the bytes of DCP data each rank wrote. The directory is in the system
temporary directory (page cache: this measures serialisation and the file system, not a disk). Must never
change the library.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torch_autopar as autopar  # noqa: E402
from torch_autopar.testing import run_on_ranks  # noqa: E402
from torch_autopar.testing.models import GPT, GPTConfig, gpt_loss  # noqa: E402
from provenance import code_state, write_report  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "checkpoint.json")
MODELS = {"gpt_default": GPTConfig(), "gpt_small": GPTConfig(n_layer=4, n_embd=128, block_size=64)}
STRATEGIES = ("data_parallel", "fully_shard", "tensor_parallel")
WORLD = 2
LOCAL_BATCH, SEQ = 4, 32


def _timed(fn) -> float:
    dist.barrier()
    started = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - started


def _directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def _measure(rank, model_name: str, strategy: str, rounds: int, directory: str) -> dict:
    torch.manual_seed(0)
    model = GPT(MODELS[model_name])
    tokens = torch.randint(0, 96, (LOCAL_BATCH * WORLD, SEQ + 1), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1].chunk(WORLD)[rank], tokens[:, 1:].chunk(WORLD)[rank]
    pmodel = autopar.compile(model, x, strategy=strategy)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    gpt_loss(pmodel(x), y).backward()
    optimizer.step()
    path = os.path.join(directory, f"{model_name}-{strategy}")
    saves = [_timed(lambda: autopar.save_checkpoint(path, pmodel, optimizer, step=1)) for _ in range(rounds)]
    loads = [_timed(lambda: autopar.load_checkpoint(path, pmodel, optimizer)) for _ in range(rounds)]
    parameters = sum(p.numel() for p in model.parameters())
    return {"model": model_name, "strategy": strategy, "parameters": parameters,
            "save_s": statistics.median(saves), "load_s": statistics.median(loads),
            "save_all_s": saves, "load_all_s": loads, "bytes": _directory_bytes(path),
            "dcp_bytes": _directory_bytes(os.path.join(path, "state")),
            "rank_data_bytes": os.path.getsize(os.path.join(path, "state", f"__{rank}_0.distcp"))}


def _job(rank, world, rounds: int, directory: str) -> list[dict]:
    rows = []
    for model_name in MODELS:
        for strategy in STRATEGIES:
            rows.append(_measure(rank, model_name, strategy, rounds, directory))
    return rows


def table(rows: list[list[dict]]) -> str:
    lines = ["| model | parameters | strategy | save (ms) | load (ms) | checkpoint size | DCP data rank 0 / rank 1 |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for row, other in zip(rows[0], rows[1]):
        lines.append(f"| {row['model']} | {row['parameters']:,} | {row['strategy']} | {1e3 * row['save_s']:.0f} | "
                     f"{1e3 * row['load_s']:.0f} | {row['bytes'] / 2**20:.2f} MiB | "
                     f"{row['rank_data_bytes'] / 2**20:.2f} / {other['rank_data_bytes'] / 2**20:.2f} MiB |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", default=RESULTS)
    args = parser.parse_args()
    started, load_before, code = time.perf_counter(), os.getloadavg(), code_state()
    with tempfile.TemporaryDirectory() as directory:
        rows = run_on_ranks(_job, WORLD, args.rounds, directory, timeout_s=600)
    print(table(rows))
    report = {"bench": "checkpoint", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "code": code, "world": WORLD, "rounds": args.rounds, "rows": rows[0], "rank1_rows": rows[1],
              "wall_s": time.perf_counter() - started,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "loadavg_before": load_before, "loadavg_after": os.getloadavg()}}
    write_report(report, args.output, load_before)


if __name__ == "__main__":
    main()
