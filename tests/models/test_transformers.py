"""The models people bring: ``transformers``' GPT-2, LLaMA (grouped-query attention), Mistral, Qwen2, Qwen3,
Gemma 2, Phi-3, Mixtral and DeepSeek-V3 (mixtures of experts), BERT, T5 and ViT, built from small configs (no
download) and called as their docs show (``model(**batch).loss``).

Every model captures in one process (dynamo front end, as torch.export: library code guarded by
``torch.compiler.is_compiling()`` takes its compiler path). On 2 gloo ranks each strategy (data_parallel,
fully_shard, tensor_parallel, auto) in eager and graph mode trains 3 AdamW steps and must equal one process:
losses 1e-5 relative, full parameters rtol 1e-4 / atol 1e-5. One representative set runs by default; the full
matrix (12 models x 4 strategies x 2 modes) runs with ``-m slow``. One spawned 2-rank job per model runs all
of that model's cases.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from torch_autopar.capture import capture, fake_global_inputs  # noqa: E402
from torch_autopar.testing import run_on_ranks  # noqa: E402
from torch_autopar.testing.hf_models import HF_MODELS, build_hf_model, hf_batch  # noqa: E402
from tests import support  # noqa: E402
from tests.models import hf_cases  # noqa: E402

STRATEGIES = ("data_parallel", "fully_shard", "tensor_parallel", "auto")
MODES = ("eager", "graph")
DEFAULT_CASES = {
    "llama": [("fully_shard", "eager"), ("tensor_parallel", "eager"), ("tensor_parallel", "graph"),
              ("data_parallel", "graph")],
    "gpt2": [("fully_shard", "graph"), ("auto", "eager")],
    "mixtral": [("fully_shard", "eager")],
}
"""The representative set: GQA + SDPA + rotary under both sharded families and graph-mode data parallelism
(LLaMA), GPT-2's logger calls and tied head in graph mode under fully_shard, auto, and Mixtral's experts in eager
mode, where transformers calls ``torch._grouped_mm`` in fp32, which DTensor's propagation cannot place on CPU."""


def _job(rank, world, name, cases):
    return {case: support.outcome(hf_cases.run_case, rank, world, name, *case) for case in cases}


@pytest.fixture(scope="module")
def jobs():
    return {}


def _outcomes(jobs, name, cases):
    key = (name, tuple(cases))
    if key not in jobs:
        jobs[key] = run_on_ranks(_job, 2, name, list(cases), timeout_s=1200)
    return jobs[key]


def _check(results, name, case):
    ref_losses, ref_params = hf_cases.reference(name)
    for rank, result in enumerate(results):
        status, run = result[case]
        assert status == "ok", f"rank {rank} {name} {case}: {status}: {run}"
        what = f"rank {rank} {name} {case} (plan: {run['strategy']})"
        support.assert_losses_close(run["losses"], ref_losses, what=what)
        support.assert_params_close(run["params"], ref_params, what=what)
        strategy = case[0]
        if strategy in ("fully_shard", "tensor_parallel"):
            assert run["sharded"], f"{what}: a {strategy} plan should shard something"


@pytest.mark.parametrize("name", HF_MODELS)
def test_captures_forward_and_backward(name):
    model = build_hf_model(name)
    args, kwargs = fake_global_inputs(model, (), hf_batch(name, 4), 1)
    program = capture(model, args, kwargs)
    assert set(program.params) == {n for n, _ in model.named_parameters()}
    assert set(program.grad_nodes) == set(program.params), "every parameter gets a gradient"
    assert program.output_nodes, "the loss and logits are outputs"


@pytest.mark.parametrize(("name", "case"), [(n, c) for n, cases in DEFAULT_CASES.items() for c in cases],
                         ids=lambda v: v if isinstance(v, str) else "-".join(v))
def test_equals_one_process(jobs, name, case):
    _check(_outcomes(jobs, name, DEFAULT_CASES[name]), name, case)


FULL_MATRIX = [(name, (strategy, mode)) for name in HF_MODELS for strategy in STRATEGIES for mode in MODES]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "case"), FULL_MATRIX, ids=lambda v: v if isinstance(v, str) else "-".join(v))
def test_full_matrix_equals_one_process(jobs, name, case):
    every_case = [c for n, c in FULL_MATRIX if n == name]
    _check(_outcomes(jobs, name, every_case), name, case)


def test_library_guards_take_the_compiler_path():
    """transformers' mask code checks ``is_tracing`` (fake tensors / torch.compiler.is_compiling()) to skip
    data-dependent checks; capture must look like a compiler to it, as torch.export does: the ``.item()`` below
    would fail on fake tensors if the guard let it run."""

    class Guarded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            if not torch.compiler.is_compiling() and x.sum().item() > 0:  # data-dependent outside compilers
                x = x * 2
            return self.fc(x)

    model = Guarded()
    args, kwargs = fake_global_inputs(model, (torch.randn(2, 4),), {}, 1)
    program = capture(model, args, kwargs)
    assert "fc.weight" in program.params


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_gradients(policy):
    """The layers' key/value cache is turned off (as transformers' gradient_checkpointing_enable does): a
    recomputed layer would otherwise see the cache its forward already grew."""
    import torch_autopar as autopar

    model, reference = build_hf_model("llama"), build_hf_model("llama")
    batch = hf_batch("llama", 4)
    autopar.compile(model, example_kwargs=batch, strategy="stand_alone", activation_checkpointing=policy)(
        **batch).loss.backward()
    reference(**batch).loss.backward()
    assert model.config.use_cache is False
    for (name, param), other in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, other.grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
