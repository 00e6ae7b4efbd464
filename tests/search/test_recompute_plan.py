"""``activation_checkpointing="auto"``: after the layout search the planner recomputes, layer by layer, the fewest
repeated layers that bring the predicted peak within ``memory_budget`` (none when it fits as it is), raises a
``torch_autopar:`` error when even all of them do not, and the plan names the layers (saved and loaded, shown by
``explain``). Planned without ranks (the layer figures are on local shards: halved on 2 data-parallel ranks);
compiled in one process and on 2 gloo ranks (data_parallel and fully_shard, eager and graph mode), where the
runtime recomputes exactly the plan's layers and 3 AdamW steps equal one process without recomputation.
"""

from __future__ import annotations

import functools

import pytest
import torch

import torch_autopar as autopar
from torch_autopar.cost import pricing
from torch_autopar.testing import run_on_ranks
from torch_autopar.testing.memory import kept_bytes
from torch_autopar.testing.models import GPT, GPTConfig
from tests import support

CONFIG = GPTConfig(n_layer=4, n_embd=64, block_size=32)
BATCH = 8


def _gpt():
    torch.manual_seed(0)
    return GPT(CONFIG)


def _tokens(step=0):
    generator = torch.Generator().manual_seed(step)
    return torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size), generator=generator)


def _plan(policy=None, budget=None, mesh_shape=(1,), strategy="auto"):
    return autopar.plan(_gpt(), (_tokens(),), mesh_shape=mesh_shape, hardware="h100", fold_layers=False,
                        strategy=strategy, memory_budget=budget, activation_checkpointing=policy)


def _tight_budget(plan) -> int:
    """A budget that two recomputed layers meet and one does not (every layer frees the same)."""
    return int(plan.peak_memory - 1.5 * next(iter(plan.layer_activations.values())).freed_bytes)


def test_auto_keeps_every_activation_when_the_plan_fits():
    plan = _plan("auto")
    assert plan.activation_checkpointing == {}
    assert plan.peak_memory == _plan(None).peak_memory
    assert "activation checkpointing: none (4 repeated layers keep their activations)" in plan.explain()


def test_auto_recomputes_the_fewest_layers_that_fit():
    keep = _plan(None)
    budget = _tight_budget(keep)
    plan = _plan("auto", budget)
    assert plan.activation_checkpointing == {"blocks.0": "full", "blocks.1": "full"}  # equal ratios: forward order
    assert plan.peak_memory <= budget < keep.peak_memory
    freed = sum(plan.layer_activations[n].freed_bytes for n in plan.activation_checkpointing)
    assert plan.memory_breakdown["activations"] == keep.memory_breakdown["activations"] - freed
    assert plan.estimated_step_time > keep.estimated_step_time  # two more layer forwards
    assert "activation checkpointing: 2 of 4 repeated layers recompute" in plan.explain()


def test_auto_raises_when_even_full_recomputation_does_not_fit():
    full = _plan("full")
    assert full.activation_checkpointing == {f"blocks.{i}": "full" for i in range(4)}
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: no plan fits the memory budget .* even with "
                                                   r"the repeated layers recomputed that lower it .*Raise "
                                                   r"memory_budget"):
        _plan("auto", full.peak_memory - 1)


def test_auto_says_recomputation_was_counted_when_no_sharding_fits():
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: no .*fits the memory budget.*even with (every "
                                                   r"repeated layer|the repeated layers) recomputed"):
        _plan("auto", 100_000, mesh_shape=(2,))


def test_layer_figures_are_on_local_shards():
    """Each rank holds half the batch's activations (all but the causal mask, the same on every rank)."""
    one, two = _plan(None), _plan(None, mesh_shape=(2,), strategy="data_parallel")
    mask = CONFIG.block_size ** 2  # bytes of one layer's boolean mask
    for name, row in one.layer_activations.items():
        half = two.layer_activations[name]
        assert half.saved_bytes * 2 - mask == row.saved_bytes
        assert (half.freed_bytes + pricing.CHECKPOINT_STATE_BYTES) * 2 - mask == \
            row.freed_bytes + pricing.CHECKPOINT_STATE_BYTES


def test_the_choice_is_saved_and_loaded(tmp_path):
    plan = _plan("auto", _tight_budget(_plan(None)))
    plan.save(tmp_path / "plan.json")
    loaded = autopar.Plan.load(tmp_path / "plan.json")
    assert loaded.activation_checkpointing == plan.activation_checkpointing
    assert loaded.layer_activations == plan.layer_activations
    assert loaded.peak_memory == plan.peak_memory and loaded.explain() == plan.explain()


def test_a_plan_and_a_policy_together_are_refused():
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: activation_checkpointing='auto' with a Plan"):
        autopar.compile(_gpt(), _tokens(), strategy=_plan(None), activation_checkpointing="auto")


@functools.cache
def _reference():
    model = _gpt()
    return support.train_language_model(model, _tokens), support.params_of(model)


def _wrapped(model) -> dict:
    return {f"blocks.{i}": getattr(block.forward, "_autopar_checkpointed", None)
            for i, block in enumerate(model.blocks)}


def test_compiled_auto_recomputes_the_planned_layers_with_the_same_numbers():
    budget = _tight_budget(autopar.compile(_gpt(), _tokens()).plan)
    model = _gpt()
    pmodel = autopar.compile(model, _tokens(), memory_budget=budget, activation_checkpointing="auto")
    assert pmodel.plan.activation_checkpointing == {"blocks.0": "full", "blocks.1": "full"}
    assert _wrapped(model) == {"blocks.0": "full", "blocks.1": "full", "blocks.2": None, "blocks.3": None}
    losses = support.train_language_model(pmodel, _tokens)
    ref_losses, ref_params = _reference()
    support.assert_losses_close(losses, ref_losses, what="auto, one process")
    support.assert_params_close(support.params_of(model), ref_params, what="auto, one process")


CASES = [("data_parallel", "eager"), ("data_parallel", "graph"), ("fully_shard", "eager"), ("fully_shard", "graph")]


def _run(rank, world, strategy, mode):
    torch._dynamo.reset()
    x = _tokens().chunk(world)[rank]
    budget = _tight_budget(autopar.compile(_gpt(), x, strategy=strategy, mode=mode).plan)
    model = _gpt()
    pmodel = autopar.compile(model, x, strategy=strategy, mode=mode, memory_budget=budget,
                             activation_checkpointing="auto")
    plan = pmodel.plan
    kept = None
    if strategy == "data_parallel" and mode == "eager":  # the activations kept by one forward, as the plan predicts
        outputs = []
        kept = kept_bytes(lambda: outputs.append(pmodel(x)))
        del outputs
    losses = support.train_language_model(pmodel, _tokens, rank, world)
    state = pmodel.state_dict()
    return {"losses": losses, "params": {n: state[n].clone() for n, _ in model.named_parameters()},
            "chosen": plan.activation_checkpointing, "wrapped": _wrapped(model), "fits": plan.peak_memory <= budget,
            "predicted": plan.memory_breakdown["activations"], "kept": kept}


def _job(rank, world):
    return {case: support.outcome(_run, rank, world, *case) for case in CASES}


@pytest.fixture(scope="module")
def job():
    return run_on_ranks(_job, 2, timeout_s=900)


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_auto_on_two_ranks_equals_one_process(job, case):
    run = support.assert_ranks_equal_one_process([result[case] for result in job], _reference(), str(case))
    assert run["chosen"] and run["fits"], run["chosen"]
    assert {name: how for name, how in run["wrapped"].items() if how} == run["chosen"]
    if run["kept"] is not None:
        assert abs(run["predicted"] - run["kept"]) <= 0.15 * run["kept"], (run["predicted"], run["kept"])
