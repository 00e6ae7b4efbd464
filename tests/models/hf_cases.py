"""Rank functions for the transformers-model tests (spawned ranks import this module by name)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import torch_autopar as autopar
from torch_autopar.testing.hf_models import build_hf_model, hf_batch, local_batch

STEPS = 3
GLOBAL_BATCH = 4


def optimizer_for(params):
    """AdamW with eps 1e-6: GPT-2's key bias has an exactly-zero true gradient (it shifts every score of a query
    equally), and with eps 1e-8 Adam scales the ~1e-9 rounding noise of that zero up to a full step."""
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.1)


@functools.cache
def reference(name: str):
    """One process, whole global batch: the run every parallel run must reproduce."""
    model = build_hf_model(name)
    optimizer = optimizer_for(model.parameters())
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = model(**hf_batch(name, GLOBAL_BATCH, step)).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def run_case(rank, world, name, strategy, mode):
    """3 AdamW steps of ``name`` under ``strategy`` in ``mode``: the mean loss over ranks per step, the full
    parameters after training, and the plan's headline."""
    torch._dynamo.reset()
    model = build_hf_model(name)
    example = local_batch(hf_batch(name, GLOBAL_BATCH, 0), rank, world)
    pmodel = autopar.compile(model, example_kwargs=example, strategy=strategy, mode=mode)
    optimizer = optimizer_for(pmodel.parameters())
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = pmodel(**local_batch(hf_batch(name, GLOBAL_BATCH, step), rank, world)).loss
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    state = pmodel.state_dict()
    params = {n: state[n].clone() for n, _ in model.named_parameters()}
    return {"losses": losses, "params": params, "sharded": pmodel.mesh is not None,
            "strategy": pmodel.plan.strategy, "replicated_ops": list(getattr(pmodel.plan, "replicated_ops", []) or [])}
