"""The ``"autopar"`` torch.compile backend: dynamo graph → aten forward/backward graphs → run.

Registered under the name "autopar", so ``torch.compile(model, backend="autopar")`` works on any module (one
process, nothing inserted). A parallel module in graph mode uses ``data_parallel_backend``, which also runs the
rewrite stage's gradient-sync pass on each backward graph (with graph breaks, each compiled piece syncs the
gradients it produces; the Python between pieces runs as torch.compile runs it). Sharded plans run their
per-rank program (``rewrite.program``) through ``sharded_compilers``. Each aten graph runs as the FX graph's
generated Python or as Inductor's code (``graph_compiler``).
"""

from __future__ import annotations

import os
import types

import torch
import torch.distributed as dist

from torch_autopar import _compat
from torch_autopar.capture.program import tensor_nbytes
from torch_autopar.errors import AutoparError
from torch_autopar.launch.faults import collective_failure
from torch_autopar.rewrite import GradSyncPass

BACKEND_NAME = "autopar"


GRAPH_COMPILERS = ("python", "inductor")
"""How each aten graph runs: "python" (the FX graph's generated Python, op by op) or "inductor" (Inductor's
fused kernels: C++/OpenMP on CPU, Triton on CUDA). ``AUTOPAR_GRAPH_COMPILER`` selects; the default is
"inductor" on CUDA and "python" on CPU (see ``default_graph_compiler``)."""


def default_graph_compiler() -> str:
    """Inductor on CUDA. On CPU the FX graph's Python: measured side by side on 2 gloo ranks (fully_shard, graph
    mode, 16 samples, median of 10 steps), Inductor's C++ was 1.27x slower on a 4 x 1024-wide MLP (41.6 vs
    32.8 ms per step) and 0.92x on the 2-layer GPT (251 vs 274 ms), and its first step took 5-6 s longer
    (compiling every graph on every rank): matmul-bound CPU steps run the same BLAS either way."""
    return "inductor" if torch.cuda.is_available() else "python"


def graph_compiler() -> str:
    name = os.environ.get("AUTOPAR_GRAPH_COMPILER") or default_graph_compiler()
    if name not in GRAPH_COMPILERS:
        raise AutoparError(f"AUTOPAR_GRAPH_COMPILER={name!r}: expected one of {GRAPH_COMPILERS}; unset it for the "
                           f"default ({default_graph_compiler()!r} on this machine).")
    return name


def generate_code(gm: torch.fx.GraphModule, example_inputs, *, backward: bool):
    """The boxed callable that runs ``gm`` with the selected graph compiler."""
    if graph_compiler() == "inductor":
        return _compat.inductor_compile(gm, example_inputs, backward=backward)
    return _compat.boxed_python(gm)


def _run_forward(gm: torch.fx.GraphModule, example_inputs):
    return generate_code(gm, example_inputs, backward=False)


def _run_backward(gm: torch.fx.GraphModule, example_inputs):
    return generate_code(gm, example_inputs, backward=True)


def guarded(boxed, stats: dict, phase: str):
    """``boxed`` (a compiled graph) with a collective's failure turned into a ``torch_autopar:`` error naming
    the step (``stats["forward_calls"]``) and ``phase``: a backward graph runs inside ``loss.backward()``, where
    the module's own forward cannot catch it."""

    def run(args):
        try:
            return boxed(args)
        except RuntimeError as error:
            failure = collective_failure(error, stats.get("forward_calls", 0), phase)
            if failure is None:
                raise
            raise failure from error

    run._boxed_call = True
    return run


def autopar_backend(gm: torch.fx.GraphModule, example_inputs):
    """Backend for one process: aten-level forward and backward graphs, run as generated Python."""
    return _compat.aot_autograd_backend(_run_forward, _run_backward)(gm, example_inputs)


def register() -> None:
    _compat.register_dynamo_backend(BACKEND_NAME, autopar_backend)


def data_parallel_backend(named_params: dict[str, torch.nn.Parameter], buckets: list[list[str]],
                          group: dist.ProcessGroup, stats: dict, reduce_dtype: torch.dtype | None = None):
    """A backend that averages parameter gradients over ``group`` inside each compiled backward graph (in
    ``reduce_dtype`` when one is given: mixed precision)."""
    name_of = {id(p): n for n, p in named_params.items()}

    def backend(gm: torch.fx.GraphModule, example_inputs):
        input_names = {i: name_of[id(t)] for i, t in enumerate(example_inputs) if id(t) in name_of}

        def bw_compiler(bw_gm: torch.fx.GraphModule, bw_inputs):
            outputs = bw_gm.graph.find_nodes(op="output")[0].args[0]
            if len(outputs) != len(example_inputs):
                raise AssertionError(
                    f"backward graph has {len(outputs)} outputs for {len(example_inputs)} forward inputs")
            grad_pass = GradSyncPass(input_names, buckets, _compat.group_name(group), dist.get_world_size(group),
                                     reduce_dtype)
            result = grad_pass(bw_gm)
            stats["all_reduces_per_backward"] = stats.get("all_reduces_per_backward", 0) + result.all_reduces
            stats["synced_bytes_per_backward"] = stats.get("synced_bytes_per_backward", 0) + result.synced_bytes
            return guarded(generate_code(result.graph_module, bw_inputs, backward=True), stats,
                           "backward: gradient all-reduce")

        return _compat.aot_autograd_backend(_run_forward, bw_compiler)(gm, example_inputs)

    return backend


def graph_collectives(gm: torch.fx.GraphModule) -> list[tuple[str, str, int]]:
    """The collectives a compiled graph runs: (kind, process group name, bytes per rank, plan convention)."""
    kinds = _compat.collective_op_kinds()
    found = []
    for node in gm.graph.nodes:
        info = kinds.get(getattr(node.target, "overloadpacket", None)) if node.op == "call_function" else None
        if info is None or info[2] is None:
            continue
        kind, which, group_index = info
        value = node.meta.get("val") if which == "output" else node.args[which if isinstance(which, int) else 0].meta.get("val")
        nbytes = tensor_nbytes(value)
        found.append((kind, str(node.args[group_index]), nbytes))
    return found


def sharded_compilers(stats: dict):
    """(forward, backward) compilers for the graphs of a sharded plan (local ops and functional collectives);
    each records its graph's collectives in ``stats["graph_collectives"]``."""
    recorded = stats.setdefault("graph_collectives", {"forward": [], "backward": []})

    def compiler(phase):
        def compile_graph(gm: torch.fx.GraphModule, example_inputs):
            recorded[phase] = graph_collectives(gm)
            return guarded(generate_code(gm, example_inputs, backward=phase == "backward"), stats, phase)
        return compile_graph

    return compiler("forward"), compiler("backward")


def sharded_backend(stats: dict):
    """The "autopar" backend for sharded plans run through DTensor (lowered to local ops and functional
    collectives by dynamo)."""
    return _compat.aot_autograd_backend(*sharded_compilers(stats))


def _call(target, *args, **kwargs):
    return target(*args, **kwargs)


def compile_own(target, backend, *, fullgraph: bool = True):
    """``torch.compile(target, fullgraph=fullgraph)`` through a top-level function with its own code object;
    logger calls inside are skipped while tracing, as ``torch.export`` skips them.

    Dynamo keeps compiled graphs, and its recompile limit (8), per code object: compiling the forward of many
    modules of one class (or many runners) would share one cache and fail after 8 instances. Each compiled
    module gets a private copy of a trivial trampoline instead; the module's own code is inlined into it."""
    code = _call.__code__.replace()
    trampoline = types.FunctionType(code, _call.__globals__, f"autopar_{type(target).__name__}", None, None)
    compiled = torch.compile(trampoline, backend=backend, fullgraph=fullgraph, dynamic=False)

    def call(*args, **kwargs):
        with _compat.compiling_without_logging():
            return compiled(target, *args, **kwargs)

    return call
