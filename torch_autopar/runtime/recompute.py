"""Activation checkpointing: recompute activations in backward instead of keeping them from the forward.

``apply_plan(module, plan.activation_checkpointing)`` wraps exactly the layers a plan names (module path →
"full" | "selective"; ``search.recompute`` chooses them, for "auto" under the memory budget) in non-reentrant
``torch.utils.checkpoint``: the layer keeps only its inputs for backward and runs its forward again there.
``apply_activation_checkpointing(module, "full" | "selective")`` wraps every repeated layer (each element of an
``nn.ModuleList`` of same-class modules with parameters: the transformer blocks, ``layer_names``).
"selective" keeps the outputs of the expensive ops (matmuls, attention) and recomputes only the cheap ones
(elementwise, norms), through ``create_selective_checkpoint_contexts``. The same wrapping serves eager mode and
graph mode (dynamo traces checkpointed regions and recomputes them in the compiled backward), so the numbers are
those of the plain model. Parameter and module names do not change (the layer's ``forward`` is wrapped in place),
so plans, state dicts and checkpoints stay valid. Must never change what a layer computes, nor choose layers.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from torch_autopar import _compat
from torch_autopar.cost.pricing import SAVED_BY_SELECTIVE
from torch_autopar.errors import AutoparError
from torch_autopar.runtime import precision
from torch_autopar.search.recompute import POLICIES


def check_policy(policy) -> None:
    if policy not in POLICIES:
        raise AutoparError(f"activation_checkpointing={policy!r}: expected one of {POLICIES} (None: keep every "
                           "activation; 'auto': recompute the layers the memory budget needs; 'full': recompute "
                           "each repeated layer; 'selective': keep matmul and attention outputs, recompute the rest).")


def layer_names(module: nn.Module, policy) -> list[str]:
    """Module paths of every element of each ``nn.ModuleList`` whose elements are of one class and hold
    parameters, in registration order; raises when ``policy`` recomputes and there is none."""
    names = []
    for path, child in module.named_modules():
        if isinstance(child, nn.ModuleList) and len(child) > 0 and len({type(m) for m in child}) == 1:
            names.extend(f"{path}.{i}" if path else str(i) for i, m in enumerate(child)
                         if any(True for _ in m.parameters()))
    if policy is not None and not names:
        raise AutoparError(f"activation_checkpointing={policy!r}: {type(module).__name__} has no repeated layers "
                           "(an nn.ModuleList of same-class blocks with parameters) to recompute; keep the "
                           "blocks in an nn.ModuleList, or leave activation_checkpointing=None.")
    return names


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(forward, policy: str, layer: nn.Module):
    options = {"use_reentrant": False}
    if policy == "selective":
        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _selective_policy)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # nothing is kept for backward anyway
            return forward(*args, **kwargs)
        return checkpoint(_in_this_call_state(forward, layer, recast=policy == "full"), *args, **options, **kwargs)

    run._autopar_checkpointed = policy
    return run


def _in_this_call_state(forward, layer: nn.Module, recast: bool):
    """``forward`` recomputed in backward with the parameters ``layer`` has in this call: under a
    ``functional_call`` (mixed precision's low-precision copies, a sharded plan's compute tensors) the layer holds
    other tensors than when backward runs, after the call has restored the masters. A plain cast of a master is
    cast again for the recompute when ``recast`` ("full": freeing it is what recomputation is for; "selective"
    recomputes under a policy that would see the cast as an op the forward did not run there: the cast is kept);
    other tensors are what the layer holds when backward runs (a fully-sharded layer's parameters gathered again,
    ``runtime.fsdp``)."""
    if torch.compiler.is_compiling():  # captured or compiled: dynamo recomputes from the graph's own inputs
        return forward
    recipes = {}
    for name, param in layer.named_parameters(remove_duplicate=False):
        recipe = _recast(param)
        if recipe is not None:
            recipes[name] = recipe if recast else (lambda param=param: param)

    def recomputable(*args, **kwargs):
        if not recipes or not _compat.in_backward():  # the forward: the layer holds this call's tensors
            return forward(*args, **kwargs)
        with _compat.reparametrized(layer, {name: recipe() for name, recipe in recipes.items()}):
            return forward(*args, **kwargs)

    return recomputable


def _recast(tensor: torch.Tensor):
    """For a cast of a parameter (``master.to(dtype)``, what mixed precision computes with; on a sharded plan
    ``precision._ToCompute``, the cast moved to its compute layout), a function casting the master again;
    otherwise None."""
    node = tensor.grad_fn
    if node is None or not node.next_functions:
        return None
    source = getattr(node.next_functions[0][0], "variable", None)  # an AccumulateGrad: the master
    if not isinstance(source, nn.Parameter) or source.shape != tensor.shape:
        return None
    dtype = tensor.dtype
    if type(node).__name__ == "ToCopyBackward0" and len(node.next_functions) == 1:
        return lambda: source.to(dtype)  # with its autograd edge, as in the forward: the same tensors are saved
    if isinstance(node, precision.to_compute_node()):
        placements, reduce_dtype = tuple(tensor.placements), node.reduce_dtype
        return lambda: precision.to_compute(source, placements, dtype, reduce_dtype)
    return None


def apply_activation_checkpointing(module: nn.Module, policy) -> list[nn.Module]:
    """Wrap every repeated layer's forward as ``policy`` ("full" | "selective" | None) says; returns the wrapped
    layers. Idempotent."""
    check_policy(policy)
    if policy == "auto":
        raise AutoparError("activation_checkpointing='auto' is chosen by the planner under the memory budget: pass "
                           "it to autopar.compile (or autopar.plan); here expected 'full', 'selective' or None.")
    return apply_plan(module, {name: policy for name in layer_names(module, policy)} if policy else {})


def apply_plan(module: nn.Module, layers: dict[str, str]) -> list[nn.Module]:
    """Wrap the forward of each layer of ``layers`` (module path → "full" | "selective", a plan's
    ``activation_checkpointing``) and unwrap any other layer an earlier plan wrapped, so exactly the plan's layers
    recompute, each under its own policy; returns the wrapped layers. Idempotent."""
    for path, child in module.named_modules():
        policy = getattr(child.__dict__.get("forward"), "_autopar_checkpointed", None)
        if policy is not None and layers.get(path) != policy:
            child.forward = child.forward.__wrapped__  # what it wrapped: the class's forward, or the user's own
            if getattr(child.forward, "__self__", None) is child and child.forward.__func__ is type(child).forward:
                del child.forward
    wrapped = []
    for path, policy in layers.items():
        layer = _layer(module, path)
        if getattr(layer.forward, "_autopar_checkpointed", None) is None:
            layer.forward = _checkpointed(layer.forward, policy, layer)
        wrapped.append(layer)
    if wrapped:
        _without_kv_cache(module)
    return wrapped


def _layer(module: nn.Module, path: str) -> nn.Module:
    try:
        return module.get_submodule(path)
    except AttributeError as missing:
        raise AutoparError(f"the plan recomputes layer {path!r}, which {type(module).__name__} does not have "
                           f"({missing}); expected a plan made for this model. Plan again for it (autopar.plan).") \
            from missing


@contextlib.contextmanager
def applied(module: nn.Module, layers: dict[str, str]):
    """A context in which the layers of ``layers`` are wrapped as ``apply_plan`` wraps them, unwrapped on exit
    (the capture a plan is made from sees the layers checkpointed as graph mode's program will)."""
    before = {path: _layer(module, path).__dict__.get("forward") for path in layers}
    apply_plan(module, layers)
    try:
        yield
    finally:
        for path, forward in before.items():
            layer = module.get_submodule(path)
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward


def captured_layers(policy, candidates: list[str]) -> dict[str, str]:
    """The layers a plan's capture sees checkpointed under ``policy``: every candidate under "full" /
    "selective", the given choice (a dict), none under "auto" (the search chooses after the capture)."""
    if isinstance(policy, dict):
        return dict(policy)
    return {name: policy for name in candidates} if policy in ("full", "selective") else {}


def _without_kv_cache(module: nn.Module) -> None:
    """A ``transformers`` model updates its key/value cache inside each layer: recomputing a layer would see the
    cache the forward already grew (selective recomputation then fails to match its saved outputs). Turn the
    cache off, as ``transformers``' own ``gradient_checkpointing_enable`` does; training never reads it."""
    config = getattr(module, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False


def wrap_inside_checkpoint(layer: nn.Module, wrap) -> None:
    """Replace ``layer.forward`` by ``wrap(forward)``, inside the layer's activation checkpoint when it has one
    (the recompute in backward then runs the wrapper too); a checkpoint applied later wraps it from outside."""
    current = layer.forward
    policy = getattr(current, "_autopar_checkpointed", None)
    layer.forward = wrap(current) if policy is None else _checkpointed(wrap(current.__wrapped__), policy, layer)
