"""``GradSyncPass`` on a small backward-like aten graph: one bucketed all-reduce per bucket, started right
after the bucket's last gradient (so it overlaps the rest of backward), waited for just before the output;
the original compute keeps its order. Run on a fake process group, whose all-reduce returns its input."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from torch_autopar.rewrite import GradSyncPass
from torch_autopar.testing import fake_process_group

ALL_REDUCE = torch.ops._c10d_functional.all_reduce_.default  # in place on the bucket buffer
WAIT = torch.ops._c10d_functional.wait_tensor.default
WORLD = 4


def _backward_like(a, b, c):
    """Three "gradients" finished in the order g_c, g_a, g_b, with compute after each."""
    g_c = (c * 3).sin()
    g_a = a.exp() * 2
    g_b = (b @ b.t()).tanh()
    return g_a, g_b, None, g_c


def _inputs():
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(3, 2, generator=generator), torch.randn(4, 4, generator=generator),
            torch.randn(5, generator=generator))


def _graph() -> fx.GraphModule:
    return make_fx(_backward_like, tracing_mode="fake")(*_inputs())


def _compute_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def test_one_all_reduce_per_bucket_placed_after_its_last_gradient():
    gm = _graph()
    original = [str(n.target) for n in _compute_nodes(gm)]
    outputs = gm.graph.find_nodes(op="output")[0].args[0]
    grad_nodes = {"a": outputs[0], "b": outputs[1], "c": outputs[3]}
    with fake_process_group(WORLD):
        group = dist.group.WORLD.group_name
        result = GradSyncPass({0: "a", 1: "b", 3: "c"}, [["c"], ["a", "b"], ["unknown"]], group, WORLD)(gm)
    graph = result.graph_module.graph
    nodes = list(graph.nodes)
    reduces = [n for n in nodes if n.target is ALL_REDUCE]
    assert result.all_reduces == len(reduces) == 2  # the bucket naming no gradient output is skipped
    assert result.synced_bytes == (5 + 3 * 2 + 4 * 4) * 4
    # bucket ["c"] starts before g_a and g_b are computed: it overlaps the rest of "backward"
    assert nodes.index(reduces[0]) < nodes.index(grad_nodes["a"])
    assert nodes.index(reduces[1]) > nodes.index(grad_nodes["b"])
    waits = [n for n in nodes if n.target is WAIT]
    assert len(waits) == 2 and all(nodes.index(w) > nodes.index(grad_nodes["b"]) for w in waits)
    inserted = {ALL_REDUCE, WAIT, torch.ops.aten.reshape.default, torch.ops.aten.cat.default,
                torch.ops.aten.div_.Tensor, torch.ops.aten.split_with_sizes.default, torch.ops.aten.view.default}
    kept = [str(n.target) for n in _compute_nodes(result.graph_module)
            if n.target not in inserted and n.target.__name__ != "getitem"]
    assert kept == [t for t in original if "view" not in t]
    new_outputs = graph.find_nodes(op="output")[0].args[0]
    assert len(new_outputs) == 4 and new_outputs[2] is None


def test_rewritten_graph_averages_each_gradient():
    gm = _graph()
    expected = gm(*_inputs())
    with fake_process_group(WORLD):
        group = dist.group.WORLD.group_name
        result = GradSyncPass({0: "a", 1: "b", 3: "c"}, [["c"], ["a", "b"]], group, WORLD)(gm)
        averaged = result.graph_module(*_inputs())
    for index in (0, 1, 3):
        assert averaged[index].shape == expected[index].shape
        torch.testing.assert_close(averaged[index], expected[index] / WORLD, rtol=1e-6, atol=1e-7)
    assert averaged[2] is None
