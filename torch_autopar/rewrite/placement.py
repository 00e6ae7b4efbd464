"""Place a module, its inputs and its outputs on a device mesh as a sharded Plan says (DTensor).

The per-rank program of a sharded plan is the user's own module whose parameters are DTensors: each op runs
on local shards and DTensor inserts the collectives its per-op rules require (the same rules the planner
propagated, so the collectives that run are the ones the plan lists). The steps, each small and testable:

  distribute_parameters  requires: the module's parameters equal on every rank or not (rank 0's win)
                         ensures:  each parameter is a DTensor with the plan's placements, whose full value is
                                   rank 0's parameter; buffers are replicated DTensors
  gathered_parameters    ensures:  parameters are moved to their compute layout for the forward (fully sharded:
                                   all-gathered; their gradients flow back through the gather: reduce-scattered);
                                   in eager mode per layer, freed after its forward and gathered again for its
                                   backward, unless the plan says otherwise (``Plan.reshard_after_forward``,
                                   ``runtime.fsdp``)
  inputs_to_global       requires: each rank passes its own slice of the global batch (dim 0)
                         ensures:  DTensors in the plan's input layout (collectives only where that differs)
  outputs_to_local       ensures:  each rank gets the rows of the outputs that match its input slice; the
                                   gradient flowing back is averaged over ranks as data parallelism does
  GradientPlacement      ensures:  after backward, each gradient is in its parameter's layout (partial sums
                                   reduced over the axes the batch was split on, shards reduce-scattered)

Must never choose a placement (the Plan does) and never change a parameter's value.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, distribute_tensor

from torch_autopar import _compat
from torch_autopar.errors import AutoparError
from torch_autopar.launch.mesh import job_mesh
from torch_autopar.search.plan import Plan
from torch_autopar.strategies import boundary
from torch_autopar.strategies.placements import parse_placements

pytree = _compat.pytree()  # torch.utils._pytree: no public equivalent in torch 2.13


def mesh_for_plan(plan: Plan) -> DeviceMesh:
    """The device mesh of ``plan`` over this job's ranks (rank-major, axes named as in the plan)."""
    return job_mesh(tuple(plan.mesh_shape), tuple(plan.axis_names))


def batch_arrival(mesh: DeviceMesh) -> tuple:
    """How a batch arrives (``strategies.boundary``)."""
    return boundary.batch_arrival(mesh.ndim)


def replicated(mesh: DeviceMesh) -> tuple:
    return boundary.replicated(mesh.ndim)


def _placements_of(plan: Plan, name: str) -> tuple:
    if name not in plan.param_placements:
        raise AutoparError(f"the plan has no placement for parameter {name!r}; it was made for another model. "
                           "Plan again for this model.")
    return parse_placements(plan.param_placements[name])


def distribute_parameters(module: torch.nn.Module, mesh: DeviceMesh, plan: Plan) -> None:
    """Replace every parameter by a DTensor parameter placed per ``plan`` (values from rank 0) and every
    buffer by a replicated DTensor. Shared (tied) parameters stay shared."""
    _compat.allow_implicit_replication()
    _compat.fix_convolution_redistribution()
    _compat.fix_inplace_redistribution()
    _compat.fix_empty_cat_redistribution()
    _compat.run_replicated_where_propagation_fails()
    _compat.prefer_early_partial_reduction()
    placed: dict[int, torch.nn.Parameter] = {}
    for owner_name, owner in module.named_modules():
        for name, param in list(owner.named_parameters(recurse=False)):
            if id(param) not in placed:
                full_name = f"{owner_name}.{name}" if owner_name else name
                local = distribute_tensor(param.detach(), mesh, _placements_of(plan, full_name))
                placed[id(param)] = torch.nn.Parameter(local, requires_grad=param.requires_grad)
            owner.register_parameter(name, placed[id(param)])
        for name, buffer in list(owner.named_buffers(recurse=False)):
            if buffer is not None and not isinstance(buffer, DTensor):
                persistent = _compat.is_persistent_buffer(owner, name)
                owner.register_buffer(name, distribute_tensor(buffer, mesh, replicated(mesh)), persistent=persistent)


def gathered_parameters(module: torch.nn.Module, plan: Plan) -> dict[str, tuple]:
    """Parameter name → compute placements, for the parameters eager mode moves before the forward
    (``strategies.boundary.compute_layouts``: the plan's own, else gathered over the batch axes)."""
    storage = {name: tuple(p.placements) for name, p in module.named_parameters() if isinstance(p, DTensor)}
    first = plan.input_placements.get(0) or next(iter(plan.input_placements.values()), ())
    planned = {name: parse_placements(p) for name, p in plan.param_compute_placements.items()}
    computed = boundary.compute_layouts(storage, parse_placements(first), planned)
    return {name: wanted for name, wanted in computed.items() if wanted != storage[name]}


def replicate_ops_without_rules(op_names) -> None:
    """Ops the plan replicates for lack of a sharding rule ("aten.foo.default", "mylib.op.default") run that way:
    DTensor gathers their inputs and runs them on whole tensors instead of raising "no sharding strategy"."""
    for name in op_names:
        namespace, op_name, overload = name.split(".")
        op = getattr(getattr(getattr(torch.ops, namespace), op_name), overload)
        _compat.register_replicated_fallback(op)


def batch_size(args, kwargs) -> int | None:
    """How a batch's size is read: dim 0 of the first tensor leaf that has a dim (None without one)."""
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.ndim >= 1:
            return int(leaf.shape[0])
    return None


def global_batch_size(args, kwargs, world_size: int) -> int | None:
    """The global batch: this rank's batch size times the number of ranks (every rank passes an equal slice)."""
    local = batch_size(args, kwargs)
    return None if local is None else local * world_size


def inputs_to_global(args, kwargs, mesh: DeviceMesh, input_placements: dict, full_batch: bool = False):
    """Each tensor leaf (flat index i) as a DTensor: in its arrival layout (``strategies.boundary``: batch-split,
    or replicated when every rank passes the whole batch), then in ``input_placements[i]``."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    placed = []
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor):
            arrival = boundary.arrival(leaf, mesh.ndim, full_batch)
            split = arrival == batch_arrival(mesh) and leaf.ndim >= 1
            shape = (leaf.shape[0] * mesh.size(),) + tuple(leaf.shape[1:]) if split else leaf.shape
            leaf = DTensor.from_local(leaf, mesh, arrival, run_check=False, shape=torch.Size(shape),
                                      stride=_contiguous_stride(shape))
            wanted = input_placements.get(index)
            if wanted is not None:
                leaf = leaf.redistribute(mesh, parse_placements(wanted))
        placed.append(leaf)
    return pytree.tree_unflatten(placed, spec)


def _contiguous_stride(shape) -> tuple:
    stride, running = [], 1
    for size in reversed(tuple(shape)):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


class _AverageOverRanks(torch.autograd.Function):
    """Identity forward; backward divides by the number of batch slices (each rank's loss is a mean over its
    slice, so the global mean's gradient is the average of the ranks' gradients, as in data parallelism)."""

    @staticmethod
    def forward(ctx, local, slices):
        ctx.slices = slices
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.slices, None


def local_batch_outputs(output, mesh: DeviceMesh):
    """The outputs of a call computed on local tensors (``Plan.local_compute``: each is this rank's rows of a
    batch output), each gradient averaged over ranks as ``outputs_to_local`` averages a batch output's."""
    def averaged(leaf):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            return _AverageOverRanks.apply(leaf, mesh.size())
        return leaf

    return pytree.tree_map(averaged, output)


class _LocalOf(torch.autograd.Function):
    """A replicated DTensor → a plain tensor on the same storage; backward: the gradient as a partial sum over
    every axis (each rank computed on its slice of the batch), as DTensor's backward leaves a parameter's."""

    @staticmethod
    def forward(ctx, whole):
        ctx.whole = (whole.device_mesh, whole.shape, whole.stride(), len(whole.placements))
        held = whole.to_local()
        alias = held.new_empty(0)
        return alias.set_(held.untyped_storage(), held.storage_offset(), held.shape, held.stride())

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor):  # the tensor met a DTensor (implicit replication): DTensor placed its gradient
            return grad
        mesh, shape, stride, axes = ctx.whole
        return DTensor.from_local(grad, mesh, tuple(Partial() for _ in range(axes)), run_check=False, shape=shape,
                                  stride=stride)


def local_view(value):
    """A replicated DTensor (a parameter or buffer computed whole) as the plain tensor it holds, its gradient a
    partial sum over every axis; anything else as it is. The tensor aliases the DTensor's storage without being
    a view of it, so the views autograd saves of it keep it alive: a fully-sharded group whose buffer is freed
    after forward sees it still needed (``runtime.flat.Gathered.track``) and refills it before backward."""
    if not isinstance(value, DTensor):
        return value
    return _LocalOf.apply(value)


def leaving(value, mesh: DeviceMesh, global_batch: int | None, full_batch: bool = False) -> tuple:
    """How an output leaves the model (``strategies.boundary``)."""
    return boundary.leaving(value, mesh.ndim, global_batch, full_batch)


@contextlib.contextmanager
def global_parameters(module: torch.nn.Module):
    """Inside, every DTensor parameter and buffer of ``module`` is an uninitialised plain tensor of its global
    shape (what capturing the model's graph needs); the DTensors are back on exit. Tied tensors stay tied."""
    swapped, stand_in = [], {}
    for owner in module.modules():
        for kind, tensors in (("parameter", owner._parameters), ("buffer", owner._buffers)):
            for name, tensor in list(tensors.items()):
                if isinstance(tensor, DTensor):
                    if id(tensor) not in stand_in:
                        plain = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device_mesh.device_type)
                        stand_in[id(tensor)] = torch.nn.Parameter(plain, tensor.requires_grad) if kind == "parameter" else plain
                    swapped.append((tensors, name, tensor))
                    tensors[name] = stand_in[id(tensor)]
    try:
        yield
    finally:
        for tensors, name, tensor in swapped:
            tensors[name] = tensor


def outputs_to_local(output, mesh: DeviceMesh, global_batch: int | None, full_batch: bool = False):
    """Each DTensor output as this rank's plain tensor: outputs with the batch as dim 0 give the rows matching
    this rank's input slice (their gradient averaged over ranks); other outputs (a loss computed inside the
    model), and every output when each rank passed the whole batch, are replicated: the same on every rank."""

    def to_local(leaf):
        if not isinstance(leaf, DTensor):
            return leaf
        layout = leaving(leaf, mesh, global_batch, full_batch)
        local = leaf.redistribute(mesh, layout).to_local(grad_placements=layout)
        if layout == batch_arrival(mesh) and local.requires_grad:
            return _AverageOverRanks.apply(local, mesh.size())
        return local

    return pytree.tree_map(to_local, output)


class GradientPlacement:
    """After each parameter's gradient is accumulated, move it into the parameter's own layout.

    DTensor's backward leaves the gradient of a parameter replicated over the batch axes as a partial sum; the
    optimizer needs it in the parameter's layout (all-reduce to replicate, reduce-scatter to shard)."""

    def __init__(self, module: torch.nn.Module):
        self.handles = []
        seen = set()
        for param in module.parameters():
            if isinstance(param, DTensor) and param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                self.handles.append(param.register_post_accumulate_grad_hook(self._place))

    @staticmethod
    def _place(param) -> None:
        grad = param.grad
        if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
            param.grad = grad.redistribute(param.device_mesh, param.placements)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def full_state_dict(state: dict) -> dict:
    """Full tensors for every DTensor value (a collective per sharded tensor: every rank must call it)."""
    return {key: value.full_tensor().detach() if isinstance(value, DTensor) else value for key, value in state.items()}


def load_full_state_dict(module: torch.nn.Module, state: dict, strict: bool = True):
    """Copy full tensors into the module's (possibly sharded) parameters and buffers: each rank keeps its shard
    of rank 0's values."""
    own = module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if strict and (missing or unexpected):
        raise AutoparError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}; expected the "
                           "state_dict of the same model (pmodel.state_dict() or the plain model's).")
    with torch.no_grad():
        for key, target in own.items():
            if key not in state:
                continue
            value = torch.as_tensor(state[key])
            if tuple(value.shape) != tuple(target.shape):
                raise AutoparError(f"load_state_dict: {key!r} has shape {tuple(value.shape)}, the model expects "
                                   f"{tuple(target.shape)} (the full, unsharded shape).")
            if isinstance(target, DTensor):
                shard = distribute_tensor(value.to(target.dtype), target.device_mesh, target.placements)
                target.to_local().copy_(shard.to_local())
            else:
                target.copy_(value)
    return _compat.incompatible_keys(missing, unexpected)
