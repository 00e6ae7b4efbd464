"""``ParallelModule`` in one process: eager mode runs the user's Python forward, graph mode the compiled one;
the ``@autopar.compile`` class decorator; state dicts under the user's own names."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torch_autopar as autopar
from torch_autopar.testing.models import MLP


class Printing(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x):
        print(f"forward on a batch of {x.shape[0]}")
        return self.linear(x)


@autopar.compile
class DecoratedNet(nn.Module):
    """A user model compiled by the bare decorator."""

    def __init__(self, width: int = 8, *, out: int = 3):
        super().__init__()
        self.fc = nn.Linear(width, out)

    def forward(self, x):
        return torch.tanh(self.fc(x))


@autopar.compile(strategy="data_parallel", mode="graph")
class DecoratedWithOptions(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.fc = nn.Linear(width, 2)

    def forward(self, x):
        return self.fc(x).relu()


def _x(batch=4, width=8):
    return torch.randn(batch, width, generator=torch.Generator().manual_seed(0))


def test_eager_mode_runs_the_python_forward_at_every_call(capsys):
    pmodel = autopar.compile(Printing(), _x(), mode="eager")  # planned here, before the calls counted below
    capsys.readouterr()
    for batch in (4, 4, 2):
        pmodel(_x(batch))
    assert capsys.readouterr().out.splitlines() == [f"forward on a batch of {b}" for b in (4, 4, 2)]


def test_eager_is_the_default_mode(capsys):
    pmodel = autopar.compile(Printing(), _x())
    capsys.readouterr()
    pmodel(_x())
    pmodel(_x())
    assert capsys.readouterr().out.count("forward on a batch of 4") == 2


def test_graph_mode_runs_a_python_side_effect_between_compiled_pieces(capsys):
    """As torch.compile does: the print breaks the graph, runs at every call, and the numbers stay the same."""
    model = Printing()
    pmodel = autopar.compile(model, _x(), mode="graph")
    capsys.readouterr()
    for _ in range(2):
        torch.testing.assert_close(pmodel(_x()), model(_x()), rtol=0, atol=0)
    assert capsys.readouterr().out.count("forward on a batch of 4") == 4


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_one_process_matches_the_plain_module(mode):
    torch.manual_seed(0)
    plain = MLP()
    torch.manual_seed(0)
    model = MLP()
    pmodel = autopar.compile(model, mode=mode)
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # the second call reuses the plan (and the compiled graph)
        output = pmodel(x)
        torch.testing.assert_close(output, plain(x), rtol=1e-6, atol=1e-6)
    output.square().sum().backward()
    plain(x).square().sum().backward()
    assert pmodel.plan.strategy == "stand_alone"
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_bare_decorator_returns_a_working_parallel_module():
    torch.manual_seed(0)
    net = DecoratedNet(6, out=2)
    assert isinstance(net, autopar.ParallelModule)
    assert DecoratedNet.__name__ == "DecoratedNet"
    assert DecoratedNet.__doc__ == "A user model compiled by the bare decorator."
    torch.manual_seed(0)
    plain = nn.Linear(6, 2)
    x = _x(width=6)
    output = net(x)
    torch.testing.assert_close(output, torch.tanh(plain(x)), rtol=0, atol=0)
    output.sum().backward()
    assert net.module.fc.weight.grad is not None
    assert sorted(net.state_dict()) == ["fc.bias", "fc.weight"]


def test_decorator_with_options_applies_them():
    torch.manual_seed(0)
    net = DecoratedWithOptions()
    assert isinstance(net, autopar.ParallelModule)
    torch.manual_seed(0)
    plain = nn.Linear(8, 2)
    torch.testing.assert_close(net(_x()), plain(_x()).relu(), rtol=1e-6, atol=1e-6)
    assert net.plan.strategy == "data_parallel"
    assert net.mode == "graph"
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    net(_x()).sum().backward()
    optimizer.step()


def test_state_dict_uses_the_users_names_and_loads_into_the_plain_model():
    torch.manual_seed(0)
    pmodel = autopar.compile(MLP())
    plain = MLP(dims=(32, 64, 64, 8))
    assert pmodel.state_dict().keys() == plain.state_dict().keys()
    plain.load_state_dict(pmodel.state_dict())
    other = MLP()
    pmodel.load_state_dict(other.state_dict())
    for name, tensor in pmodel.state_dict().items():
        assert torch.equal(tensor, other.state_dict()[name])
