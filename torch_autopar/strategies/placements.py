"""DTensor placements and their short text form ("R", "S(0)", "P(sum)") used in plans and explanations."""

from __future__ import annotations

import re

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from torch_autopar import _compat
from torch_autopar.errors import AutoparError

_SHARD = re.compile(r"S\((\d+)\)")
_PARTIAL = re.compile(r"P\((\w+)\)")


def format_placement(placement: Placement) -> str:
    if type(placement).__name__ == "_StridedShard":
        return f"SS({placement.dim},{placement.split_factor})"
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, Partial):
        return f"P({placement.reduce_op})"
    if isinstance(placement, Replicate):
        return "R"
    raise AssertionError(f"unknown placement type {placement!r}")


def format_placements(placements) -> tuple[str, ...]:
    return tuple(format_placement(p) for p in placements)


def parse_placement(text: str) -> Placement:
    if text == "R":
        return Replicate()
    if match := _SHARD.fullmatch(text):
        return Shard(int(match.group(1)))
    if match := _PARTIAL.fullmatch(text):
        return Partial(match.group(1))
    raise AutoparError(f"expected a placement written as 'R', 'S(<dim>)' or 'P(<op>)', found {text!r}.")


def parse_placements(texts) -> tuple[Placement, ...]:
    return tuple(parse_placement(t) for t in texts)


def tensor_meta(value) -> _compat.TensorMeta:
    """DTensor's description of a (fake or meta) tensor: shape, stride, dtype."""
    return _compat.TensorMeta(value.shape, value.stride(), value.dtype)


def spec_for(mesh, value, placements) -> _compat.DTensorSpec:
    """The DTensor spec of ``value`` laid out as ``placements`` on ``mesh``."""
    return _compat.DTensorSpec(mesh, tuple(placements), tensor_meta(value))
