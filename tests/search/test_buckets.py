"""``assign_buckets``: consecutive buckets in gradient-ready order, at most ``cap_bytes`` each (a larger tensor
gets a bucket of its own), never mixing dtypes. ``group_buckets``: a fully-sharded group's gradients are one bucket,
placed where its last gradient is ready."""

from __future__ import annotations

import random

from torch_autopar.search.buckets import DEFAULT_BUCKET_CAP_BYTES, assign_buckets, group_buckets


def test_empty():
    assert assign_buckets([], {}) == []


def test_everything_fits_in_one_bucket_in_order():
    names = ["c", "a", "b"]
    assert assign_buckets(names, {"a": 10, "b": 20, "c": 30}) == [["c", "a", "b"]]
    assert DEFAULT_BUCKET_CAP_BYTES == 25 * 1024 * 1024


def test_cap_is_inclusive():
    sizes = {"a": 4, "b": 4, "c": 4, "d": 1}
    assert assign_buckets(["a", "b", "c", "d"], sizes, cap_bytes=8) == [["a", "b"], ["c", "d"]]
    assert assign_buckets(["a", "b", "c", "d"], sizes, cap_bytes=7) == [["a"], ["b"], ["c", "d"]]


def test_a_tensor_larger_than_the_cap_gets_its_own_bucket():
    sizes = {"a": 2, "big": 100, "b": 2, "c": 2}
    assert assign_buckets(["a", "big", "b", "c"], sizes, cap_bytes=8) == [["a"], ["big"], ["b", "c"]]


def test_dtypes_never_share_a_bucket():
    sizes = dict.fromkeys("abcde", 1)
    dtypes = {"a": "float32", "b": "bfloat16", "c": "bfloat16", "d": "float32", "e": "float32"}
    assert assign_buckets(list("abcde"), sizes, cap_bytes=100, dtypes=dtypes) == [["a"], ["b", "c"], ["d", "e"]]
    assert assign_buckets(list("abcde"), sizes, cap_bytes=100) == [list("abcde")]  # no dtypes given: one bucket


def test_greedy_invariants_on_random_inputs():
    rng = random.Random(0)
    for _ in range(200):
        names = [f"p{i}" for i in range(rng.randint(1, 30))]
        sizes = {n: rng.choice([1, 3, 8, 64, 500]) for n in names}
        dtypes = {n: rng.choice(["float32", "float32", "bfloat16"]) for n in names}
        cap = rng.choice([1, 8, 64, 1000])
        buckets = assign_buckets(names, sizes, cap, dtypes)
        assert [n for bucket in buckets for n in bucket] == names  # every name once, order kept
        for index, bucket in enumerate(buckets):
            assert bucket, "empty bucket"
            assert len(bucket) == 1 or sum(sizes[n] for n in bucket) <= cap
            assert len({dtypes[n] for n in bucket}) == 1
            if index:  # a new bucket starts only when the next name would not fit the previous one
                previous = buckets[index - 1]
                closed_by_size = sum(sizes[n] for n in previous) + sizes[bucket[0]] > cap
                assert closed_by_size or dtypes[previous[-1]] != dtypes[bucket[0]]


def test_a_group_is_one_bucket_where_its_last_gradient_is_ready():
    ready = ["head", "b1.w", "b1.b", "b0.w", "root", "b0.b"]
    groups = [["b0.b", "b0.w", "b0.frozen"], ["b1.w", "b1.b"]]
    assert group_buckets(ready, groups) == [["head"], ["b1.w", "b1.b"], ["root"], ["b0.b", "b0.w", "b0.frozen"]]
    assert group_buckets(ready, [["nothing.ready"]]) == [[name] for name in ready]
