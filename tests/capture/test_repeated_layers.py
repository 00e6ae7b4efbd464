"""Repeated-layer tying (capture/layers.py): the nodes of layers 1..L-1 are tied to layer 0's, so the search
solves one layer for all of them and the number of MILP decisions does not grow with depth."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from torch_autopar.capture import capture
from torch_autopar.capture.layers import find_repeated_layers, layer_of_param, node_signature
from torch_autopar.cost import CostModel, get_profile
from torch_autopar.launch import offline_mesh
from torch_autopar.search.problem import build_problem
from torch_autopar.strategies.enumerate import enumerate_strategies
from torch_autopar.testing.models import GPT, GPTConfig

MESH = (2,)


def _program(n_layer: int):
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=n_layer))
    return capture(model, (torch.empty(8, 32, dtype=torch.long, device="meta"),), {})


@pytest.fixture(scope="module")
def programs():
    return {n: _program(n) for n in (2, 8)}


@pytest.fixture(scope="module")
def problems(programs):
    result = {}
    with offline_mesh(MESH) as mesh:
        cost = CostModel(get_profile("h100"), MESH)
        for n, program in programs.items():
            space = enumerate_strategies(program, mesh)
            result[n] = build_problem(program, space, cost, lambda node: (Shard(0),))
    return result


def test_layer_of_param():
    assert layer_of_param("blocks.3.attn.qkv.weight") == ("blocks", 3)
    assert layer_of_param("encoder.layers.11.fc.bias") == ("encoder.layers", 11)
    assert layer_of_param("tok.weight") is None
    assert layer_of_param("ln_f.bias") is None


def test_decisions_do_not_grow_with_depth(problems):
    assert len(problems[2].decisions) == len(problems[8].decisions)
    assert problems[2].size()[0] == problems[8].size()[0]  # choice variables too


def test_layer_decisions_stand_for_every_layer(problems, programs):
    """A decision made for layer 0 places its copy in all 8 layers (members == 8 for the layer's nodes)."""
    members = {d.members for d in problems[8].decisions}
    assert 8 in members and max(members) == 8
    layer0_params = [node for name, node in programs[8].param_nodes.items() if name.startswith("blocks.0.")]
    for node in layer0_params:
        assert problems[8].decisions[problems[8].decision_of[node]].members == 8, node.name


def test_edge_variables_do_not_grow_with_depth(problems):
    assert problems[2].size()[1] == problems[8].size()[1]


def test_tied_nodes_have_identical_signatures(programs):
    program = programs[8]
    tied = find_repeated_layers(program)
    assert tied
    params = {node: name for name, node in program.param_nodes.items()}
    compared = 0
    for node, representative in tied.items():
        assert representative not in tied, "representatives are roots: no chains"
        if node in params:
            name, rep_name = params[node], params[representative]
            assert name.split(".", 2)[2] == rep_name.split(".", 2)[2]  # same parameter of another layer
            assert node.meta["val"].shape == representative.meta["val"].shape
        else:
            assert node_signature(node) == node_signature(representative), node.format_node()
            compared += 1
    assert compared > 100


def test_every_layer_after_the_first_is_tied(programs):
    """Each of the 6 extra layers adds the same number of tied nodes, at least as many as the one tied layer of
    the 2-layer model (whose last layer also borders the final layer norm, so fewer of its nodes match)."""
    tied = {n: len(find_repeated_layers(program)) for n, program in programs.items()}
    extra = tied[8] - tied[2]
    assert tied[2] > 0 and extra % 6 == 0 and extra // 6 >= tied[2], tied
    params_per_layer = sum(1 for name in programs[8].params if name.startswith("blocks.0."))
    tied_nodes = find_repeated_layers(programs[8])
    tied_params = [name for name, node in programs[8].param_nodes.items() if node in tied_nodes]
    assert len(tied_params) == 7 * params_per_layer
    assert not any(name.startswith("blocks.0.") for name in tied_params)
