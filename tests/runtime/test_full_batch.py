"""``full_batch=True`` with a sharded plan: every rank passes the whole batch, as parallelize_module users call a
model, so inputs arrive and outputs leave replicated and no batch slice moves.

On 2 gloo ranks, the column/row layout (first linear of each MLP block column-parallel, second row-parallel)
given as a Plan, eager and graph mode, MLP and GPT: 3 AdamW steps equal one process (each rank's loss is the
global loss), the collectives counted every step equal the plan's list, and the bytes moved per step are no
more than parallelize_module's ColwiseParallel/RowwiseParallel on the same model, counted the same way (the plan
adds only its 32-byte-per-input check that the ranks were given the same batch).
"""

from __future__ import annotations

import pytest
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import torch_autopar as autopar
from torch_autopar.launch.mesh import job_mesh
from torch_autopar.runtime.comm_count import CollectiveCounter, planned_summary
from torch_autopar.testing import run_on_ranks
from tests import support

WORLD = 2
MODELS = ("mlp", "gpt")
MODES = ("eager", "graph")


def _bytes(counted) -> int:
    return sum(nbytes * count for (_, _, nbytes), count in counted.items())


def _ours(rank, world, model_name, mode):
    model = support.build_model(model_name)
    x, _ = support.global_batch(model_name, 0)
    plan = support.megatron_plan(model, x, (world,), full_batch=True)
    pmodel = autopar.compile(model, x, strategy=plan, mode=mode, full_batch=True)
    optimizer = support.make_optimizer("adamw", pmodel.parameters())
    losses, counts = [], []
    for step in range(support.STEPS):
        x, y = support.global_batch(model_name, step)
        loss, counted = support.counted_step(pmodel, model_name, optimizer, x, y, mode)
        losses.append(loss)
        counts.append(dict(counted))
    check = sum(c.nbytes for c in pmodel.plan.collectives if c.where == "full batch check")
    state = pmodel.state_dict()
    return {"losses": losses, "params": {name: state[name].clone() for name, _ in model.named_parameters()},
            "counted": counts, "planned": dict(planned_summary(pmodel.plan)), "check_bytes": check,
            "moved_bytes": _bytes(counts[-1]) - check, "full_batch": pmodel.plan.full_batch}


def _parallelize_module_bytes(rank, world, model_name) -> int:
    """Bytes moved by one training step of parallelize_module's column/row layout on the whole batch."""
    model = support.build_model(model_name)
    mesh = job_mesh((world,), ("tp",))
    pairs = [("layers.0", "layers.1")] if model_name == "mlp" else [
        (f"blocks.{i}.fc", f"blocks.{i}.out") for i in range(len(model.blocks))]
    parallelize_module(model, mesh, {name: style for column, row in pairs
                                     for name, style in ((column, ColwiseParallel()), (row, RowwiseParallel()))})
    x, y = support.global_batch(model_name, 0)
    with CollectiveCounter(mesh) as counter:
        support.loss_fn(model_name, model(x), y).backward()
    return _bytes(counter.summary())


def _job(rank, world):
    results = {(m, mode): support.outcome(_ours, rank, world, m, mode) for m in MODELS for mode in MODES}
    results.update({(m, "parallelize_module"): support.outcome(_parallelize_module_bytes, rank, world, m)
                    for m in MODELS})
    return results


@pytest.fixture(scope="module")
def runs():
    return support.by_case(run_on_ranks(_job, WORLD, timeout_s=600))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model_name", MODELS)
def test_full_batch_column_row_equals_one_process_and_moves_no_more_than_parallelize_module(runs, model_name, mode):
    what = f"{model_name} column/row, full batch, {mode} mode"
    outcomes = runs[(model_name, mode)]
    for rank, (status, run) in enumerate(outcomes):
        assert status == "ok", f"rank {rank} {what}: {status}: {run}"
    ref_losses, ref_params = support.reference_run(model_name, "adamw")
    for rank, (_, run) in enumerate(outcomes):
        assert run["full_batch"], what
        support.assert_losses_close(run["losses"], ref_losses, what=f"rank {rank} {what}")
        support.assert_params_close(run["params"], ref_params, what=f"rank {rank} {what}")
        for step, counted in enumerate(run["counted"]):
            assert counted == run["planned"], f"rank {rank} step {step} {what}: ran {counted}, planned {run['planned']}"
    status, reference_bytes = runs[(model_name, "parallelize_module")][0]
    assert status == "ok", reference_bytes
    first = outcomes[0][1]
    assert first["check_bytes"] == 32, what
    assert first["moved_bytes"] <= reference_bytes, (
        f"{what}: {first['moved_bytes']} bytes per step (plus the {first['check_bytes']}-byte batch check) vs "
        f"parallelize_module's {reference_bytes}")
