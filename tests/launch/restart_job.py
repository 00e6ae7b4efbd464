"""A training job for ``test_torchrun_restart.py``, run under ``torchrun``: 3 epochs of the project's MLP with
``Model.train(checkpoint_dir=..., checkpoint_every=2, resume=True)``. With ``--kill-at N`` rank 1 SIGKILLs
itself at its N-th optimizer step of the first attempt (torchrun's TORCHELASTIC_RESTART_COUNT == 0); torchrun
restarts every rank and training continues from the last checkpoint. Rank 0 writes the final full parameters.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch

import torch_autopar as autopar
from torch_autopar.testing.models import MLP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--kill-at", type=int, default=0)
    args = parser.parse_args()
    autopar.init(timeout=20)
    torch.manual_seed(0)
    net = autopar.compile(MLP(), strategy="data_parallel")
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def kill(info):
        if info["event"] == "step" and first_attempt and autopar.get_rank() == 1 and info["step"] == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    generator = torch.Generator().manual_seed(7)
    data = (torch.randn(64, 32, generator=generator), torch.randn(64, 8, generator=generator))
    model = autopar.Model(net, torch.nn.functional.mse_loss, optimizer)
    model.train(3, data, batch_size=8, progress=False, callbacks=kill, checkpoint_dir=args.checkpoint_dir,
                checkpoint_every=2, resume=True)
    state = net.state_dict()
    if autopar.get_rank() == 0:
        torch.save({name: tensor.clone() for name, tensor in state.items()}, args.output)


if __name__ == "__main__":
    main()
