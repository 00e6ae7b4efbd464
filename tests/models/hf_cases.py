"""Rank functions for the transformers-model tests (spawned ranks import this module by name)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import torch_autopar as autopar
from torch_autopar.testing.hf_models import build_hf_model, hf_batch, local_batch, next_token_loss

STEPS = 3
GLOBAL_BATCH = 4


def optimizer_for(params):
    """AdamW with eps 1e-6: GPT-2's key bias has an exactly-zero true gradient (it shifts every score of a query
    equally), and with eps 1e-8 Adam scales the ~1e-9 rounding noise of that zero up to a full step."""
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.1)


def _one_process(name: str, loss_at):
    """``STEPS`` AdamW steps of ``name`` in one process on ``loss_at(model, step)``: (losses, parameters)."""
    model = build_hf_model(name)
    optimizer = optimizer_for(model.parameters())
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_at(model, step)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@functools.cache
def reference(name: str):
    """One process, whole global batch: the run every parallel run must reproduce."""
    return _one_process(name, lambda model, step: model(**hf_batch(name, GLOBAL_BATCH, step)).loss)


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


PIPELINE_BATCH = 8


def next_token_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, next-token targets) of one global batch for a pipelined causal language model."""
    tokens = hf_batch("llama", PIPELINE_BATCH, step)["input_ids"]
    return tokens, torch.roll(tokens, -1, dims=1)


@functools.cache
def pipeline_reference(name: str):
    """One process, whole global batch, the pipeline's loss: the run a pipelined one must reproduce."""
    def loss_at(model, step):
        inputs, target = next_token_batch(step)
        return next_token_loss(model(inputs), target)
    return _one_process(name, loss_at)


def run_pipeline_case(rank, world, name, schedule, mode, strategy, resume_from=None):
    """3 AdamW steps of ``name`` cut into 2 stages (``pmodel.step``): each step's loss, the full parameters, the
    type of the model's output, the plan's strategy and the layers of each stage. ``resume_from`` (a directory):
    after the first step ``save_checkpoint`` there, and a fresh model (other initial values) compiled alike
    loads it and takes the other steps."""
    torch._dynamo.reset()
    share = 1 if strategy == "tensor_parallel" else world // 2  # tensor-parallel stage ranks pass the same batch

    def fresh(seed: int):
        model = build_hf_model(name, seed=seed)
        inputs, _ = next_token_batch(0)
        pmodel = autopar.compile(model, inputs.chunk(share)[rank // 2 % share], pipeline=2, schedule=schedule,
                                 loss_fn=next_token_loss, mode=mode, strategy=strategy)
        return model, pmodel, optimizer_for(pmodel.parameters())

    model, pmodel, optimizer = fresh(0)
    slot, replicas = pmodel.data_parallel_rank, pmodel.data_parallel_size
    losses = []
    for step in range(STEPS):
        if resume_from is not None and step == 1:
            autopar.save_checkpoint(resume_from, pmodel, optimizer, step=step)
            model, pmodel, optimizer = fresh(1)
            assert autopar.load_checkpoint(resume_from, pmodel, optimizer)["step"] == step
        inputs, target = next_token_batch(step)
        optimizer.zero_grad(set_to_none=True)
        losses.append(pmodel.step(inputs.chunk(replicas)[slot], target.chunk(replicas)[slot]).item())
        optimizer.step()
    state = pmodel.state_dict()
    output = pmodel(inputs.chunk(replicas)[slot])
    return {"losses": losses, "params": {n: state[n].clone() for n, _ in model.named_parameters()},
            "output": type(output).__name__, "strategy": pmodel.plan.strategy,
            "stages": [list(row.layers) for row in pmodel.plan.stages]}
