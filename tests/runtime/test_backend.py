"""The "autopar" torch.compile backend (one process) and the data-parallel backend (gradient all-reduces in the
compiled backward graph), the latter on a fake process group: its collectives return their input, so each
averaged gradient is the local one divided by the world size."""

from __future__ import annotations

import torch
import torch.distributed as dist

import torch_autopar  # noqa: F401  (registers the "autopar" backend)
from torch_autopar.runtime.backend import data_parallel_backend
from torch_autopar.testing import fake_process_group
from torch_autopar.testing.models import GPT, MLP, gpt_loss


def _pair(factory):
    torch.manual_seed(0)
    first = factory()
    torch.manual_seed(0)
    return first, factory()


def test_torch_compile_with_autopar_backend_matches_eager():
    compiled_model, plain = _pair(MLP)
    compiled = torch.compile(compiled_model, backend="autopar")
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    out, ref = compiled(x), plain(x)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, p), q in zip(compiled_model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_torch_compile_with_autopar_backend_on_gpt():
    compiled_model, plain = _pair(GPT)
    compiled = torch.compile(compiled_model, backend="autopar", fullgraph=True)
    tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    loss, ref = gpt_loss(compiled(tokens[:, :-1]), tokens[:, 1:]), gpt_loss(plain(tokens[:, :-1]), tokens[:, 1:])
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    loss.backward()
    ref.backward()
    for (name, p), q in zip(compiled_model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_data_parallel_backend_all_reduces_each_bucket_in_backward():
    world = 4
    model, plain = _pair(MLP)
    named = dict(model.named_parameters())
    names = list(named)
    buckets = [names[4:], names[2:4], names[:2]]  # the order backward finishes them
    stats: dict = {}
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    with fake_process_group(world):
        backend = data_parallel_backend(named, buckets, dist.group.WORLD, stats)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        compiled(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert stats["all_reduces_per_backward"] == len(buckets)
    assert stats["synced_bytes_per_backward"] == sum(p.numel() * 4 for p in named.values())
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad * world, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_graph_compiler_is_selected_by_the_environment_and_a_bad_name_is_a_clear_error(monkeypatch):
    from torch_autopar.errors import AutoparError
    from torch_autopar.runtime import backend

    monkeypatch.delenv("AUTOPAR_GRAPH_COMPILER", raising=False)
    assert backend.graph_compiler() == ("inductor" if torch.cuda.is_available() else "python")
    monkeypatch.setenv("AUTOPAR_GRAPH_COMPILER", "inductor")
    assert backend.graph_compiler() == "inductor"
    monkeypatch.setenv("AUTOPAR_GRAPH_COMPILER", "tvm")
    try:
        backend.graph_compiler()
    except AutoparError as error:
        assert str(error).startswith("torch_autopar: AUTOPAR_GRAPH_COMPILER='tvm': expected one of")
    else:
        raise AssertionError("an unknown graph compiler was accepted")


def test_a_graph_compiler_failure_is_named_as_such_not_as_a_graph_break():
    """Inductor failing on a captured graph is not a graph break: the error says which compiler failed and how
    to run without it."""
    from torch._inductor.exc import InductorError

    import torch_autopar as autopar

    pmodel = autopar.compile(MLP((4, 8, 2)), torch.randn(2, 4), mode="graph")
    message = str(pmodel._graph_error(InductorError(AssertionError("both a fallback and a decomp"), None)))
    assert message.startswith("torch_autopar: graph mode captured MLP.forward, but the graph compiler"), message
    assert "both a fallback and a decomp" in message and "AUTOPAR_GRAPH_COMPILER=python" in message
    assert "as one graph" not in message
