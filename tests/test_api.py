"""The public entry points ``autopar.compile`` and ``autopar.plan``: argument checking in one process.

Every mistake is an ``AutoparError`` whose message starts with ``torch_autopar:`` (errors.py) and names the
valid choices.
"""

from __future__ import annotations

import pytest
import torch

import torch_autopar as autopar
from torch_autopar.search import STRATEGIES
from torch_autopar.testing.models import MLP


def _x(batch=4):
    return torch.randn(batch, 32, generator=torch.Generator().manual_seed(0))


def test_autopar_error_message_has_the_prefix_once():
    assert str(autopar.AutoparError("bad")) == "torch_autopar: bad"
    assert str(autopar.AutoparError("torch_autopar: bad")) == "torch_autopar: bad"
    assert issubclass(autopar.AutoparError, RuntimeError)


@pytest.mark.parametrize("entry", ["compile", "plan"])
def test_unknown_strategy_lists_the_valid_names(entry):
    with pytest.raises(autopar.AutoparError) as info:
        if entry == "compile":
            autopar.compile(MLP(), strategy="nonsense")
        else:
            autopar.plan(MLP(), _x(), strategy="nonsense")
    message = str(info.value)
    assert message.startswith("torch_autopar: strategy='nonsense'")
    for name in STRATEGIES:
        assert repr(name) in message


def test_compile_checks_mode_mesh_and_model():
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: mode='fast'.*'eager'.*'graph'"):
        autopar.compile(MLP(), mode="fast")
    for mesh in [(2,), 2, (1, 2)]:
        with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: mesh=.* has 2 devices but this job has 1"):
            autopar.compile(MLP(), mesh=mesh)
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: compile\(\) expected an nn.Module"):
        autopar.compile(lambda x: x)


def test_compile_with_a_mesh_of_this_job_size_works():
    x = _x()
    torch.manual_seed(0)
    pmodel = autopar.compile(MLP(), mesh=(1,))
    torch.manual_seed(0)
    torch.testing.assert_close(pmodel(x), MLP()(x), rtol=0, atol=0)


def test_compile_plans_at_the_first_call_or_from_example_inputs():
    lazy = autopar.compile(MLP())
    assert lazy.plan is None
    lazy(_x())
    assert isinstance(lazy.plan, autopar.Plan)
    eager_plan = autopar.compile(MLP(), _x())
    assert isinstance(eager_plan.plan, autopar.Plan)
    assert eager_plan.plan.fingerprint == lazy.plan.fingerprint


@pytest.mark.parametrize("when", ["first call", "example_inputs"])
def test_plan_for_another_model_is_refused(when):
    plan = autopar.plan(MLP(), _x(), mesh_shape=(1,))
    other = MLP(dims=(32, 16, 8))
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: this plan was made for another model"):
        if when == "first call":
            autopar.compile(other, strategy=plan)(_x())
        else:
            autopar.compile(other, _x(), strategy=plan)


def test_plan_for_another_world_size_is_refused():
    plan = autopar.plan(MLP(), _x(), mesh_shape=(2,), strategy="data_parallel")
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: this plan needs 2 ranks .* the job has 1"):
        autopar.compile(MLP(), strategy=plan)(_x())


def test_a_matching_plan_is_used_as_is():
    plan = autopar.plan(MLP(), _x(), mesh_shape=(1,))
    pmodel = autopar.compile(MLP(), strategy=plan)
    pmodel(_x())
    assert pmodel.plan is plan


@pytest.mark.parametrize("mismatch", ["model", "mesh"])
def test_offline_plan_refuses_a_plan_for_another_model_or_mesh(mismatch):
    plan = autopar.plan(MLP(), _x(), mesh_shape=(4,), strategy="data_parallel")
    model, mesh = (MLP(dims=(32, 16, 8)), (4,)) if mismatch == "model" else (MLP(), (8,))
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: "):
        autopar.plan(model, _x(), mesh_shape=mesh, strategy=plan)


@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"mesh_shape": (0,)}, r"mesh shape of positive sizes"),
    ({"mesh_shape": ()}, r"mesh shape of positive sizes"),
    ({"mesh_shape": (2, 2), "axis_names": ("dp",)}, r"axis_names \('dp',\) must name each of the 2 mesh axes"),
    ({"hardware": "tpu-v9"}, r"hardware='tpu-v9': expected one of .*'h100'"),
])
def test_plan_checks_its_arguments(kwargs, pattern):
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: .*" + pattern):
        autopar.plan(MLP(), _x(), **kwargs)


def test_plan_needs_a_batch():
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: plan\(\) needs one global batch .* found neither"):
        autopar.plan(MLP(), mesh_shape=(2,))
    with pytest.raises(autopar.AutoparError, match=r"found neither \(or an empty tuple\)"):
        autopar.plan(MLP(), (), mesh_shape=(2,))
