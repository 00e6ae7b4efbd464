"""Per-node facts the cost model needs: FLOPs, bytes, and whether an op is free (a view or alias).

Must never look at placements.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from torch_autopar import _compat

_FREE_OPS = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "detach", "alias", "unsqueeze", "squeeze",
             "reshape", "slice", "select", "split", "getitem", "split_with_sizes"}


def is_free(node: fx.Node) -> bool:
    """Views and aliases: no kernel, no new memory."""
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    return name in _FREE_OPS


def nbytes(value) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def node_flops(node: fx.Node) -> float:
    """FLOPs of the node on global shapes (``torch.utils.flop_counter``; 0 for ops without a formula)."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return 0.0
    values = lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a  # noqa: E731
    args = fx.node.map_aggregate(node.args, values)
    kwargs = fx.node.map_aggregate(node.kwargs, values)
    return float(_compat.node_flops(node.target, args, kwargs, node.meta.get("val")))


def bytes_accessed(node: fx.Node) -> int:
    """Bytes read and written by the node on global shapes (inputs plus output)."""
    return sum(nbytes(a.meta.get("val")) for a in node.all_input_nodes) + nbytes(node.meta.get("val"))


def dtype_name(node: fx.Node) -> str:
    value = node.meta.get("val")
    return str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else "float32"
