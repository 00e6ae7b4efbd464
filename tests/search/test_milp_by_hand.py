"""The MILP's optimum checked against costs worked out by hand from the CostModel formulas, and against brute
force over every choice of small problems.

Set-up that keeps the hand computation exact: a 2-layer MLP (x @ W1^T + b1 → relu → @ W2^T + b2) on a mesh of
2 devices, a hardware profile with no per-op overhead and unlimited memory bandwidth (so every op costs
flops / (peak · efficiency): only the five matmuls count, the element-wise ops have no FLOPs), and one link
with known alpha and bandwidth:

    compute = matmul FLOPs / 2 / (peak · efficiency)      (every matmul has a batch-sharded operand)
    all_reduce(n)            = 2(p-1)·alpha + 2(p-1)/p · n · beta      p = 2, beta = 1 / (bandwidth · comm_eff)
    all_gather(n) = reduce_scatter(n) = (p-1)·alpha + (p-1)/p · n · beta
    backward = backward matmul FLOPs / 2 / (peak · efficiency)
    exposed(syncs, last) = max(last, Σ syncs − backward)   gradient syncs overlap backward, except the sync of
                                                          W1's gradient, which is ready last
    by_hand(sharded) = compute + one all_gather per layer of its sharded parameters' bytes (a layer's parameters
                       are gathered together: one latency) + all_gather(W2) again when W2 is sharded (backward's
                       dL/dh reads it) + exposed(reduce_scatter(n) per sharded param, all_reduce(n) per other,
                       less one latency when W2's and B2's gradients are reduced alike: graph mode's buckets
                       reduce a layer's gradients reduced the same way together; W1's, ready last, keeps its own;
                       the problems here are built for graph mode)

On a ring, all_gather + reduce_scatter = all_reduce, so sharding one parameter used once costs what replicating it
does, but sharding both of a layer's parameters saves one latency (two reduce-scatters and one gather against two
all-reduces): the optimum shards the first layer (W2, which backward reads too, costs a gather more), and the
memory budget moves it from there.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import torch_autopar as autopar
from torch_autopar.capture import capture
from torch_autopar.cost import CostModel, HardwareProfile, Link
from torch_autopar.launch import offline_mesh
from torch_autopar.search import milp
from torch_autopar.search.executed import BATCH_CHECK_BYTES, BATCH_CHECKS
from torch_autopar.search.problem import build_problem
from torch_autopar.strategies.enumerate import enumerate_strategies
from torch_autopar.strategies.roles import axis_roles, leaf_filter
from torch_autopar.testing.models import MLP

PEAK, EFFICIENCY = 3e12, 0.4
ALPHA, BANDWIDTH, COMM_EFFICIENCY = 1e-5, 1e9, 0.8
BETA = 1.0 / (BANDWIDTH * COMM_EFFICIENCY)
HARDWARE = HardwareProfile(
    name="by-hand", flops={"float32": PEAK}, memory_bandwidth=float("inf"), memory_bytes=1 << 50, devices_per_node=8,
    intra_node=Link(ALPHA, BANDWIDTH), inter_node=Link(1.0, 1.0), compute_efficiency=EFFICIENCY,
    comm_efficiency=COMM_EFFICIENCY, op_overhead_s=0.0, dtensor_overhead_s=0.0)
"""The inter-node link is absurd on purpose: a 2-device mesh must never use it."""

D_IN, D_HID, D_OUT, BATCH = 64, 128, 32, 4096
W1, B1, W2, B2 = 4 * D_IN * D_HID, 4 * D_HID, 4 * D_HID * D_OUT, 4 * D_OUT
"""Parameter bytes (fp32)."""
NAMES = {"layers.0.weight": W1, "layers.0.bias": B1, "layers.1.weight": W2, "layers.1.bias": B2}

MATMUL_FLOPS = (2 * BATCH * D_IN * D_HID + 2 * BATCH * D_HID * D_OUT  # forward
                + 2 * BATCH * D_OUT * D_HID  # dL/dh = dL/dy @ W2
                + 2 * BATCH * D_OUT * D_HID  # dL/dW2 = dL/dy^T @ h
                + 2 * BATCH * D_HID * D_IN)  # dL/dW1 = dL/dh^T @ x   (no gradient for the input x)
COMPUTE = MATMUL_FLOPS / 2 / (PEAK * EFFICIENCY)
BACKWARD = (2 * BATCH * D_OUT * D_HID + 2 * BATCH * D_OUT * D_HID + 2 * BATCH * D_HID * D_IN) / 2 / (PEAK * EFFICIENCY)


def all_reduce(n):
    return 2 * (2 - 1) * ALPHA + 2 * (2 - 1) / 2 * n * BETA


def all_gather(n):
    return (2 - 1) * ALPHA + (2 - 1) / 2 * n * BETA


reduce_scatter = all_gather


def exposed(syncs, last):
    return max(last, sum(syncs) - BACKWARD)


def by_hand(sharded: set) -> float:
    """The step with the parameters named in ``sharded`` ("W1", "B1", "W2", "B2") sharded, the others replicated,
    every activation batch-sharded."""
    size = {"W1": W1, "B1": B1, "W2": W2, "B2": B2}
    gathers = sum(all_gather(sum(size[n] for n in layer if n in sharded))
                  for layer in (("W1", "B1"), ("W2", "B2")) if sharded & set(layer))
    if "W2" in sharded:
        gathers += all_gather(W2)
    syncs = [reduce_scatter(size[n]) if n in sharded else all_reduce(size[n]) for n in ("W1", "B1", "W2", "B2")]
    if ("W2" in sharded) == ("B2" in sharded):  # the second layer's gradients reduced alike: one latency
        syncs[3] -= ALPHA if "B2" in sharded else 2 * ALPHA
    return COMPUTE + gathers + exposed(syncs, syncs[0])


DATA_PARALLEL = COMPUTE + exposed([all_reduce(W1), all_reduce(B1), all_reduce(W2), all_reduce(B2) - 2 * ALPHA],
                                  all_reduce(W1))
FIRST_LAYER_SHARDED = by_hand({"W1", "B1"})
FULLY_SHARDED = by_hand({"W1", "B1", "W2", "B2"})

GRAPH_FULLY_SHARDED = (COMPUTE + all_gather(W1 + B1) + 2 * all_gather(W2 + B2)
                       + exposed([reduce_scatter(n) for n in (W1, B1, W2, B2)], reduce_scatter(W1)))

SAVED = 4 * BATCH * (D_HID + D_OUT)
"""Activations counted as kept for backward (fp32, batch-sharded in every plan below): relu's output, and the
model's output (the graph's output node, which returns the gradients too, counts as a backward user)."""
STATE_COPIES = 4
"""Copies of each parameter held as backward starts: itself, its gradient and Adam's two moments, since graph
mode (these problems) frees the activations only as backward ends (``pricing.peak_bytes``)."""
DP_MEMORY = STATE_COPIES * (W1 + B1 + W2 + B2) + SAVED // 2
"""Problem memory: the state copies of each parameter over its shard factor, and the activations."""
MIN_MEMORY = STATE_COPIES * (W1 + B1 + W2 + B2) // 2 + SAVED // 2


def _mlp():
    with torch.device("meta"):
        return MLP((D_IN, D_HID, D_OUT))


def _x(batch=BATCH):
    return torch.empty(batch, D_IN, device="meta")


@pytest.fixture(scope="module")
def program():
    return capture(_mlp(), (_x(),), {})


def _problem(program, mesh, roles=("free",), budget=float("inf")):
    space = enumerate_strategies(program, mesh, leaf_filter(program, roles))
    cost = CostModel(HARDWARE, tuple(mesh.shape))
    return build_problem(program, space, cost, lambda node: tuple(Shard(0) for _ in mesh.shape), budget, mode="graph")


def _param_output(program, problem, choice, name):
    node = program.param_nodes[name]
    return tuple(problem.node_output(node, choice[problem.decision_of[node]]))


def _forward_outputs(program, problem, choice, ops=("addmm", "relu")):
    result = {}
    for node in program.graph.graph.nodes:
        name = getattr(node.target, "__name__", "").split(".")[0]
        if node.op == "call_function" and name in ops and not program.is_backward(node):
            result[node.name] = tuple(problem.node_output(node, choice[problem.decision_of[node]]))
    return result


def _memory(problem, choice) -> float:
    """The peak the budget bounds: the larger end of backward (``milp``'s memory rows)."""
    return max(sum(float(d.memory[phase, a]) for d, a in zip(problem.decisions, choice)) for phase in (0, 1))


# the unrestricted optimum --------------------------------------------------------------------------------------
def test_hand_costs_are_not_degenerate():
    """The set-up really separates the plans, and backward hides part of data parallelism's gradient sync but
    not all of it (both branches of exposed() are taken)."""
    syncs = sum(all_reduce(n) for n in (W1, B1, W2, B2))
    assert all_reduce(W1) < syncs - BACKWARD < syncs
    assert by_hand(set()) == DATA_PARALLEL
    assert FIRST_LAYER_SHARDED < DATA_PARALLEL - ALPHA / 4  # a latency saved, as above (in part hidden by backward)
    assert by_hand({"W1"}) == pytest.approx(DATA_PARALLEL, rel=1e-9)  # one parameter of a layer: a tie
    assert FULLY_SHARDED - FIRST_LAYER_SHARDED > all_gather(W2)
    assert COMPUTE > 0.3 * DATA_PARALLEL and DATA_PARALLEL - COMPUTE > 0.3 * DATA_PARALLEL


def test_optimum_shards_the_first_layer_cost_worked_out_by_hand(program):
    with offline_mesh((2,)) as mesh:
        problem = _problem(program, mesh)
        solution = milp.solve(problem)
    assert solution.objective == pytest.approx(FIRST_LAYER_SHARDED, rel=1e-6)
    assert milp.objective_of(problem, solution.choice) == pytest.approx(solution.objective, rel=1e-9)
    assert set(_forward_outputs(program, problem, solution.choice).values()) == {(Shard(0),)}
    assert _param_output(program, problem, solution.choice, "layers.1.weight") == (Replicate(),)
    for name in ("layers.0.weight", "layers.0.bias"):
        assert _param_output(program, problem, solution.choice, name) != (Replicate(),), name
    # replicated, B2's gradient is all-reduced with W2's: sharded, it would pay a latency of its own
    assert _param_output(program, problem, solution.choice, "layers.1.bias") == (Replicate(),)
    assert by_hand({"W1", "B1", "B2"}) > FIRST_LAYER_SHARDED + ALPHA


def test_objective_of_prices_the_data_parallel_choice_by_hand(program):
    """objective_of on a choice built by hand (every leaf replicated but the batch, matmuls batch-sharded)."""
    with offline_mesh((2,)) as mesh:
        problem = _problem(program, mesh, roles=("dp",))
        solution = milp.solve(problem)
    assert milp.objective_of(problem, solution.choice) == pytest.approx(DATA_PARALLEL, rel=1e-6)
    assert _memory(problem, solution.choice) == DP_MEMORY
    gradients_end = [sum(float(d.memory[1, a]) for d, a in zip(problem.decisions, solution.choice))]
    assert gradients_end == [4 * (W1 + B1 + W2 + B2)]  # as backward ends: no activations
    assert set(_forward_outputs(program, problem, solution.choice).values()) == {(Shard(0),)}


def test_small_batch_prefers_replicated_compute_over_gradient_sync(program):
    """Counter-check of the set-up: with 8 samples, gathering the input once (all_gather, 8·64·4 bytes) and
    computing everything replicated beats four gradient all-reduces, and the objective says by how much."""
    small = capture(_mlp(), (_x(8),), {})
    with offline_mesh((2,)) as mesh:
        problem = _problem(small, mesh)
        solution = milp.solve(problem)
    flops = MATMUL_FLOPS * 8 / BATCH
    replicated = all_gather(8 * D_IN * 4) + flops / (PEAK * EFFICIENCY)
    assert solution.objective == pytest.approx(replicated, rel=1e-6)
    assert set(_forward_outputs(small, problem, solution.choice).values()) == {(Replicate(),)}


# the memory budget ---------------------------------------------------------------------------------------------
def _fitting(budget) -> list[set]:
    """Every set of sharded parameters whose plan fits ``budget``."""
    size = {"W1": W1, "B1": B1, "W2": W2, "B2": B2}
    subsets = [set(s) for r in range(5) for s in itertools.combinations(size, r)]
    return [s for s in subsets if DP_MEMORY - STATE_COPIES * sum(size[n] for n in s) // 2 <= budget]


def test_budget_just_below_the_first_layer_sharded_shards_the_last_bias_too(program):
    budget = DP_MEMORY - STATE_COPIES * (W1 + B1) // 2 - 1
    with offline_mesh((2,)) as mesh:
        problem = _problem(program, mesh, budget=budget)
        solution = milp.solve(problem)
    assert solution.objective == pytest.approx(by_hand({"W1", "B1", "B2"}), rel=1e-6)
    assert by_hand({"W1", "B1", "B2"}) == min(by_hand(s) for s in _fitting(budget))
    assert _memory(problem, solution.choice) <= budget
    sharded = {n for n in NAMES if _param_output(program, problem, solution.choice, n) != (Replicate(),)}
    assert sharded == {"layers.0.weight", "layers.0.bias", "layers.1.bias"}


def test_budget_that_only_fits_with_w2_sharded_pays_its_gathers(program):
    all_but_w2 = DP_MEMORY - STATE_COPIES * (W1 + B1 + B2) // 2
    with offline_mesh((2,)) as mesh:
        fits = milp.solve(_problem(program, mesh, budget=all_but_w2))
        problem = _problem(program, mesh, budget=all_but_w2 - 1)
        tighter = milp.solve(problem)
    assert fits.objective == pytest.approx(by_hand({"W1", "B1", "B2"}), rel=1e-6)
    # what fits shards W1 and W2 (the bytes above all_but_w2): the cheapest such choice, by hand
    fitting = _fitting(all_but_w2 - 1)
    assert all({"W1", "W2"} <= s for s in fitting)
    assert tighter.objective == pytest.approx(min(by_hand(s) for s in fitting), rel=1e-6)
    assert tighter.objective < FULLY_SHARDED
    assert _param_output(program, problem, tighter.choice, "layers.1.weight") != (Replicate(),)
    assert MIN_MEMORY <= _memory(problem, tighter.choice) <= all_but_w2 - 1


def test_budget_below_every_plan_states_the_smallest_memory(program):
    with offline_mesh((2,)) as mesh:
        problem = _problem(program, mesh, budget=MIN_MEMORY - 1)
        with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: no sharding fits the memory budget") as info:
            milp.solve(problem)
    assert f"the smallest per-device memory any plan needs is about {MIN_MEMORY:,} bytes" in str(info.value)


# through autopar.plan ------------------------------------------------------------------------------------------
def test_fully_shard_plan_objective_and_collectives_by_hand():
    plan = autopar.plan(_mlp(), _x(), mesh_shape=(2,), hardware=HARDWARE, strategy="fully_shard",
                        bucket_cap_bytes=0, mode="graph")
    assert plan.search_stats["mode"] == "exact"
    assert plan.search_stats["objective_s"] == pytest.approx(FULLY_SHARDED, rel=1e-6)
    assert plan.param_placements == {name: ("S(0)",) for name in NAMES}
    assert plan.input_placements == {0: ("S(0)",)}
    gathers = sorted(c.nbytes for c in plan.collectives if (c.kind, c.phase) == ("all_gather", "forward"))
    assert gathers == sorted([W1 + B1, W2 + B2])  # one per layer (``rewrite.gather_buckets``)
    assert [c.nbytes for c in plan.collectives if c.phase == "backward"] == [W2 + B2]
    grad_sync = [c for c in plan.collectives if c.phase == "grad_sync"]
    assert sorted((c.kind, c.nbytes) for c in grad_sync) == sorted(("reduce_scatter", n) for n in NAMES.values())
    # what runs adds the runtime's per-step check of equal batch slices (16 bytes all-reduced) to the objective
    (check,) = [c for c in plan.collectives if c.where in BATCH_CHECKS]
    assert (check.kind, check.nbytes) == ("all_reduce", BATCH_CHECK_BYTES)
    assert plan.estimated_step_time == pytest.approx(GRAPH_FULLY_SHARDED + check.seconds, rel=1e-6)  # each gradient alone
    for c in plan.collectives:
        assert c.axis == "dp" and (c is check or c.seconds == pytest.approx(all_gather(c.nbytes), rel=1e-9))
    assert plan.compute_time == pytest.approx(COMPUTE, rel=1e-6)


# brute force ---------------------------------------------------------------------------------------------------
def _brute_force(problem, budget=float("inf")) -> tuple[float, list[int]]:
    sizes = [len(d.strategies) for d in problem.decisions]
    best, best_choice = float("inf"), None
    for choice in itertools.product(*map(range, sizes)):
        if _memory(problem, choice) <= budget:
            value = milp.objective_of(problem, list(choice))
            if value < best:
                best, best_choice = value, list(choice)
    return best, best_choice


@pytest.fixture(scope="module")
def linear_program():
    """A small batch: the optimum replicates the weights, so a memory budget can push it elsewhere."""
    with torch.device("meta"):
        return capture(nn.Linear(64, 32), (torch.empty(8, 64),), {})


SLOW = dataclasses.replace(HARDWARE, name="by-hand-slow", flops={"float32": PEAK / 1000},
                           intra_node=Link(ALPHA * 1000, BANDWIDTH / 1000))
"""HARDWARE with every time 1000 times longer: same optimum, objective x1000."""

# Regression: costs were passed to HiGHS in seconds, so its absolute MIP gap (1e-6) accepted a plan 0.24% worse
# than optimal for this layer (1.13346e-05 s instead of 1.13073e-05 s); the solver now works in microseconds.


def _linear_problem(program, hardware, budget=float("inf")):
    with offline_mesh((2,)) as mesh:
        space = enumerate_strategies(program, mesh)
        return build_problem(program, space, CostModel(hardware, (2,)), lambda node: (Shard(0),), budget, mode="graph")


def test_milp_equals_brute_force_on_one_linear_layer(linear_program):
    problem = _linear_problem(linear_program, HARDWARE)
    sizes = [len(d.strategies) for d in problem.decisions]
    assert 100 < np.prod(sizes) < 20_000, sizes  # small enough to enumerate, large enough to mean something
    best, _ = _brute_force(problem)
    assert milp.solve(problem).objective == pytest.approx(best, rel=1e-9)


def test_the_optimum_does_not_depend_on_the_unit_of_time(linear_program):
    fast = milp.solve(_linear_problem(linear_program, HARDWARE))
    slow = milp.solve(_linear_problem(linear_program, SLOW))
    assert fast.objective * 1000 == pytest.approx(slow.objective, rel=1e-9)


def test_milp_equals_brute_force_on_one_linear_layer_in_milliseconds(linear_program):
    problem = _linear_problem(linear_program, SLOW)
    sizes = [len(d.strategies) for d in problem.decisions]
    assert 100 < np.prod(sizes) < 20_000, sizes
    best, _ = _brute_force(problem)
    solution = milp.solve(problem)
    assert solution.objective == pytest.approx(best, rel=1e-9)
    assert milp.objective_of(problem, solution.choice) == pytest.approx(best, rel=1e-9)


@pytest.fixture(scope="module")
def narrow_program():
    """One output feature: the output cannot be split by feature, the bias cannot be split at all, so the
    cheapest plan (gather the input once, compute replicated) keeps more than the least memory."""
    with torch.device("meta"):
        return capture(nn.Linear(64, 1), (torch.empty(8, 64),), {})


def test_milp_equals_brute_force_under_a_memory_budget(narrow_program):
    unconstrained_problem = _linear_problem(narrow_program, SLOW)
    unconstrained = milp.solve(unconstrained_problem)
    budget = _memory(unconstrained_problem, unconstrained.choice) - 1  # the unconstrained optimum no longer fits
    problem = _linear_problem(narrow_program, SLOW, budget)
    best, _ = _brute_force(problem, budget)
    assert best > unconstrained.objective * 1.1  # the budget binds
    solution = milp.solve(problem)
    assert solution.objective == pytest.approx(best, rel=1e-9)
    assert _memory(problem, solution.choice) <= budget


def test_milp_equals_brute_force_on_the_fully_sharded_mlp(program):
    """Every choice of the fully-sharded MLP problem (parameters pinned to S(0), about 2e5 choices: 5-10 s)."""
    with offline_mesh((2,)) as mesh:
        problem = _problem(program, mesh, roles=axis_roles("fully_shard", 1))
    best, choice = _brute_force(problem)
    assert best == pytest.approx(FULLY_SHARDED, rel=1e-6)
    assert milp.solve(problem).objective == pytest.approx(best, rel=1e-9)
    assert _memory(problem, choice) == MIN_MEMORY



def test_milp_equals_brute_force_with_gradient_sync_overlapping_backward(linear_program):
    """The overlap term (constraint (5)): gradient sync hidden behind backward compute but the last, exactly."""
    problem = _linear_problem(linear_program, SLOW)
    best, _ = _brute_force(problem)
    assert any(e.last_share for e in problem.edges.values() if e.grad_sync)
    solution = milp.solve(problem)
    assert solution.objective == pytest.approx(best, rel=1e-9)
    assert milp.objective_of(problem, solution.choice) == pytest.approx(best, rel=1e-9)
