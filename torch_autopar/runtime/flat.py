"""One all_gather and one reduce_scatter per fully-sharded group, on flat buffers (FSDP2's all-gather and
reduce-scatter of a group), in eager mode.

A group's gathered parameters that ``strategies.boundary.flat_gather_axis`` admits (Shard(0) -> Replicate on one
mesh axis) form one ``FlatGroup`` per axis and dtype they are gathered in (one, in practice):
  gather   ``start_gather`` concatenates this rank's dim-0 shards, each cast to the gathered dtype (mixed
           precision: ``param_dtype``) and padded to ``boundary.padded_shard_numel`` (DTensor's padding of uneven
           shards), and issues ONE asynchronous all_gather; ``copy_out`` waits for it and copies it into one
           unsharded buffer where each whole parameter is a contiguous prefix of its padded rows (FSDP2's
           copy-out), so the parameters compute as views of the buffer (replicated DTensors). The buffer's
           owner may free its storage and refill it in place from another gather (``runtime.fsdp``).
  reduce   ``_GatherGroup`` is the autograd function from the shards to the whole parameters. A hook on each
           whole parameter (``FlatGroup.collect``) copies its gradient, once complete (a partial sum over the
           axis, as DTensor leaves a parameter's gradient from a batch-split forward), into the group's flat
           buffer, cast to ``reduce_dtype`` and padded, rank by rank, and lets it go at once (a placeholder of no
           bytes goes on). Autograd runs the function's backward once every gradient is complete: ONE
           reduce_scatter (sum) of the flat buffer; each rank's piece holds its shard of every gradient, cast to
           the master's dtype and handed to autograd in the parameter's own layout: what DTensor's backward of
           the gather (and ``precision._ToCompute``'s) gives, so the optimizer and checkpoints see the same
           ``.grad``.
``GroupGather`` is one group: its flat groups plus the parameters DTensor moves one by one (other layouts; under a
policy, the casts of the parameters not gathered: ``precision.compute_parameters``). A gradient that is not a
partial sum over the axis is moved by DTensor on its own. Must never change a value (padding is sent and
dropped), keep a gathered buffer beyond the tensors that view it, or act in graph mode (the runner's program and
its compiled path gather with DTensor).
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torch_autopar import _compat
from torch_autopar.runtime.precision import MixedPrecision, compute_parameters
from torch_autopar.strategies.boundary import flat_gather_axis, flat_reduced, padded_shard_numel


class FlatGroup:
    """Parameters gathered together on one mesh axis in one dtype: sizes and offsets in the flat buffers."""

    def __init__(self, params: dict, computed: dict, axis: int, dtype: torch.dtype, reduce_dtype: torch.dtype | None):
        self.names, self.params, self.computed = list(params), params, computed
        first = next(iter(params.values()))
        self.mesh, self.dtype, self.reduce_dtype = first.device_mesh, dtype, reduce_dtype
        self.ranks, self.axis, self.group = self.mesh.size(axis), axis, self.mesh.get_group(axis)
        self.rank = self.mesh.get_local_rank(axis)
        with torch.no_grad():
            self.local_shapes = {name: tuple(p.to_local().shape) for name, p in params.items()}
        self.shapes = {name: (p.shape[0], *self.local_shapes[name][1:]) for name, p in params.items()}
        """Each parameter as gathered: all its rows, its other dims as held (split by other axes or not)."""
        self.sizes = [padded_shard_numel(self.shapes[name], self.ranks) for name in self.names]
        self.offsets = [self.ranks * sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.numel = self.ranks * sum(self.sizes)
        """Of the unsharded buffer (and of the all-gather's output)."""

    def start_gather(self) -> tuple:
        """Issue the all_gather of this rank's padded shards, sent from this rank's slot of the result (in place,
        as FSDP2: no separate input buffer): (its work, its result), for ``copy_out``."""
        with torch.no_grad():
            gathered = self.empty_buffer()
            sent = gathered.view(self.ranks, -1)[self.rank]
            for name, size, start in zip(self.names, self.sizes, _starts(self.sizes)):
                local = self.params[name].to_local().reshape(-1)
                sent[start:start + local.numel()].copy_(local)
                sent[start + local.numel():start + size].zero_()
            return dist.all_gather_single(gathered, sent, group=self.group, async_op=True), gathered

    def empty_buffer(self) -> torch.Tensor:
        first = next(iter(self.params.values()))
        return torch.empty(self.numel, dtype=self.dtype, device=first.device)

    @staticmethod
    def settled(started: tuple) -> tuple:
        """``started`` once its all_gather is done, without the collective's work (its buffers go now)."""
        if started[0] is not None:
            started[0].wait()
        return None, started[1]

    def copy_out(self, started: tuple, buffer: torch.Tensor) -> None:
        """Wait for the all_gather ``started`` and copy each rank's shards into ``buffer``, parameter by
        parameter."""
        gathered = self.settled(started)[1]
        out = [buffer[o:o + self.ranks * s].view(self.ranks, s) for o, s in zip(self.offsets, self.sizes)]
        with torch.no_grad():
            torch.split_with_sizes_copy(gathered.view(self.ranks, -1), self.sizes, dim=1, out=out)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """The whole parameters as views of ``buffer``."""
        return [buffer[o:o + _numel(self.shapes[n])].view(self.shapes[n]) for n, o in zip(self.names, self.offsets)]

    def wholes(self, buffer: torch.Tensor) -> list[DTensor]:
        """The whole parameters, views of ``buffer``, as DTensors in their compute layouts."""
        return [DTensor.from_local(view, self.mesh, self.computed[name], run_check=False,
                                   shape=self.params[name].shape, stride=self.params[name].stride())
                for name, view in zip(self.names, self.views(buffer))]

    def collect(self, gathered: "Gathered", index: int, grad):
        """Tensor hook on whole parameter ``index``: its complete gradient, a partial sum over the axis, is copied
        into the flat buffer the group reduce-scatters (made at the group's first) and replaced by a placeholder
        of no bytes, so that each whole gradient is freed as soon as it is made, not once the group's are all
        complete (FSDP2 keeps them until its copy-in); any other gradient goes on to ``reduce`` as it is."""
        if grad is None or not self._flat_partial(index, grad):
            return grad
        if gathered.send is None:
            gathered.send = self._empty_send(grad.dtype)
        _copy_padded(self._column(gathered.send, index), grad.to_local())
        gathered.collected.add(index)
        nothing = torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.to_local().shape)
        return DTensor.from_local(nothing, grad.device_mesh, grad.placements, run_check=False, shape=grad.shape,
                                  stride=grad.stride())

    def reduce(self, gathered: "Gathered", grads: tuple, needed: tuple) -> list:
        """Each parameter's gradient shard in its own layout (None where none is needed or none came): ONE
        reduce_scatter of the flat buffer (the gradients ``collect`` took, the other partial sums of ``grads``,
        zeros for the rest: every rank sends the same sizes), none where no gradient is a partial sum; a
        gradient of another layout moved by DTensor."""
        send, collected = gathered.send, gathered.collected
        gathered.send, gathered.collected = None, set()
        send = send if send is not None else self._empty_send(self.dtype)
        shards: list = [None] * len(self.names)
        reduced_ones = set(collected)
        for i, (grad, need) in enumerate(zip(grads, needed)):
            if i in collected:
                continue
            if need and grad is not None and not self._flat_partial(i, grad):
                shards[i] = self._moved(grad, self.params[self.names[i]])
            elif need and grad is not None:
                reduced_ones.add(i)
            _copy_padded(self._column(send, i), grad.to_local() if i in reduced_ones else None)
        if not reduced_ones:  # every gradient moved on its own (a replicated one keeps its rows): nothing to reduce
            return shards
        reduced = send.new_empty(send.shape[1])
        work = dist.reduce_scatter_single(reduced, send.view(-1), group=self.group, async_op=True)
        work.wait()
        for i in sorted(reduced_ones):
            if not needed[i]:
                continue
            param, shape = self.params[self.names[i]], self.local_shapes[self.names[i]]
            start = self.offsets[i] // self.ranks
            shard = reduced[start:start + _numel(shape)].view(shape).to(param.dtype)
            shards[i] = DTensor.from_local(shard, self.mesh, param.placements, run_check=False, shape=param.shape,
                                           stride=param.stride())
        return shards

    def _empty_send(self, grad_dtype: torch.dtype) -> torch.Tensor:
        first = next(iter(self.params.values()))
        return torch.empty(self.ranks, self.numel // self.ranks, dtype=self.reduce_dtype or grad_dtype,
                           device=first.device)

    def _column(self, send: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s padded shards in the flat buffer ``send`` (ranks x all shards)."""
        start = self.offsets[index] // self.ranks
        return send[:, start:start + self.sizes[index]]

    def _flat_partial(self, index: int, grad: DTensor) -> bool:
        """Whether ``grad`` joins the reduce-scatter (``boundary.flat_reduced``: a partial sum over the axis)."""
        return isinstance(grad, DTensor) and flat_reduced(tuple(grad.placements),
                                                          tuple(self.params[self.names[index]].placements), self.axis)

    def _moved(self, grad: DTensor, param: DTensor) -> DTensor:
        """A gradient the flat reduce-scatter cannot carry, moved by DTensor into its parameter's layout."""
        with torch.no_grad():
            moved = grad.to(self.reduce_dtype or grad.dtype).redistribute(grad.device_mesh, param.placements)
        return moved.to(param.dtype)


def _numel(shape) -> int:
    return int(torch.Size(shape).numel())


def _starts(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def _copy_padded(column: torch.Tensor, whole: torch.Tensor | None) -> None:
    """Write ``whole`` (its rows, dim 0) into ``column`` (ranks x padded shard, a column block of the flat
    buffer) as the ranks' padded shards, zeros in the padding, without a contiguous copy of ``whole`` (a weight's
    gradient is often a transposed view)."""
    ranks = column.shape[0]
    if whole is None:
        column.zero_()
        return
    rows = whole.reshape(whole.shape[0], -1) if whole.dim() != 1 else whole.unsqueeze(1)
    per_rank = column.shape[1] // rows.shape[1]
    laid = column.view(ranks, per_rank, rows.shape[1])
    full, rest = divmod(rows.shape[0], per_rank)
    laid[:full].copy_(rows[:full * per_rank].view(full, per_rank, -1))
    if full < ranks:
        laid[full:].zero_()
        laid[full, :rest].copy_(rows[full * per_rank:])


class _Moved:
    """A gathered parameter that DTensor moves on its own (a layout no flat all-gather carries), as a source of
    ``Gathered``: its gather is DTensor's (cast under a policy), run again to refill."""

    def __init__(self, param: DTensor, placements: tuple, policy: MixedPrecision | None):
        self.param, self.placements, self.policy = param, placements, policy

    def start_gather(self) -> torch.Tensor:
        with torch.no_grad():
            return compute_parameters({"p": self.param}, {"p": self.placements}, self.policy)["p"].to_local()

    @staticmethod
    def settled(started: torch.Tensor) -> torch.Tensor:
        """Nothing to wait for: DTensor's gather has run."""
        return started

    @staticmethod
    def copy_out(gathered: torch.Tensor, buffer: torch.Tensor) -> None:
        buffer.copy_(gathered)


class Gathered:
    """The whole parameters of a flat group (or one moved by DTensor) for one forward: the buffer they view,
    which its owner may free (``free``: storage resized to 0, the tensors autograd saved keep no bytes) and
    refill in place from a new gather (``refill``, issued early by ``prefetch``)."""

    def __init__(self, source, buffer: torch.Tensor, wholes):
        self.source, self.buffer, self.nbytes = source, buffer, buffer.untyped_storage().nbytes()
        with torch.no_grad():
            self.views = [weakref.ref(whole.to_local()) for whole in wholes]
        """Weak references to the whole parameters' local tensors (alive: something autograd saved reads them)."""
        self.after_reduce = None
        """Called once the gradients are complete (flat: reduce-scattered); the owner frees the buffer."""
        self.pending: torch.Tensor | None = None
        self.send: torch.Tensor | None = None
        """The flat buffer this backward's gradients are collected in (``FlatGroup.collect``)."""
        self.collected: set[int] = set()

    def track(self, whole: DTensor, local: torch.Tensor) -> None:
        """``local``, the plain tensor a local computation reads for ``whole`` (``Plan.local_compute``), keeps
        the buffer needed as ``whole``'s own local tensor does."""
        if any(view() is whole._local_tensor for view in self.views):
            self.views.append(weakref.ref(local))

    def reduced(self, *unused) -> None:
        if self.after_reduce is not None:
            self.after_reduce()

    def free(self, *unused) -> None:
        self.buffer.untyped_storage().resize_(0)

    def needed(self) -> bool:
        """Whether backward will read the buffer (a checkpointed layer keeps only its inputs: nothing)."""
        return any(view() is not None for view in self.views)

    def prefetch(self) -> None:
        """Issue the refill's all_gather now (once; only where ``refill`` will gather)."""
        if self.pending is None and self.needed() and self.buffer.untyped_storage().nbytes() == 0:
            self.pending = self.source.start_gather()

    def settle(self) -> None:
        """Wait for a prefetched refill's gather, keeping its result only."""
        if self.pending is not None:
            self.pending = self.source.settled(self.pending)

    def drop_prefetch(self) -> None:
        """Wait for a prefetched refill that no backward took (every rank issued it), and drop it."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self.source.settled(pending)

    def refill(self) -> None:
        if not self.needed() or self.buffer.untyped_storage().nbytes() != 0:
            self.drop_prefetch()
            return
        pending, self.pending = self.pending, None
        with torch.no_grad(), _compat.keeping_version(self.buffer):
            self.buffer.untyped_storage().resize_(self.nbytes)
            self.source.copy_out(pending if pending is not None else self.source.start_gather(), self.buffer)


class _GatherGroup(torch.autograd.Function):
    """Shards → whole parameters (views of ``buffer``); backward, once every whole gradient is complete (most
    already copied into the flat buffer by ``FlatGroup.collect``): ``gathered.reduced`` (its owner frees the
    buffer), then one reduce-scatter."""

    @staticmethod
    def forward(ctx, flat: FlatGroup, buffer: torch.Tensor, gathered: list, *params):
        ctx.set_materialize_grads(False)
        ctx.flat, ctx.gathered = flat, gathered
        return tuple(flat.wholes(buffer))

    @staticmethod
    def backward(ctx, *grads):
        gathered = ctx.gathered[0]
        gathered.reduced()  # the whole parameters are read no more: freed before the reduce-scatter
        return (None, None, None, *ctx.flat.reduce(gathered, grads, ctx.needs_input_grad[3:]))


class GroupGather:
    """One group's parameters as its forward computes with them: flat groups gathered by one all_gather each,
    the others moved (and cast) by DTensor (``precision.compute_parameters``)."""

    def __init__(self, params: dict, placements: dict, policy: MixedPrecision | None):
        """``params``: name → DTensor parameter, every parameter of the group; ``placements``: name → compute
        placements of those gathered before the forward."""
        self.params, self.placements, self.policy = params, placements, policy
        by_key: dict[tuple, list[str]] = {}
        for name, wanted in placements.items():
            param = params[name]
            axis = flat_gather_axis(tuple(param.placements), tuple(wanted))
            if axis is not None and param.is_floating_point():
                dtype = policy.param_dtype if policy is not None else param.dtype
                by_key.setdefault((axis, dtype), []).append(name)
        reduce_dtype = policy.reduce_dtype if policy is not None else None
        self.flats = [FlatGroup({n: params[n] for n in names}, {n: placements[n] for n in names}, axis, dtype,
                                reduce_dtype) for (axis, dtype), names in by_key.items()]
        flat = {name for names in by_key.values() for name in names}
        self.others = {name: p for name, p in params.items() if name not in flat}
        self.others_placements = {name: p for name, p in placements.items() if name not in flat}

    def start(self) -> list[tuple]:
        """Issue the all_gather of each flat group (``compute`` takes them, or ``drop``)."""
        return [flat.start_gather() for flat in self.flats]

    def drop(self, started: list[tuple]) -> None:
        """Wait for gathers ``start`` issued that no forward took (every rank issued them), and drop them."""
        for flat, pending in zip(self.flats, started):
            flat.settled(pending)

    def compute(self, started: list | None = None) -> tuple[dict, list[Gathered]]:
        """(name → tensor the forward computes with, a ``Gathered`` per flat group and per parameter DTensor
        gathers). ``started``: this group's all_gathers already issued (a prefetch; taken), else issued now."""
        started = started if started is not None else self.start()
        computed = compute_parameters(self.others, self.others_placements, self.policy)
        gathered = []
        for name, wanted in self.others_placements.items():
            whole = computed[name]
            with torch.no_grad():
                one = Gathered(_Moved(self.params[name], wanted, self.policy), whole.to_local(), [whole])
            if whole.requires_grad:
                whole.register_hook(one.reduced)
            gathered.append(one)
        for flat in self.flats:
            buffer, box = flat.empty_buffer(), []
            flat.copy_out(started.pop(0), buffer)
            wholes = _GatherGroup.apply(flat, buffer, box, *(self.params[n] for n in flat.names))
            box.append(Gathered(flat, buffer, wholes))
            for index, whole in enumerate(wholes):
                if whole.requires_grad:
                    whole.register_hook(functools.partial(flat.collect, box[0], index))
            computed.update(zip(flat.names, wholes))
            gathered += box
        return computed, gathered
