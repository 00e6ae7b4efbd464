"""``autopar.Model(network, loss_fn, optimizer).train(...)``: the dataset is sharded by rank so each kept sample
is seen once per epoch across ranks, training equals a one-process run over the same global batches, metrics
are reduced over ranks, and ``eval`` averages over the whole dataset."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

import torch_autopar as autopar
from torch_autopar.testing import run_on_ranks
from tests.support import outcome

WORLD = 2
SIZE = 21  # 1 sample left out per epoch on 2 ranks
BATCH = 4  # global; 2 per rank, 5 steps per epoch
EPOCHS = 3
LR = 0.05
METRIC_KEYS = {"epoch", "loss", "samples", "dropped", "seconds", "samples_per_s"}


class IndexedDataset(Dataset):
    """A linear regression problem whose items record the indices they were read at."""

    def __init__(self, size: int):
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(4, 2, generator=generator)
        self.x = torch.randn(size, 4, generator=generator)
        self.y = self.x @ weight + 0.5
        self.seen: list[int] = []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        self.seen.append(int(index))
        return self.x[index], self.y[index]


def _network():
    torch.manual_seed(0)
    return nn.Linear(4, 2)


def _trainer_job(rank, world):
    dataset = IndexedDataset(SIZE)
    network = _network()
    pnetwork = autopar.compile(network, strategy="data_parallel")
    model = autopar.Model(pnetwork, F.mse_loss, torch.optim.SGD(pnetwork.parameters(), lr=LR))
    metrics = model.train(EPOCHS, dataset, batch_size=BATCH, seed=7)
    seen = list(dataset.seen)
    evaluation = model.eval(IndexedDataset(SIZE - 1), batch_size=BATCH)

    plain = _network()  # Model compiles a plain network itself
    auto_model = autopar.Model(plain, F.mse_loss, torch.optim.SGD(plain.parameters(), lr=LR))
    auto_model.train(1, IndexedDataset(SIZE), batch_size=BATCH, seed=7, progress=False)
    return {"metrics": metrics, "seen": seen, "eval": evaluation,
            "params": {n: p.detach().clone() for n, p in network.named_parameters()},
            "auto_params": {n: p.detach().clone() for n, p in auto_model.network.module.named_parameters()},
            "odd_batch": outcome(model.train, 1, dataset, batch_size=3)}


@pytest.fixture(scope="module")
def job():
    return run_on_ranks(_trainer_job, WORLD, timeout_s=180)


def _epoch_slices(result, epoch):
    per_rank = (SIZE - SIZE % WORLD) // WORLD
    return result["seen"][epoch * per_rank:(epoch + 1) * per_rank]


def test_each_kept_sample_seen_once_per_epoch(job):
    assert all(len(result["seen"]) == EPOCHS * (SIZE // WORLD) for result in job)
    orders = []
    for epoch in range(EPOCHS):
        seen = [index for result in job for index in _epoch_slices(result, epoch)]
        assert len(seen) == len(set(seen)) == SIZE - SIZE % WORLD, f"epoch {epoch}: {sorted(seen)}"
        assert set(seen) <= set(range(SIZE))
        orders.append(seen)
    assert orders[0] != orders[1]  # shuffled per epoch


def test_metrics(job):
    for result in job:
        metrics = result["metrics"]
        assert [m["epoch"] for m in metrics] == list(range(1, EPOCHS + 1))
        for m in metrics:
            assert set(m) == METRIC_KEYS
            assert m["samples"] == SIZE - SIZE % WORLD and m["dropped"] == SIZE % WORLD
            assert m["seconds"] > 0 and m["samples_per_s"] > 0
        losses = [m["loss"] for m in metrics]
        assert losses[0] > losses[1] > losses[2], losses
    assert [m["loss"] for m in job[0]["metrics"]] == [m["loss"] for m in job[1]["metrics"]]  # reduced over ranks


def _one_process_reference(job):
    """Plain SGD over the global batches the ranks formed together (rank r's local batch s is its s-th pair)."""
    dataset = IndexedDataset(SIZE)
    network = _network()
    optimizer = torch.optim.SGD(network.parameters(), lr=LR)
    local = BATCH // WORLD
    epoch_losses = []
    for epoch in range(EPOCHS):
        slices = [_epoch_slices(result, epoch) for result in job]
        losses = []
        for start in range(0, len(slices[0]), local):
            indices = [i for part in slices for i in part[start:start + local]]
            loss = F.mse_loss(network(dataset.x[indices]), dataset.y[indices])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        epoch_losses.append(sum(losses) / len(losses))
    return network, epoch_losses


def test_training_matches_one_process_run(job):
    network, epoch_losses = _one_process_reference(job)
    for result in job:
        for name, p in network.named_parameters():
            torch.testing.assert_close(result["params"][name], p.detach(), rtol=1e-4, atol=1e-5)
        for metric, expected in zip(result["metrics"], epoch_losses):
            assert metric["loss"] == pytest.approx(expected, rel=1e-5)


def test_eval_is_the_mean_loss_over_the_dataset(job):
    network, _ = _one_process_reference(job)
    dataset = IndexedDataset(SIZE - 1)
    with torch.no_grad():
        expected = F.mse_loss(network(dataset.x), dataset.y).item()
    for result in job:
        evaluation = result["eval"]
        assert evaluation["epoch"] is None and evaluation["samples"] == SIZE - 1 and evaluation["dropped"] == 0
        assert evaluation["loss"] == pytest.approx(expected, rel=1e-5)


def test_batch_size_not_divisible_by_ranks_raises(job):
    for result in job:
        kind, message = result["odd_batch"]
        assert kind == "AutoparError"
        assert message.startswith("torch_autopar: batch_size=3 is the global batch") and "2 data-parallel" in message


def test_model_compiles_a_plain_network_for_data_parallel(job):
    assert all(torch.equal(job[0]["auto_params"][name], job[1]["auto_params"][name]) for name in job[0]["auto_params"])


def test_train_in_one_process():
    dataset = IndexedDataset(10)
    network = _network()
    model = autopar.Model(network, F.mse_loss, torch.optim.SGD(network.parameters(), lr=LR))
    assert isinstance(model.network, autopar.ParallelModule)
    metrics = model.train(2, dataset, batch_size=3, progress=False)
    assert [m["samples"] for m in metrics] == [10, 10] and [m["dropped"] for m in metrics] == [0, 0]
    assert sorted(dataset.seen) == sorted(list(range(10)) * 2)
    assert metrics[1]["loss"] < metrics[0]["loss"]
    tensors = (dataset.x, dataset.y)  # a tuple of tensors is a dataset too
    assert model.eval(tensors, batch_size=5)["samples"] == 10


def test_train_argument_errors():
    network = _network()
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: Model.train needs an optimizer"):
        autopar.Model(network, F.mse_loss).train(1, IndexedDataset(4), batch_size=2)
    model = autopar.Model(network, F.mse_loss, torch.optim.SGD(network.parameters(), lr=LR))
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: expected a map-style Dataset"):
        model.train(1, 42, batch_size=2)
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: expected dataset items of the form"):
        model.train(1, TensorDataset(torch.randn(4, 4)), batch_size=2, progress=False)  # no targets
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: batch_size=0"):
        model.train(1, IndexedDataset(4), batch_size=0)
