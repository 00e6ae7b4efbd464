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


def next_token_batch(step: int, masked: bool = False):
    """(inputs, next-token targets) of one global batch for a pipelined causal language model: the input_ids, or
    (``masked``) keyword inputs with an attention_mask that pads the last 5 positions of every other sequence."""
    tokens = hf_batch("llama", PIPELINE_BATCH, step)["input_ids"]
    target = torch.roll(tokens, -1, dims=1)
    if not masked:
        return tokens, target
    mask = torch.ones_like(tokens)
    mask[::2, -5:] = 0
    return {"input_ids": tokens, "attention_mask": mask}, target


def _call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def _slice(inputs, parts: int, index: int):
    """Slice ``index`` of ``parts`` along dim 0 of a tensor or of each value of a dict of them."""
    if isinstance(inputs, dict):
        return {key: value.chunk(parts)[index] for key, value in inputs.items()}
    return inputs.chunk(parts)[index]


@functools.cache
def pipeline_reference(name: str, masked: bool = False):
    """One process, whole global batch, the pipeline's loss: the run a pipelined one must reproduce."""
    def loss_at(model, step):
        inputs, target = next_token_batch(step, masked)
        return next_token_loss(_call(model, inputs), target)
    return _one_process(name, loss_at)


def run_pipeline_case(rank, world, name, schedule, mode, strategy, resume_from=None, masked=False):
    """3 AdamW steps of ``name`` cut into 2 stages (``pmodel.step``): each step's loss, the full parameters, the
    type of the model's output, the plan's strategy and the layers of each stage. ``resume_from`` (a directory):
    after the first step ``save_checkpoint`` there, and a fresh model (other initial values) compiled alike
    loads it and takes the other steps. ``masked``: keyword inputs with a padding attention_mask (a dict passed to
    ``step``)."""
    torch._dynamo.reset()
    share = 1 if strategy == "tensor_parallel" else world // 2  # tensor-parallel stage ranks pass the same batch

    def fresh(seed: int):
        model = build_hf_model(name, seed=seed)
        mine = _slice(next_token_batch(0, masked)[0], share, rank // 2 % share)
        example = {"example_kwargs": mine} if masked else {"example_inputs": mine}
        pmodel = autopar.compile(model, pipeline=2, schedule=schedule, loss_fn=next_token_loss, mode=mode,
                                 strategy=strategy, **example)
        return model, pmodel, optimizer_for(pmodel.parameters())

    model, pmodel, optimizer = fresh(0)
    slot, replicas = pmodel.data_parallel_rank, pmodel.data_parallel_size
    losses = []
    for step in range(STEPS):
        if resume_from is not None and step == 1:
            autopar.save_checkpoint(resume_from, pmodel, optimizer, step=step)
            model, pmodel, optimizer = fresh(1)
            assert autopar.load_checkpoint(resume_from, pmodel, optimizer)["step"] == step
        inputs, target = next_token_batch(step, masked)
        optimizer.zero_grad(set_to_none=True)
        losses.append(pmodel.step(_slice(inputs, replicas, slot), target.chunk(replicas)[slot]).item())
        optimizer.step()
    state = pmodel.state_dict()
    output = _call(pmodel, _slice(inputs, replicas, slot))
    shorter = inputs[:, :8] if isinstance(inputs, torch.Tensor) else {k: v[:, :8] for k, v in inputs.items()}
    try:  # captured stages run at their capture's shapes: a clear error on every rank, before any collective
        pmodel.step(_slice(shorter, replicas, slot), target[:, :8].chunk(replicas)[slot])
        other_shapes = "ran"
    except autopar.AutoparError as error:
        other_shapes = str(error)
    return {"losses": losses, "other_shapes": other_shapes,
            "params": {n: state[n].clone() for n, _ in model.named_parameters()},
            "output": type(output).__name__, "strategy": pmodel.plan.strategy,
            "stages": [list(row.layers) for row in pmodel.plan.stages]}
