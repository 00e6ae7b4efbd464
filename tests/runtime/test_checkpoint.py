"""Checkpoint and resume: a job whose ranks are all killed (SIGKILL) during step 7 resumes from its step-6
checkpoint (mid-epoch) and ends with the loss curve and parameters of an uninterrupted run; a fully-sharded
checkpoint resumes under tensor and data parallelism and loads into one process; a save that crashes leaves
the previous checkpoint loadable; another model's checkpoint is refused by name."""

from __future__ import annotations

import os
import pickle
import shutil
import signal

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import torch_autopar as autopar
from torch_autopar.testing import run_on_ranks
from torch_autopar.testing.dist import RankFailure
from tests import support

WORLD = 2
SIZE = 17  # 16 kept on 2 ranks: 8 per rank, 4 steps of 2 per epoch; 1 dropped
BATCH = 4
EPOCHS = 3  # 12 steps; the checkpoint at step 6 is in the middle of epoch 2
SEED = 3


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(11)
    return TensorDataset(torch.randn(SIZE, 32, generator=generator), torch.randn(SIZE, 8, generator=generator))


class KillAt:
    """A loss function that SIGKILLs its own process at its ``call``-th call (inside that step's forward)."""

    def __init__(self, call: int):
        self.call, self.calls = call, 0

    def __call__(self, output, target):
        self.calls += 1
        if self.calls == self.call:
            os.kill(os.getpid(), signal.SIGKILL)
        return F.mse_loss(output, target)


class Recorder:
    """A step callback keeping (step, loss); stops after step ``stop_at`` if given."""

    def __init__(self, stop_at: int | None = None):
        self.losses, self.stop_at = [], stop_at

    def __call__(self, info):
        if info["event"] == "step":
            self.losses.append((info["step"], info["loss"]))
            if info["step"] == self.stop_at:
                raise autopar.StopTraining


def _trainer(strategy: str, loss_fn=F.mse_loss, world: int = WORLD):
    model = support.build_model("mlp")
    x, _ = _dataset()[:BATCH // world]
    pmodel = autopar.compile(model, x, strategy=strategy)
    optimizer = support.make_optimizer("adamw", pmodel.parameters())
    return autopar.Model(pmodel, loss_fn, optimizer)


def _train(trainer, recorder, directory, **options):
    metrics = trainer.train(EPOCHS, _dataset(), batch_size=BATCH, seed=SEED, progress=False, callbacks=recorder,
                            checkpoint_dir=directory, **options)
    return {"losses": recorder.losses, "metrics": [m["loss"] for m in metrics],
            "params": {k: v.clone() for k, v in trainer.network.state_dict().items()}}


def _killed_job(rank, world, directory):
    """Checkpoints every 3 steps; every rank kills itself in step 7's forward (7th loss call)."""
    trainer = _trainer("data_parallel", KillAt(7))
    _train(trainer, Recorder(), directory, checkpoint_every=3)
    raise AssertionError("the rank was not killed")


def _sharded_then_stopped(directory):
    """fully_shard: 6 steps, checkpoint at 6 (mid-epoch), stop."""
    trainer = _trainer("fully_shard")
    _train(trainer, Recorder(stop_at=6), directory, checkpoint_every=6)


def _crash_on_rank_1(rank, directory):
    """A save whose rank-1 writer fails half-way: every rank gets the error, the checkpoint stays loadable."""
    trainer = _trainer("fully_shard")
    original = dcp.FileSystemWriter.write_data

    def failing(self, plan, planner):
        if rank == 1:
            raise OSError("disk full (injected)")
        return original(self, plan, planner)

    dcp.FileSystemWriter.write_data = failing
    try:
        error = support.outcome(autopar.save_checkpoint, directory, trainer.network, trainer.optimizer, step=99)
    finally:
        dcp.FileSystemWriter.write_data = original
    extra = autopar.load_checkpoint(directory, trainer.network, trainer.optimizer)
    return {"error": error, "extra_step": extra["step"]}


def _from_one_process(single_dir):
    """A one-process checkpoint loaded into a fully-sharded model on 2 ranks."""
    trainer = _trainer("fully_shard")
    extra = autopar.load_checkpoint(single_dir, trainer.network, trainer.optimizer)
    return {"extra": extra, "params": {k: v.clone() for k, v in trainer.network.state_dict().items()}}


def _resume_job(rank, world, killed_dir, sharded_dir, fresh_dir, single_dir):
    results = {"uninterrupted": _train(_trainer("data_parallel"), Recorder(), fresh_dir, checkpoint_every=5)}
    results["from_one_process"] = _from_one_process(single_dir)
    results["resumed"] = _train(_trainer("data_parallel"), Recorder(), killed_dir, checkpoint_every=3, resume=True)
    _sharded_then_stopped(sharded_dir)
    for strategy in ("tensor_parallel", "data_parallel"):
        copy = f"{sharded_dir}-{strategy}"  # each resumes from its own copy (a resumed run saves at its end)
        if rank == 0:
            shutil.copytree(sharded_dir, copy)
        dist.barrier()
        results[strategy] = _train(_trainer(strategy), Recorder(), copy, resume=True)
    results["crash"] = _crash_on_rank_1(rank, sharded_dir)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    killed, sharded, fresh, single = (str(root / name) for name in ("killed", "sharded", "fresh", "single"))
    with pytest.raises(RankFailure, match="died"):
        run_on_ranks(_killed_job, WORLD, killed, timeout_s=120)
    model = support.build_model("mlp", seed=7)
    optimizer = support.make_optimizer("adamw", model.parameters())
    _step(model, optimizer)
    autopar.save_checkpoint(single, model, optimizer, note="one process")
    results = run_on_ranks(_resume_job, WORLD, killed, sharded, fresh, single, timeout_s=240)
    return {"results": results, "sharded": sharded, "killed": killed, "single_params": support.params_of(model)}


def _reference(steps: int = 12):
    """One process, plain PyTorch, the same global batches: rank r's s-th local batch is positions 2s, 2s+1 of
    perm[:16][r::2], so global batch s is the set perm[4s:4s+4] (DistributedSampler with drop_last)."""
    dataset = _dataset()
    model = support.build_model("mlp")
    optimizer = support.make_optimizer("adamw", model.parameters())
    losses = []
    for epoch in range(EPOCHS):
        order = torch.randperm(SIZE, generator=torch.Generator().manual_seed(SEED + epoch))[:16]
        per_rank = [order[r::WORLD] for r in range(WORLD)]
        for s in range(4):
            indices = torch.cat([part[2 * s:2 * s + 2] for part in per_rank])
            loss = F.mse_loss(model(dataset.tensors[0][indices]), dataset.tensors[1][indices])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if len(losses) == steps:
                return losses, support.params_of(model)
    return losses, support.params_of(model)


def _mean_curve(results, name):
    """The global batch's loss per step: the mean of the ranks' (equal-sized) slices' losses."""
    curves = [dict(r[name]["losses"]) for r in results]
    return {step: sum(c[step] for c in curves) / len(curves) for step in curves[0]}


def test_uninterrupted_run_matches_one_process(runs):
    ref_losses, ref_params = _reference()
    curve = _mean_curve(runs["results"], "uninterrupted")
    support.assert_losses_close([curve[s] for s in range(1, 13)], ref_losses, what="uninterrupted")
    for result in runs["results"]:
        support.assert_params_close(result["uninterrupted"]["params"], ref_params, what="uninterrupted")


def test_killed_job_resumes_exactly(runs):
    for result in runs["results"]:
        fresh, resumed = result["uninterrupted"], result["resumed"]
        assert [step for step, _ in resumed["losses"]] == list(range(7, 13))
        for step, loss in resumed["losses"]:
            assert loss == pytest.approx(dict(fresh["losses"])[step], abs=1e-6), step
        assert resumed["metrics"] == pytest.approx(fresh["metrics"][1:], abs=1e-6)  # epochs 2 and 3, whole
        for name, value in fresh["params"].items():
            torch.testing.assert_close(resumed["params"][name], value, rtol=0, atol=1e-6)


@pytest.mark.parametrize("strategy", ["tensor_parallel", "data_parallel"])
def test_fully_sharded_checkpoint_resumes_under_another_strategy(runs, strategy):
    for result in runs["results"]:
        fresh, resumed = result["uninterrupted"], result[strategy]
        assert [step for step, _ in resumed["losses"]] == list(range(7, 13))
        for step, loss in resumed["losses"]:
            assert loss == pytest.approx(dict(fresh["losses"])[step], rel=1e-5), step
        for name, value in fresh["params"].items():
            torch.testing.assert_close(resumed["params"][name], value, rtol=1e-5, atol=1e-5)


def test_two_rank_checkpoint_loads_into_one_process(runs):
    _, ref_params = _reference(steps=6)
    model = support.build_model("mlp", seed=9)
    optimizer = support.make_optimizer("adamw", model.parameters())
    extra = autopar.load_checkpoint(runs["sharded"], model, optimizer)
    assert extra == {"step": 6, "epoch": 1, "consumed": 2}
    support.assert_params_close(support.params_of(model), ref_params, what="2-rank fully_shard -> 1 process")
    assert all(state["step"] == 6 for state in optimizer.state.values())


def test_one_process_checkpoint_loads_fully_sharded_on_two_ranks(runs):
    for result in runs["results"]:
        assert result["from_one_process"]["extra"] == {"note": "one process"}
        for name, value in runs["single_params"].items():
            torch.testing.assert_close(result["from_one_process"]["params"][name], value, rtol=0, atol=0)


def test_crash_in_one_ranks_writer_leaves_previous_checkpoint(runs):
    for result in runs["results"]:
        kind, message = result["crash"]["error"]
        assert kind == "AutoparError" and message.startswith("torch_autopar: saving the checkpoint failed"), message
        assert "previous checkpoint" in message
        assert result["crash"]["extra_step"] == 6


def _small(seed=0):
    torch.manual_seed(seed)
    model = support.build_model("mlp", seed=seed)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _step(model, optimizer):
    x, y = support.global_batch("mlp", 0)
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    optimizer.step()


def test_crash_mid_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    model, optimizer = _small()
    _step(model, optimizer)
    saved = support.params_of(model)
    autopar.save_checkpoint(tmp_path / "ck", model, optimizer, step=1)
    _step(model, optimizer)

    def finish_fails(self, metadata, results):
        raise OSError("power cut (injected) after the data files, before the metadata")

    monkeypatch.setattr(dcp.FileSystemWriter, "finish", finish_fails)
    with pytest.raises(autopar.AutoparError, match="^torch_autopar: saving the checkpoint failed"):
        autopar.save_checkpoint(tmp_path / "ck", model, optimizer, step=2)
    monkeypatch.undo()
    fresh, fresh_optimizer = _small(seed=4)
    assert autopar.load_checkpoint(tmp_path / "ck", fresh, fresh_optimizer) == {"step": 1}
    support.assert_params_close(support.params_of(fresh), saved, what="after a failed save")


def test_crash_between_renames_loads_the_old_copy(tmp_path, monkeypatch):
    model, optimizer = _small()
    autopar.save_checkpoint(tmp_path / "ck", model, optimizer, step=1)
    real_rename = os.rename

    def staging_rename_fails(source, target):  # the old copy is out of the way, the new one not yet in place
        if os.fspath(target) == str(tmp_path / "ck"):
            raise OSError("killed between the renames (injected)")
        real_rename(source, target)

    monkeypatch.setattr(os, "rename", staging_rename_fails)
    with pytest.raises(OSError):
        autopar.save_checkpoint(tmp_path / "ck", model, optimizer, step=2)
    monkeypatch.undo()
    assert not (tmp_path / "ck").exists() and (tmp_path / "ck.old").exists()
    fresh, fresh_optimizer = _small(seed=4)
    assert autopar.load_checkpoint(tmp_path / "ck", fresh, fresh_optimizer) == {"step": 1}
    autopar.save_checkpoint(tmp_path / "ck", model, optimizer, step=3)  # and the next save cleans up
    assert not (tmp_path / "ck.old").exists() and not (tmp_path / "ck.tmp").exists()


def test_checkpoint_of_another_model_is_refused_by_name(tmp_path):
    model, optimizer = _small()
    autopar.save_checkpoint(tmp_path / "ck", model, optimizer)
    torch.manual_seed(0)
    wider = support.MLP((32, 64, 60, 8))
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: the checkpoint .* another model: parameter "
                                                   r"'layers.1.weight' is expected with shape \(60, 64\)"):
        autopar.load_checkpoint(tmp_path / "ck", wider, torch.optim.SGD(wider.parameters(), lr=0.1))
    gpt = support.build_model("gpt")
    with pytest.raises(autopar.AutoparError, match=r"parameter 'tok.weight' is expected .* found absent"):
        autopar.load_checkpoint(tmp_path / "ck", gpt)
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: no checkpoint at"):
        autopar.load_checkpoint(tmp_path / "missing", model)
    adamw = support.make_optimizer("adamw", model.parameters())  # the checkpoint holds SGD's momentum
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: could not load .* on rank 0: "
                                                   r"RuntimeError: Missing key .*optimizer.state.layers"):
        autopar.load_checkpoint(tmp_path / "ck", model, adamw)
    assert autopar.load_checkpoint(tmp_path / "ck", model) == {}  # the model alone


def test_rng_state_extra_and_plan_round_trip(tmp_path):
    model, optimizer = _small()
    pmodel = autopar.compile(model, support.global_batch("mlp", 0)[0])
    autopar.save_checkpoint(tmp_path / "ck", pmodel, optimizer, epoch=2, note="x", sizes=[1, 2])
    assert autopar.Plan.load(tmp_path / "ck" / "plan.json").fingerprint == pmodel.plan.fingerprint
    expected = torch.rand(5)
    torch.rand(3)
    extra = autopar.load_checkpoint(tmp_path / "ck", model, optimizer)
    assert extra == {"epoch": 2, "note": "x", "sizes": [1, 2]}
    assert torch.equal(torch.rand(5), expected)
    with pytest.raises(autopar.AutoparError, match="must be JSON values"):
        autopar.save_checkpoint(tmp_path / "ck2", model, optimizer, weights=torch.ones(2))


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_nothing_in_a_checkpoint_is_unpickled_unchecked(tmp_path):
    model, optimizer = _small()
    _step(model, optimizer)
    autopar.save_checkpoint(tmp_path / "ck", model, optimizer)
    metadata = dcp.FileSystemReader(str(tmp_path / "ck" / "state")).read_metadata()
    kinds = {type(entry).__name__ for entry in metadata.state_dict_metadata.values()}
    assert kinds == {"TensorStorageMetadata"}, kinds  # hyper-parameters went to JSON, not DCP's pickled bytes
    assert autopar.load_checkpoint(tmp_path / "ck", model, optimizer) == {}
    assert optimizer.param_groups[0]["lr"] == 0.1 and optimizer.param_groups[0]["momentum"] == 0.9
    marker = tmp_path / "exploited"
    with open(tmp_path / "ck" / "state" / ".metadata", "wb") as handle:
        pickle.dump(_Exploit(marker), handle)
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: could not load the checkpoint .* not allowed"):
        autopar.load_checkpoint(tmp_path / "ck", model, optimizer)
    assert not marker.exists()
