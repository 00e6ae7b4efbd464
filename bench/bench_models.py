"""Capture of the models people bring: ``transformers`` models from small configs, and LLaMA-3-8B on meta.

For each model of ``torch_autopar.testing.hf_models`` (global batch 4): the time to capture forward+backward
(dynamo front end + AOTAutograd joint, the first compile; median of --repeats fresh captures) and the size of
the joint graph (nodes, parameters, ops replicated for lack of a sharding rule on a 2-way mesh). Then
``autopar.plan`` of ``transformers``' LlamaForCausalLM with the LLaMA-3-8B config on the meta device, 16
sequences of 2048 tokens, mesh 8 x 16, h100: wall time and the plan's headline figures.

Which strategies run and equal one process per model is the test matrix's job:
``python -m pytest -m slow tests/models/test_transformers.py``.

    python bench/bench_models.py [--quick] [--output bench/results/models.json]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch

import torch_autopar as autopar
from torch_autopar.capture import capture, fake_global_inputs
from torch_autopar.launch import offline_mesh
from torch_autopar.strategies import propagate
from torch_autopar.testing.hf_models import HF_MODELS, build_hf_model, hf_batch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "models.json")


def measure_capture(name: str, repeats: int) -> dict:
    times, program = [], None
    for _ in range(repeats):
        model = build_hf_model(name)
        args, kwargs = fake_global_inputs(model, (), hf_batch(name, 4), 1)
        started = time.perf_counter()
        program = capture(model, args, kwargs)
        times.append(time.perf_counter() - started)
    with offline_mesh((2,)) as mesh:
        replicated = propagate(program, mesh, {}).replicated_ops
    return {"capture_s": statistics.median(times), "capture_s_all": times,
            "nodes": len(program.graph.graph.nodes), "params": len(program.params),
            "replicated_ops_without_rule": dict(replicated)}


def plan_llama3_8b() -> dict:
    import transformers

    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                      max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False)
    started = time.perf_counter()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    tokens = torch.empty(16, 2048, dtype=torch.long, device="meta")
    plan = autopar.plan(model, (), example_kwargs={"input_ids": tokens, "labels": tokens}, mesh_shape=(8, 16),
                        hardware="h100")
    return {"wall_s": time.perf_counter() - started, "strategy": plan.search_stats.get("candidate"),
            "estimated_step_time_s": plan.estimated_step_time, "peak_memory_gib": plan.peak_memory / 2**30,
            "capture_s": plan.search_stats.get("capture_s"), "solver": plan.search_stats.get("mode"),
            "replicated_ops": dict(plan.replicated_ops)}


def table(captures: dict) -> str:
    lines = [f"{'model':<8} {'capture (s)':>11} {'nodes':>6} {'params':>6}  ops without a rule (2-way mesh)",
             "-" * 78]
    for name, row in captures.items():
        ops = ", ".join(f"{op} x{n}" for op, n in sorted(row["replicated_ops_without_rule"].items())) or "none"
        lines.append(f"{name:<8} {row['capture_s']:>11.2f} {row['nodes']:>6} {row['params']:>6}  {ops}")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one capture per model, no LLaMA-3-8B plan")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=RESULTS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    repeats = 1 if args.quick else args.repeats
    started, load_before, code = time.perf_counter(), os.getloadavg(), provenance.code_state()
    captures = {name: measure_capture(name, repeats) for name in HF_MODELS}
    print(table(captures))
    llama = None if args.quick else plan_llama3_8b()
    if llama is not None:
        print(f"\nLLaMA-3-8B (transformers config, meta), 16 x 2048 tokens, mesh 8x16 h100: planned in "
              f"{llama['wall_s']:.1f} s (capture {llama['capture_s']:.1f} s); auto = {llama['strategy']}, "
              f"{llama['estimated_step_time_s']:.3f} s per step, {llama['peak_memory_gib']:.1f} GiB per device")
    report = {
        "benchmark": "bench/bench_models.py", "command": " ".join(["python"] + sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "torch_autopar": autopar.__version__, "python": platform.python_version(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "captures": captures, "llama3_8b_plan": llama, "code": code, "wall_s": time.perf_counter() - started,
    }
    provenance.write_report(report, args.output, load_before)


if __name__ == "__main__":
    main()
