"""Pipeline step time on 2 gloo ranks: pp=2 GPipe and 1F1B vs data parallelism, GPT, and the bubble.

Each variant trains the same GPT (GPT-2 init) on the same global batch; the timing alternates variants in
rounds (median over rounds of the mean step). Measured bubble = 1 - T_one / (P x T_pp): the share of the P
ranks' time not spent on the one-process step's compute (idle at the pipeline's ends, plus sends and the
imbalance between stages); predicted = (P - 1) / (M + P - 1).

    python bench/bench_pipeline.py [--rounds 5] [--steps 4] [--microbatches 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import torch_autopar as autopar
from torch_autopar.testing import run_on_ranks
from torch_autopar.testing.models import GPT, GPTConfig, gpt2_init, gpt_loss

CONFIG = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128)
BATCH, SEQ = 16, 64


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    gpt2_init(model)
    return model


def _data():
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def _variant(name: str, rank: int, world: int, microbatches: int):
    x, y = _data()
    if name == "data_parallel":
        pmodel = autopar.compile(_model(), x.chunk(world)[rank], strategy="data_parallel")
        optimizer = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)

        def step():
            optimizer.zero_grad(set_to_none=True)
            gpt_loss(pmodel(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            optimizer.step()
        return step, None
    pmodel = autopar.compile(_model(), x, pipeline=world, schedule=name, microbatches=microbatches,
                             loss_fn=gpt_loss)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad(set_to_none=True)
        pmodel.step(x, y)
        optimizer.step()
    return step, pmodel.plan


def _worker(rank, world, names, rounds, steps, microbatches):
    torch.set_num_threads(1)
    variants = {name: _variant(name, rank, world, microbatches) for name in names}
    times = {name: [] for name in names}
    for round_index in range(rounds + 1):  # round 0 warms up
        for name, (step, _) in variants.items():
            torch.distributed.barrier()
            started = time.perf_counter()
            for _ in range(steps):
                step()
            if round_index:
                times[name].append((time.perf_counter() - started) / steps)
    plans = {name: (plan.bubble_fraction, plan.estimated_step_time) for name, (_, plan) in variants.items() if plan}
    return {"times": {name: statistics.median(t) for name, t in times.items()}, "plans": plans}


def _one_process(rounds: int, steps: int) -> float:
    torch.set_num_threads(1)
    model, (x, y) = _model(), _data()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    samples = []
    for round_index in range(rounds + 1):
        started = time.perf_counter()
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            gpt_loss(model(x), y).backward()
            optimizer.step()
        if round_index:
            samples.append((time.perf_counter() - started) / steps)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    names = ("data_parallel", "gpipe", "1f1b")
    results = run_on_ranks(_worker, 2, names, args.rounds, args.steps, args.microbatches, timeout_s=900)
    one = _one_process(args.rounds, args.steps)
    times = {name: max(r["times"][name] for r in results) for name in names}
    report = {"one_process_s": one, "step_s": times, "microbatches": args.microbatches,
              "bubble": {name: {"predicted": results[0]["plans"][name][0],
                                "measured": 1 - one / (2 * times[name])} for name in ("gpipe", "1f1b")},
              "estimated_step_s": {name: results[0]["plans"][name][1] for name in ("gpipe", "1f1b")},
              "load_average": list(__import__("os").getloadavg())}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
