"""Candidate strategies per node (strategies/enumerate.py) and the per-axis roles of named strategies
(strategies/roles.py) on the joint graph of a small GPT and a 2-D mesh."""

from __future__ import annotations

import operator

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from torch_autopar.capture import capture
from torch_autopar.errors import AutoparError
from torch_autopar.launch import offline_mesh
from torch_autopar.strategies.enumerate import enumerate_strategies, leaf_placements
from torch_autopar.strategies.roles import axis_roles, leaf_filter
from torch_autopar.testing.models import GPT, GPTConfig

MESH = (2, 2)
R, S0, S1 = Replicate(), Shard(0), Shard(1)
MATMULS = ("mm", "addmm", "bmm")


def _op(node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


@pytest.fixture(scope="module")
def program():
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2))
    return capture(model, (torch.empty(8, 32, dtype=torch.long, device="meta"),), {})


@pytest.fixture(scope="module")
def spaces(program):
    with offline_mesh(MESH) as mesh:
        return {strategy: enumerate_strategies(program, mesh, leaf_filter(program, axis_roles(strategy, 2)))
                for strategy in ("auto", "data_parallel", "fully_shard", "tensor_parallel")}


def _tensor_nodes(program):
    for node in program.graph.graph.nodes:
        if node.op in ("placeholder", "call_function") and isinstance(node.meta.get("val"), torch.Tensor):
            yield node


def test_every_node_gets_a_candidate(program, spaces):
    space = spaces["auto"]
    nodes = list(_tensor_nodes(program))
    assert len(nodes) > 200
    for node in nodes:
        candidates = space.candidates.get(node)
        assert candidates, f"no candidate for {node.format_node()}"
        for strategy in candidates:
            assert len(strategy.inputs) == len(node.all_input_nodes), node.format_node()
            if node.target is not operator.getitem:
                assert len(strategy.output) == len(MESH), (node.format_node(), strategy)
    assert not space.replicated_ops, space.replicated_ops  # every op of the GPT has a DTensor rule


def test_restricted_spaces_keep_a_candidate_for_every_node(program, spaces):
    for name, space in spaces.items():
        for node in _tensor_nodes(program):
            assert space.candidates.get(node), (name, node.format_node())


def test_matmuls_have_several_strategies_on_a_2d_mesh(program, spaces):
    space = spaces["auto"]
    matmuls = [node for node in program.graph.graph.nodes if node.op == "call_function" and _op(node) in MATMULS]
    assert {_op(node) for node in matmuls} == set(MATMULS)
    for node in matmuls:
        candidates = space.candidates[node]
        assert len(candidates) >= 9, (node.format_node(), len(candidates))
        outputs = {tuple(s.output) for s in candidates}
        assert (R, R) in outputs  # compute it whole on every device
        assert any(p == Partial() for out in outputs for p in out), node.format_node()  # contracted dim split
        assert any(all(isinstance(p, Shard) for p in out) for out in outputs)  # split over both axes


def test_identical_nodes_share_one_enumeration(program, spaces):
    """Repeated layers: the same op on the same shapes gets the very same candidate list (cheap enumeration)."""
    space = spaces["auto"]
    qkv = [node for node in program.graph.graph.nodes
           if node.op == "call_function" and _op(node) == "mm" and not program.is_backward(node)]
    by_shape = {}
    for node in qkv:
        by_shape.setdefault(tuple(node.meta["val"].shape), []).append(node)
    shared = [nodes for nodes in by_shape.values() if len(nodes) >= 2]
    assert shared
    for nodes in shared:
        assert all(space.candidates[n] is space.candidates[nodes[0]] for n in nodes[1:])


# leaves and roles ----------------------------------------------------------------------------------------------
def test_leaf_placements_keep_every_shard_non_empty():
    value = torch.empty(3, 5, device="meta")
    assert set(leaf_placements(value, 2, (2, 4))) == {(R, R), (S0, R), (S1, R), (R, S1), (S0, S1)}
    assert set(leaf_placements(torch.empty(8, device="meta"), 2, (2, 4))) == {(R, R), (S0, R), (R, S0), (S0, S0)}
    assert leaf_placements(torch.empty((), device="meta"), 2, (2, 2)) == [(R, R)]


def test_axis_roles_of_the_named_strategies():
    assert axis_roles("auto", 3) == ("free",) * 3
    assert axis_roles("data_parallel", 2) == ("dp", "dp")
    assert axis_roles("fully_shard", 2) == ("fsdp", "fsdp")
    assert axis_roles("tensor_parallel", 1) == ("tp",)
    assert axis_roles("tensor_parallel", 3) == ("dp", "dp", "tp")
    assert axis_roles("fsdp_tp", 3) == ("fsdp", "fsdp", "tp")
    with pytest.raises(AutoparError, match=r"^torch_autopar: strategy 'fsdp_tp' needs a mesh of at least 2 axes"):
        axis_roles("fsdp_tp", 1)


def _leaf_outputs(space, node) -> set:
    return {tuple(s.output) for s in space.candidates[node]}


def test_data_parallel_role_replicates_parameters_and_splits_inputs(program, spaces):
    space = spaces["data_parallel"]
    for node in program.param_nodes.values():
        assert _leaf_outputs(space, node) == {(R, R)}
    for node in program.input_nodes.values():
        assert _leaf_outputs(space, node) == {(S0, S0)}


def test_fully_shard_role_splits_parameters_on_dim_0(program, spaces):
    space = spaces["fully_shard"]
    for name, node in program.param_nodes.items():
        rows = node.meta["val"].shape[0]
        expected = {(S0, S0)} if rows >= 4 else {(R, R)}  # too few rows for 4 shards: replicated
        assert _leaf_outputs(space, node) == expected, name
    for node in program.input_nodes.values():
        assert _leaf_outputs(space, node) == {(S0, S0)}


def test_tensor_parallel_role_leaves_the_last_axis_free(program, spaces):
    """dp x tp: parameters replicated on the dp axis and free on the tp axis; inputs split on dp, whole on tp."""
    space = spaces["tensor_parallel"]
    for name, node in program.param_nodes.items():
        value = node.meta["val"]
        free = {p[1] for p in leaf_placements(value, 2, MESH) if p[0] == R}
        assert _leaf_outputs(space, node) == {(R, p) for p in free}, name
        if value.ndim == 2:
            assert {(R, S0), (R, S1)} <= _leaf_outputs(space, node), name
    for node in program.input_nodes.values():
        assert _leaf_outputs(space, node) == {(S0, R)}


def test_tangents_are_not_restricted(program, spaces):
    for tangent in program.tangent_nodes:
        assert _leaf_outputs(spaces["data_parallel"], tangent) == _leaf_outputs(spaces["auto"], tangent)
        assert len(_leaf_outputs(spaces["auto"], tangent)) > 1


def test_auto_leaves_are_every_leaf_placement(program, spaces):
    for node in list(program.param_nodes.values()) + list(program.input_nodes.values()):
        assert _leaf_outputs(spaces["auto"], node) == set(leaf_placements(node.meta["val"], 2, MESH))
