"""Module boundaries read from a plan's node layouts (what eager mode's hooks hold), and a graph-mode plan priced
again from its own node layouts (what the per-rank program runs): offline, on fake meshes."""

from __future__ import annotations

import pytest
import torch

import torch_autopar as autopar
from torch_autopar import api, launch
from torch_autopar.capture import capture
from torch_autopar.capture.scopes import module_scopes
from torch_autopar.cost import get_profile
from torch_autopar.search.planner import Planner
from torch_autopar.strategies.propagate import ModulePins
from tests import support


class _CallsTwice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) + self.a(x * 2))


def test_each_once_called_submodule_has_its_boundary_with_the_plans_layouts():
    model = support.build_model("mlp")
    x, _ = support.global_batch("mlp", 0)
    plan = autopar.plan(model, (x,), mesh_shape=(2,), strategy="fully_shard", hardware="cpu-gloo", fold_layers=False,
                        mode="graph")
    assert sorted(plan.module_layouts) == ["layers.0", "layers.1", "layers.2"]
    first = plan.module_layouts["layers.0"]
    assert [(shape, layout) for _, shape, layout in first.inputs] == [((8, 32), plan.node_layouts["addmm"].inputs[1])]
    assert [(name, shape, layout) for name, shape, layout in first.outputs] == [
        ("addmm", (8, 64), plan.node_layouts["addmm"].output)]
    second = plan.module_layouts["layers.1"]
    assert second.inputs == (("relu", (8, 64), plan.node_layouts["addmm_1"].inputs[1]),)


def test_module_layouts_are_saved_and_loaded(tmp_path):
    model = support.build_model("gpt")
    x, _ = support.global_batch("gpt", 0)
    plan = autopar.plan(model, (x,), mesh_shape=(2,), strategy="tensor_parallel", hardware="cpu-gloo",
                        fold_layers=False)
    assert {"blocks.0", "blocks.0.attn", "blocks.0.attn.qkv", "blocks.1.fc", "ln_f"} <= set(plan.module_layouts)
    plan.save(tmp_path / "plan.json")
    loaded = autopar.Plan.load(tmp_path / "plan.json")
    assert loaded.module_layouts == plan.module_layouts
    assert loaded.param_compute_placements == plan.param_compute_placements


def test_a_module_called_twice_has_no_boundary_and_backward_ops_take_their_forward_ops_scope():
    program = capture(_CallsTwice(), (torch.randn(4, 8),))
    scopes = module_scopes(program)
    assert {scope for scope in scopes.values()} == {(), ("b",)}
    backward = [node for node in scopes if program.is_backward(node)]
    assert any(scopes[node] == ("b",) for node in backward)


def test_a_value_crosses_out_of_its_modules_then_into_the_users():
    made, used = object(), object()
    pins = ModulePins(scopes={made: ("blocks.0", "blocks.0.fc"), used: ("blocks.0", "blocks.0.out")},
                      entering={("blocks.0.out", made): ("R",)}, leaving={})
    assert pins.crossings(made, used) == [("blocks.0.fc", None), ("blocks.0.out", ("R",))]


@pytest.mark.parametrize("model_name", ["mlp", "gpt", "cnn"])
@pytest.mark.parametrize("mesh_shape,strategy", [((2,), "tensor_parallel"), ((2,), "fully_shard"), ((2,), "auto"),
                                                 ((2, 2), "fsdp_tp")])
def test_a_graph_plan_priced_from_its_node_layouts_is_the_plan(model_name, mesh_shape, strategy):
    model = support.build_model(model_name)
    x, _ = support.global_batch(model_name, 0)
    with launch.offline_mesh(mesh_shape) as mesh:
        planner = Planner(api._capture(model, (x,), {}, None), mesh, mesh.mesh_dim_names,
                          hardware=get_profile("cpu-gloo"), global_batch=x.shape[0], mode="graph",
                          bucket_cap_bytes=0)  # as planned: one gradient per bucket
        plan = planner.plan(strategy)  # the search's plan, before it is priced as it runs
        relaid = planner.executed(plan)
    assert sorted(map(repr, relaid.collectives)) == sorted(map(repr, plan.collectives))
    assert relaid.estimated_step_time == pytest.approx(plan.estimated_step_time, rel=1e-12)
    assert relaid.peak_memory == plan.peak_memory
