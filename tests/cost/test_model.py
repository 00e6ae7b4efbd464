"""``CostModel``: alpha-beta collective times per mesh axis worked out by hand, link choice by node, roofline
compute, shard factors, the memo of moves by canonical placement pair."""

from __future__ import annotations

import itertools
import random

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from torch_autopar.cost import CostModel, collectives_for, get_profile
from torch_autopar.cost.model import CollectiveCost, canonical_move
from torch_autopar.launch.mesh import offline_mesh

MB = 1_000_000
H100 = get_profile("h100")  # NVLink 450e9 B/s and 3 us; InfiniBand 50e9 B/s and 10 us; 8 per node; 80% efficiency


def test_all_reduce_on_8_h100_in_a_node():
    cost = CostModel(H100, (8,))
    expected = 2 * 7 * 3e-6 + 2 * 7 / 8 * MB / (450e9 * 0.8)
    assert cost.collective_time("all_reduce", 0, MB) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(42e-6 + 4.861111e-6, rel=1e-6)  # 46.86 us


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_to_all"])
def test_one_pass_collectives_on_8_h100(kind):
    cost = CostModel(H100, (8,))
    expected = 7 * 3e-6 + 7 / 8 * MB / (450e9 * 0.8)
    assert cost.collective_time(kind, 0, MB) == pytest.approx(expected, rel=1e-12)


def test_all_reduce_across_nodes_uses_the_inter_node_link():
    cost = CostModel(H100, (16,))
    expected = 2 * 15 * 10e-6 + 2 * 15 / 16 * MB / (50e9 * 0.8)
    assert cost.collective_time("all_reduce", 0, MB) == pytest.approx(expected, rel=1e-12)


def test_each_axis_of_a_2d_mesh_has_its_link():
    """(4, 8) on 8-GPU nodes: axis 1 (8 consecutive ranks) stays in a node, axis 0 (stride 8) crosses nodes."""
    cost = CostModel(H100, (4, 8))
    assert cost.link(1) == H100.intra_node and cost.link(0) == H100.inter_node
    assert cost.collective_time("all_gather", 0, MB) == pytest.approx(3 * 10e-6 + 3 / 4 * MB / (50e9 * 0.8), rel=1e-12)
    assert cost.collective_time("all_gather", 1, MB) == pytest.approx(7 * 3e-6 + 7 / 8 * MB / (450e9 * 0.8), rel=1e-12)
    assert CostModel(H100, (2, 4)).link(0) == H100.intra_node  # 2 x 4 = 8 ranks: one node


def test_trivial_collectives_are_free():
    cost = CostModel(H100, (1, 8))
    assert cost.collective_time("all_reduce", 0, MB) == 0.0
    assert cost.collective_time("all_reduce", 1, 0) == 0.0


def test_cpu_gloo_profile():
    cost = CostModel(get_profile("cpu-gloo"), (2,))
    assert cost.collective_time("all_reduce", 0, MB) == pytest.approx(2 * 60e-6 + MB / 1.5e9, rel=1e-12)


def test_compute_time_is_a_roofline_plus_overhead():
    cost = CostModel(H100, (8,))
    flops, nbytes = 1e12, 1e6
    assert cost.compute_time(flops, nbytes, "bfloat16") == pytest.approx(flops / (989e12 * 0.6) + 5e-6, rel=1e-12)
    assert cost.compute_time(1e3, 1e9, "float32") == pytest.approx(1e9 / 3.35e12 + 5e-6, rel=1e-12)


def test_shard_factor():
    cost = CostModel(H100, (4, 8))
    assert cost.shard_factor((Replicate(), Replicate())) == 1
    assert cost.shard_factor((Shard(0), Replicate())) == 4
    assert cost.shard_factor((Shard(0), Shard(1))) == 32
    assert cost.shard_factor((Partial(), Shard(0))) == 8


def test_collectives_for_transitions():
    mesh = (4, 8)

    def kinds(source, target):
        return [(c.kind, c.axis, c.nbytes) for c in collectives_for(source, target, 1024, mesh)]

    assert kinds((Replicate(), Replicate()), (Replicate(), Replicate())) == []
    assert kinds((Partial(), Replicate()), (Replicate(), Replicate())) == [("all_reduce", 0, 1024)]
    assert kinds((Partial(), Partial()), (Replicate(), Replicate())) == [("all_reduce", 0, 1024),
                                                                         ("all_reduce", 1, 1024)]
    assert kinds((Replicate(), Partial()), (Replicate(), Shard(0))) == [("reduce_scatter", 1, 1024)]
    assert kinds((Shard(0), Replicate()), (Replicate(), Replicate())) == [("all_gather", 0, 1024)]
    assert kinds((Replicate(), Replicate()), (Shard(0), Replicate())) == []  # a local slice: no communication
    # all-gather along axis 1 of a tensor still sharded over axis 0 moves a quarter of it
    assert kinds((Shard(0), Shard(1)), (Shard(0), Replicate())) == [("all_gather", 1, 256)]


def test_canonical_move_renumbers_dims_by_first_appearance_and_keeps_what_differs():
    assert canonical_move((Shard(2), Replicate()), (Replicate(), Shard(3))) == ((Shard(0), Replicate()),
                                                                                 (Replicate(), Shard(1)))
    assert canonical_move((Shard(1), Shard(1)), (Shard(3), Partial())) == ((Shard(0), Shard(0)), (Shard(1), Partial()))
    same_dim = canonical_move((Shard(0), Shard(0)), (Replicate(), Shard(0)))
    assert same_dim != canonical_move((Shard(0), Shard(1)), (Replicate(), Shard(1)))


def test_memoised_moves_and_prices_equal_dtensors_steps_on_the_pairs_as_given():
    """The memo (by canonical pair) answers exactly what pricing each pair as given answers, on a 3-D mesh."""
    options = [Replicate(), Partial(), Partial("max")] + [Shard(d) for d in range(3)]
    layouts = list(itertools.product(options, repeat=3))
    pairs = random.Random(0).sample([(s, t) for s in layouts for t in layouts], 300)
    with offline_mesh((2, 4, 8)) as mesh:
        memoised, fresh = CostModel(H100, (2, 4, 8), mesh), CostModel(H100, (2, 4, 8), mesh)
        for source, target in pairs:
            assert memoised.moves(source, target, 3 << 20) == [
                CollectiveCost(kind, axis, int((3 << 20) * share)) for kind, axis, share in fresh._unit_moves(source, target)]
            latency, per_byte = memoised.reshard_coefficients(source, target)
            moves = fresh.moves(source, target, 1 << 30)
            assert latency == sum(fresh.collective_coefficients(m.kind, m.axis)[0] for m in moves)
            assert per_byte == sum(fresh.collective_coefficients(m.kind, m.axis)[1] * m.nbytes / (1 << 30) for m in moves)
