"""Fully-sharded groups in eager mode, as FSDP2 runs them: one all_gather and one reduce_scatter per group, the
next group's gather prefetched, and (FSDP2's ``reshard_after_forward=True``) each group freed after its forward.

A fully-sharded plan stores each parameter as a shard and gathers it where the batch slices use it. The groups
are FSDP2's units: each layer of an ``nn.ModuleList`` (``capture.layers.reshard_groups``, what FSDP2 users wrap
one by one) and the root (every other parameter: embeddings, final norm, head). Each group's gathered parameters
move as flat buffers (``runtime.flat``): ONE all_gather of every local shard, whose copy-out holds each whole
parameter (cast under a mixed-precision policy), and in backward, once every gradient of the group is complete,
ONE reduce_scatter that leaves each gradient's shard in its parameter's layout, as DTensor's backward would.

  root       gathered by the runner once per call and kept for the step (backward needs it at once, as FSDP2's
             root); with ``reshard_after_forward=False`` every group's all_gather is issued there too, in order,
             and so are those of the groups ``Plan.kept_gathered`` names (``reshard_after_forward="auto"``): each
             such group takes its gather in its own forward and keeps it until its reduce_scatter.
  forward    a group's module runs through a wrapper of its ``forward`` that gathers the group (or takes the
             gather prefetched for it), issues the next group's all_gather (asynchronous: it overlaps this
             group's compute; "next" is the order the groups ran in the previous call, at first the order they
             were registered in), and runs the original ``forward`` on the whole parameters
             (``_compat.reparametrized``, what ``functional_call`` does). Then the unsharded buffer's storage is
             freed (``untyped_storage().resize_(0)``): autograd still holds the tensors it saved (views of it),
             but they hold no bytes. Gathers prefetched and not taken are waited for and dropped as the call
             ends.
  backward   the group's outputs pass through ``_RegatherBeforeBackward`` (identity): the first gradient to reach
             it refills the buffer in place from one all_gather (as FSDP2 refills its unsharded parameters)
             before any backward op of the group reads it, and issues the refill of the group that ran before it
             (the next in backward), waited for at once: in flight, gloo's all_gather holds a whole flat copy of
             its output, a third group at backward's peak (measured), so backward prefetches as FSDP2 does on
             CPU, without overlap. Each whole gradient is copied into the group's flat buffer as it is made and
             freed (``flat.FlatGroup.collect``); once all are, the buffer of parameters is freed again and the
             group's reduce-scatter runs.
  recompute  the wrapper sits inside an activation checkpoint (``runtime.recompute.wrap_inside_checkpoint``): the
             recompute in backward gathers again and keeps those tensors for that layer's backward only (its
             forward kept nothing, so nothing is refilled). Gathers run outside a selective checkpoint's record
             of ops (``_compat.outside_selective_checkpoint``): prefetched for the forward, issued in the
             recompute, they are not the same ops, and the recompute must replay the forward's.

A group is freed only when one of its outputs carries a gradient (else nothing could refill it).
Must never change what a group computes, keep a gathered group past its forward and its backward (a prefetch
holds one more, gathered ahead), or act outside an eager call of the runner (graph mode captures and runs its
own program, gathering with DTensor: the wrapper passes through).
"""

from __future__ import annotations

import contextlib

import torch

from torch_autopar import _compat
from torch_autopar.capture.layers import reshard_groups
from torch_autopar.errors import AutoparError
from torch_autopar.rewrite.placement import local_view
from torch_autopar.runtime.flat import GroupGather
from torch_autopar.runtime.precision import MixedPrecision
from torch_autopar.runtime.recompute import wrap_inside_checkpoint

pytree = _compat.pytree()  # torch.utils._pytree: no public equivalent in torch 2.13


def grouped_names(module: torch.nn.Module) -> dict[str, list[str]]:
    """``reshard_groups`` of ``module``'s parameters, less any parameter also registered under a name of another
    group or of the root (a tied weight is gathered with the root)."""
    every = list(module.named_parameters(remove_duplicate=False))
    group_of = {name: group for group, names in reshard_groups(n for n, _ in every).items() for name in names}
    groups_of_param: dict[int, set] = {}
    for name, param in every:
        groups_of_param.setdefault(id(param), set()).add(group_of.get(name, ""))
    params = dict(module.named_parameters())
    return {group: kept for group, names in reshard_groups(params).items()
            if (kept := [n for n in names if len(groups_of_param[id(params[n])]) == 1])}


class _RegatherBeforeBackward(torch.autograd.Function):
    """Identity on a group's outputs; its backward refills the group's buffers (every backward through it: a
    second one, ``retain_graph=True``, finds them freed again after the group's reduce-scatter) and prefetches
    the refill of the group that ran before it."""

    @staticmethod
    def forward(ctx, gathered, previous, *outputs):
        ctx.gathered, ctx.previous = gathered, previous
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        for one in ctx.gathered:
            one.refill()
        for one in ctx.previous:  # issued now, waited at once: in flight, gloo's all_gather holds a whole flat
            one.prefetch()          # copy of its output, a third group at backward's peak (measured)
            one.settle()
        if ctx.previous:  # a refill prefetched and never taken (that group got no gradient) is waited for
            _compat.queue_backward_callback(lambda previous=ctx.previous: [one.drop_prefetch() for one in previous])
        return (None, None, *grads)


class FullyShardedGroups:
    """The groups of a fully-sharded module: the root (and the groups ``Plan.kept_gathered``) gathered for the
    runner's call, the others around their own forward and backward (or, not resharding, for the call too), each
    by one flat all_gather."""

    def __init__(self, module: torch.nn.Module, gathered: dict, policy: MixedPrecision | None, reshard: bool,
                 kept: tuple[str, ...] = ()):
        self.enabled = False
        """Set by the runner for its eager calls only."""
        self.local_compute = False
        """Set by the runner for a plan that computes on local tensors (``Plan.local_compute``): each group's
        parameters go into its forward as the plain tensors they hold."""
        self.policy = policy
        self.params = dict(module.named_parameters())
        self.names = grouped_names(module)
        self.grouped = frozenset(name for names in self.names.values() for name in names)
        """The parameters of the groups other than the root."""
        self.members = {**self.names, "": [name for name in self.params if name not in self.grouped]}
        """Group → its parameters; "" the root."""
        self.gathers: dict[str, GroupGather] = {}
        self.gather(gathered, reshard, kept)
        self._order = list(self.names)
        """The order the groups ran in during the last call (prefetch: the group after the current one)."""
        self._seen: list[str] = []
        self._prefetched: dict[str, list] = {}
        self._kept_computed: dict[str, tuple] = {}
        """Kept group → (the tensors its forward computes with, their ``Gathered``), for this call (``_kept``)."""
        self._previous: tuple = ()
        for group in self.names:
            layer = module.get_submodule(group)
            wrap_inside_checkpoint(layer, lambda forward, l=layer, g=group: self._wrap(forward, l, g))

    def gather(self, gathered: dict, reshard: bool, kept: tuple[str, ...] = ()) -> None:
        """Gather, from the next call on, the parameters of ``gathered`` (name → compute placements); each group
        around its own forward and backward when ``reshard``, but the groups ``kept`` (``Plan.kept_gathered``)
        with the root, for the whole call."""
        unknown = sorted(set(kept) - set(self.names))
        if unknown:
            raise AutoparError(f"the plan keeps the groups {unknown} gathered (Plan.kept_gathered), but this model's "
                               f"fully-sharded groups are {list(self.names)}; expected names among them: plan again "
                               "for this model, or edit kept_gathered.")
        self.reshard, self.kept = reshard, frozenset(kept)
        self.gathers = {group: GroupGather({n: self.params[n] for n in names},
                                           {n: gathered[n] for n in names if n in gathered}, self.policy)
                        for group, names in self.members.items()}

    @contextlib.contextmanager
    def call(self):
        """One call of the runner: the groups' order is recorded; prefetches not taken are dropped at its end."""
        self._seen, self._previous = [], ()
        try:
            yield
        finally:
            if self._seen:
                self._order = self._seen
            prefetched, self._prefetched = self._prefetched, {}
            self._kept_computed = {}
            for group, started in prefetched.items():
                self.gathers[group].drop(started)

    def whole_parameters(self) -> dict:
        """Name → tensor, for the runner's call: the root's parameters (cast, gathered by one all_gather per
        flat group; plain local tensors under ``local_compute``). The all_gathers of every group when groups do
        not reshard, else of the kept groups (``Plan.kept_gathered``), are issued here too, in the groups' order
        on every rank (each is a collective), but not returned: each such group's forward takes
        the result (``_kept``), so that the nodes autograd runs its gradients through (the gather's,
        ``local_view``'s) are made with the group's forward. Made here, before every layer's forward, they would
        be the oldest nodes of the graph, which autograd's ready queue (latest node first) runs only once nothing
        else is ready: at the end of backward, every kept group's whole gradients held until then instead of
        copied into its flat buffer and freed as each is made."""
        computed, self._kept_computed = {}, {}
        for group in (g for g in self.gathers if not self.reshard or g == "" or g in self.kept):
            if group:  # gathered now, in order on every rank, each waited for (in flight, gloo holds a copy of
                gather = self.gathers[group]  # its output); copied out, autograd's node made, by its forward
                self._prefetched[group] = [flat.settled(one) for flat, one in zip(gather.flats, gather.start())]
                continue
            wholes, gathered = self.gathers[group].compute()
            computed.update(_local(wholes, gathered) if self.local_compute else wholes)
        return computed

    def _wrap(self, forward, layer: torch.nn.Module, group: str):
        """``forward`` of ``layer`` run on its group's gathered parameters."""
        prefix = f"{group}."

        def run(*args, **kwargs):
            if self.enabled and (not self.reshard or group in self.kept):
                return self._kept(forward, layer, group, args, kwargs)
            if not self.enabled:
                return forward(*args, **kwargs)
            recompute = _compat.in_backward()
            with _compat.outside_selective_checkpoint():  # gathered in the forward or prefetched: not replayed
                computed, gathered = self.gathers[group].compute(None if recompute else
                                                                 self._prefetched.pop(group, None))
                if not recompute:
                    self._seen.append(group)
                    self._prefetch_after(group)
            if self.local_compute:
                computed = _local(computed, gathered)
            with _compat.reparametrized(layer, {n[len(prefix):]: t for n, t in computed.items()}):
                output = forward(*args, **kwargs)
            if recompute or not torch.is_grad_enabled():  # a recompute: kept for this backward only
                return output
            return self._reshard(output, gathered)

        return run

    def _kept(self, forward, layer: torch.nn.Module, group: str, args: tuple, kwargs: dict):
        """``forward`` of a group kept gathered for the call, on the whole parameters of the gather
        ``whole_parameters`` issued for it (taken at its first forward, kept for the call's later ones); not
        freed after forward, but once its reduce-scatter has run (as FSDP2 reshards after backward; refilled by a
        second backward, as a resharded group is). Outside a call's forward (a recompute in backward), ``forward``
        as it is."""
        prefix = f"{group}."
        if group not in self._kept_computed:
            started = self._prefetched.pop(group, None)
            if started is None:
                return forward(*args, **kwargs)
            with _compat.outside_selective_checkpoint():
                computed, gathered = self.gathers[group].compute(started)
            self._kept_computed[group] = (_local(computed, gathered) if self.local_compute else computed, gathered)
        computed, gathered = self._kept_computed[group]
        with _compat.reparametrized(layer, {n[len(prefix):]: t for n, t in computed.items()}):
            output = forward(*args, **kwargs)
        if not torch.is_grad_enabled():
            return output
        return self._reshard(output, gathered, now=False)

    def _prefetch_after(self, group: str) -> None:
        """Issue the all_gather of the group that ran after ``group`` in the last call."""
        order = [one for one in self._order if one not in self.kept]  # kept groups are gathered for the call
        index = order.index(group) + 1 if group in order else len(order)
        upcoming = order[index] if index < len(order) else None
        if upcoming is not None and upcoming not in self._prefetched:
            self._prefetched[upcoming] = self.gathers[upcoming].start()

    def _reshard(self, output, gathered: list, now: bool = True):
        """``output`` routed through the refill of ``gathered``, whose storage is freed now (unless not ``now``: a
        kept group) and once the group's reduce-scatter has run; ``output`` as it is when no gradient can come back
        through it."""
        leaves, spec = pytree.tree_flatten(output)
        carrying = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        if not carrying or not gathered:
            return output
        for one in gathered:
            one.after_reduce = one.free
            if now:
                one.free()
        routed = _RegatherBeforeBackward.apply(tuple(gathered), self._previous, *(leaves[i] for i in carrying))
        self._previous = tuple(gathered)
        for i, leaf in zip(carrying, routed):
            leaves[i] = leaf
        return pytree.tree_unflatten(leaves, spec)


def _local(wholes: dict, gathered: list) -> dict:
    """Name → the plain tensor each whole parameter holds (``Plan.local_compute``), tracked by the buffer it
    views so that backward refills that buffer as it would for the whole parameter."""
    locals_ = {}
    for name, whole in wholes.items():
        locals_[name] = local_view(whole)
        if isinstance(whole, torch.distributed.tensor.DTensor):
            for one in gathered:
                one.track(whole, locals_[name])
    return locals_
