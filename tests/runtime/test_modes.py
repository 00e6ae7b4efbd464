"""Execution modes: ``set_mode`` / ``get_mode`` / ``mode(...)``, ``$AUTOPAR_MODE``, and the mode a compiled
model picks up at call time (the conftest starts every test with no mode set and no $AUTOPAR_MODE)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torch_autopar as autopar


def test_default_is_eager():
    assert autopar.get_mode() == "eager"


def test_set_mode_and_scoped_mode_restore():
    autopar.set_mode("graph")
    assert autopar.get_mode() == "graph"
    with autopar.mode("eager"):
        assert autopar.get_mode() == "eager"
        with autopar.mode("graph"):
            assert autopar.get_mode() == "graph"
        assert autopar.get_mode() == "eager"
    assert autopar.get_mode() == "graph"
    autopar.set_mode("eager")
    assert autopar.get_mode() == "eager"


def test_scoped_mode_restores_after_an_exception():
    with pytest.raises(ValueError):
        with autopar.mode("graph"):
            raise ValueError("inside")
    assert autopar.get_mode() == "eager"


def test_environment_variable_is_the_default(monkeypatch):
    monkeypatch.setenv("AUTOPAR_MODE", "graph")
    assert autopar.get_mode() == "graph"
    with autopar.mode("eager"):
        assert autopar.get_mode() == "eager"
    assert autopar.get_mode() == "graph"
    autopar.set_mode("eager")  # set_mode wins over the environment
    assert autopar.get_mode() == "eager"


@pytest.mark.parametrize("bad", ["fast", "EAGER", "", None])
def test_invalid_names_raise(bad):
    with pytest.raises(autopar.AutoparError,
                       match=r"^torch_autopar: set_mode\(\) expected a mode in \('eager', 'graph'\)"):
        autopar.set_mode(bad)
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: mode\(\) expected a mode in"):
        with autopar.mode(bad):
            pass
    assert autopar.get_mode() == "eager"  # a refused name changes nothing


def test_invalid_environment_variable_raises(monkeypatch):
    monkeypatch.setenv("AUTOPAR_MODE", "turbo")
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: the environment variable AUTOPAR_MODE .*'turbo'"):
        autopar.get_mode()


class ModeProbe(nn.Module):
    """Adds 1000 to its output when a compiler traces it (graph mode), nothing when its Python runs (eager)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x) + (1000.0 if torch.compiler.is_compiling() else 0.0)


def _mode_used(pmodel) -> str:
    return "graph" if pmodel(torch.randn(3, 4)).abs().min() > 100 else "eager"


def test_compiled_model_follows_the_mode_in_force_at_call_time(monkeypatch):
    pmodel = autopar.compile(ModeProbe(), torch.randn(3, 4))
    assert _mode_used(pmodel) == "eager"
    with autopar.mode("graph"):
        assert _mode_used(pmodel) == "graph"
    assert _mode_used(pmodel) == "eager"
    monkeypatch.setenv("AUTOPAR_MODE", "graph")
    assert _mode_used(pmodel) == "graph"
    autopar.set_mode("eager")
    assert _mode_used(pmodel) == "eager"


def test_mode_given_to_compile_wins_over_the_global_mode():
    fixed_eager = autopar.compile(ModeProbe(), torch.randn(3, 4), mode="eager")
    fixed_graph = autopar.compile(ModeProbe(), torch.randn(3, 4), mode="graph")
    with autopar.mode("graph"):
        assert _mode_used(fixed_eager) == "eager"
    assert _mode_used(fixed_graph) == "graph"
