"""torch_autopar in one process: no torchrun, no process group.

    python examples/single_process.py

``autopar.init()`` does nothing outside torchrun, so ``autopar.compile`` plans for one device (the
``stand_alone`` plan: every parameter replicated, no collectives) and the compiled module computes exactly what
the plain model does. Also shown: ``autopar.plan`` for a cluster this machine does not have (offline planning
needs a process without a process group, so under torchrun that part is skipped).
"""

from __future__ import annotations

import copy
import warnings

import torch

import torch_autopar as autopar
from torch_autopar.testing.models import MLP

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning)


def regression_data(samples: int = 512, seed: int = 0):
    """y = sin(x @ w) for a fixed random w: a small, learnable, deterministic task."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, 32, generator=generator)
    targets = torch.sin(inputs @ torch.randn(32, 8, generator=generator))
    return inputs, targets


def train(model: torch.nn.Module, optimizer, inputs, targets, steps: int, batch: int, first: int = 0) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        start = step * batch % len(inputs)
        x, y = inputs[start:start + batch], targets[start:start + batch]
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    torch.set_num_threads(1)
    autopar.init()                                            # outside torchrun: a no-op, rank 0 of 1
    print(f"rank {autopar.get_rank()} of {autopar.get_world_size()}, mode {autopar.get_mode()}")

    torch.manual_seed(0)
    model = MLP((32, 128, 128, 8))
    reference = copy.deepcopy(model)                          # the plain model, for comparison
    inputs, targets = regression_data()
    batch = 32

    pmodel = autopar.compile(model, example_inputs=(inputs[:batch],))
    print(pmodel.plan.explain())

    optimizer = torch.optim.Adam(pmodel.parameters(), lr=3e-3)
    losses = train(pmodel, optimizer, inputs, targets, steps=60, batch=batch)
    plain = train(reference, torch.optim.Adam(reference.parameters(), lr=3e-3), inputs, targets, steps=60, batch=batch)
    print("\nstep   autopar loss   plain loss")
    for step in (0, 9, 19, 39, 59):
        print(f"{step + 1:>4}   {losses[step]:12.6f}   {plain[step]:10.6f}")
    same = max(abs(a - b) for a, b in zip(losses, plain))
    print(f"largest loss difference from the plain model over 60 steps: {same:.3g}")

    x, y = inputs[:batch], targets[:batch]
    eager_loss = torch.nn.functional.mse_loss(pmodel(x), y).item()
    with autopar.mode("graph"):                               # same module, now through torch.compile
        graph_loss = torch.nn.functional.mse_loss(pmodel(x), y).item()
        graph_losses = train(pmodel, optimizer, inputs, targets, steps=20, batch=batch, first=60)
    print(f"loss of the first batch: eager {eager_loss:.6f}, graph {graph_loss:.6f}; "
          f"20 more steps in graph mode: {graph_losses[0]:.6f} -> {graph_losses[-1]:.6f}")

    if autopar.get_world_size() > 1:
        return
    offline = autopar.plan(MLP((32, 128, 128, 8)), (torch.randn(512, 32, device="meta"),), mesh_shape=(8,),
                           hardware="h100", strategy="data_parallel")
    print("\nthe same model planned offline for 8 H100s (meta tensors, no ranks):")
    print(f"  strategy {offline.strategy}, est. step {offline.estimated_step_time * 1e6:.1f} us, "
          f"peak memory {offline.peak_memory / 2**20:.2f} MiB per device, "
          f"{len(offline.grad_buckets)} gradient bucket(s)")


if __name__ == "__main__":
    main()
