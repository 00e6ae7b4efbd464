"""The one adapter between torch_autopar and PyTorch's private APIs.

Everything torch_autopar touches under ``torch._*`` or ``torch.distributed.*._*`` is imported here and only
here, so a PyTorch upgrade breaks this file and not twenty. Each helper is small and documented with the
public behaviour it stands for. This module must never import another torch_autopar module (except errors).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch._functorch._aot_autograd import descriptors as _desc
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors, make_boxed_func
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.utils import flop_counter as _flop_counter

__all__ = [
    "DTensorSpec", "FakeTensor", "FakeTensorMode", "TensorMeta", "make_boxed_func",
    "export_joint", "input_kind", "grad_target", "tangent_output_index", "output_index",
    "propagate_sharding", "node_flops", "queue_backward_callback", "fake_store", "aot_autograd_backend",
    "register_dynamo_backend", "functional_all_reduce_inplace", "functional_wait_tensor", "DynamoUnsupported",
]


def export_joint(module: torch.nn.Module, args: tuple, kwargs: dict | None):
    """Trace ``module(*args, **kwargs)`` and its backward into one aten-level FX graph (dynamo front end).

    Returns the joint ``GraphModule`` whose placeholders/outputs carry ``meta["desc"]`` descriptors
    (parameter, buffer, user input, tangent / forward output, gradient of a parameter).
    """
    with contextlib.ExitStack() as stack:
        joint = aot_export_joint_with_descriptors(stack, module, args, kwargs or {})
        return joint.graph_module, joint.out_spec


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


def grad_target(desc: Any) -> str | None:
    """For a graph output that is the gradient of a parameter or buffer, its fully qualified name."""
    if isinstance(desc, _desc.GradAOTOutput) and isinstance(desc.grad_of, (_desc.ParamAOTInput, _desc.BufferAOTInput)):
        return desc.grad_of.target
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
    return propagator.propagate_op_sharding(OpSchema(op, args_schema, kwargs_schema))


def has_sharding_rule(op) -> bool:
    """Whether DTensor has a registered sharding strategy or rule for this aten overload."""
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


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the autograd engine finishes the current backward pass (as DDP does)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


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


def dynamo_unsupported_errors() -> tuple[type, ...]:
    """Exception types dynamo raises when it cannot capture a forward as one graph."""
    from torch._dynamo import exc
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    return (exc.TorchDynamoException, exc.UserError, DataDependentOutputException, DynamicOutputShapeException)


DynamoUnsupported = dynamo_unsupported_errors


def functional_all_reduce_inplace():
    """The traceable, asynchronous in-place all-reduce op (``_c10d_functional.all_reduce_``) for graph passes;
    pair it with ``functional_wait_tensor``."""
    return torch.ops._c10d_functional.all_reduce_.default


def functional_wait_tensor():
    """The op that waits for a functional collective's result."""
    return torch.ops._c10d_functional.wait_tensor.default


def group_name(group: dist.ProcessGroup) -> str:
    """The registered name of a process group, as functional collectives expect it."""
    return group.group_name


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
    schema = OpSchema(op, args_schema, kwargs_schema, schema_info=propagator.op_to_schema_info.get(op))
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
    func = propagator.op_strategy_funcs.get(op)
    return func(schema) if func is not None else None


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
