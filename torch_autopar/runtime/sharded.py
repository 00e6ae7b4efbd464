"""Run a sharded plan (tensor-, fully-sharded or hybrid) on this rank, in eager or graph mode.

Eager: the user's ``forward`` runs op by op on DTensor parameters; hooks move each submodule's inputs and
outputs to the plan's layouts (``rewrite.module_hooks``) and DTensor places the ops between them (prints and
breakpoints work; a print shows a DTensor). A plan whose ops move nothing but parameters (``Plan.local_compute``)
runs them on plain local tensors, as FSDP2 does. A fully-sharded plan's eager calls gather each group's parameters
(each layer, and the root once per call) by one all_gather and reduce-scatter their gradients by one
reduce_scatter, each layer around its forward and backward only (``runtime.fsdp``; ``Plan.reshard_after_forward``). Graph: the plan's
per-rank program (``rewrite.program``: every node in its planned layout, explicit collectives; each parameter
gathered once, again for backward when it reshards), compiled; ``AUTOPAR_SHARDED_GRAPH=dtensor`` instead runs the eager function through
``torch.compile``. Both compute the one-process numbers. Must never plan, and never leave a parameter out of
the optimizer: a parameter replaced by its sharded version is swapped in any optimizer that still holds the
original.
"""

from __future__ import annotations

import contextlib
import os
import weakref

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from torch_autopar.capture.program import without_opaque_outputs
from torch_autopar.errors import AutoparError
from torch_autopar.rewrite import placement
from torch_autopar.rewrite.module_hooks import ModuleBoundaries
from torch_autopar.rewrite.program import ShardedProgram
from torch_autopar.runtime.backend import compile_own, sharded_backend, sharded_compilers
from torch_autopar.runtime.fsdp import FullyShardedGroups
from torch_autopar.runtime.precision import CastCall, MixedPrecision, compute_parameters, reduce_dtype
from torch_autopar.search import Plan

_REPLACED: "weakref.WeakValueDictionary[int, torch.nn.Parameter]" = weakref.WeakValueDictionary()
"""id(original parameter) → its sharded replacement, for optimizers built before planning."""
_ORIGINALS: dict[int, "weakref.ref"] = {}
_HOOK = None


def _swap_in_optimizers(optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook: replace original parameters by their sharded versions (before any state)."""
    for group in optimizer.param_groups:
        for index, param in enumerate(group["params"]):
            replacement = _REPLACED.get(id(param))
            if replacement is None or _ORIGINALS.get(id(param), lambda: None)() is not param:
                continue
            if optimizer.state.get(param):
                raise AutoparError(
                    "this optimizer already holds state for a parameter that autopar.compile has since sharded; "
                    "create the optimizer after the first forward, or pass example_inputs to autopar.compile.")
            group["params"][index] = replacement


def swap_sharded_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Replace, in ``optimizer``, parameters that a sharded plan has replaced (what its first step would do)."""
    _swap_in_optimizers(optimizer, (), {})


def _remember_replacements(before: dict, module: torch.nn.Module) -> None:
    global _HOOK
    after = dict(module.named_parameters(remove_duplicate=False))
    for name, original in before.items():
        if after.get(name) is not original:
            _REPLACED[id(original)] = after[name]
            _ORIGINALS[id(original)] = weakref.ref(original)
    if _HOOK is None:
        _HOOK = register_optimizer_step_pre_hook(_swap_in_optimizers)


class ShardedRunner:
    """The module's parameters placed per ``plan`` on a mesh over all ranks, and how one call runs."""

    def __init__(self, module: torch.nn.Module, plan: Plan, mixed_precision: MixedPrecision | None = None):
        self.module, self.plan, self.mixed_precision = module, plan, mixed_precision
        self.mesh = placement.mesh_for_plan(plan)
        placement.replicate_ops_without_rules(plan.replicated_ops)
        before = dict(module.named_parameters(remove_duplicate=False))
        placement.distribute_parameters(module, self.mesh, plan)
        _remember_replacements(before, module)
        self.gradients = placement.GradientPlacement(module)
        self.boundaries = ModuleBoundaries(module, plan)
        self.gathered = placement.gathered_parameters(module, plan)
        self._params = dict(module.named_parameters())
        self.groups: FullyShardedGroups | None = None
        """Eager mode: each group's parameters gathered by one all_gather, around its forward and backward when
        the plan reshards after forward (``runtime.fsdp``)."""
        self._set_groups()
        self._compiled = None
        self._programs: dict[tuple, ShardedProgram] = {}

    @property
    def world_size(self) -> int:
        return self.mesh.size()

    @contextlib.contextmanager
    def as_plain_module(self):
        """Inside, the module is the user's plain module again, for a capture: parameters and buffers plain
        tensors of their global shapes, no group gathering its own (``placement.global_parameters``)."""
        enabled = self.groups is not None and self.groups.enabled
        if self.groups is not None:
            self.groups.enabled = False
        try:
            with placement.global_parameters(self.module):
                yield
        finally:
            if self.groups is not None:
                self.groups.enabled = enabled

    def drop_module_boundaries(self, plan: Plan) -> None:
        """Run eager mode as DTensor places every op, ``plan`` being that execution (priced), instead of holding
        the submodules to the plan's layouts."""
        self.boundaries.remove()
        self.plan = plan
        self.gathered = placement.gathered_parameters(self.module, plan)
        self._set_groups()

    def _set_groups(self) -> None:
        """The groups that gather the parameters ``self.gathered`` gathers, in eager calls."""
        if self.groups is not None:
            self.groups.gather(self.gathered, self.plan.reshard_after_forward, self.plan.kept_gathered)
        elif self.gathered:
            self.groups = FullyShardedGroups(self.module, self.gathered, self.mixed_precision,
                                             self.plan.reshard_after_forward, self.plan.kept_gathered)
        if self.groups is not None:
            self.groups.local_compute = self.plan.local_compute

    def forward(self, *args, **kwargs):
        """One call on this rank's slice: global DTensor inputs → the user's forward → this rank's outputs."""
        if self.plan.local_compute and self.groups is not None and self.groups.enabled:
            return self._local_forward(args, kwargs)
        full = self.plan.full_batch
        batch = placement.global_batch_size(args, kwargs, 1 if full else self.world_size)
        global_args, global_kwargs = placement.inputs_to_global(args, kwargs, self.mesh, self.plan.input_placements,
                                                                full)
        grouped = self.groups is not None and self.groups.enabled
        with self.groups.call() if grouped else contextlib.nullcontext():
            whole = self.groups.whole_parameters() if grouped else compute_parameters(
                self._params, self.gathered, self.mixed_precision)
            if whole:
                output = torch.func.functional_call(self.module, whole, global_args, global_kwargs, strict=False)
            else:
                output = self.module(*global_args, **global_kwargs)
        return placement.outputs_to_local(output, self.mesh, batch, full)

    def _local_forward(self, args: tuple, kwargs: dict):
        """One call as FSDP2 runs it (``Plan.local_compute``): this rank's slice through the user's forward on
        plain tensors, each group's parameters gathered whole (``runtime.fsdp``), the rest of the parameters and
        the buffers replicated, as their local tensors; no DTensor dispatch."""
        with self.groups.call():
            whole = self.groups.whole_parameters()
            tensors = {name: whole[name] if name in whole else placement.local_view(param)
                       for name, param in self._params.items() if name in whole or name not in self.groups.grouped}
            tensors.update((name, placement.local_view(buffer)) for name, buffer in self.module.named_buffers())
            output = torch.func.functional_call(self.module, tensors, args, kwargs, strict=False)
        return placement.local_batch_outputs(output, self.mesh)

    def run(self, args, kwargs, mode: str, stats: dict):
        if not self.plan.full_batch:  # full batches are checked to be equal by the caller
            self.check_batch_sizes(args, kwargs)
        if self.groups is not None:
            self.groups.enabled = mode != "graph"
        if mode != "graph":
            return self.forward(*args, **kwargs)
        if os.environ.get("AUTOPAR_SHARDED_GRAPH", "program") == "program":
            return self._program(args, kwargs, stats)(self.module, args, kwargs)
        if self._compiled is None:  # objects like a key/value cache would hold DTensors the graph cannot return
            self._compiled = compile_own(lambda *a, **k: without_opaque_outputs(self.forward(*a, **k)),
                                         sharded_backend(stats))
        return self._compiled(*args, **kwargs)

    def _program(self, args, kwargs, stats: dict) -> ShardedProgram:
        """The plan's per-rank program for inputs shaped as these (traced and compiled on first use)."""
        key = tuple(tuple(leaf.shape) for leaf in placement.pytree.tree_leaves((args, kwargs))
                    if isinstance(leaf, torch.Tensor))
        if key not in self._programs:
            self._programs[key] = ShardedProgram(self.module, self.plan, self.mesh, args, kwargs,
                                                 compilers=sharded_compilers(stats),
                                                 call=CastCall(self.module, self.mixed_precision),
                                                 reduce_dtype=reduce_dtype(self.mixed_precision))
        return self._programs[key]

    def check_batch_sizes(self, args, kwargs) -> None:
        """One 16-byte all-reduce: every rank must pass a slice of the same size (the global shape depends on it)."""
        check_equal_slices(placement.global_batch_size(args, kwargs, 1), self.world_size, None,
                           "a sharded plan needs equal slices of the global batch")

    def state_dict(self, *args, **kwargs) -> dict:
        return placement.full_state_dict(self.module.state_dict(*args, **kwargs))

    def sharded_state_dict(self) -> dict:
        return self.module.state_dict()

    def load_state_dict(self, state_dict, strict: bool = True):
        return placement.load_full_state_dict(self.module, state_dict, strict)


def check_equal_slices(local_batch: int | None, world_size: int, group, consequence: str) -> None:
    """Raise a clear error unless every rank of ``group`` passed ``local_batch`` samples (one all-reduce of
    [b, b^2]: equal sizes iff world * sum(b^2) == sum(b)^2)."""
    local = float(local_batch or 0)
    sums = torch.tensor([local, local * local], dtype=torch.float64)
    dist.all_reduce(sums, group=group)
    if abs(world_size * float(sums[1]) - float(sums[0]) ** 2) > 0.5:
        raise AutoparError(
            f"ranks were given batches of unequal size (this rank: {int(local)}, sum over {world_size} ranks: "
            f"{int(sums[0])}); {consequence}. Make the global batch divisible by the number of ranks, or use "
            "autopar.Model(...).train().")
