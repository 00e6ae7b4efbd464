"""Measured speed on real ranks: autopar's plans against PyTorch's own wrappers, side by side in one run.

    python bench/bench_speed.py            # 2 and 4 gloo ranks; writes bench/results/speed.json
    python bench/bench_speed.py --quick    # 2 ranks, GPT and the wide MLP, eager variants, fewer steps (~40 s)

Per workload and world size, every variant trains the same model on the same global batch, alternating in
rounds (order rotating), each step after a barrier and counted as its slowest rank's time; medians over
>= 20 timed steps after warm-up. Variants:
  ddp                DistributedDataParallel, each rank its slice of the batch
  fsdp2              torch.distributed.fsdp.fully_shard per layer + root, each rank its slice
  tp_hand            parallelize_module: column- then row-parallel MLP layers, the whole batch on every rank
  autopar_auto       autopar.compile(strategy="auto") (its chosen plan), each rank its slice
  autopar_fully_shard, autopar_tensor_parallel   the named strategies
  autopar_tp_hand    autopar.compile(strategy=<the tp_hand layout as a Plan>): same layout as tp_hand, each
                     rank its slice (the batch is gathered for the column layer, outputs split again)
  autopar_tp_hand_full   the same with full_batch=True: the whole batch on every rank, as tp_hand
  autopar_auto_full  autopar_auto with full_batch=True: auto under tp_hand's contract (with each rank's slice, a
                     tensor-parallel plan gathers the batch and splits outputs again: collectives tp_hand skips)
  autopar_*_graph    the same in graph mode (torch.compile through the "autopar" backend: no DTensor dispatch)
autopar plans with this machine's measured profile (``--profile measured``, the default: measured once per world
size and cached, as ``compile(hardware="measured")`` does, so compile's default ``hardware=None`` finds it) or
the built-in ``cpu-gloo`` profile (``--profile builtin``).
Memory per rank: the local bytes of parameters, gradients and optimizer state (DTensor shards counted as
held), and the process's peak RSS at the end. Bytes communicated per rank per step: counted with
``CollectiveCounter`` on one untimed step; for autopar also the plan's prediction. Must never change what it
measures: every variant runs its library's defaults apart from the mesh.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import resource
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import torch_autopar as autopar  # noqa: E402
from bench.timing import alternating_step_times  # noqa: E402
from torch_autopar.cost.job_profile import MEASURED, job_profile  # noqa: E402
from torch_autopar.runtime.comm_count import CollectiveCounter  # noqa: E402
from torch_autopar.testing import run_on_ranks  # noqa: E402
from torch_autopar.testing.models import GPT, MLP, GPTConfig, gpt2_init, gpt_loss  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "speed.json")
VARIANTS = ("ddp", "fsdp2", "tp_hand", "autopar_auto", "autopar_auto_full", "autopar_fully_shard",
            "autopar_tensor_parallel", "autopar_tp_hand", "autopar_tp_hand_full", "autopar_auto_graph",
            "autopar_fully_shard_graph", "autopar_tp_hand_graph", "autopar_tp_hand_full_graph")
PAIRS = (("autopar_auto", "ddp"), ("autopar_data_parallel", "ddp"), ("autopar_auto", "fsdp2"), ("autopar_auto", "tp_hand"),
         ("autopar_auto_full", "tp_hand"),
         ("autopar_fully_shard", "fsdp2"), ("autopar_tp_hand", "tp_hand"), ("autopar_tensor_parallel", "tp_hand"),
         ("autopar_tp_hand_full", "tp_hand"), ("autopar_auto_graph", "ddp"), ("autopar_fully_shard_graph", "fsdp2"),
         ("autopar_tp_hand_graph", "tp_hand"), ("autopar_tp_hand_full_graph", "tp_hand"))


# workloads --------------------------------------------------------------------------------------------------
def _gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=256))
    gpt2_init(model)  # the default N(0, 1) init makes CPU backward slow on subnormal numbers
    return model


def _mlp(width):
    def build():
        torch.manual_seed(0)
        return MLP((width,) * 5)
    return build


def _resnet50():
    from torch_autopar.testing.resnet import ResNet50

    return ResNet50()


WORKLOADS = {
    # name: (build, global batch (inputs, targets), loss, layers for FSDP2, MLP layer pairs for TP)
    "gpt_256": (_gpt, lambda g: _tokens(g, 16, 64, 512), gpt_loss),
    "mlp_wide_small_batch": (_mlp(2048), lambda g: (torch.randn(8, 2048, generator=g), torch.randn(8, 2048, generator=g)), F.mse_loss),
    "mlp_narrow_large_batch": (_mlp(512), lambda g: (torch.randn(1024, 512, generator=g), torch.randn(1024, 512, generator=g)), F.mse_loss),
    "resnet50_64px": (_resnet50, lambda g: (torch.randn(8, 3, 64, 64, generator=g), torch.randint(0, 1000, (8,), generator=g)),
                      F.cross_entropy),
}
FOUR_RANK_WORKLOADS = ("gpt_256", "mlp_wide_small_batch")
QUICK_VARIANTS = ("ddp", "fsdp2", "tp_hand", "autopar_auto", "autopar_fully_shard", "autopar_tp_hand",
                  "autopar_tp_hand_full")
RESNET_VARIANTS = ("ddp", "autopar_auto", "autopar_data_parallel")
"""ResNet-50 is MindSpore's showcase (its automatic plan ~8% faster than hand data parallelism on 8 Ascend 910):
the analogous ratio here is autopar_auto / ddp. 64x64 images keep it within the time budget on 2 CPU cores."""
"""mlp_wide_small_batch is the communication-bound one (4 x 2048x2048 layers, 8 samples): data parallelism
moves 64 MiB of gradients per step, tensor parallelism a few activations."""


def _tokens(generator, batch, seq, vocab):
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _tp_layers(model) -> dict[str, str]:
    """The hand tensor-parallel layout: (column, row) pairs of linear layers."""
    if isinstance(model, GPT):
        return {f"blocks.{i}.{n}": kind for i in range(len(model.blocks)) for n, kind in (("fc", "col"), ("out", "row"))}
    return {f"layers.{i}": ("col" if i % 2 == 0 else "row") for i in range(len(model.layers) - len(model.layers) % 2)}


def _hand_plan(model, global_x, world, full_batch: bool, hardware):
    """The tp_hand layout as an autopar Plan: column weights/biases S(0), row weights S(1), rest replicated."""
    plan = autopar.plan(model, (global_x,), mesh_shape=(world,), strategy="data_parallel", hardware=hardware,
                        full_batch=full_batch)
    layers = _tp_layers(model)
    for name in plan.param_placements:
        owner, leaf = name.rsplit(".", 1)
        kind = layers.get(owner)
        plan.param_placements[name] = (("S(0)",) if kind == "col" else ("S(1)",) if kind == "row" and leaf == "weight"
                                       else ("R",))
    plan.input_placements = {0: ("R",)}
    plan.strategy = "tp_hand (Plan)"
    return plan


# variants ---------------------------------------------------------------------------------------------------
def make_variant(name, workload, rank, world, global_x, hardware="cpu-gloo"):
    """(network, optimizer, feeds_whole_batch)."""
    build = WORKLOADS[workload][0]
    model = build()
    local_x = global_x.chunk(world)[rank]
    whole = False
    if name == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
    elif name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in (model.blocks if isinstance(model, GPT) else model.layers):
            fully_shard(block)
        net = fully_shard(model)
    elif name == "tp_hand":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,))
        styles = {k: ColwiseParallel() if v == "col" else RowwiseParallel() for k, v in _tp_layers(model).items()}
        net, whole = parallelize_module(model, mesh, styles), True
    else:
        mode = "graph" if name.endswith("_graph") else "eager"
        strategy = name.removeprefix("autopar_").removesuffix("_graph")
        whole = strategy.endswith("_full")
        strategy = strategy.removesuffix("_full")
        if strategy == "tp_hand":
            strategy = _hand_plan(build(), global_x, world, whole, hardware)
        net = autopar.compile(model, global_x if whole else local_x, strategy=strategy, mode=mode, full_batch=whole)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-4), whole


def _step(variant, loss_fn, batch, rank, world):
    net, optimizer, whole = variant
    x, y = batch
    if not whole:
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    loss = loss_fn(net(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def _local_bytes(tensor) -> int:
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


def state_bytes(variant) -> int:
    net, optimizer, _ = variant
    total = sum(_local_bytes(p) + _local_bytes(p.grad) for p in net.parameters())
    for state in optimizer.state.values():
        total += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.ndim > 0)
    return total


def counted_bytes(variant, loss_fn, batch, rank, world) -> int:
    """Bytes one rank's collectives move in one step. Graph mode: a dispatch mode cannot run inside
    torch.compile, so the forward graph's collectives are read from the compiled graph (plus the plan's input
    check outside it) and backward is counted as it runs."""
    net, optimizer, whole = variant
    if getattr(net, "mode", None) != "graph":
        with CollectiveCounter(getattr(net, "mesh", None)) as counter:
            _step(variant, loss_fn, batch, rank, world)
        return sum(r.nbytes for r in counter.records)
    x, y = batch if whole else (batch[0].chunk(world)[rank], batch[1].chunk(world)[rank])
    loss = loss_fn(net(x), y)
    optimizer.zero_grad(set_to_none=True)
    with CollectiveCounter(getattr(net, "mesh", None)) as counter:
        loss.backward()
    optimizer.step()
    forward = sum(nbytes for _, _, nbytes in net.stats.get("graph_collectives", {}).get("forward", []))
    check = sum(c.nbytes for c in net.plan.collectives if c.where.endswith("check"))
    return sum(r.nbytes for r in counter.records) + forward + check


def worker(rank, world, options):
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    # compile's default hardware=None plans with this machine's cached measurement: made here on first use
    profile = job_profile(MEASURED if options["profile"] == "measured" else "cpu-gloo")
    out = {"profile": profile.name}
    for workload in options["workloads"]:
        loss_fn = WORKLOADS[workload][2]
        batch = WORKLOADS[workload][1](torch.Generator().manual_seed(7))
        names = RESNET_VARIANTS if workload.startswith("resnet") else options["variants"]
        variants = {name: make_variant(name, workload, rank, world, batch[0], profile) for name in names}
        for variant in variants.values():
            for _ in range(options["warmup"]):
                _step(variant, loss_fn, batch, rank, world)
        comm = {name: counted_bytes(v, loss_fn, batch, rank, world) for name, v in variants.items()}
        steps = {name: functools.partial(_step, v, loss_fn, batch, rank, world) for name, v in variants.items()}
        times = alternating_step_times(steps, options["rounds"], options["steps_per_round"])
        plans = {name: {"strategy": v[0].plan.strategy, "candidate": v[0].plan.search_stats.get("candidate"),
                        "predicted_comm_bytes": v[0].plan.comm_bytes(),
                        "estimated_step_ms": v[0].plan.estimated_step_time * 1e3,
                        "sharded": getattr(v[0], "mesh", None) is not None}
                 for name, v in variants.items() if hasattr(v[0], "plan")}
        out[workload] = {"step_s": times, "comm_bytes_counted": comm, "state_bytes": {n: state_bytes(v) for n, v in variants.items()},
                         "plans": plans}
    out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def summarise(results: list, world: int) -> dict:
    first = results[0]
    summary = {}
    for workload, data in first.items():
        if workload in ("max_rss_bytes", "profile"):
            continue
        medians = {n: statistics.median(v) for n, v in data["step_s"].items()}
        summary[workload] = {
            "median_ms": {n: m * 1e3 for n, m in medians.items()},
            "steps_timed": {n: len(v) for n, v in data["step_s"].items()},
            "ratios": {f"{a}/{b}": medians[a] / medians[b] for a, b in PAIRS if a in medians and b in medians},
            "state_mib_per_rank": {n: max(r[workload]["state_bytes"][n] for r in results) / 2**20 for n in medians},
            "comm_mib_per_rank_counted": {n: data["comm_bytes_counted"][n] / 2**20 for n in medians},
            "plans": data["plans"],
        }
    summary["max_rss_mib"] = [r["max_rss_bytes"] / 2**20 for r in results]
    summary["profile"] = first["profile"]
    return summary


def table(world: int, summary: dict) -> str:
    lines = [f"\n== {world} gloo ranks: median step ms (state MiB/rank, counted comm MiB/rank/step); autopar plans "
             f"with the profile {summary['profile']}"]
    for workload, data in summary.items():
        if workload in ("max_rss_mib", "profile"):
            continue
        lines.append(f"{workload}:")
        for name, ms in data["median_ms"].items():
            plan = data["plans"].get(name)
            chosen = f"  plan={plan['candidate'] or plan['strategy']} est={plan['estimated_step_ms']:.1f}ms " \
                     f"pred_comm={plan['predicted_comm_bytes'] / 2**20:.2f}MiB" if plan else ""
            lines.append(f"  {name:26s} {ms:9.2f} ms  state {data['state_mib_per_rank'][name]:8.2f}  comm "
                         f"{data['comm_mib_per_rank_counted'][name]:8.2f}{chosen}")
        lines.append("  ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in data["ratios"].items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worlds", default=None, help="comma-separated world sizes (default 2,4; quick: 2)")
    parser.add_argument("--workloads", default=None, help="default: all (quick: all but resnet50_64px)")
    parser.add_argument("--variants", default=None, help=f"comma-separated subset of {', '.join(VARIANTS)}")
    parser.add_argument("--profile", choices=("measured", "builtin"), default="measured",
                        help="what autopar plans with: this machine's measured profile, cached per world size as "
                             "compile(hardware='measured') caches it (default), or the built-in cpu-gloo")
    args = parser.parse_args()
    worlds = [int(w) for w in (args.worlds or ("2" if args.quick else "2,4")).split(",")]
    default = list(FOUR_RANK_WORKLOADS) if args.quick else list(WORKLOADS)
    variants = [v for v in VARIANTS if not args.quick or v in QUICK_VARIANTS]
    if args.variants:
        unknown = set(args.variants.split(",")) - set(VARIANTS)
        if unknown:
            parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
        variants = args.variants.split(",")
    options = {"workloads": args.workloads.split(",") if args.workloads else default, "variants": variants, "warmup": 2 if args.quick else 3,
               "rounds": 2 if args.quick else 4, "steps_per_round": 5 if args.quick else 5, "profile": args.profile}
    started = time.perf_counter()
    report = {"command": " ".join(["python"] + sys.argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "options": options, "worlds": {}}
    for world in worlds:
        if world > 2 and not args.workloads:  # 4 ranks on 2 cores: the two workloads where layouts differ most
            options = dict(options, workloads=[w for w in options["workloads"] if w in FOUR_RANK_WORKLOADS])
        results = run_on_ranks(worker, world, options, timeout_s=1500)
        report["worlds"][str(world)] = summarise(results, world)
        print(table(world, report["worlds"][str(world)]), flush=True)
    report["summary"] = {f"{world} ranks {workload} {ratio}": round(value, 3)
                         for world, by_workload in report["worlds"].items() for workload, data in by_workload.items()
                         if isinstance(data, dict) for ratio, value in data["ratios"].items()
                         if ratio.startswith(("autopar_auto/", "autopar_auto_full/"))}
    report["wall_s"] = time.perf_counter() - started
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as handle:
        json.dump(report, handle, indent=1)
    print(f"\nwrote {RESULTS} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
