"""Gradient buckets: parameters grouped, in the order backward finishes their gradients, up to a byte cap.

Launching a bucket's collective (an all-reduce; in graph mode's sharded program also a reduce-scatter,
``rewrite.grad_buckets``) as soon as its last gradient is ready overlaps communication with the rest of backward;
every rank must launch buckets in the same order. Must never communicate.
"""

from __future__ import annotations

DEFAULT_BUCKET_CAP_BYTES = 25 * 1024 * 1024


def assign_buckets(ready_order: list[str], nbytes: dict[str, int], cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                   dtypes: dict | None = None) -> list[list[str]]:
    """Split ``ready_order`` into consecutive buckets of at most ``cap_bytes`` (a larger tensor gets its own).

    ``dtypes``: a key per tensor (its dtype, or dtype and layouts); tensors with different keys never share a
    bucket, since a bucket is one flat buffer moved by one collective.
    """
    buckets: list[list[str]] = []
    size = 0
    for name in ready_order:
        same_dtype = not buckets or dtypes is None or dtypes[buckets[-1][0]] == dtypes[name]
        if buckets and size + nbytes[name] <= cap_bytes and same_dtype:
            buckets[-1].append(name)
            size += nbytes[name]
        else:
            buckets.append([name])
            size = nbytes[name]
    return buckets


def group_buckets(ready_order: list[str], groups: list[list[str]]) -> list[list[str]]:
    """One bucket per tensor of ``ready_order``, except that each of ``groups`` is one bucket (one flat buffer,
    as given: its first tensor's layouts price it), placed where its last ready tensor is. A group none of whose
    tensors is ready has no bucket."""
    group_of = {name: index for index, group in enumerate(groups) for name in group}
    ready = set(ready_order)
    left = {index: sum(name in ready for name in group) for index, group in enumerate(groups)}
    buckets: list[list[str]] = []
    for name in ready_order:
        index = group_of.get(name)
        if index is None:
            buckets.append([name])
            continue
        left[index] -= 1
        if left[index] == 0:
            buckets.append(list(groups[index]))
    return buckets
