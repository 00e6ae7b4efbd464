"""``Model.train``'s loop on 2 gloo ranks against one-process PyTorch: gradient accumulation (K=4 equals one
step on a 4x batch; data parallelism skips the all-reduce of the first K-1 micro-steps), clipping and an LR
scheduler, IterableDataset / DataLoader inputs, worker processes, a mid-epoch resume with workers, early
stopping, and ``detect_anomalies`` stopping every rank at an injected NaN with the step, rank and parameter."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

import torch_autopar as autopar
from torch_autopar.testing import run_on_ranks
from tests import support

WORLD = 2
SIZE = 32
LR = 0.05


def _data(nan_at: int | None = None) -> TensorDataset:
    generator = torch.Generator().manual_seed(21)
    x, y = torch.randn(SIZE, 32, generator=generator), torch.randn(SIZE, 8, generator=generator)
    if nan_at is not None:
        x[nan_at, 0] = float("nan")
    return TensorDataset(x, y)


class Stream(IterableDataset):
    """The dataset's samples in order, as a stream (no length)."""

    def __iter__(self):
        data = _data()
        return iter(zip(*data.tensors))


def _trainer(strategy: str, optimizer: str = "sgd"):
    model = support.build_model("mlp")
    pmodel = autopar.compile(model, _data().tensors[0][:2], strategy=strategy)
    opt = torch.optim.SGD(pmodel.parameters(), lr=LR) if optimizer == "sgd" else \
        support.make_optimizer(optimizer, pmodel.parameters())
    return autopar.Model(pmodel, F.mse_loss, opt)


def _params(trainer) -> dict:
    return {k: v.clone() for k, v in trainer.network.state_dict().items()}


def _count_all_reduces(fn):
    """Calls of dist.all_reduce made by ``fn`` (gradient buckets, batch checks and metrics alike)."""
    original, calls = dist.all_reduce, []

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        fn()
    finally:
        dist.all_reduce = original
    return len(calls)


def _accumulation(strategy):
    """2 epochs of 32 samples: K=4 micro-batches of 4 (global) per step vs one batch of 16 per step."""
    runs = {}
    for name, batch, accumulate in (("accumulated", 4, 4), ("big_batch", 16, 1)):
        trainer = _trainer(strategy)
        count = _count_all_reduces(lambda: trainer.train(2, _data(), batch_size=batch, accumulate=accumulate,
                                                         shuffle=False, progress=False))
        runs[name] = {"params": _params(trainer), "all_reduces": count}
    return runs


def _clip_and_schedule():
    trainer = _trainer("fully_shard", "adamw")
    scheduler = torch.optim.lr_scheduler.StepLR(trainer.optimizer, step_size=2, gamma=0.5)
    lrs = []
    trainer.train(1, _data(), batch_size=8, shuffle=False, progress=False, clip_grad_norm=0.05,
                  lr_scheduler=scheduler, callbacks=lambda info: lrs.append(info.get("lr")))
    return {"params": _params(trainer), "lrs": lrs}


def _inputs(rank, world):
    runs = {}
    trainer = _trainer("data_parallel")
    metrics = trainer.train(1, Stream(), batch_size=6, progress=False)  # 5 batches of 6, a last one of 2
    runs["stream"] = {"params": _params(trainer), "metrics": metrics}
    trainer = _trainer("data_parallel")
    trainer.train(1, DataLoader(_data(), batch_size=8), progress=False)  # global batches, sliced per rank
    runs["loader"] = {"params": _params(trainer)}
    sampler = DistributedSampler(_data(), num_replicas=world, rank=rank, shuffle=False)
    trainer = _trainer("data_parallel")
    trainer.train(1, DataLoader(_data(), batch_size=4, sampler=sampler), progress=False)  # this rank's batches
    runs["sharded_loader"] = {"params": _params(trainer)}
    trainer = _trainer("data_parallel")
    trainer.train(1, _data(), batch_size=8, shuffle=False, num_workers=2, progress=False)
    runs["workers"] = {"params": _params(trainer)}
    return runs


def _resume_with_workers(directory):
    """Stop mid-epoch at step 3 (of 4 per epoch), then a new trainer with 2 workers resumes; vs uninterrupted."""
    def stop_at_3(info):
        return info["event"] == "step" and info["step"] == 3

    options = dict(batch_size=8, seed=5, num_workers=2, progress=False)
    whole = _trainer("data_parallel", "adamw")
    whole.train(2, _data(), **options)
    first = _trainer("data_parallel", "adamw")
    first.train(2, _data(), checkpoint_dir=directory, checkpoint_every=3, callbacks=stop_at_3, **options)
    second = _trainer("data_parallel", "adamw")
    metrics = second.train(2, _data(), checkpoint_dir=directory, resume=True, **options)
    return {"whole": _params(whole), "resumed": _params(second), "epochs": [m["epoch"] for m in metrics]}


def _anomaly(strategy):
    trainer = _trainer(strategy)
    before = []
    outcome = support.outcome(trainer.train, 1, _data(nan_at=9), batch_size=4, shuffle=False, progress=False,
                              detect_anomalies=True, callbacks=lambda info: before.append(_params(trainer)))
    return {"outcome": outcome, "steps_done": len(before), "after": _params(trainer),
            "before": before[-1] if before else None}


def _job(rank, world, directory):
    # A rank may inherit its launcher's start method ("spawn", "forkserver"), which would re-import torch in
    # every DataLoader worker (seconds each); torchrun's ranks fork their workers, as Linux does by default.
    multiprocessing.set_start_method("fork", force=True)
    return {"accumulate_dp": _accumulation("data_parallel"), "accumulate_fsdp": _accumulation("fully_shard"),
            "clip": _clip_and_schedule(), "inputs": _inputs(rank, world),
            "resume_workers": _resume_with_workers(directory),
            "anomaly_dp": _anomaly("data_parallel"), "anomaly_fsdp": _anomaly("fully_shard")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_on_ranks(_job, WORLD, str(tmp_path_factory.mktemp("loop") / "ck"), timeout_s=300)


def _reference(global_batches, epochs=1, optimizer="sgd", clip=None, scheduler=None):
    """Plain PyTorch in one process over the given lists of sample indices (each one optimizer step)."""
    data = _data()
    model = support.build_model("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=LR) if optimizer == "sgd" else \
        support.make_optimizer(optimizer, model.parameters())
    schedule = scheduler(opt) if scheduler else None
    for _ in range(epochs):
        for indices in global_batches:
            opt.zero_grad()
            F.mse_loss(model(data.tensors[0][indices]), data.tensors[1][indices]).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            if schedule is not None:
                schedule.step()
    return support.params_of(model)


def _in_order(batch: int, size: int = SIZE) -> list[list[int]]:
    """Global batches without shuffling: rank r's local batch s is rank r's s-th run of indices r, r+2, ..."""
    local = batch // WORLD
    per_rank = [list(range(size))[r::WORLD] for r in range(WORLD)]
    return [[i for part in per_rank for i in part[s * local:(s + 1) * local]] for s in range(size // batch)]


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_accumulating_4_micro_steps_equals_one_step_on_a_4x_batch(results, strategy):
    expected = _reference(_in_order(16), epochs=2)
    for result in results:
        runs = result[f"accumulate_{strategy}"]
        support.assert_params_close(runs["accumulated"]["params"], expected, what="accumulate=4")
        support.assert_params_close(runs["big_batch"]["params"], expected, what="4x batch")
        if strategy == "dp":  # no_sync: the same number of gradient all-reduces as 4x fewer steps
            assert runs["accumulated"]["all_reduces"] == runs["big_batch"]["all_reduces"], runs


def test_clipping_and_lr_scheduler_match_one_process(results):
    scheduler = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # noqa: E731
    expected = _reference(_in_order(8), optimizer="adamw", clip=0.05, scheduler=scheduler)
    for result in results:
        support.assert_params_close(result["clip"]["params"], expected, what="clip + StepLR")
        assert result["clip"]["lrs"][:4] == [1e-2, 5e-3, 5e-3, 2.5e-3]


def test_iterable_dataset_and_data_loaders_match_one_process(results):
    stream = [list(range(s, min(s + 6, SIZE))) for s in range(0, SIZE, 6)]  # the last global batch has 2
    expected = {"stream": _reference(stream), "loader": _reference([list(range(s, s + 8)) for s in range(0, SIZE, 8)]),
                "sharded_loader": _reference(_in_order(8)), "workers": _reference(_in_order(8))}
    for result in results:
        for name, params in expected.items():
            support.assert_params_close(result["inputs"][name]["params"], params, what=name)
        metrics = result["inputs"]["stream"]["metrics"][0]
        assert metrics["samples"] == SIZE and metrics["dropped"] == 0


def test_mid_epoch_resume_with_worker_processes(results):
    for result in results:
        value = result["resume_workers"]
        assert value["epochs"] == [1, 2]
        for name, tensor in value["whole"].items():
            torch.testing.assert_close(value["resumed"][name], tensor, rtol=0, atol=1e-6)


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_detect_anomalies_stops_every_rank_naming_step_rank_parameter(results, strategy):
    for result in results:
        value = result[f"anomaly_{strategy}"]
        kind, message = value["outcome"]
        assert kind == "AutoparError", value["outcome"]
        # sample 9 is rank 1's 5th sample: its 3rd local batch of 2, step 3
        assert message.startswith("torch_autopar: detect_anomalies: training stopped at step 3 (epoch 1) on rank 1:")
        assert "loss nan" in message and "'layers.0.weight'" in message, message
        assert value["steps_done"] == 2
        support.assert_params_close(value["after"], value["before"], what="parameters before the NaN step")


def test_a_short_last_accumulation_group_is_its_own_mean():
    """10 samples, batches of 2, accumulate=3: steps over 6 and then 4 samples (one process)."""
    data = TensorDataset(*_data()[:10])
    model = support.build_model("mlp")
    trainer = autopar.Model(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=LR))
    steps = []
    trainer.train(1, data, batch_size=2, shuffle=False, accumulate=3, progress=False,
                  callbacks=lambda info: steps.append(info["step"]) if info["event"] == "step" else None)
    assert steps == [1, 2]
    expected = _reference([list(range(6)), list(range(6, 10))])
    support.assert_params_close(support.params_of(model), expected, what="accumulate=3 over 5 batches")


def test_resume_plans_a_lazily_compiled_model_first(tmp_path):
    """Model(plain network) plans at its first batch; resume must plan before loading (one process)."""
    def trained(stop_at=None, resume=False):
        model = support.build_model("mlp")
        trainer = autopar.Model(model, F.mse_loss, support.make_optimizer("adamw", model.parameters()))
        trainer.train(2, _data(), batch_size=8, seed=1, progress=False, checkpoint_dir=tmp_path / "ck",
                      checkpoint_every=3, resume=resume,
                      callbacks=lambda info: info["event"] == "step" and info["step"] == stop_at)
        return support.params_of(model)

    whole = trained()
    trained(stop_at=3)  # overwrites the checkpoint: step 3, mid-epoch 1
    resumed = trained(resume=True)
    for name, value in whole.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-6)


def test_train_option_errors():
    model = support.build_model("mlp")
    trainer = autopar.Model(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=LR))
    with pytest.raises(autopar.AutoparError, match="^torch_autopar: checkpoint_every needs checkpoint_dir"):
        trainer.train(1, _data(), batch_size=4, checkpoint_every=2)
    with pytest.raises(autopar.AutoparError, match="^torch_autopar: resume=True needs checkpoint_dir"):
        trainer.train(1, _data(), batch_size=4, resume=True)
    with pytest.raises(autopar.AutoparError, match="^torch_autopar: accumulate=0"):
        trainer.train(1, _data(), batch_size=4, accumulate=0)
    with pytest.raises(autopar.AutoparError, match="^torch_autopar: Model.train needs batch_size="):
        trainer.train(1, _data())


def test_detect_anomalies_catches_an_infinite_gradient_with_a_finite_loss():
    model = support.build_model("mlp")
    model.layers[2].bias.register_hook(lambda grad: grad * float("inf"))
    trainer = autopar.Model(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=LR))
    events = []
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: detect_anomalies: training stopped at step 1 "
                                                   r"\(epoch 1\) on rank 0: finite loss, first parameter with a "
                                                   r"non-finite gradient: 'layers.2.bias'"):
        trainer.train(1, _data(), batch_size=4, progress=False, detect_anomalies=True, callbacks=events.append)
    assert events == []
    trainer = autopar.Model(support.build_model("mlp"), F.mse_loss)
    trainer.optimizer = torch.optim.SGD(trainer.network.parameters(), lr=LR)
    trainer.train(1, _data(), batch_size=4, progress=False, detect_anomalies=True, callbacks=events.append)
    assert [e["event"] for e in events] == ["step"] * 8 + ["epoch"] and events[-1]["samples"] == SIZE
