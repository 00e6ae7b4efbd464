"""Bare linear layers tie by alternating phase (capture.layers.tie_phases), so the search can pair them up
column- then row-parallel as Megatron's MLP does; transformer blocks still tie every layer to the first."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import torch_autopar as autopar
from torch_autopar.capture import capture
from torch_autopar.cost import get_profile
from torch_autopar.capture.layers import find_repeated_layers, tie_phases
from torch_autopar.testing.models import GPT, MLP, GPTConfig

_LINK = dataclasses.replace(get_profile("cpu-gloo").intra_node, call_s=1.2e-3)
IN_STEP = dataclasses.replace(get_profile("cpu-gloo"), intra_node=_LINK, inter_node=_LINK)
"""cpu-gloo with gloo's cost per collective call inside a training step on this machine (autopar.profile)."""


def _mlp_program(layers: int, width: int = 64):
    with torch.device("meta"):
        return capture(MLP((width,) * (layers + 1)), (torch.empty(8, width, device="meta"),), {})


def test_single_matrix_layers_alternate():
    program = _mlp_program(6)
    assert [tie_phases(program)[("layers", i)] for i in range(6)] == [0, 1, 0, 1, 0, 1]
    tied = find_repeated_layers(program)
    weights = {i: program.param_nodes[f"layers.{i}.weight"] for i in range(6)}
    assert weights[0] not in tied and weights[1] not in tied  # one representative per phase
    assert [tied[weights[i]] for i in (2, 4)] == [weights[0]] * 2
    assert [tied[weights[i]] for i in (3, 5)] == [weights[1]] * 2


def test_two_single_matrix_layers_are_not_split():
    """Alternating needs a third layer to tie to anything; two layers keep one phase."""
    assert set(tie_phases(_mlp_program(2)).values()) == {0}


def test_blocks_with_several_matrices_keep_one_phase():
    with torch.device("meta"):
        program = capture(GPT(GPTConfig(n_layer=4)), (torch.empty(8, 32, dtype=torch.long, device="meta"),), {})
    assert set(tie_phases(program).values()) == {0}


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_wide_mlp_small_batch_plans_column_then_row(mode):
    """4 linears of 2048 on 8 samples, 2 ranks (bench_speed's mlp_wide_small_batch): auto pairs the layers
    column/row as parallelize_module's hand layout does (6 collectives a step, no gradient sync), where tying
    every layer to the first forced all four column-parallel (an all_gather after each layer)."""
    with torch.device("meta"):
        model = MLP((2048,) * 5)
    plan = autopar.plan(model, (torch.empty(8, 2048, device="meta"),), mesh_shape=(2,), hardware=IN_STEP,
                        mode=mode, fold_layers=False)
    weights = [plan.param_placements[f"layers.{i}.weight"] for i in range(4)]
    assert weights in ([("S(0)",), ("S(1)",)] * 2, [("S(1)",), ("S(0)",)] * 2), weights
    assert not any(c.phase == "grad_sync" for c in plan.collectives), plan.collectives
