"""Activation checkpointing (``compile(..., activation_checkpointing="full" | "selective")``): the same numbers
as without, less activation memory (measured with PyTorch's MemTracker), in one process and on 2 gloo ranks under
data_parallel, fully_shard and tensor_parallel, eager and graph mode (3 AdamW steps against one process); under
bf16 mixed precision, recomputation casts each master again as the forward did (in one process and, sharded and
laid out, on 2 ranks): exactly the same gradients."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch.distributed.tensor import DTensor

import torch_autopar as autopar
from torch_autopar import _compat
from torch_autopar.runtime.recompute import apply_activation_checkpointing
from torch_autopar.testing import run_on_ranks
from torch_autopar.testing.models import GPT, GPTConfig, gpt_loss
from tests import support

CONFIG = GPTConfig(n_layer=4, n_embd=64, block_size=64)


def _gpt():
    torch.manual_seed(0)
    return GPT(CONFIG)


def _tokens(step=0, batch=8):
    return torch.randint(0, CONFIG.vocab_size, (batch, 64), generator=torch.Generator().manual_seed(step))


def _peak_and_grads(policy):
    model = _gpt()
    apply_activation_checkpointing(model, policy)
    x = _tokens()
    peak = _compat.measured_peak_bytes(model, lambda: gpt_loss(model(x), x).backward())
    return peak, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_recomputing_saves_memory_and_changes_no_number():
    keep, grads = _peak_and_grads(None)
    selective, selective_grads = _peak_and_grads("selective")
    full, full_grads = _peak_and_grads("full")
    assert full < selective < keep, (full, selective, keep)
    assert full < 0.6 * keep, (full, keep)  # 4 blocks of 8 x 64 tokens: activations dominate the peak
    for name in grads:
        torch.testing.assert_close(selective_grads[name], grads[name], rtol=0, atol=0)
        torch.testing.assert_close(full_grads[name], grads[name], rtol=0, atol=0)


def test_names_and_state_dict_are_unchanged():
    model = _gpt()
    before = list(model.state_dict())
    wrapped = apply_activation_checkpointing(model, "full")
    assert wrapped == list(model.blocks) and list(model.state_dict()) == before
    assert apply_activation_checkpointing(model, "full") == wrapped  # idempotent


def test_bad_policy_and_a_model_without_repeated_layers_raise():
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: activation_checkpointing='everything'"):
        autopar.compile(_gpt(), activation_checkpointing="everything")
    with pytest.raises(autopar.AutoparError, match=r"no repeated layers"):
        apply_activation_checkpointing(torch.nn.Linear(4, 4), "full")


CASES = [("data_parallel", "graph", "full"), ("fully_shard", "eager", "full"), ("fully_shard", "eager", "selective"),
         ("fully_shard", "graph", "selective"), ("tensor_parallel", "eager", "selective")]


def _run(rank, world, strategy, mode, policy):
    torch._dynamo.reset()
    model = _gpt()
    pmodel = autopar.compile(model, _tokens().chunk(world)[rank], strategy=strategy, mode=mode,
                             activation_checkpointing=policy)
    losses = support.train_language_model(pmodel, _tokens, rank, world)
    state = pmodel.state_dict()
    return {"losses": losses, "params": {n: state[n].clone() for n, _ in model.named_parameters()}}


BF16_CASES = [(strategy, policy) for strategy in ("fully_shard", "tensor_parallel") for policy in ("full", "selective")]


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _bf16_step(rank, world, strategy, policy=None):
    """One bf16 step on a fresh GPT: the plan, the loss and this rank's local gradient shards."""
    torch._dynamo.reset()
    model = _gpt()
    x = _tokens(batch=4).chunk(world)[rank]
    pmodel = autopar.compile(model, x, strategy=strategy, mixed_precision="bf16", activation_checkpointing=policy)
    loss = gpt_loss(pmodel(x), x)
    loss.backward()
    return pmodel.plan, loss.item(), {n: _local(p.grad).clone() for n, p in model.named_parameters()}


def _bf16_with_and_without_recomputing(rank, world, strategy, policy):
    """The plan searched under ``policy``, then that plan given as it is, then keeping every activation."""
    plan, *searched = _bf16_step(rank, world, strategy, policy)
    assert set(plan.activation_checkpointing.values()) == {policy}, plan.activation_checkpointing
    _, *given = _bf16_step(rank, world, plan)
    _, *kept = _bf16_step(rank, world, dataclasses.replace(plan, activation_checkpointing={}))
    return searched, given, kept


def _job(rank, world):
    return {**{case: support.outcome(_run, rank, world, *case) for case in CASES},
            **{("bf16",) + case: support.outcome(_bf16_with_and_without_recomputing, rank, world, *case)
               for case in BF16_CASES}}


@pytest.fixture(scope="module")
def job():
    return run_on_ranks(_job, 2, timeout_s=600)


@functools.cache
def _reference():
    model = _gpt()
    return support.train_language_model(model, _tokens), support.params_of(model)


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_equals_one_process_on_two_ranks(job, case):
    support.assert_ranks_equal_one_process([result[case] for result in job], _reference(), str(case))


@pytest.mark.parametrize("strategy,policy", BF16_CASES)
def test_sharded_bf16_recomputation_gives_the_gradients_of_keeping_every_activation(job, strategy, policy):
    """On 2 ranks the forward's bf16 copies are cast (and laid out) by the mixed-precision cast; the recompute
    casts each sharded master again the same way: the same loss and local gradients, bit for bit, as the same
    plan keeping every activation. (The searched plan runs too; given back as a Plan it may run the collectives in
    another order, so its loss is compared within bf16 rounding.)"""
    for rank, result in enumerate(job):
        status, run = result[("bf16", strategy, policy)]
        assert status == "ok", (rank, status, run)
        (searched_loss, _), (loss, grads), (kept_loss, kept_grads) = run
        assert abs(searched_loss - kept_loss) < 1e-2 * kept_loss, (rank, searched_loss, kept_loss)  # bf16 rounding
        assert loss == kept_loss, (rank, loss, kept_loss)
        for name, grad in kept_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=f"rank {rank}: {name}")


def test_apply_plan_wraps_exactly_the_plan_layers_and_refuses_unknown_ones():
    """A second plan replaces the first: layers it leaves out are unwrapped (back to the class's forward), a layer
    under another policy is re-wrapped; a layer the model lacks is a clear error."""
    from torch_autopar.runtime.recompute import apply_plan
    model = GPT(GPTConfig(n_layer=3, n_embd=32, block_size=16))
    policy_of = lambda: {f"blocks.{i}": getattr(b.__dict__.get("forward"), "_autopar_checkpointed", None)  # noqa: E731
                         for i, b in enumerate(model.blocks)}
    apply_plan(model, {"blocks.0": "full", "blocks.1": "full"})
    assert policy_of() == {"blocks.0": "full", "blocks.1": "full", "blocks.2": None}
    apply_plan(model, {"blocks.1": "selective"})
    assert policy_of() == {"blocks.0": None, "blocks.1": "selective", "blocks.2": None}
    assert "forward" not in model.blocks[0].__dict__
    tokens = torch.randint(0, 96, (2, 16))
    gpt_loss(model(tokens), tokens).backward()  # runs, recomputing block 1 selectively
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: the plan recomputes layer 'blocks.7'"):
        apply_plan(model, {"blocks.7": "full"})


@pytest.mark.parametrize("policy,mode", (("full", "eager"), ("selective", "eager"), ("full", "graph")))
def test_under_mixed_precision_recomputation_sees_the_low_precision_parameters(policy, mode):
    """The recompute in backward runs after the call restored the fp32 masters: it must run on the bf16 copies
    the forward used (else a dtype mismatch), and give exactly the gradients of keeping every activation."""
    tokens = _tokens(batch=4)
    results = {}
    for checkpointing in (None, policy):
        torch._dynamo.reset()
        model = _gpt()
        loss = gpt_loss(autopar.compile(model, tokens, strategy="fully_shard", mixed_precision="bf16",
                                        activation_checkpointing=checkpointing, mode=mode)(tokens), tokens)
        loss.backward()
        results[checkpointing] = loss.item(), support.params_of(model), {n: p.grad for n, p in model.named_parameters()}
    assert results[policy][0] == results[None][0]
    for name, grad in results[None][2].items():
        assert results[policy][1][name].dtype == torch.float32
        torch.testing.assert_close(results[policy][2][name], grad, rtol=0, atol=0, msg=name)
