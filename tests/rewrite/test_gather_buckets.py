"""Parameter gathers of graph mode's per-rank program made one per group (``rewrite.gather_buckets``), as FSDP2
gathers a wrapped layer with one flat all-gather.

  program   traced on a fake process group of 2 ranks (never run), the GPT planned fully sharded: each forward
            all-gather of parameters gathers one group (``param_gathers.gather_groups``: a block, or the root
            parameters), one per group and dtype, also under bf16 mixed precision; what runs (with the gathers
            made again for backward) is exactly the plan's list, which prices one latency per group
  ranks     on 2 gloo ranks, a model whose parameters do not split evenly (DTensor pads their shards: the cuts of
            the flat result must drop the padding) trained 3 AdamW steps fully sharded in graph mode equals one
            process, gathering each layer's weight and bias with one all-gather, as planned
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn

import torch_autopar as autopar
from torch_autopar import _compat
from torch_autopar.runtime.backend import graph_collectives
from torch_autopar.runtime import precision
from torch_autopar.runtime.sharded import ShardedRunner
from torch_autopar.strategies.param_gathers import gather_groups, parameter_side
from torch_autopar.testing import fake_process_group, run_on_ranks
from torch_autopar.testing.models import GPT

from tests import support

WORLD = 2


def _gpt_and_tokens():
    torch.manual_seed(0)
    return GPT(), torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(0))


def _plan_and_program(mixed_precision):
    with fake_process_group(WORLD):
        model, tokens = _gpt_and_tokens()
        plan = autopar.plan(model, (tokens,), mesh_shape=(WORLD,), hardware="cpu-gloo", strategy="fully_shard",
                            mode="graph", fold_layers=False, mixed_precision=mixed_precision)
        runner = ShardedRunner(model, plan, precision.resolve(mixed_precision))
        program = runner._program((tokens.chunk(WORLD)[0],), {}, {})
        itemsize = 2 if mixed_precision else 4
        return plan, program, [name for name, _ in model.named_parameters()], itemsize


@pytest.fixture(scope="module", params=[None, "bf16"])
def traced(request):
    return _plan_and_program(request.param)


def _param_gathers(graph) -> dict:
    """All-gather node → the names of the parameters it gathers (gathers of anything else left out)."""
    found = {}
    for gather in graph.graph.find_nodes(op="call_function", target=_compat.functional_all_gather()):
        side = parameter_side(gather.args[0], lambda n: n.op == "placeholder" and _compat.input_kind(
            n.meta["desc"]) == "param")
        if side is not None:
            found[gather] = {_compat.param_target(p.meta["desc"]) for p in side[0]}
    return found


def test_each_group_is_gathered_by_one_collective(traced):
    plan, program, names, _ = traced
    groups = gather_groups(names)
    gathers = _param_gathers(program.graph)
    assert gathers, "no parameter is gathered: the plan is not fully sharded"
    gathered_groups = []
    for gather, params in gathers.items():
        assert len({groups[name] for name in params}) == 1, f"{gather.name} gathers across groups: {params}"
        gathered_groups.append((groups[next(iter(params))], gather.args[0].meta["val"].dtype))
    assert len(gathered_groups) == len(set(gathered_groups)), f"a group gathered twice: {gathered_groups}"
    sharded = {name for name, placements in plan.param_placements.items() if "R" not in placements}
    assert {groups[name] for name in sharded} == {group for group, _ in gathered_groups}
    assert program.report.merged_gathers == sum(len(p) for p in gathers.values() if len(p) > 1) > len(gathers)


def test_program_runs_the_plans_gathers_one_latency_per_group(traced):
    plan, program, names, itemsize = traced
    ran = Counter((kind, nbytes) for kind, _, nbytes in graph_collectives(program.graph))
    ran += support.regathered(program.graph)
    planned = Counter()
    for c in plan.collectives:
        if not c.where.endswith("check"):  # the batch-size check runs outside the program
            planned[(c.kind, c.nbytes)] += c.count
    assert ran == planned
    groups = gather_groups(names)
    sharded = [name for name, placements in plan.param_placements.items() if "R" not in placements]
    expected = Counter()
    for name in sharded:
        expected[f"{groups[name] or 'root'} parameters"] += program_numel(name) * itemsize
    forward = {c.where: c.nbytes for c in plan.collectives
               if c.kind == "all_gather" and c.phase == "forward" and c.where.endswith(" parameters")}
    assert forward == dict(expected)


def program_numel(name: str) -> int:
    model, _ = _gpt_and_tokens()
    return model.get_parameter(name).numel()


class _Uneven(nn.Module):
    """Two layers whose weights' rows (7, 5) and biases do not split evenly over 2 ranks."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 7), nn.Linear(7, 5)])

    def forward(self, x):
        return self.layers[1](torch.tanh(self.layers[0](x)))


def _batch(step: int):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=generator), torch.randn(8, 5, generator=generator)


def _train(module, rank: int, world: int) -> list[float]:
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        x, y = _batch(step)
        loss = nn.functional.mse_loss(module(x.chunk(world)[rank]), y.chunk(world)[rank])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _uneven_worker(rank: int, world: int):
    return support.outcome(_uneven_run, rank, world)


def _uneven_run(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = _Uneven()
    pmodel = autopar.compile(model, _batch(0)[0].chunk(world)[rank], strategy="fully_shard", mode="graph")
    losses = _train(pmodel, rank, world)
    state = pmodel.state_dict()
    forward = [kind for kind, _, _ in pmodel.stats["graph_collectives"]["forward"] if kind == "all_gather"]
    return {"losses": losses, "params": {n: state[n].clone() for n, _ in model.named_parameters()},
            "forward_gathers": len(forward), "planned": [(c.kind, c.phase, c.where) for c in pmodel.plan.collectives]}


@pytest.mark.timeout(300)
def test_uneven_shards_gathered_per_group_equal_one_process():
    torch.manual_seed(0)
    reference = _Uneven()
    expected = _train(reference, 0, 1)
    outcomes = run_on_ranks(_uneven_worker, WORLD, timeout_s=240)
    support.assert_ranks_equal_one_process(outcomes, (expected, support.params_of(reference)), "uneven, graph")
    for _, run in outcomes:
        planned = [where for kind, phase, where in run["planned"] if kind == "all_gather" and phase == "forward"]
        assert run["forward_gathers"] == len(planned), run["planned"]
        assert sorted(w for w in planned if w.endswith(" parameters")) == ["layers.0 parameters", "layers.1 parameters"]
