"""Mixed precision (runtime.precision): bf16 training on 2 gloo ranks stays within 1e-2 relative of an fp32
one-process run over 10 steps (data parallel eager and graph, fully_shard and tensor_parallel eager and graph; MLP
and GPT); master parameters, their gradients and the optimizer state stay fp32; gradient collectives run in the
policy's reduce_dtype (counted, with their dtypes); the planner prices compute in param_dtype and gradient
reductions in reduce_dtype; a bad policy is a clear error.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

import torch_autopar as autopar
from torch_autopar.errors import AutoparError
from torch_autopar.runtime.comm_count import CollectiveCounter
from torch_autopar.testing import run_on_ranks
from tests import support

pytestmark = pytest.mark.timeout(900)  # one spawned job trains every case (12 x 10 steps) before the first test

STEPS = 10
REL = 1e-2
CASES = [(model, strategy, mode) for model in ("mlp", "gpt")
         for strategy in ("data_parallel", "fully_shard", "tensor_parallel") for mode in ("eager", "graph")]
BF16_REDUCE = autopar.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
REDUCE_CASES = [(strategy, policy) for strategy in ("data_parallel", "fully_shard", "tensor_parallel")
                for policy in ("bf16", "bf16_reduce")]
POLICIES = {"bf16": "bf16", "bf16_reduce": BF16_REDUCE}


def _train(rank, world, model_name, strategy, mode, steps=STEPS):
    torch._dynamo.reset()
    model = support.build_model(model_name)
    x, _ = support.global_batch(model_name, 0)
    pmodel = autopar.compile(model, x.chunk(world)[rank], strategy=strategy, mode=mode, mixed_precision="bf16")
    optimizer = support.make_optimizer("adamw", pmodel.parameters())
    losses = []
    for step in range(steps):
        x, y = support.global_batch(model_name, step)
        output = pmodel(x.chunk(world)[rank])
        loss = support.loss_fn(model_name, output, y.chunk(world)[rank])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    state = [value for values in optimizer.state.values() for value in values.values()
             if isinstance(value, torch.Tensor) and value.is_floating_point() and value.ndim > 0]
    return {"losses": losses, "output_dtype": str(output.dtype), "sharded": pmodel.mesh is not None,
            "param_dtypes": sorted({str(p.dtype) for p in pmodel.parameters()}),
            "grad_dtypes": sorted({str(p.grad.dtype) for p in pmodel.parameters() if p.grad is not None}),
            "state_dtypes": sorted({str(t.dtype) for t in state})}


def _collectives(rank, world, strategy, policy_name):
    """One eager step of the MLP: (phase, kind, dtype) → how many collectives ran."""
    model = support.build_model("mlp")
    x, y = support.global_batch("mlp", 0)
    pmodel = autopar.compile(model, x.chunk(world)[rank], strategy=strategy, mode="eager",
                             mixed_precision=POLICIES[policy_name])
    counted = Counter()
    with CollectiveCounter(pmodel.mesh) as forward:
        loss = support.loss_fn("mlp", pmodel(x.chunk(world)[rank]), y.chunk(world)[rank])
    with CollectiveCounter(pmodel.mesh) as backward:
        loss.backward()
    for phase, counter in (("forward", forward), ("backward", backward)):
        counted.update((phase, r.kind, r.dtype) for r in counter.records)
    return dict(counted)


def _graph_sync(rank, world, policy_name):
    """One graph-mode data-parallel step of the MLP: bytes the backward graphs all-reduce, dtypes counted."""
    torch._dynamo.reset()
    model = support.build_model("mlp")
    x, y = support.global_batch("mlp", 0)
    pmodel = autopar.compile(model, x.chunk(world)[rank], strategy="data_parallel", mode="graph",
                             mixed_precision=POLICIES[policy_name])
    loss = support.loss_fn("mlp", pmodel(x.chunk(world)[rank]), y.chunk(world)[rank])
    with CollectiveCounter() as counter:
        loss.backward()
    grads = {str(p.grad.dtype) for p in model.parameters()}
    return {"synced_bytes": pmodel.stats["synced_bytes_per_backward"], "grad_dtypes": grads,
            "dtypes": sorted({r.dtype for r in counter.records})}


def _tiny_loss(output, target):
    """An MSE so small that its fp16 gradients underflow to zero unless the loss is scaled (trained with Adam's
    eps far below the gradients, so that the updates do not depend on the loss's scale)."""
    return torch.nn.functional.mse_loss(output, target) * 1e-7


def _fp16_train(rank, world, strategy, mixed_precision):
    generator = torch.Generator().manual_seed(0)
    data = (torch.randn(64, 32, generator=generator), torch.randn(64, 8, generator=generator))
    model = support.build_model("mlp")
    network = autopar.compile(model, strategy=strategy, mixed_precision=mixed_precision)
    trainer = autopar.Model(network, _tiny_loss, torch.optim.AdamW(network.parameters(), lr=1e-2, eps=1e-20))
    metrics = trainer.train(4, data, batch_size=16, progress=False, shuffle=False)
    return {"losses": [m["loss"] for m in metrics], "scaler": trainer.grad_scaler is not None,
            "param_dtypes": sorted({str(p.dtype) for p in network.parameters()})}


def _small_job(rank, world):
    results = {("graph", name): support.outcome(_graph_sync, rank, world, name) for name in POLICIES}
    results.update({("fp16", strategy): support.outcome(_fp16_train, rank, world, strategy, "fp16")
                    for strategy in ("data_parallel", "fully_shard")})
    return results


def _job(rank, world):
    results = {case: support.outcome(_train, rank, world, *case) for case in CASES}
    results.update({("reduce", *case): support.outcome(_collectives, rank, world, *case) for case in REDUCE_CASES})
    return results


@pytest.fixture(scope="module")
def job():
    return run_on_ranks(_job, 2, timeout_s=900)


@pytest.fixture(scope="module")
def small_job():
    return run_on_ranks(_small_job, 2, timeout_s=600)


@functools.cache
def _fp32_reference(model_name) -> list[float]:
    model = support.build_model(model_name)
    optimizer = support.make_optimizer("adamw", model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = support.global_batch(model_name, step)
        loss = support.loss_fn(model_name, model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _ok(outcomes, what):
    for rank, (status, value) in enumerate(outcomes):
        assert status == "ok", f"rank {rank} {what}: {status}: {value}"
    return [value for _, value in outcomes]


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_bf16_within_1e2_of_fp32_one_process_and_masters_stay_fp32(job, case):
    model_name, strategy, mode = case
    runs = _ok([result[case] for result in job], case)
    assert runs[0]["sharded"] == (strategy != "data_parallel"), f"{case}: expected the strategy to run as named"
    mean = [sum(run["losses"][s] for run in runs) / len(runs) for s in range(STEPS)]
    support.assert_losses_close(mean, _fp32_reference(model_name), rel=REL, what=f"bf16 {case}")
    bf16 = [run["losses"] for run in runs]
    assert any(abs(a - b) > 0 for a, b in zip(mean, _fp32_reference(model_name))), (
        f"{case}: bf16 losses equal fp32 ones exactly ({bf16}): nothing ran in bf16")
    for run in runs:
        assert run["param_dtypes"] == run["grad_dtypes"] == run["state_dtypes"] == ["torch.float32"], (case, run)
        assert run["output_dtype"] == "torch.float32", (case, run)


def _reduce_counts(job, strategy, policy_name):
    runs = _ok([result[("reduce", strategy, policy_name)] for result in job], (strategy, policy_name))
    assert runs[0] == runs[1], f"ranks ran different collectives: {runs}"
    return runs[0]


@pytest.mark.parametrize("strategy", ["data_parallel", "fully_shard", "tensor_parallel"])
def test_gradient_reductions_run_in_reduce_dtype(job, strategy):
    for policy_name, reduce in (("bf16", "float32"), ("bf16_reduce", "bfloat16")):
        counts = _reduce_counts(job, strategy, policy_name)
        backward = {(kind, dtype): n for (phase, kind, dtype), n in counts.items() if phase == "backward"}
        reductions = {(kind, dtype) for kind, dtype in backward if kind in ("all_reduce", "reduce_scatter")}
        what = f"{strategy} {policy_name}: collectives {counts}"
        if strategy == "data_parallel":  # the bucket(s); the batch-size check rides along or runs in float64
            assert reductions and {dtype for _, dtype in reductions} <= {reduce, "float64"}, what
            assert any(dtype == reduce for _, dtype in reductions), what
        elif strategy == "fully_shard":  # activations and gathered parameters move in param_dtype, parameter
            # gradients into their shards in reduce_dtype (the plan computes some layers with sharded weights)
            assert {dtype for _, dtype in backward} <= {"bfloat16", reduce}, what
            assert any(dtype == reduce for _, dtype in backward), what
            gathers = {dtype for (phase, kind, dtype) in counts if phase == "forward" and kind == "all_gather"}
            assert gathers == {"bfloat16"}, what
        else:  # this plan's parameter gradients need no reduction; activation gradients move in param_dtype
            assert backward and {dtype for _, dtype in backward} == {"bfloat16"}, what


def test_one_process_bf16_keeps_fp32_masters_and_computes_in_bf16():
    model = support.build_model("mlp")
    seen = []
    model.layers[0].register_forward_hook(lambda module, args, out: seen.append((args[0].dtype, out.dtype)))
    pmodel = autopar.compile(model, mixed_precision="bf16")
    x, y = support.global_batch("mlp", 0)
    output = pmodel(x)
    support.loss_fn("mlp", output, y).backward()
    assert seen == [(torch.bfloat16, torch.bfloat16)]
    assert output.dtype == torch.float32
    assert {p.dtype for p in model.parameters()} == {p.grad.dtype for p in model.parameters()} == {torch.float32}
    assert model.state_dict().keys() == pmodel.state_dict().keys()


@pytest.mark.parametrize("policy, fragments", [
    ("int8", ("mixed_precision='int8'", "'bf16'")),
    (torch.bfloat16, ("mixed_precision=torch.bfloat16", "autopar.MixedPrecision")),
])
def test_bad_policy_name_is_a_clear_error(policy, fragments):
    support.assert_autopar_error(support.outcome(autopar.compile, support.build_model("mlp"), mixed_precision=policy),
                                 *fragments)


@pytest.mark.parametrize("fields, fragment", [
    ({"param_dtype": torch.int8}, "param_dtype=torch.int8"),
    ({"param_dtype": torch.float64}, "param_dtype=torch.float64"),
    ({"reduce_dtype": "bf16"}, "reduce_dtype='bf16'"),
    ({"output_dtype": torch.int64}, "output_dtype=torch.int64"),
])
def test_bad_policy_fields_are_clear_errors(fields, fragment):
    support.assert_autopar_error(support.outcome(autopar.MixedPrecision, **fields), fragment, "expected")


def test_pipeline_with_mixed_precision_is_refused():
    support.assert_autopar_error(
        support.outcome(autopar.plan, support.build_model("blocks"), support.global_batch("mlp", 0)[0],
                        mesh_shape=(2,), pipeline=2, mixed_precision="bf16"),
        "mixed_precision=", "pipeline=")


def _meta_plan(mixed_precision, strategy="data_parallel"):
    with torch.device("meta"):
        model = support.MLP((1024, 4096, 4096, 1024))
    x = torch.empty(512, 1024, device="meta")
    return autopar.plan(model, (x,), mesh_shape=(8,), hardware="h100", strategy=strategy,
                        mixed_precision=mixed_precision)


def test_plan_prices_compute_in_param_dtype_and_grad_sync_in_reduce_dtype():
    fp32, bf16, bf16_reduce = _meta_plan(None), _meta_plan("bf16"), _meta_plan(BF16_REDUCE)
    # forward and backward in bf16; the optimizer step updates the fp32 masters in both
    model_compute = lambda plan: plan.compute_time - plan.search_stats["optimizer_s"]  # noqa: E731
    assert bf16.search_stats["optimizer_s"] == fp32.search_stats["optimizer_s"] > 0
    assert model_compute(bf16) < 0.5 * model_compute(fp32), (model_compute(bf16), model_compute(fp32))
    sync = lambda plan: sum(c.nbytes * c.count for c in plan.collectives if c.phase == "grad_sync")  # noqa: E731
    assert sync(bf16) == sync(fp32) > 0
    assert sync(bf16_reduce) * 2 == sync(fp32)
    assert bf16.memory_breakdown["parameters"] == fp32.memory_breakdown["parameters"]  # fp32 masters
    assert bf16.memory_breakdown["activations"] < fp32.memory_breakdown["activations"]
    assert any("mixed precision" in note for note in bf16.notes)
    with pytest.raises(AutoparError, match="mixed_precision="):
        _meta_plan("float8")


def test_graph_mode_data_parallel_reduces_in_reduce_dtype(small_job):
    fp32, bf16 = ({**_ok([r[("graph", name)] for r in small_job], name)[0]} for name in ("bf16", "bf16_reduce"))
    assert fp32["synced_bytes"] == 2 * bf16["synced_bytes"] > 0, (fp32, bf16)
    assert "bfloat16" in bf16["dtypes"] and "bfloat16" not in fp32["dtypes"], (fp32, bf16)
    assert fp32["grad_dtypes"] == bf16["grad_dtypes"] == {"torch.float32"}


@pytest.mark.parametrize("strategy", ["data_parallel", "fully_shard"])
def test_fp16_model_train_scales_the_loss(small_job, strategy):
    """A loss whose fp16 gradients underflow trains as in fp32 (AdamW is scale-invariant) only with the scaler."""
    runs = _ok([r[("fp16", strategy)] for r in small_job], strategy)
    reference = _fp16_train(0, 1, "stand_alone", None)
    for run in runs:
        assert run["scaler"] and run["param_dtypes"] == ["torch.float32"], run
        support.assert_losses_close(run["losses"], reference["losses"], rel=REL, what=f"fp16 {strategy}")
    unscaled = _fp16_without_scaler()
    assert unscaled > 1.2 * reference["losses"][-1], (unscaled, reference["losses"])


def _fp16_without_scaler() -> float:
    """The last epoch's loss of ``_fp16_train``'s run written by hand without loss scaling."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 32, generator=generator), torch.randn(64, 8, generator=generator)
    network = autopar.compile(support.build_model("mlp"), mixed_precision="fp16")
    optimizer = torch.optim.AdamW(network.parameters(), lr=1e-2, eps=1e-20)
    for _ in range(4):
        losses = []
        for xb, yb in zip(x.split(16), y.split(16)):
            loss = _tiny_loss(network(xb), yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return sum(losses) / len(losses)
