"""Graph pass: average gradients over the data-parallel group inside an aten backward graph.

For each bucket of the plan, the gradients it holds are flattened into one buffer and a functional all-reduce
is started right after the last of them is computed, so it runs while the rest of backward computes; the
result is waited for just before the graph returns. With a ``reduce_dtype`` (mixed precision) the buffer is cast
to it for the all-reduce and back to the gradients' dtype after. Written as requires / call / ensures, as torch.fx passes.
Must never reorder the compute of the original graph.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from torch_autopar import _compat

aten = torch.ops.aten
_convert = torch.ops.prims.convert_element_type.default


@dataclass(kw_only=True)
class GradSyncResult:
    graph_module: fx.GraphModule
    all_reduces: int
    synced_bytes: int


class GradSyncPass:
    """Insert one bucketed all-reduce per plan bucket for the gradient outputs of a backward graph.

    grad_outputs: output position in the backward graph → parameter name; reduce_dtype: the dtype each bucket is
    all-reduced in (None: the gradients' own).
    """

    def __init__(self, grad_outputs: dict[int, str], buckets: list[list[str]], group_name: str, world_size: int,
                 reduce_dtype: torch.dtype | None = None):
        self.grad_outputs = grad_outputs
        self.reduce_dtype = reduce_dtype
        self.buckets = buckets
        self.group_name = group_name
        self.world_size = world_size

    def requires(self, gm: fx.GraphModule) -> None:
        outputs = _outputs(gm)
        for position in self.grad_outputs:
            if position >= len(outputs):
                raise AssertionError(f"gradient output {position} beyond the {len(outputs)} outputs of the backward graph")

    def call(self, gm: fx.GraphModule) -> GradSyncResult:
        self.requires(gm)
        outputs = list(_outputs(gm))
        by_name = {name: pos for pos, name in self.grad_outputs.items() if isinstance(outputs[pos], fx.Node)}
        order = {node: i for i, node in enumerate(gm.graph.nodes)}
        result = GradSyncResult(graph_module=gm, all_reduces=0, synced_bytes=0)
        for bucket in self.buckets:
            positions = [by_name[name] for name in bucket if name in by_name]
            if positions:
                self._sync_bucket(gm, outputs, positions, order, result)
        output_node = gm.graph.find_nodes(op="output")[0]
        output_node.args = (tuple(outputs),) if isinstance(output_node.args[0], tuple) else (outputs,)
        gm.graph.lint()
        gm.recompile()
        self.ensures(result)
        return result

    def _sync_bucket(self, gm, outputs, positions, order, result) -> None:
        grads = [outputs[p] for p in positions]
        last = max(grads, key=lambda node: order[node])
        graph = gm.graph
        anchor = [last]

        def after_anchor(target, args):
            with graph.inserting_after(anchor[0]):
                anchor[0] = graph.call_function(target, args)
            return anchor[0]

        # NOTE [one buffer per bucket]: cat makes the bucket's only new buffer; the all-reduce and the division
        # work in place on it (the out-of-place functional versions cost two more bucket-sized allocations and
        # their page faults every step). The graph is already functionalised, so in-place ops are safe here.
        flats = [after_anchor(aten.reshape.default, (g, [-1])) for g in grads]
        flat = after_anchor(aten.cat.default, (flats,))
        grad_dtype = _value(grads[0]).dtype
        cast = self.reduce_dtype is not None and self.reduce_dtype != grad_dtype
        if cast:
            flat = after_anchor(_convert, (flat, self.reduce_dtype))
        reduced = after_anchor(_compat.functional_all_reduce_inplace(), (flat, "sum", self.group_name))
        output_node = graph.find_nodes(op="output")[0]
        with graph.inserting_before(output_node):
            waited = graph.call_function(_compat.functional_wait_tensor(), (reduced,))
            mean = graph.call_function(aten.div_.Tensor, (waited, self.world_size))
            if cast:
                mean = graph.call_function(_convert, (mean, grad_dtype))
            sizes = [_numel(g) for g in grads]
            pieces = graph.call_function(aten.split_with_sizes.default, (mean, sizes))
            for index, (position, grad) in enumerate(zip(positions, grads)):
                piece = graph.call_function(operator.getitem, (pieces, index))
                outputs[position] = graph.call_function(aten.view.default, (piece, list(_shape(grad))))
        result.all_reduces += 1
        result.synced_bytes += sum(sizes) * (self.reduce_dtype.itemsize if cast else _itemsize(grads[0]))

    def ensures(self, result: GradSyncResult) -> None:
        waits = len(result.graph_module.graph.find_nodes(op="call_function", target=_compat.functional_wait_tensor()))
        if waits < result.all_reduces:
            raise AssertionError(f"{result.all_reduces} all-reduces inserted but only {waits} waits")

    def __call__(self, gm: fx.GraphModule) -> GradSyncResult:
        return self.call(gm)


def _outputs(gm: fx.GraphModule):
    return gm.graph.find_nodes(op="output")[0].args[0]


def _value(node: fx.Node):
    value = node.meta.get("val")
    if value is None:
        raise AssertionError(f"node {node.format_node()} has no meta['val']; cannot size its gradient bucket")
    return value


def _shape(node: fx.Node):
    return tuple(_value(node).shape)


def _numel(node: fx.Node) -> int:
    return _value(node).numel()


def _itemsize(node: fx.Node) -> int:
    return _value(node).element_size()

