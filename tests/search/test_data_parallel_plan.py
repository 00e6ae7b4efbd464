"""The data-parallel plan of a meta-device GPT on 64 ranks nobody has (a fake process group lives only while
planning): gradient synchronisation is exactly one all-reduce per gradient bucket and nothing else. A plan of
another name laid out as data parallelism is priced as data parallelism runs it."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

import torch_autopar as autopar
from torch_autopar import api, launch
from torch_autopar.cost import CostModel, get_profile
from torch_autopar.search.planner import Planner
from torch_autopar.testing import fake_process_group
from torch_autopar.testing.models import GPT, GPTConfig
from tests import support

WORLD = 64
BATCH, SEQ = 64, 256
SMALL_CAP = 1 << 20


@pytest.fixture(scope="module")
def meta_gpt():
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=50304, block_size=256, n_layer=4, n_head=4, n_embd=256))


def _plan(model, **kwargs):
    tokens = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    return autopar.plan(model, tokens, mesh_shape=(WORLD,), strategy="data_parallel", hardware="h100", **kwargs)


@pytest.fixture(scope="module")
def plans(meta_gpt):
    plans = {"default": _plan(meta_gpt), "small buckets": _plan(meta_gpt, bucket_cap_bytes=SMALL_CAP)}
    assert not dist.is_initialized(), "planning left its fake process group behind"
    return plans


@pytest.fixture(params=["default", "small buckets"])
def plan(plans, request):
    return plans[request.param]


def _param_bytes(model):
    return {name: p.numel() * p.element_size() for name, p in model.named_parameters()}


def test_only_one_grad_sync_all_reduce_per_bucket(plan):
    assert plan.strategy == "data_parallel"
    assert plan.mesh_shape == (WORLD,) and plan.axis_names == ("dp",) and plan.global_batch == BATCH
    assert {(c.kind, c.phase, c.axis) for c in plan.collectives} == {("all_reduce", "grad_sync", "dp")}
    assert len(plan.collectives) == len(plan.grad_buckets)
    assert sorted(c.where for c in plan.collectives) == sorted(f"bucket{i}" for i in range(len(plan.grad_buckets)))
    assert plan.collective_counts() == {("all_reduce", "grad_sync"): len(plan.grad_buckets)}


def test_every_parameter_in_exactly_one_bucket(plan, meta_gpt):
    counts = Counter(name for bucket in plan.grad_buckets for name in bucket)
    assert set(counts) == {name for name, _ in meta_gpt.named_parameters()}
    assert set(counts.values()) == {1}


def test_all_reduce_sizes_and_times_follow_the_cost_model(plan, meta_gpt):
    nbytes = _param_bytes(meta_gpt)
    cost = CostModel(get_profile("h100"), (WORLD,))
    for collective in plan.collectives:
        bucket = plan.grad_buckets[int(collective.where.removeprefix("bucket"))]
        assert collective.nbytes == sum(nbytes[name] for name in bucket)
        assert collective.seconds == pytest.approx(cost.collective_time("all_reduce", 0, collective.nbytes), rel=1e-12)
    assert plan.comm_bytes() == sum(nbytes.values())


def test_small_bucket_cap_gives_more_buckets_each_under_the_cap(plans, meta_gpt):
    default, small = plans["default"], plans["small buckets"]
    assert len(small.grad_buckets) > len(default.grad_buckets) >= 1
    nbytes = _param_bytes(meta_gpt)
    for bucket in small.grad_buckets:
        assert len(bucket) == 1 or sum(nbytes[name] for name in bucket) <= SMALL_CAP
    # buckets follow the order backward finishes gradients: the last block's before the first block's
    flat = [name for bucket in small.grad_buckets for name in bucket]
    assert flat.index("blocks.3.fc.weight") < flat.index("blocks.0.fc.weight")


def test_parameters_replicated_batch_sharded(plan, meta_gpt):
    assert plan.param_placements == {name: ("R",) for name, _ in meta_gpt.named_parameters()}
    assert plan.input_placements == {0: ("S(0)",)}


def test_explain_reports_no_replicated_ops(plan):
    text = plan.explain()
    assert plan.replicated_ops == {}
    assert "ops replicated for lack of a sharding rule: none" in text
    assert "strategy=data_parallel" in text and "dp=64" in text and "hardware=h100" in text
    assert f"gradient buckets: {len(plan.grad_buckets)}" in text
    assert "blocks.3.attn.qkv" in text


def test_planning_inside_a_fake_process_group_of_the_same_size(meta_gpt, plans):
    with fake_process_group(WORLD):
        inside = _plan(meta_gpt)
        assert dist.is_initialized()  # the caller's group is left alone
        with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: cannot plan for 8 devices inside a running "
                                                       r"job of 64 ranks"):
            autopar.plan(meta_gpt, torch.empty(8, SEQ, dtype=torch.long, device="meta"), mesh_shape=(8,))
    assert inside.grad_buckets == plans["default"].grad_buckets
    assert inside.collectives == plans["default"].collectives


def test_a_failed_plan_leaves_no_process_group(meta_gpt):
    with pytest.raises(autopar.AutoparError):
        _plan(meta_gpt, memory_budget=1)
    assert not dist.is_initialized()


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_searched_plan_laid_out_as_data_parallelism_is_priced_as_it_runs(mode):
    """A plan of another name whose every parameter is replicated runs as data parallelism (bucketed all-reduces,
    ``runtime.parallel_module``), so it is executed and priced as that: data parallelism's buckets, collectives
    and estimate, not the search's one sync per gradient."""
    model = support.build_model("mlp")
    x, _ = support.global_batch("mlp", 0)
    with launch.offline_mesh((2,)) as mesh:
        planner = Planner(api._capture(model, (x,), {}, None), mesh, mesh.mesh_dim_names,
                          hardware=get_profile("cpu-gloo"), global_batch=x.shape[0], mode=mode)
        data_parallel = planner.plan("data_parallel", executable=True)
        searched = planner.plan("data_parallel")
        searched.strategy, searched.grad_buckets = "auto", [[name] for bucket in searched.grad_buckets
                                                            for name in bucket]
        ran = planner.executed(searched)
    assert ran.strategy == "auto" and ran.is_data_parallel()
    assert len(data_parallel.grad_buckets) < len(searched.grad_buckets)
    assert ran.grad_buckets == data_parallel.grad_buckets
    assert sorted(map(repr, ran.collectives)) == sorted(map(repr, data_parallel.collectives))
    assert ran.estimated_step_time == pytest.approx(data_parallel.estimated_step_time, rel=1e-12)
    assert any("runs as data parallelism" in note for note in ran.notes)
