"""Command line: ``python -m torch_autopar plan MODULE:FACTORY --mesh 8x8 --hardware h100 ...``.

``FACTORY()`` runs under ``torch.device("meta")`` (no parameter memory) and returns a module, or a
``(module, example_inputs)`` tuple; ``--batch`` / ``--input-shape`` give (or replace) the example inputs as meta
tensors. The plan is printed with ``Plan.explain()`` and saved with ``--json``. Every mistake is reported as a
``torch_autopar:`` message and exit status 1. Must never plan anything itself: it calls ``autopar.plan``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import sys

import torch

from torch_autopar.errors import AutoparError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_DTYPES = {"long": torch.long, "int64": torch.long, "int": torch.int32, "int32": torch.int32,
           "float": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16, "bool": torch.bool}


def parse_memory(text: str) -> int:
    """Bytes in "80GB" (10^9), "24GiB" (2^30), "512MB", "1.5TB" or a plain number of bytes."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise AutoparError(f"--memory {text!r}: expected a size such as 80GB, 24GiB, 512MB or a number of bytes "
                           "(units B, KB, MB, GB, TB: powers of 1000; KiB, MiB, GiB, TiB: powers of 1024; any case).")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_shape(text: str, what: str) -> tuple[int, ...]:
    """(8, 1024) from "8x1024"; (64,) from "64"."""
    parts = str(text).lower().split("x")
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise AutoparError(f"{what} {text!r}: expected positive sizes joined by 'x', such as 8x8 or 64.")
    return tuple(int(p) for p in parts)


def parse_dtype(text: str) -> torch.dtype:
    if text not in _DTYPES:
        raise AutoparError(f"--dtype {text!r}: expected one of {', '.join(sorted(_DTYPES))}.")
    return _DTYPES[text]


def parse_input(text: str, default_dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor from "8x3x224x224" or "8x1024:long" (``--input-shape``)."""
    shape, _, dtype = str(text).partition(":")
    return torch.empty(parse_shape(shape, "--input-shape"), dtype=parse_dtype(dtype) if dtype else default_dtype,
                       device="meta")


def load_factory(spec: str):
    """The callable named by "package.module:factory" or "path/to/file.py:factory" (dots: attributes)."""
    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise AutoparError(f"{spec!r}: expected MODULE:FACTORY, e.g. my_models:build_gpt or models.py:build_gpt.")
    module = _import(module_name)
    target = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise AutoparError(f"{spec!r}: module {module_name!r} has no attribute {attribute!r}.")
        target = getattr(target, part)
    if not callable(target):
        raise AutoparError(f"{spec!r}: {attribute!r} is a {type(target).__name__}, expected a function or class.")
    return target


def _import(name: str):
    if name.endswith(".py") or os.sep in name:
        if not os.path.isfile(name):
            raise AutoparError(f"could not import {name!r}: no such file.")
        spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(name))[0], name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise AutoparError(f"could not import module {name!r}: {error}. Run from the directory that contains it, "
                           "or set PYTHONPATH.") from error


def build_model(spec: str):
    """(module, example_inputs or None) from the factory, built on the meta device."""
    factory = load_factory(spec)
    with torch.device("meta"):
        result = factory()
    if isinstance(result, torch.nn.Module):
        return result, None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module):
        return result
    raise AutoparError(f"{spec} returned {type(result).__name__}; expected an nn.Module or a "
                       "(module, example_inputs) tuple.")


def example_inputs(args, from_factory):
    """The inputs to plan for: --batch / --input-shape when given, else the factory's."""
    dtype = parse_dtype(args.dtype)
    if args.batch is not None:
        return (torch.empty(parse_shape(args.batch, "--batch"), dtype=dtype, device="meta"),)
    if args.input_shape:
        return tuple(parse_input(text, dtype) for text in args.input_shape)
    if from_factory is None:
        raise AutoparError(f"{args.factory} returned a module without example inputs; pass --batch 8x1024 "
                           "(with --dtype long for token ids) or --input-shape, or return (module, example_inputs).")
    return from_factory


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="python -m torch_autopar", description=__doc__.split("\n")[0])
    commands = root.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="plan a model for a mesh you need not have and explain the plan")
    plan.add_argument("factory", metavar="MODULE:FACTORY",
                      help="callable returning a module or (module, example_inputs); runs on the meta device")
    plan.add_argument("--mesh", default="1", help="mesh shape such as 64 or 8x8 (default 1)")
    plan.add_argument("--axis-names", default=None, help="comma-separated axis names, e.g. dp,tp")
    plan.add_argument("--hardware", default="h100", help="built-in profile name or a profile JSON file")
    plan.add_argument("--memory", default=None, help="memory budget per device, e.g. 80GB, 24GiB, 512MB")
    plan.add_argument("--strategy", default="auto", help="auto, data_parallel, fully_shard, tensor_parallel, ...")
    shapes = plan.add_mutually_exclusive_group()
    shapes.add_argument("--batch", default=None, help="shape of the one input, e.g. 8x1024")
    shapes.add_argument("--input-shape", action="append", default=None,
                        help="shape of one input, e.g. 8x3x224x224 or 8x1024:long; repeat for several inputs")
    plan.add_argument("--dtype", default="float32", help="dtype of --batch / --input-shape (e.g. long, bf16)")
    plan.add_argument("--json", default=None, metavar="PATH", help="save the plan as JSON")
    return root


def run_plan(args) -> int:
    import torch_autopar as autopar

    mesh = parse_shape(args.mesh, "--mesh")
    budget = parse_memory(args.memory) if args.memory is not None else None
    names = tuple(n.strip() for n in args.axis_names.split(",")) if args.axis_names else None
    model, from_factory = build_model(args.factory)
    inputs = example_inputs(args, from_factory)
    plan = autopar.plan(model, inputs, mesh_shape=mesh, axis_names=names, hardware=args.hardware,
                        strategy=args.strategy, memory_budget=budget)
    print(plan.explain())
    if args.json:
        plan.save(args.json)
        print(f"plan saved to {args.json}")
    return 0


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return run_plan(args)
    except AutoparError as error:
        print(error, file=sys.stderr)
        return 1
