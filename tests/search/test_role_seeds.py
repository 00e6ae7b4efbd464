"""Tensor-parallel role seeds split each matrix along the right dim whatever its storage: ``nn.Linear``'s
(out, in) weight is column parallel on dim 0 and row parallel on dim 1; an (in, out) weight multiplied as it is
(``transformers``' ``Conv1D`` in GPT-2) the other way round; a column-parallel bias on dim 0. One process, fake
inputs: nothing runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from torch_autopar.capture import capture, fake_global_inputs
from torch_autopar.search.role_seeds import megatron_splits, role_seeds


class InOutLinear(nn.Module):
    """A linear layer storing its weight (in, out), as GPT-2's Conv1D: ``addmm(bias, x, weight)``."""

    def __init__(self, inputs: int, outputs: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(inputs, outputs))
        self.bias = nn.Parameter(torch.zeros(outputs))

    def forward(self, x):
        return torch.addmm(self.bias, x.flatten(0, -2), self.weight).view(*x.shape[:-1], -1)


class TwoMlps(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)
        self.fc, self.proj = InOutLinear(8, 32), InOutLinear(32, 8)

    def forward(self, x):
        x = x + self.down(torch.relu(self.up(x)))
        return x + self.proj(torch.relu(self.fc(x)))


def _seeds(model, x):
    args, kwargs = fake_global_inputs(model, (x,), {}, 1)
    program = capture(model, args, kwargs)
    seeds = role_seeds(program, ("tp",), (2,), megatron_splits(program).splits)
    return {name: seeds[node][0] for name, node in program.param_nodes.items()}


def test_column_then_row_on_each_storage():
    seeds = _seeds(TwoMlps(), torch.randn(4, 8))
    assert seeds["up.weight"] == Shard(0) and seeds["up.bias"] == Shard(0)
    assert seeds["down.weight"] == Shard(1) and seeds["down.bias"] == Replicate()
    assert seeds["fc.weight"] == Shard(1) and seeds["fc.bias"] == Shard(0)
    assert seeds["proj.weight"] == Shard(0) and seeds["proj.bias"] == Replicate()


def test_gpt2_conv1d_attention_and_mlp():
    pytest.importorskip("transformers")
    from torch_autopar.testing.hf_models import build_hf_model, hf_batch

    seeds = _seeds(build_hf_model("gpt2"), hf_batch("gpt2", 2)["input_ids"])
    for block in ("transformer.h.0", "transformer.h.1"):
        assert seeds[f"{block}.attn.c_attn.weight"] == Shard(1) and seeds[f"{block}.mlp.c_fc.weight"] == Shard(1)
        assert seeds[f"{block}.attn.c_proj.weight"] == Shard(0) and seeds[f"{block}.mlp.c_proj.weight"] == Shard(0)
