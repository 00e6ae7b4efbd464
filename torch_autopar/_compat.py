"""The one adapter between torch_autopar and PyTorch's private APIs.

Everything torch_autopar touches under ``torch._*`` or ``torch.distributed.*._*`` is imported here and only
here, so a PyTorch upgrade breaks this file and not twenty. Each helper is small and documented with the
public behaviour it stands for. This module must never import another torch_autopar module (except errors).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import pickle
import re
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch._functorch._aot_autograd import descriptors as _desc
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensor, FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.utils import flop_counter as _flop_counter

__all__ = [
    "DTensorSpec", "FakeTensor", "FakeTensorMode", "TensorMeta", "boxed_python",
    "export_joint", "capture_forward", "captured_output_spec", "module_paths", "input_kind", "grad_target",
    "tangent_output_index", "output_index",
    "propagate_sharding", "node_flops", "queue_backward_callback", "default_store", "fake_store",
    "aot_autograd_backend",
    "register_dynamo_backend", "functional_all_reduce_inplace", "functional_all_reduce", "functional_reduce_scatter",
    "functional_wait_tensor", "functional_all_gather", "recompute_in_backward", "DynamoUnsupported",
    "safe_checkpoint_reader", "recording_ops", "pytree",
]


def unbacked_mesh(device_type: str, ranks: torch.Tensor, names) -> DeviceMesh:
    """A DeviceMesh over ``ranks`` whose axes have no process groups (to plan on: DTensor's layout rules need a
    mesh, not communication). Private ``DeviceMesh(..., _init_backend=False)``: no public equivalent in torch
    2.13."""
    return DeviceMesh(device_type, ranks, mesh_dim_names=tuple(names), _init_backend=False)


def export_joint(module: torch.nn.Module, args: tuple, kwargs: dict | None, *, names_from: torch.nn.Module | None = None):
    """Trace ``module(*args, **kwargs)`` and its backward into one aten-level FX graph.

    The forward is captured by dynamo exactly as ``torch.export`` captures it (``torch.compiler.is_compiling()``
    and ``is_exporting()`` are True inside, logger and ``warnings`` calls are skipped, ``ModelOutput``-style
    outputs are flattened), so library code written for compilers takes its compiler path. The captured
    module keeps the parameter and buffer names they have in ``names_from`` (default ``module``); AOTAutograd
    then traces the joint forward+backward.
    Returns the joint ``GraphModule`` whose placeholders/outputs carry ``meta["desc"]`` descriptors
    (parameter, buffer, user input, tangent / forward output, gradient of a parameter).
    """
    with contextlib.ExitStack() as stack:
        joint = joint_with_descriptors(stack, module, args, kwargs, names_from=names_from)
        return joint.graph_module, joint.out_spec


def joint_with_descriptors(stack: contextlib.ExitStack, module: torch.nn.Module, args: tuple, kwargs: dict | None, *,
                           names_from: torch.nn.Module | None = None):
    """``export_joint``'s capture, returned as AOTAutograd's ``JointWithDescriptors`` (graph_module, params_spec,
    buffers_spec, out_spec) for ``compile_joint``; the tracing context lives as long as ``stack``."""
    from torch._guards import TracingContext, tracing

    captured = capture_forward(module, args, kwargs, names_from=names_from)
    stack.enter_context(tracing(TracingContext(captured.meta.get("fake_mode"))))
    return aot_export_joint_with_descriptors(stack, captured, args, kwargs or {})


def capture_forward(module: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
                    names_from: torch.nn.Module | None = None) -> torch.fx.GraphModule:
    """``module(*args, **kwargs)``'s forward alone, captured by dynamo as ``export_joint`` captures it: a torch-level
    GraphModule (no backward, no decomposition) whose parameters and buffers are ``get_attr`` nodes under their
    names in ``names_from`` (default ``module``), each node's ``meta["nn_module_stack"]`` naming the modules it ran
    in; ``captured_output_spec`` gives the structure of its flat outputs. Shapes are those of ``args``. Private
    ``_dynamo_graph_capture_for_export``: ``torch.export``'s own capture, with no public forward-only entry."""
    from torch._dynamo.functional_export import _dynamo_graph_capture_for_export

    with compiling_without_logging(), _static_shapes_unchecked():
        captured = _dynamo_graph_capture_for_export(module)(*args, **(kwargs or {}))
    _restore_names(names_from if names_from is not None else module, captured)
    return captured


@contextlib.contextmanager
def _static_shapes_unchecked():
    """While ``capture_forward`` runs: the export capture's check for violated dynamic-shape constraints is skipped
    when no dynamic shapes were asked for (ours: every shape is static), where it can find none. It builds the
    frame's guards for nothing, a fifth of a capture (1.2 of 6.4 s for a 12-block GPT). Private
    ``functional_export._suggest_or_raise_constraint_violation``; where it is absent, nothing changes."""
    from torch._dynamo import functional_export

    check = getattr(functional_export, "_suggest_or_raise_constraint_violation", None)
    if check is None:
        yield
        return

    signature = inspect.signature(check)

    def only_with_dynamic_shapes(*args, **kwargs):
        if signature.bind(*args, **kwargs).arguments.get("dynamic_shapes") is not None:
            check(*args, **kwargs)

    functional_export._suggest_or_raise_constraint_violation = only_with_dynamic_shapes
    try:
        yield
    finally:
        functional_export._suggest_or_raise_constraint_violation = check


def captured_output_spec(captured: torch.fx.GraphModule):
    """The pytree spec that turns ``capture_forward``'s flat graph outputs back into the module's output."""
    return captured._out_spec


def module_paths(node: torch.fx.Node) -> list[str]:
    """The qualified names, from the captured module, of the modules ``node`` ran inside, outermost first
    ("model.layers.0"; from ``meta["nn_module_stack"]``, filled by dynamo's capture, which writes them as
    "L['self'].model.layers.0" or "L['self'].model.layers[0]")."""
    paths = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
    return [re.sub(r"\[(\d+)\]", r".\1", re.sub(r"^L\['self'\]\.?", "", path)) for path in paths]


def trace_local_joint(run: Callable, local_inputs: list) -> torch.fx.GraphModule:
    """``run(*local_inputs)`` traced into an aten graph (``make_fx``): DTensor's redistributions inside appear as
    ``_c10d_functional`` collectives and every op on local shapes. Nothing is communicated while tracing."""
    import torch.fx.traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    with fx_traceback.preserve_node_meta():
        return make_fx(run)(*local_inputs)


def replace_joint_graph(joint, graph_module: torch.fx.GraphModule) -> None:
    """Make ``joint`` (a ``JointWithDescriptors``) compile ``graph_module``, a rewrite of its joint graph with the
    same placeholders and outputs in the same order but local shapes: AOTAutograd's recorded inputs and tangents
    are replaced by the new placeholders' values."""
    values = [node.meta["val"] for node in graph_module.graph.find_nodes(op="placeholder")]
    state, capture = joint._aot_state, joint._aot_graph_capture
    primals = [torch.nn.Parameter(new, requires_grad=old.requires_grad) if isinstance(old, torch.nn.Parameter) else new
               for old, new in zip(state.flat_args, values)]
    tangents = values[len(state.flat_args):]
    joint.graph_module = capture.graph_module = graph_module
    capture.updated_flat_args = (primals, tangents)
    state.flat_args = primals
    state.fw_metadata.traced_tangents = tangents
    from torch._functorch._aot_autograd.schemas import MemoryFormatMeta, PlainTensorMeta

    for meta, tangent in zip(state.fw_metadata.subclass_tangent_meta, tangents):  # the shapes backward coerces to
        if isinstance(meta, PlainTensorMeta) and isinstance(tangent, torch.Tensor):
            meta.memory_format = MemoryFormatMeta.from_tensor(tangent)


def boxed_python(graph_module: torch.fx.GraphModule) -> Callable:
    """The FX graph's generated Python, called boxed (one list of inputs, as AOTAutograd calls a compiled graph)
    and emptying that list as it starts, so that each input is freed after its last use in the graph, as
    Inductor's code frees it: a backward graph's saved activations die as backward consumes them, not all at its
    end (AOTAutograd's own ``boxed_nop``). Changes ``graph_module``'s code to take that list."""
    from torch.fx.graph import _BoxedCodeGen

    graph_module.graph.set_codegen(_BoxedCodeGen())
    graph_module.recompile()
    forward = graph_module.forward

    def run(args: list) -> Any:
        return forward(args)

    run._boxed_call = True
    return run


def inductor_compile(graph_module: torch.fx.GraphModule, example_inputs, *, backward: bool) -> Callable:
    """Inductor's code for one aten graph (forward or backward of an AOTAutograd partition), called boxed
    (one list of inputs), as ``torch.compile``'s default backend compiles each graph."""
    import torch.fx.traceback as fx_traceback
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    fake_mode = next((t.fake_mode for t in example_inputs if isinstance(t, FakeTensor)), None)
    with fx_traceback.preserve_node_meta(), (fake_mode or contextlib.nullcontext()):
        # Inductor lowers its decomposed op set (what torch.compile's tracing would have produced)
        decomposed = make_fx(torch.fx.Interpreter(graph_module).run, decomposition_table=select_decomp_table())(
            *example_inputs)
    return compile_fx_inner(decomposed, example_inputs, is_backward=backward)


def compile_joint(joint, fw_compiler: Callable, bw_compiler: Callable) -> Callable:
    """Partition ``joint``'s graph into forward and backward, compile each, and return a differentiable callable
    taking (parameters, buffers, user input leaves) as flat positional tensors and returning flat outputs."""
    from torch._functorch.aot_autograd import aot_compile_joint_with_descriptors

    return aot_compile_joint_with_descriptors(joint, fw_compiler=fw_compiler, bw_compiler=bw_compiler)


def _restore_names(original: torch.nn.Module, traced: torch.fx.GraphModule) -> None:
    """Give the traced module's parameters and buffers the names (and registration order) they have in
    ``original``; a tied tensor keeps its first name, as ``named_parameters()`` reports it. Tensors dynamo lifted
    that ``original`` does not own (constants a forward creates) stay plain attributes under their traced names,
    so the joint graph sees them as constants, not as buffers of the model."""
    from torch.fx.graph_module import _assign_attr, _del_attr

    first_name: dict[int, str] = {}
    for name, tensor in [*original.named_parameters(), *original.named_buffers()]:
        first_name.setdefault(id(tensor), name)
    traced_tensors = [*traced.named_parameters(remove_duplicate=False), *traced.named_buffers(remove_duplicate=False)]
    for name, _ in traced_tensors:
        _del_attr(traced, name)
    by_id = {id(tensor): tensor for _, tensor in traced_tensors}
    for tensor_id, name in first_name.items():
        if tensor_id in by_id:
            _assign_attr(by_id[tensor_id], traced, name)
    renamed = {}
    for name, tensor in traced_tensors:
        new_name = first_name.get(id(tensor))
        if new_name is None:
            *owner_path, field = name.split(".")
            setattr(traced.get_submodule(".".join(owner_path)), field, tensor)
        renamed[name] = new_name or name
    for node in traced.graph.find_nodes(op="get_attr"):
        node.target = renamed.get(node.target, node.target)
    traced.recompile()


def input_kind(desc: Any) -> str:
    """Classify a placeholder descriptor: "param", "buffer", "input", "tangent" or "other"."""
    if isinstance(desc, _desc.ParamAOTInput):
        return "param"
    if isinstance(desc, _desc.BufferAOTInput):
        return "buffer"
    if isinstance(desc, _desc.PlainAOTInput):
        return "input"
    if isinstance(desc, _desc.TangentAOTInput):
        return "tangent"
    return "other"


def user_input_index(desc: Any) -> int | None:
    """Flat index of a user input placeholder among the user's (args, kwargs) leaves."""
    return desc.idx if isinstance(desc, _desc.PlainAOTInput) else None


def param_target(desc: Any) -> str | None:
    """For a parameter placeholder, its fully qualified name."""
    return desc.target if isinstance(desc, _desc.ParamAOTInput) else None


def grad_target(desc: Any) -> str | None:
    """For a graph output that is the gradient of a parameter or buffer, its fully qualified name."""
    if isinstance(desc, _desc.GradAOTOutput) and isinstance(desc.grad_of, (_desc.ParamAOTInput, _desc.BufferAOTInput)):
        return desc.grad_of.target
    return None


def mutated_buffer(desc: Any) -> str | None:
    """For a graph output that is the new value of a buffer the forward updates in place, the buffer's name."""
    if isinstance(desc, _desc.InputMutationAOTOutput) and isinstance(desc.mutated_input, _desc.BufferAOTInput):
        return desc.mutated_input.target
    return None


def output_index(desc: Any) -> int | None:
    """For a graph output that is a user (forward) output, its flat index among the model's output leaves."""
    return desc.idx if isinstance(desc, _desc.PlainAOTOutput) else None


def tangent_output_index(desc: Any) -> int | None:
    """For a tangent placeholder, the flat index of the forward output it is the gradient for."""
    if isinstance(desc, _desc.TangentAOTInput):
        return output_index(desc.output)
    return None


def propagate_sharding(op, args_schema: tuple, kwargs_schema: dict):
    """Run DTensor's registered sharding rule for ``op`` on specs; returns its ``OutputSharding``."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    return propagator.propagate_op_sharding(op_schema(op, args_schema, kwargs_schema))


def op_schema(op, args_schema: tuple, kwargs_schema: dict) -> OpSchema:
    """``op``'s schema on specs as DTensor's dispatcher builds it: with the op's runtime schema info, which names
    the non-tensor arguments (a view's shape, a reduction's dims) that are part of the sharding cache's key.
    Without it two calls on the same input spec share one cache entry: a view to ``(B*T, C)`` would be given the
    output of an earlier view of that input to ``(B, T, H, D)``."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    info = propagator.op_to_schema_info.get(op) or propagator.op_to_schema_info_for_single_dim_strategy.get(op)
    return OpSchema(op, args_schema, kwargs_schema, schema_info=info)


_REPLICATED_FALLBACKS: set = set()
"""Ops given DTensor's replicate-everything strategy by ``register_replicated_fallback``: they still count as
having no rule (the planner replicates and reports them)."""


def has_sharding_rule(op) -> bool:
    """Whether DTensor has a registered sharding strategy or rule for this aten overload (a replicated fallback
    torch_autopar registered is not a rule)."""
    if op in _REPLICATED_FALLBACKS:
        return False
    propagator = DTensor._op_dispatcher.sharding_propagator
    tables = [propagator.op_strategy_funcs, propagator.op_to_rules,
              getattr(propagator, "op_single_dim_strategy_funcs", {}) or {}]
    return any(op in table for table in tables)


def node_flops(op, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one aten op call, from ``torch.utils.flop_counter``'s registry (0 for ops it has no formula for)."""
    packet = getattr(op, "overloadpacket", None)
    formula = _flop_counter.flop_registry.get(packet)
    if formula is None:
        return 0
    return int(formula(*args, out_val=out, **kwargs))


def grad_scaler_found_inf(scaler, optimizer) -> list[torch.Tensor]:
    """The non-finite flags ``scaler.unscale_(optimizer)`` left, one per device: what torch's own
    ``ShardedGradScaler`` all-reduces so that every rank skips the same steps (no public accessor in 2.13)."""
    return list(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the autograd engine finishes the current backward pass (as DDP does)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def default_store():
    """The key-value store of the default process group (the rendezvous store torchrun or init set up)."""
    return dist.distributed_c10d._get_default_store()


def fake_store():
    """A store for ``dist.init_process_group("fake", ...)``: plans for N ranks in one process, no traffic."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def aot_autograd_backend(fw_compiler: Callable, bw_compiler: Callable) -> Callable:
    """A dynamo backend that splits the captured graph into aten forward/backward graphs for the compilers."""
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler)


def register_dynamo_backend(name: str, fn: Callable) -> None:
    """Make ``torch.compile(model, backend=name)`` call ``fn(graph_module, example_inputs)``."""
    from torch._dynamo.backends import registry

    if name not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=fn, name=name)


def _logging_calls() -> set:
    """``warnings.warn`` and the ``logging.Logger`` methods that emit a message, including ones libraries add to
    the class (such as ``transformers``' ``warning_once``); querying methods (``isEnabledFor``) are left out:
    they return values."""
    import logging
    import warnings

    emitting = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log"}
    found = {warnings.warn, warnings.warn_explicit}
    for name, value in vars(logging.Logger).items():
        added = callable(value) and getattr(value, "__module__", "logging") != "logging" and not name.startswith("_")
        if name in emitting or added:
            found.add(value)
    return found


def compiling_without_logging():
    """While dynamo traces, logger and ``warnings.warn`` calls are skipped as ``torch.export`` skips logger calls
    (no graph break); they still run in eager mode. Returns a context manager."""
    from torch._dynamo import config

    return config.patch(ignore_logging_functions=set(config.ignore_logging_functions) | _logging_calls())


def dynamo_unsupported_errors() -> tuple[type, ...]:
    """Exception types dynamo raises when it cannot capture a forward as one graph."""
    from torch._dynamo import exc
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    return (exc.TorchDynamoException, exc.UserError, DataDependentOutputException, DynamicOutputShapeException)


DynamoUnsupported = dynamo_unsupported_errors


def is_graph_compiler_failure(error: BaseException) -> bool:
    """Whether ``error`` is a code generator's failure on a captured graph (Inductor's, or a backend's), not a
    graph break."""
    from torch._dynamo import exc

    return isinstance(error, exc.BackendCompilerFailed)


def graph_break_reason(error: BaseException) -> str:
    """Why dynamo could not capture a forward as one graph, in one line: its explanation of the break and the
    user's line that caused it (the last frame of dynamo's "from user code" trace), else the error's first line."""
    import re

    text = str(error)
    explanation = re.search(r"Explanation: (.*)", text)
    reason = explanation.group(1).strip() if explanation else (text.splitlines() or [""])[0]
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', text.split("from user code:")[-1])
    if "from user code:" in text and frames:
        path, line, function, source = frames[-1]
        reason += f" (at {path}:{line} in {function}: {source.strip()})"
    return f"{type(error).__name__}: {reason}"


def functional_all_reduce_inplace():
    """The traceable, asynchronous in-place all-reduce op (``_c10d_functional.all_reduce_``) for graph passes;
    pair it with ``functional_wait_tensor``."""
    return torch.ops._c10d_functional.all_reduce_.default


def functional_all_reduce():
    """The traceable, asynchronous all-reduce op (``_c10d_functional.all_reduce``: input, reduce op, group name);
    pair it with ``functional_wait_tensor``."""
    return torch.ops._c10d_functional.all_reduce.default


def functional_reduce_scatter():
    """The traceable, asynchronous reduce-scatter op (``_c10d_functional.reduce_scatter_tensor``: input, reduce op,
    group size, group name; dim 0 split); pair it with ``functional_wait_tensor``."""
    return torch.ops._c10d_functional.reduce_scatter_tensor.default


def functional_wait_tensor():
    """The op that waits for a functional collective's result."""
    return torch.ops._c10d_functional.wait_tensor.default


def functional_all_gather():
    """The traceable, asynchronous all-gather op (``_c10d_functional.all_gather_into_tensor``: input, group size,
    group name; dim 0 gathered); pair it with ``functional_wait_tensor``."""
    return torch.ops._c10d_functional.all_gather_into_tensor.default


RECOMPUTED_REGION = 100_000
"""The checkpoint region id given to every node ``recompute_in_backward`` tags: one region, so that AOTAutograd's
partitioner (``cleanup_recompute_tags``) never saves a tagged node at the border of two regions; far above the ids
``torch.utils.checkpoint`` counts from 0 (SimpleFSDP's and AutoParallel's choice)."""


def recompute_in_backward(node: torch.fx.Node) -> None:
    """Make AOTAutograd's partitioner compute ``node`` (a node of a joint graph) again in the backward graph instead
    of saving its value: the tag selective activation checkpointing gives an op its policy marks
    ``CheckpointPolicy.MUST_RECOMPUTE`` (``node.meta["recompute"]``, with the region ``node.meta["ac_graph_id"]``);
    the partitioner otherwise saves every collective's result (``force_save_collectives``)."""
    from torch.utils.checkpoint import CheckpointPolicy

    node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    node.meta["ac_graph_id"] = RECOMPUTED_REGION


def fake_copy(module: torch.nn.Module, fake_mode: FakeTensorMode) -> torch.nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are ``fake_mode``'s fake tensors (no storage)."""
    with FakeCopyMode(fake_mode):
        return copy.deepcopy(module)


def autograd_node_class(function: type) -> type:
    """The class of the autograd nodes (``grad_fn``) an ``autograd.Function`` subclass's outputs get."""
    return function._backward_cls


def group_name(group: dist.ProcessGroup) -> str:
    """The registered name of a process group, as functional collectives expect it."""
    return group.group_name


def dispatched_group_name(group) -> str:
    """The registered name of the process group a c10d op carries to the dispatcher (a ``torch.ScriptObject``:
    ``ProcessGroup.unbox``, no public form in torch 2.13)."""
    return dist.ProcessGroup.unbox(group).group_name


# --- Strategy enumeration (DTensor's per-op strategy registry) -------------------------------------------------

def op_strategies(op, args_schema: tuple, kwargs_schema: dict, mesh, output_meta):
    """Every sharding strategy DTensor registers for ``op`` on ``mesh``.

    ``args_schema`` holds an ``OpStrategy`` (all candidate specs of the producer) in place of each tensor argument.
    Returns an ``OpStrategy`` whose ``OpSpec``s give output specs and the input specs they require, or None when
    DTensor has no rule for ``op``. Single-dim registrations are expanded to the full mesh, as DTensor does.
    """
    from torch.distributed.tensor._ops import single_dim_strategy as sds
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    propagator = DTensor._op_dispatcher.sharding_propagator
    schema = op_schema(op, args_schema, kwargs_schema)
    info = propagator.op_single_dim_strategy_funcs.get(op)
    if info is not None:
        single = info.func(op, schema.args_meta, schema.kwargs_meta)
        num_inputs = sds._get_num_tensor_inputs(schema)
        num_outputs = len(single[0]) - num_inputs if single else (1 if isinstance(output_meta, TensorMeta) else len(output_meta))
        single = sds._insert_single_dim_replication_strategy(list(single), num_outputs, num_inputs, output_meta)
        from torch.distributed.tensor import Shard as _Shard

        filled = sds._fill_single_dim_strategy_placeholders({_Shard(0)}, single)
        return expand_to_full_mesh_op_strategy(
            mesh, schema, filled, output_tensor_meta=output_meta, input_index=num_outputs,
            allow_unbacked_sharding=info.allow_unbacked_sharding, allow_uneven_sharding=info.allow_uneven_sharding)
    func = propagator.op_strategy_funcs.get(op) if op not in _REPLICATED_FALLBACKS else None
    return func(schema) if func is not None else None


def op_choice(op, args_schema: tuple, kwargs_schema: dict, mesh, output_meta, pinned: set[int],
              output_on: dict | None = None):
    """DTensor's choice of strategy for ``op`` on the specs ``args_schema`` (a ``DTensorSpec`` per tensor
    argument), as ``propagate_sharding`` makes it (the cheapest by DTensor's redistribute cost) with two
    differences: only strategies that take the positional arguments at ``pinned`` exactly as they come and whose
    output has the placements ``output_on`` gives on its mesh axes, and a move out of a strided shard priced
    (``_move_cost``; DTensor prices none, so it picks among such inputs' strategies blindly, replicating every
    axis). Returns (the spec each argument must be moved to, aligned with
    ``args_schema``: None where it is not a tensor; the output spec), or None when ``op`` has no strategy
    function, returns several outputs (a ``TupleStrategy``: not chosen here), or no strategy keeps to both
    restrictions."""
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy
    from torch.distributed.tensor._ops import utils as ops_utils

    tensors = [i for i, a in enumerate(args_schema) if isinstance(a, DTensorSpec)]
    as_strategy = tuple(OpStrategy([OpSpec(a)]) if isinstance(a, DTensorSpec) else a for a in args_schema)
    found = op_strategies(op, as_strategy, kwargs_schema, mesh, output_meta)
    if not isinstance(found, OpStrategy):
        return None
    best, best_cost = None, (float("inf"), float("inf"))
    for spec in found.strategies:
        wanted = list(spec.input_specs or ())
        if len(wanted) < len(tensors):
            continue
        if any(tuple(wanted[k].placements) != tuple(args_schema[i].placements)
               for k, i in enumerate(tensors) if i in pinned):
            continue
        output = spec.output_specs
        if isinstance(output, DTensorSpec) and any(output.placements[a] != p for a, p in (output_on or {}).items()):
            continue
        costs = [_move_cost(ops_utils.redistribute_cost, args_schema[i], wanted[k]) for k, i in enumerate(tensors)]
        cost = (sum(c == float("inf") for c in costs), sum(c for c in costs if c != float("inf")))
        if cost < best_cost:
            best, best_cost = spec, cost
    if best is None:
        return None
    moved = [None] * len(args_schema)
    for k, i in enumerate(tensors):
        moved[i] = best.input_specs[k]
    return moved, best.output_specs


def _move_cost(redistribute_cost, current: DTensorSpec, target: DTensorSpec) -> float:
    """DTensor's cost of moving ``current`` to ``target``; it prices no move out of a strided shard (a dim split
    inside a flattened one, such as a sequence split seen through a ``(batch * seq, dim)`` view): such a move is
    priced as the plain shard's of the same dim, which moves as many bytes."""
    cost = redistribute_cost(current, target)
    if cost != float("inf"):
        return cost
    plain = lambda spec: DTensorSpec(spec.mesh, tuple(  # noqa: E731
        Shard(p.dim) if is_strided_shard(p) else p for p in spec.placements), spec.tensor_meta)
    return redistribute_cost(plain(current), plain(target))


def is_strided_shard(placement) -> bool:
    """Whether ``placement`` is DTensor's private ``_StridedShard`` (a dim split inside a flattened one)."""
    return type(placement).__name__ == "_StridedShard"


@contextlib.contextmanager
def without_dtensor_redistribute_costs():
    """Skip DTensor's own redistribute-cost estimates while enumerating (torch_autopar prices resharding with
    its cost model); they are ~90% of enumeration time. Restores the functions afterwards."""
    import sys

    from torch.distributed.tensor._ops import utils as ops_utils

    original = ops_utils.generate_redistribute_costs

    def zero_costs(src_strategy, dst_spec):
        return [0.0] * len(src_strategy.strategies)

    patched = []
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.distributed.tensor") and getattr(module, "generate_redistribute_costs", None) is original:
            module.generate_redistribute_costs = zero_costs
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            module.generate_redistribute_costs = original


def strategy_types():
    """DTensor's strategy containers: (OpStrategy, OpSpec, TupleStrategy)."""
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy, TupleStrategy

    return OpStrategy, OpSpec, TupleStrategy


# --- Sharded execution (DTensor) -------------------------------------------------------------------------------

def allow_implicit_replication() -> None:
    """Let plain tensors meet DTensors in one op as replicated values (``positions = torch.arange(T)`` added to
    a sharded activation, a causal mask kept for backward). Process-wide and left on: the autograd engine runs
    backward outside any context manager, and dynamo cannot trace the public ``implicit_replication()`` one.
    Public equivalent: ``torch.distributed.tensor.experimental.implicit_replication``."""
    DTensor._op_dispatcher._allow_implicit_replication = True


def collective_op_kinds() -> dict:
    """Collective ops as they reach the dispatcher (functional and c10d), by overload packet → (kind, how the
    moved bytes are read: "input" (the first argument), "output" or the index of the argument sent, group
    argument index (a name, or a c10d op's process group: ``dispatched_group_name``))."""
    fc, c10d = torch.ops._c10d_functional, torch.ops.c10d
    return {
        fc.all_reduce: ("all_reduce", "input", 2), fc.all_reduce_: ("all_reduce", "input", 2),
        fc.all_gather_into_tensor: ("all_gather", "output", 2),
        fc.reduce_scatter_tensor: ("reduce_scatter", "input", 3),
        fc.all_to_all_single: ("all_to_all", "input", 3),
        fc.broadcast: ("broadcast", "input", 2),
        c10d.allreduce_: ("all_reduce", "input", 1), c10d.broadcast_: ("broadcast", "input", 1),
        c10d._allgather_base_: ("all_gather", "output", 2), c10d.allgather_: ("all_gather", "output", 2),
        c10d._reduce_scatter_base_: ("reduce_scatter", 1, 2),
    }


def is_persistent_buffer(module: torch.nn.Module, name: str) -> bool:
    """Whether ``module``'s buffer ``name`` is saved in its state_dict (``register_buffer(persistent=...)``)."""
    return name not in module._non_persistent_buffers_set


def incompatible_keys(missing: list, unexpected: list):
    """What ``nn.Module.load_state_dict`` returns: a named tuple of missing and unexpected keys."""
    return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


def redistribute_steps(mesh, source: tuple, target: tuple) -> list[tuple[int, Any, Any]]:
    """The steps DTensor's ``redistribute`` takes from ``source`` to ``target`` placements on ``mesh``, in
    order: (mesh axis, from, to). Computed for an evenly divisible tensor."""
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    dims = [p.dim for p in tuple(source) + tuple(target) if hasattr(p, "dim")]
    ndim = max(dims, default=0) + 1
    side = 2 * mesh.size()
    stride = tuple(side ** (ndim - 1 - i) for i in range(ndim))
    meta = TensorMeta(torch.Size((side,) * ndim), stride, torch.float32)
    infos = _gen_transform_infos(DTensorSpec(mesh, tuple(source), meta), DTensorSpec(mesh, tuple(target), meta))
    return [(info.mesh_dim, info.src_dst_placements[0], info.src_dst_placements[1]) for info in infos]


def fix_convolution_redistribution() -> None:
    """DTensor's runtime handlers for ``aten.convolution`` and its backward (written for spatially sharded
    tensor parallelism) skip the redistribution its own sharding rule asks for, so a sharded weight reaches the
    local kernel as a shard. Wrap them to redistribute the arguments as the rule requires first (a weight
    sharded by a fully-sharded plan is all-gathered, as the planner predicts). Idempotent."""
    dispatcher = DTensor._op_dispatcher
    for op in (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default):
        original = dispatcher._custom_op_handlers.get(op)
        if original is None or getattr(original, "_autopar_redistributes", False):
            continue

        def handler(op_call, args, kwargs, original=original):
            return original(op_call, _redistribute_as_required(op_call, args, kwargs), kwargs)

        handler._autopar_redistributes = True
        dispatcher._custom_op_handlers[op] = handler


def _redistribute_as_required(op_call, args: tuple, kwargs: dict) -> tuple:
    op_info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    DTensor._op_dispatcher.sharding_propagator.propagate(op_info)
    output = op_info.output_sharding
    if output is None or not output.needs_redistribute or output.redistribute_schema is None:
        return args
    wanted = output.redistribute_schema.args_schema
    moved = list(args)
    for index, (arg, spec) in enumerate(zip(args, wanted)):
        if isinstance(arg, DTensor) and isinstance(spec, DTensorSpec) and tuple(arg.placements) != tuple(spec.placements):
            moved[index] = arg.redistribute(arg.device_mesh, spec.placements)
    return tuple(moved)


def _without_handler(op_call, args: tuple, kwargs: dict):
    """``op_call`` on DTensors as DTensor runs it, the custom handler installed for it set aside meanwhile."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handler = handlers.pop(op_call)
    try:
        return op_call(*args, **kwargs)
    finally:
        handlers[op_call] = handler


PROPAGATION_MAY_FAIL = ("_grouped_mm",)
"""aten ops whose meta kernel, which DTensor's sharding propagation runs, refuses inputs their CPU kernel takes:
``_grouped_mm``'s asks for bf16, and transformers' mixture-of-experts layers (Mixtral, Qwen-MoE) call it in fp32
on CPU outside a compiler (``run_replicated_where_propagation_fails``)."""


def run_replicated_where_propagation_fails() -> None:
    """For the ``PROPAGATION_MAY_FAIL`` ops: where DTensor's sharding propagation raises on the arguments, run the
    op on whole local tensors (every DTensor argument replicated first, the outputs replicated DTensors), as the
    replicated fallback of an op without a rule does; elsewhere DTensor runs it as usual. Idempotent."""
    dispatcher = DTensor._op_dispatcher
    for name in PROPAGATION_MAY_FAIL:
        op = getattr(torch.ops.aten, name).default
        if op in dispatcher._custom_op_handlers:
            continue

        def handler(op_call, args, kwargs):
            if not _propagates(op_call, args, kwargs):
                return _replicated_local_call(op_call, args, kwargs)
            return _without_handler(op_call, args, kwargs)

        dispatcher._custom_op_handlers[op] = handler


_UNPROPAGATED: set = set()
"""The argument schemas (op, placements, shapes) DTensor's propagation failed on: not tried again."""


def _propagates(op_call, args: tuple, kwargs: dict) -> bool:
    """Whether DTensor's sharding propagation handles ``op_call`` on these arguments. The fake-tensor log of a
    meta kernel that refuses them is silenced; the op then runs replicated (correct, as slow as one device),
    which a warning says once per argument schema."""
    op_info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    if op_info.schema in _UNPROPAGATED:
        return False
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    disabled, fake_log.disabled = fake_log.disabled, True
    try:
        DTensor._op_dispatcher.sharding_propagator.propagate(op_info)
        return True
    except Exception as error:  # any failure of the rule or of its meta kernel: run replicated instead
        _UNPROPAGATED.add(op_info.schema)
        warnings.warn(f"torch_autopar: DTensor cannot place {op_call} on {op_info.schema} ({type(error).__name__}: "
                      f"{str(error).splitlines()[0][:200]}); it runs on replicated whole tensors instead (correct, "
                      "as slow as one device).", stacklevel=2)
        return False
    finally:
        fake_log.disabled = disabled


def _replicated_local_call(op_call, args: tuple, kwargs: dict):
    """``op_call`` on whole local tensors: every DTensor argument replicated (partial sums reduced), the tensor
    outputs replicated DTensors on the arguments' mesh."""
    mesh = next(a.device_mesh for a in pytree().tree_leaves((args, kwargs)) if isinstance(a, DTensor))
    whole = [Replicate()] * mesh.ndim
    local_args, local_kwargs = pytree().tree_map_only(
        DTensor, lambda a: a.redistribute(mesh, whole).to_local(), (args, kwargs))
    out = op_call(*local_args, **local_kwargs)
    return pytree().tree_map_only(torch.Tensor, lambda t: DTensor.from_local(t, mesh, whole, run_check=False), out)


def fix_empty_cat_redistribution() -> None:
    """``aten.cat`` skips 1-D empty tensors (the legacy "nothing yet" value, e.g. transformers' key/value cache
    before its first update), but DTensor's rule asks for every input in the layout of the others, and an empty
    1-D tensor cannot be sharded on a dim >= 1. Keep such inputs replicated (their local value is the same
    empty tensor). Idempotent."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    op = torch.ops.aten.cat.default
    original = propagator.op_strategy_funcs.get(op)
    if original is None or getattr(original, "_autopar_keeps_empty", False):
        return

    def strategy(op_schema, original=original):
        result = original(op_schema)
        children = op_schema.args_schema[0].children
        empty = [i for i, child in enumerate(children) if tuple(child.strategies[0].output_spec.shape) == (0,)]
        for spec in result.strategies if empty else ():
            inputs = list(spec.input_specs)
            for index in empty:
                mesh = inputs[index].mesh
                inputs[index] = DTensorSpec(mesh, tuple(Replicate() for _ in range(mesh.ndim)), inputs[index].tensor_meta)
            spec.input_specs = tuple(inputs)
        return result

    strategy._autopar_keeps_empty = True
    propagator.op_strategy_funcs[op] = strategy
    propagator.propagate_op_sharding.cache_clear()


def fix_inplace_redistribution() -> None:
    """DTensor runs an op that updates an argument in place (batch norm's running statistics) on a
    redistributed copy when its rule wants that argument in another layout, so the update is lost. Wrap such
    ops to write the updated copy back into the original tensor, in its own layout. Idempotent."""
    dispatcher = DTensor._op_dispatcher
    for op in (torch.ops.aten.native_batch_norm.default, torch.ops.aten._native_batch_norm_legit.default):
        if op in dispatcher._custom_op_handlers:
            continue
        written = [i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        if op is torch.ops.aten.native_batch_norm.default:
            written = [3, 4]  # running_mean, running_var: updated in place although the schema does not say so

        def handler(op_call, args, kwargs, written=written):
            moved = _redistribute_as_required(op_call, args, kwargs)
            out = _without_handler(op_call, moved, kwargs)
            for index in written:
                before, after = args[index], moved[index]
                if after is not before and isinstance(before, DTensor):
                    before.to_local().copy_(after.redistribute(before.device_mesh, before.placements).to_local())
            return out

        dispatcher._custom_op_handlers[op] = handler


def prefer_early_partial_reduction() -> None:
    """Make DTensor's per-op choice price turning a value that is not a partial sum into one (free by itself)
    at 1.5 times the all-reduce that partial sum will need later. Without it, ``partial + replicated`` keeps
    the sum partial (the replicated operand is "converted" for free) and the reduction is paid again by every
    later consumer: a transformer's residual stream stays partial and each layer norm all-reduces it. With it,
    the partial sum is reduced once where it is made, as Megatron-style tensor parallelism does. Only changes
    which layout DTensor picks (never a value); the planner's propagation runs the same rule, so plans still
    list exactly the collectives that run. Idempotent; process-wide."""
    from torch.distributed.tensor._ops import utils as ops_utils

    original = ops_utils.redistribute_cost
    if getattr(original, "_autopar_partial_penalty", False):
        return

    def redistribute_cost(current, target):
        cost = original(current, target)
        if cost == float("inf"):
            return cost
        for axis, (have, want) in enumerate(zip(current.placements, target.placements)):
            if want.is_partial() and not have.is_partial():
                reduced = list(target.placements)
                reduced[axis] = Replicate()
                later = original(target, DTensorSpec(target.mesh, tuple(reduced), target.tensor_meta))
                cost += 1.5 * later if later != float("inf") else 0.0
        return cost

    redistribute_cost._autopar_partial_penalty = True
    ops_utils.redistribute_cost = redistribute_cost


# --- Sharding rules torch_autopar adds to DTensor's registry (strategies/rules/) -------------------------------

def register_sharding_rule(op, single_axis_rule: Callable, *, num_outputs: int, static_argnum: int) -> None:
    """Register ``op`` in DTensor's strategy registry (used by the planner and by DTensor at run time).

    ``single_axis_rule(schema)`` returns the op's valid placements on one mesh axis, each a list of
    [output placements..., tensor input placements (positional, then keyword)...]; DTensor expands them to
    every axis of the mesh. ``static_argnum``: index of the first non-tensor argument that keys DTensor's cache.
    """
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy

    def strategy(op_schema):
        mesh = op_schema.get_mesh_from_args(validate=False)
        return expand_to_full_mesh_op_strategy(mesh, op_schema, single_axis_rule(op_schema), input_index=num_outputs)

    register_op_strategy(op, schema_info=RuntimeSchemaInfo(static_argnum))(strategy)


def register_replicated_fallback(op) -> None:
    """Give ``op`` (which has no sharding rule) DTensor's replicate-everything strategy: inputs are gathered,
    the op runs on whole tensors, outputs are replicated. Correct for any op, and as slow as one device."""
    from torch.distributed.tensor._ops.utils import register_op_strategy, replicate_op_strategy

    if not has_sharding_rule(op) and op not in _REPLICATED_FALLBACKS:
        register_op_strategy(op)(replicate_op_strategy)
        _REPLICATED_FALLBACKS.add(op)


def strategy_shape(strategy) -> tuple[int, ...] | None:
    """The global shape of the tensor an ``OpStrategy`` argument stands for (None for a non-tensor)."""
    OpStrategy, _, _ = strategy_types()
    return tuple(strategy.shape) if isinstance(strategy, OpStrategy) else None


def redistribute_keyword_tensors(op, wanted_placements: Callable) -> None:
    """DTensor moves positional arguments into the layout the chosen strategy wants but never keyword tensors
    ("rare", says its dispatcher), so an op like CPU flash attention got a whole ``attn_mask`` next to a
    batch-sharded query. Install a handler for ``op`` that first moves each keyword DTensor into
    ``wanted_placements(name, tensor, args, args_placements)`` (``args_placements``: the placements the chosen
    strategy wants for each positional argument, None for non-tensors), then runs the op as DTensor would. A
    plain keyword tensor next to DTensor arguments (a mask a stage built from plain ops) is taken as replicated
    where DTensor takes a plain positional one so: under implicit replication, or with one element. Idempotent."""
    dispatcher = DTensor._op_dispatcher
    if op in dispatcher._custom_op_handlers:
        return

    def handler(op_call, args, kwargs):
        mesh = next((a.device_mesh for a in args if isinstance(a, DTensor)), None)
        if mesh is not None:  # as DTensor itself: under implicit replication, or a one-element tensor
            implicit = dispatcher._allow_implicit_replication
            kwargs = {name: DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
                      if isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
                      and (implicit or value.numel() == 1) else value
                      for name, value in kwargs.items()}
        if any(isinstance(value, DTensor) for value in kwargs.values()):
            wanted_args = _wanted_positional_placements(op_call, args, kwargs)
            kwargs = {name: value.redistribute(value.device_mesh, wanted_placements(name, value, args, wanted_args))
                      if isinstance(value, DTensor) else value for name, value in kwargs.items()}
        return _without_handler(op_call, args, kwargs)

    dispatcher._custom_op_handlers[op] = handler


def _wanted_positional_placements(op_call, args: tuple, kwargs: dict) -> list:
    op_info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    DTensor._op_dispatcher.sharding_propagator.propagate(op_info)
    output = op_info.output_sharding
    schema = output.redistribute_schema if output is not None and output.needs_redistribute else None
    specs = schema.args_schema if schema is not None else [getattr(a, "_spec", None) for a in args]
    return [tuple(spec.placements) if isinstance(spec, DTensorSpec) else None for spec in specs]


_CHECKPOINT_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _CheckpointMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` file allowing only the classes DCP writes there (its metadata dataclasses
    and enums, storage infos, ``torch.Size``, dtypes, layouts, paths): anything else is refused, not run."""

    def find_class(self, module: str, name: str):
        import torch.distributed.checkpoint.metadata as metadata

        if module == metadata.__name__ and isinstance(getattr(metadata, name, None), type):
            return getattr(metadata, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _CHECKPOINT_METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")


def safe_checkpoint_reader(path: str):
    """DCP's ``FileSystemReader`` for ``path``, except that its ``.metadata`` file (a pickle, read with plain
    ``pickle.load`` by DCP) is read through an allow-list unpickler, so a tampered checkpoint cannot run code.
    Tensors are read as raw bytes by DCP; non-tensor values ("bytes" items, which DCP loads with
    ``weights_only=False``) must not be saved through DCP at all."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as handle:
                metadata = _CheckpointMetadataUnpickler(handle).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def measured_peak_bytes(module: torch.nn.Module, step: Callable[[], Any]) -> int:
    """Peak bytes allocated on the module's device while ``step()`` runs (parameters, gradients, activations,
    temporaries), from PyTorch's ``MemTracker`` (works on CPU)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(module)
    with tracker:
        step()
    snapshot = tracker.get_tracker_snapshot("peak")
    return max(int(per_device["Total"]) for per_device in snapshot.values())


def recording_ops(record: Callable[[Any, tuple, dict, Any], None]):
    """A context in which every aten op call is passed with its result to ``record(op, args, kwargs, out)``
    (a ``TorchDispatchMode``, the mechanism ``torch.utils.flop_counter.FlopCounterMode`` uses); used to price
    the units of a pipeline on fake tensors."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            record(func, args, kwargs or {}, out)
            return out

    return _Recorder()


def pytree():
    """``torch.utils._pytree`` (flatten nested outputs, (de)serialise their structure); torch 2.13 has no public
    equivalent. Used where a pipeline's outputs cross ranks and where its units are priced."""
    import torch.utils._pytree as _pytree

    return _pytree


def reparametrized(module: torch.nn.Module, tensors: dict):
    """A context in which ``module``'s parameters named in ``tensors`` (relative names) are those tensors: what
    ``torch.func.functional_call`` does around a call, for a forward that runs inside the module's own
    ``forward`` (``torch.nn.utils.stateless._reparametrize_module``; no public form in torch 2.13)."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, tensors, strict=False)


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (activation checkpointing then
    recomputes a forward): ``torch._C._current_graph_task_id()`` is -1 outside one."""
    return torch._C._current_graph_task_id() != -1


def keeping_version(tensor: torch.Tensor):
    """A context in which writing into ``tensor`` leaves its version counter as it was, so autograd still accepts
    the copies it saved (``torch.autograd._unsafe_preserve_version_counter``, as FSDP2 refills a parameter)."""
    return torch.autograd._unsafe_preserve_version_counter(tensor)


def dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` is active (a FLOP counter, a collective counter): torch.compile'd
    functions then run their Python eagerly instead of their compiled graphs."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is not None


@contextlib.contextmanager
def outside_selective_checkpoint():
    """A context in which the ops run are not seen by a selective activation checkpoint's dispatch modes (torch
    2.13 records every op of a checkpointed forward and requires its recompute to replay exactly those: a
    fully-sharded layer's gather, prefetched before the forward but issued in the recompute, would not match).
    Pops the checkpoint's modes (``torch.utils.checkpoint._CachingTorchDispatchMode`` /
    ``_CachedTorchDispatchMode``) from the top of the dispatch-mode stack and pushes them back on exit; modes
    below them (a collective counter) still see the ops."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

    popped = []
    while (stack := _get_current_dispatch_mode_stack()) and isinstance(
            stack[-1], (_CachingTorchDispatchMode, _CachedTorchDispatchMode)):
        popped.append(_pop_mode())
    try:
        yield
    finally:
        for mode in reversed(popped):
            _push_mode(mode)
