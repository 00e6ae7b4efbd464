"""Scaled dot-product attention on CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward.

DTensor registers rules for the CUDA flash and efficient kernels only, so every sharded run of a model calling
``F.scaled_dot_product_attention`` on CPU failed. The CPU kernel computes each (batch, head) pair on its own, so
like DTensor's CUDA rules it shards on the batch dim (0) or the head dim (1) of query, key, value, output and
logsumexp, or runs replicated. The optional ``attn_mask`` (keyword, broadcast over batch and heads) follows
query on a dim where it has the full size and stays replicated where it is broadcast (size 1). Sharding the
sequence (context parallelism) is not offered: every query attends to keys on other ranks.

# NOTE [GQA heads]: heads shard only when key and value have as many heads as query; with grouped-query
attention DTensor would split the key/value heads in other places than the query heads that use them.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from torch_autopar import _compat

aten = torch.ops.aten
FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _mask_placement(mask_shape, dim: int, query_shape):
    """How the broadcast mask is laid out when query is sharded on ``dim``."""
    if mask_shape is None:
        return None
    offset = len(mask_shape) - len(query_shape)  # a mask may have fewer leading dims (broadcast)
    own_dim = dim + offset
    if own_dim < 0 or mask_shape[own_dim] == 1:
        return Replicate()
    return Shard(own_dim)


def _single_axis(query_shape, key_shape, mask_shape, outputs: int, tensors: int) -> list[list]:
    """[outputs..., q, k, v, (out, lse, grad) ..., mask] per strategy: replicated, batch-sharded, head-sharded."""
    has_mask = mask_shape is not None
    strategies = [[Replicate()] * (outputs + tensors + has_mask)]
    dims = [0] + ([1] if key_shape[1] == query_shape[1] else [])  # NOTE [GQA heads]
    for dim in dims:
        if query_shape[dim] == 1:
            continue
        mask = [_mask_placement(mask_shape, dim, query_shape)] if has_mask else []
        strategies.append([Shard(dim)] * (outputs + tensors) + mask)
    return strategies


def forward_rule(schema) -> list[list]:
    """(output, logsumexp) = op(query, key, value, dropout_p, is_causal, *, attn_mask, scale)."""
    query, key = (_compat.strategy_shape(schema.args_schema[i]) for i in (0, 1))
    mask = _compat.strategy_shape(schema.kwargs_schema.get("attn_mask"))
    return _single_axis(query, key, mask, outputs=2, tensors=3)


def backward_rule(schema) -> list[list]:
    """(grad_q, grad_k, grad_v) = op(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
    attn_mask, scale)."""
    query, key = (_compat.strategy_shape(schema.args_schema[i]) for i in (1, 2))
    mask = _compat.strategy_shape(schema.kwargs_schema.get("attn_mask"))
    return _single_axis(query, key, mask, outputs=3, tensors=6)


def _mask_follows_query(query_index: int):
    """The mask's layout for the query layout the chosen strategy wants (DTensor never moves keyword tensors
    itself: see ``_compat.redistribute_keyword_tensors``)."""

    def wanted(name, mask, args, args_placements):
        query_shape = tuple(args[query_index].shape)
        return tuple(_mask_placement(tuple(mask.shape), p.dim, query_shape) if p.is_shard() else Replicate()
                     for p in args_placements[query_index])

    return wanted


if not _compat.has_sharding_rule(FORWARD):
    _compat.register_sharding_rule(FORWARD, forward_rule, num_outputs=2, static_argnum=3)
    _compat.redistribute_keyword_tensors(FORWARD, _mask_follows_query(0))
if not _compat.has_sharding_rule(BACKWARD):
    _compat.register_sharding_rule(BACKWARD, backward_rule, num_outputs=3, static_argnum=6)
    _compat.redistribute_keyword_tensors(BACKWARD, _mask_follows_query(1))
