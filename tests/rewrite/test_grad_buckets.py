"""Gradient buckets of graph mode's per-rank program, on a fake process group of 2 ranks (collectives do nothing;
the program is traced, not run): the GPT planned fully sharded in graph mode.

  assignment  buckets hold every gradient once, in the order backward produces them; a bucket's gradients share
              one dtype, collective kind and mesh axis (``cost.pricing.bucket_key``) and fit the cap (one larger
              than the cap has a bucket of its own); ``bucket_cap_bytes=0`` gives one bucket per gradient
  program     the traced program runs exactly the plan's collectives (kind and bytes): one reduce_scatter per
              bucket, fewer than one per gradient; each is issued as soon as its last gradient is computed (backward
              compute follows all but the last) and waited for when the next is issued: one in flight at a time
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import torch_autopar as autopar
from torch_autopar.capture import capture
from torch_autopar.cost import pricing
from torch_autopar.runtime.backend import graph_collectives
from torch_autopar.runtime.sharded import ShardedRunner
from torch_autopar.search import DEFAULT_BUCKET_CAP_BYTES
from torch_autopar.strategies import parse_placements
from torch_autopar.testing import fake_process_group
from torch_autopar.testing.models import GPT

from tests import support

WORLD = 2
SMALL_CAP = 4096
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
WAIT = torch.ops._c10d_functional.wait_tensor.default


def _model_and_batch():
    torch.manual_seed(0)
    return GPT(), torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(0))


def _plan(cap: int):
    model, tokens = _model_and_batch()
    return autopar.plan(model, (tokens,), mesh_shape=(WORLD,), hardware="cpu-gloo", strategy="fully_shard",
                        mode="graph", fold_layers=False, bucket_cap_bytes=cap)


@pytest.fixture(scope="module")
def plans():
    with fake_process_group(WORLD):
        return {cap: _plan(cap) for cap in (DEFAULT_BUCKET_CAP_BYTES, SMALL_CAP, 0)}


@pytest.fixture(scope="module")
def program():
    model, tokens = _model_and_batch()
    return capture(model, (tokens,))


def _key(plan, program, name):
    grad = plan.node_layouts[program.grad_nodes[name].name].output
    return pricing.bucket_key(program.params[name].dtype, parse_placements(grad),
                              parse_placements(plan.param_placements[name]))


@pytest.mark.parametrize("cap", [DEFAULT_BUCKET_CAP_BYTES, SMALL_CAP])
def test_buckets_follow_backward_order_keys_and_cap(plans, program, cap):
    plan = plans[cap]
    assert [name for bucket in plan.grad_buckets for name in bucket] == program.grad_ready_order()
    shared = [bucket for bucket in plan.grad_buckets if len(bucket) > 1]
    assert shared, "no two gradients share a bucket"
    for bucket in shared:
        keys = {_key(plan, program, name) for name in bucket}
        assert len(keys) == 1 and None not in keys, f"{bucket}: keys {keys}"
        assert sum(program.params[name].nbytes for name in bucket) <= cap, bucket


def test_cap_zero_is_one_bucket_per_gradient(plans):
    assert all(len(bucket) == 1 for bucket in plans[0].grad_buckets)
    assert len(plans[0].grad_buckets) > len(plans[SMALL_CAP].grad_buckets) > len(
        plans[DEFAULT_BUCKET_CAP_BYTES].grad_buckets)


def _traced(plan):
    """The plan's per-rank program for rank 0, traced (compiled graphs recorded, never run)."""
    with fake_process_group(WORLD):
        model, tokens = _model_and_batch()
        runner = ShardedRunner(model, plan)
        return runner._program((tokens.chunk(WORLD)[0],), {}, {}).graph


def _grad_syncs(plan) -> list:
    return [c for c in plan.collectives if c.phase == "grad_sync"]


@pytest.mark.parametrize("cap", [DEFAULT_BUCKET_CAP_BYTES, 0])
def test_program_runs_the_plans_collectives(plans, cap):
    plan = plans[cap]
    graph = _traced(plan)
    ran = Counter((kind, nbytes) for kind, _, nbytes in graph_collectives(graph)) + support.regathered(graph)
    planned = Counter()
    for c in plan.collectives:
        if not c.where.endswith("check"):  # the batch-size check runs outside the program
            planned[(c.kind, c.nbytes)] += c.count
    assert ran == planned
    assert {c.kind for c in _grad_syncs(plan)} == {"reduce_scatter"}


def test_buckets_run_fewer_collectives(plans):
    assert len(_grad_syncs(plans[DEFAULT_BUCKET_CAP_BYTES])) < len(_grad_syncs(plans[0]))


def _of_a_flat_buffer(collective) -> bool:
    """Whether ``collective`` reduces a concatenation (a bucket's buffer), not one activation."""
    source = collective.args[0]
    while source.target in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
                            torch.ops.aten.reshape.default, torch.ops.aten.clone.default):
        source = source.args[0]
    return source.target is torch.ops.aten.cat.default


def test_buckets_are_issued_amid_backward_each_waited_when_the_next_is_issued(plans):
    """Each bucket's collective reads its buffer, so it follows its gradients in graph order by construction; what
    is checked is that it does not wait for the end (backward ops still follow every bucket but the last), and
    that it is waited for before the next is issued (its buffers freed: one in flight)."""
    plan = plans[SMALL_CAP]
    nodes = list(_traced(plan).graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    issued = [node for node in nodes if node.target is REDUCE_SCATTER and _of_a_flat_buffer(node)]
    assert len(issued) == len(_grad_syncs(plan))  # one per bucket that moves (others: each gradient's own layout)
    computing = [i for i, node in enumerate(nodes) if node.op == "call_function"
                 and (node.target in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)
                      or "backward" in str(node.target))]
    for node in issued[:-1]:  # backward goes on computing while each bucket but the last is reduced
        assert any(i > position[node] for i in computing)
    waits = {node.args[0]: node for node in nodes if node.target is WAIT and node.args[0] in issued}
    assert len(waits) == len(issued)
    for node, after in zip(issued, issued[1:] + [nodes[-1]]):
        assert position[node] < position[waits[node]] < position[after], node.format_node()
