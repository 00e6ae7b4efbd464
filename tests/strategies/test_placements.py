"""The short text form of DTensor placements used in plans: "R", "S(dim)", "P(op)"."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

import torch_autopar as autopar
from torch_autopar.strategies import format_placements, parse_placements


def test_round_trip():
    placements = (Replicate(), Shard(0), Shard(2), Partial("sum"))
    text = format_placements(placements)
    assert text == ("R", "S(0)", "S(2)", "P(sum)")
    assert parse_placements(text) == placements


@pytest.mark.parametrize("text", ["S", "S(x)", "shard(0)", "", "P()"])
def test_unknown_text_raises(text):
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: expected a placement written as"):
        parse_placements([text])
