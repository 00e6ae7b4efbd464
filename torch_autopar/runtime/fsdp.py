"""Fully-sharded groups that reshard after forward (FSDP2's ``reshard_after_forward=True``), in eager mode.

A fully-sharded plan stores each parameter as a shard and gathers it where the batch slices use it. Gathered
for the whole module at once, every parameter stays whole until backward (autograd keeps what it saved): peak
memory as large as data parallelism's. Here each group of parameters (``capture.layers.reshard_groups``: each
layer of an ``nn.ModuleList``, the granularity FSDP2 users wrap) is gathered just before the group runs and
freed after it, and gathered again for its backward:

  forward    the group's module runs through a wrapper of its ``forward`` that gathers (and casts, under a
             mixed-precision policy) the group's parameters with ``runtime.precision.compute_parameters`` and runs
             the original ``forward`` on them (``_compat.reparametrized``, what ``functional_call`` does). Then
             each gathered tensor's storage is freed (``untyped_storage().resize_(0)``): autograd still holds the
             tensors it saved (the gathered weight or a view of it), but they hold no bytes.
  backward   the group's outputs pass through ``_RegatherBeforeBackward`` (identity): the first gradient to reach
             it gathers each parameter again into the very storage the saved tensors view (as FSDP2 refills its
             unsharded parameter), before any backward op of the group reads it. A hook on each gathered tensor
             frees the storage again once that tensor's gradient is complete. The gradient then flows back
             through the gather (DTensor's backward of Shard→Replicate: a reduce-scatter into the parameter's
             layout), so a whole gradient lives only from its op to its reduce-scatter.
  recompute  the wrapper sits inside an activation checkpoint (``runtime.recompute.wrap_inside_checkpoint``): the
             recompute in backward gathers again and keeps those tensors for that layer's backward only.

Parameters in no group (the root: embeddings, final norm, head) are gathered by the runner once per step, as
FSDP2's root is. A group is freed only when one of its outputs carries a gradient (else nothing could refill it).
Must never change what a group computes, keep a gathered group past its forward and its backward, or act
outside an eager call of the runner (graph mode captures and runs its own program: the wrapper passes through).
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor

from torch_autopar import _compat
from torch_autopar.capture.layers import reshard_groups
from torch_autopar.runtime.precision import MixedPrecision, compute_parameters
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


class _Gathered:
    """One gathered parameter whose storage is freed after forward: how to refill it, and where."""

    def __init__(self, tensor: DTensor, param: DTensor, placements: tuple, policy: MixedPrecision | None):
        with torch.no_grad():
            local = tensor.to_local()
        self.local, self.nbytes = weakref.ref(local), local.untyped_storage().nbytes()
        self.param, self.placements, self.policy = param, placements, policy

    def free(self, *unused) -> None:
        local = self.local()
        if local is not None:
            local.untyped_storage().resize_(0)

    def refill(self) -> None:
        local = self.local()
        if local is None:  # nothing kept it for backward (a checkpointed layer keeps only its inputs)
            return
        with torch.no_grad():
            fresh = compute_parameters({"p": self.param}, {"p": self.placements}, self.policy)["p"].to_local()
            with _compat.keeping_version(local):
                local.untyped_storage().resize_(self.nbytes)
                local.copy_(fresh)


class _RegatherBeforeBackward(torch.autograd.Function):
    """Identity on a group's outputs; its backward refills the group's gathered parameters (every backward through
    it: a second one, ``retain_graph=True``, finds them freed again by their gradient hooks)."""

    @staticmethod
    def forward(ctx, gathered, *outputs):
        ctx.gathered = gathered
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        for tensor in ctx.gathered:
            tensor.refill()
        return (None, *grads)


class ReshardedGroups:
    """The groups of a fully-sharded module, each gathered around its own forward and backward."""

    def __init__(self, module: torch.nn.Module, gathered: dict, policy: MixedPrecision | None):
        self.enabled = False
        """Set by the runner for its eager calls only."""
        self.policy = policy
        params = dict(module.named_parameters())
        self.names = grouped_names(module)
        self.placements: dict[str, dict] = {group: {} for group in self.names}
        """Group → its gathered parameters' compute placements (filled by ``gather``)."""
        self.gather(gathered)
        for group, names in self.names.items():
            layer = module.get_submodule(group)
            members = {name: params[name] for name in names}
            wrap_inside_checkpoint(layer, lambda forward, l=layer, m=members, p=self.placements[group], g=group:
                                   self._wrap(forward, l, f"{g}.", m, p))

    def gather(self, gathered: dict) -> None:
        """Gather, from the next call on, the parameters of ``gathered`` (name → compute placements)."""
        for group, names in self.names.items():
            self.placements[group].clear()
            self.placements[group].update({name: gathered[name] for name in names if name in gathered})

    def grouped(self) -> set[str]:
        """Every parameter that some group gathers itself."""
        return {name for names in self.names.values() for name in names}

    def _wrap(self, forward, layer: torch.nn.Module, prefix: str, members: dict, placements: dict):
        """``forward`` of ``layer`` run on its group's gathered parameters (named ``prefix`` + relative name)."""

        def run(*args, **kwargs):
            if not self.enabled:
                return forward(*args, **kwargs)
            computed = compute_parameters(members, placements, self.policy)
            with _compat.reparametrized(layer, {n[len(prefix):]: t for n, t in computed.items()}):
                output = forward(*args, **kwargs)
            if _compat.in_backward() or not torch.is_grad_enabled():  # a recompute: kept for this backward only
                return output
            return self._reshard(output, [(computed[n], members[n], placements[n]) for n in placements])

        return run

    def _reshard(self, output, gathered: list):
        """``output`` routed through the refill of ``gathered``, whose storage is freed now (and again once each
        tensor's gradient is done); ``output`` as it is when no gradient can come back through it."""
        leaves, spec = pytree.tree_flatten(output)
        carrying = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        if not carrying:
            return output
        handles = []
        for tensor, param, placements in gathered:
            handle = _Gathered(tensor, param, placements, self.policy)
            if tensor.requires_grad:
                tensor.register_hook(handle.free)
            handle.free()
            handles.append(handle)
        routed = _RegatherBeforeBackward.apply(tuple(handles), *(leaves[i] for i in carrying))
        for i, leaf in zip(carrying, routed):
            leaves[i] = leaf
        return pytree.tree_unflatten(leaves, spec)
