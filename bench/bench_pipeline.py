"""Pipeline step time on gloo ranks vs data parallelism, and the bubble: the project's GPT, or a ``transformers``
model (``--model llama`` / ``gpt2``: 4 layers of width 128, its forward captured by dynamo and cut between them).

2 ranks: pp=2 under every schedule. 4 ranks: pp=2 under GPipe and 1F1B with each stage layout over its 2 ranks
(data_parallel: pp x dp, fully_shard: pp x FSDP, tensor_parallel: pp x tp).
Each variant trains the same model (the GPT with GPT-2 init) on the same global batch; the timing alternates variants in
rounds (median over rounds of the mean step). Measured bubble = 1 - T_one / (W x T): the share of the W
ranks' time not spent on the one-process step's compute (idle at the pipeline's ends, plus sends, the
imbalance between stages, the stage layout's collectives and the schedule's own overhead); predicted:
``plan.bubble_fraction`` ((P - 1) / (d M + P - 1), ``search.pipeline``), which counts the schedule's idle time
only.

    python bench/bench_pipeline.py [--model gpt|llama|gpt2] [--world 2|4] [--rounds 5] [--steps 4] [--microbatches 4]
    # writes results/pipeline.json (GPT, 2 ranks), results/pipeline_4ranks.json, results/pipeline_llama.json, ...
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torch_autopar as autopar  # noqa: E402
from bench.provenance import code_state, write_report  # noqa: E402
from torch_autopar.search.pipeline import SCHEDULES  # noqa: E402
from torch_autopar.testing import run_on_ranks  # noqa: E402
from torch_autopar.testing.hf_models import VOCAB, build_hf_model, next_token_loss  # noqa: E402
from torch_autopar.testing.models import GPT, GPTConfig, gpt2_init, gpt_loss  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "pipeline{}.json")
STAGE_LAYOUTS = ("data_parallel", "fully_shard", "tensor_parallel")
FOUR_RANK_SCHEDULES = ("gpipe", "1f1b")

CONFIG = GPTConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128)
BATCH, SEQ = 16, 64
MODELS = ("gpt", "llama", "gpt2")
"""The project's GPT (traced by torch.fx), and transformers' LLaMA and GPT-2 (captured by dynamo); 4 layers of
width 128 each."""


def _model(model_name: str) -> torch.nn.Module:
    if model_name != "gpt":  # every variant without a key/value cache, as the pipelined stages run
        model = build_hf_model(model_name, layers=CONFIG.n_layer, width=CONFIG.n_embd)
        model.config.use_cache = False
        return model
    torch.manual_seed(0)
    model = GPT(CONFIG)
    gpt2_init(model)
    return model


def _loss(model_name: str):
    return gpt_loss if model_name == "gpt" else next_token_loss


def _data(model_name: str):
    vocab = CONFIG.vocab_size if model_name == "gpt" else VOCAB
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def _variant(model_name: str, name: str, rank: int, world: int, microbatches: int):
    (x, y), loss_fn = _data(model_name), _loss(model_name)
    if name == "data_parallel":
        pmodel = autopar.compile(_model(model_name), x.chunk(world)[rank], strategy="data_parallel")
        optimizer = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)

        def step():
            optimizer.zero_grad(set_to_none=True)
            loss_fn(pmodel(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            optimizer.step()
        return step, None
    schedule, _, layout = name.partition("/")
    replicas = 1 if layout in ("", "tensor_parallel") else world // 2
    mine = x.chunk(replicas)[rank // 2 % replicas], y.chunk(replicas)[rank // 2 % replicas]
    pmodel = autopar.compile(_model(model_name), mine[0], pipeline=2, schedule=schedule, microbatches=microbatches,
                             loss_fn=loss_fn, strategy=layout or "auto")
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad(set_to_none=True)
        pmodel.step(*mine)
        optimizer.step()
    return step, pmodel.plan


def variant_names(world: int) -> tuple[str, ...]:
    """data_parallel, then the pipelined variants: "schedule" on 2 ranks, "schedule/stage layout" on 4."""
    if world == 2:
        return ("data_parallel",) + SCHEDULES
    return ("data_parallel",) + tuple(f"{s}/{layout}" for layout in STAGE_LAYOUTS for s in FOUR_RANK_SCHEDULES)


def _worker(rank, world, model_name, names, rounds, steps, microbatches):
    torch.set_num_threads(1)
    variants = {name: _variant(model_name, name, rank, world, microbatches) for name in names}
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


def _one_process(model_name: str, rounds: int, steps: int) -> float:
    torch.set_num_threads(1)
    model, (x, y), loss_fn = _model(model_name), _data(model_name), _loss(model_name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    samples = []
    for round_index in range(rounds + 1):
        started = time.perf_counter()
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            optimizer.step()
        if round_index:
            samples.append((time.perf_counter() - started) / steps)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--world", type=int, choices=(2, 4), default=2)
    parser.add_argument("--model", choices=MODELS, default="gpt")
    args = parser.parse_args()
    started, load_before = time.perf_counter(), os.getloadavg()
    names = variant_names(args.world)
    pipelined = names[1:]
    results = run_on_ranks(_worker, args.world, args.model, names, args.rounds, args.steps, args.microbatches,
                           timeout_s=900)
    one = _one_process(args.model, args.rounds, args.steps)
    times = {name: max(r["times"][name] for r in results) for name in names}
    report = {"command": "python bench/bench_pipeline.py " + " ".join(sys.argv[1:]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "code": code_state(), "one_process_s": one, "step_s": times,
              "microbatches": args.microbatches, "world": args.world, "model": args.model,
              "bubble": {name: {"predicted": results[0]["plans"][name][0],
                                "measured": 1 - one / (args.world * times[name])} for name in pipelined},
              "estimated_step_s": {name: results[0]["plans"][name][1] for name in pipelined}}
    print(f"{args.world} gloo ranks, {args.model} {CONFIG.n_layer} x {CONFIG.n_embd}, {BATCH} x {SEQ} tokens, "
          f"M = {args.microbatches}; one process {one * 1e3:.1f} ms")
    print(f"{'variant':<28}{'step ms':>9}{'vs dp':>7}{'bubble predicted':>18}{'measured':>10}{'estimated ms':>14}")
    for name in names:
        bubble = report["bubble"].get(name)
        columns = f"{bubble['predicted']:>18.2f}{bubble['measured']:>10.2f}" if bubble else " " * 28
        estimate = report["estimated_step_s"].get(name)
        print(f"{name:<28}{times[name] * 1e3:>9.1f}{times[name] / times['data_parallel']:>7.2f}{columns}"
              + (f"{estimate * 1e3:>14.2f}" if estimate else ""))
    report["wall_s"] = time.perf_counter() - started
    report["machine"] = {"loadavg_after": os.getloadavg(), "cpus": os.cpu_count()}
    suffix = ("" if args.model == "gpt" else f"_{args.model}") + ("" if args.world == 2 else f"_{args.world}ranks")
    write_report(report, RESULTS.format(suffix), load_before)


if __name__ == "__main__":
    main()
