"""Validation of a plan read from JSON: every field present and of the right kind, placements well formed.

A plan file may be edited by hand (that is supported: placements are the program), so nothing here refuses an
edit that still describes a valid plan; what it refuses is a file a plan cannot be made from (a field missing,
added or of the wrong type; a placement that is not 'R', 'S(<dim>)' or 'P(<op>)'; one placement too few for
the mesh). Must never run anything or import a stage below ``search``.
"""

from __future__ import annotations

import dataclasses
import re

from torch_autopar.errors import AutoparError

_PLACEMENT = re.compile(r"R|S\(\d+\)|P\(\w+\)")
_NUMBERS = ("compute_time", "exposed_comm_time", "estimated_step_time", "peak_memory")


def check_fields(data: dict, plan_type) -> None:
    """Every field of ``plan_type`` without a default is in ``data``, and ``data`` has no other field."""
    fields = {f.name: f for f in dataclasses.fields(plan_type)}
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in data]
    unknown = sorted(n for n in data if n not in fields)
    if missing or unknown:
        raise AutoparError(
            f"this plan file is not a plan of format version {data.get('version')}: "
            + (f"missing fields {missing}" if missing else "") + ("; " if missing and unknown else "")
            + (f"unknown fields {unknown}" if unknown else "")
            + ". Expected exactly the fields Plan.save() writes; it was edited or written by another program. "
            "Plan again (autopar.plan(...).save(path)) or restore the field.")


def check_values(data: dict) -> None:
    """Mesh, axis names, numbers and placements of a plan read from JSON are well formed."""
    mesh = data["mesh_shape"]
    if not isinstance(mesh, (list, tuple)) or not mesh or not all(_positive_int(s) for s in mesh):
        _bad("mesh_shape", mesh, "a list of positive integers such as [2, 4]")
    names = data["axis_names"]
    if not isinstance(names, (list, tuple)) or len(names) != len(mesh) or not all(isinstance(n, str) for n in names):
        _bad("axis_names", names, f"{len(mesh)} axis names, one per mesh axis")
    for key in _NUMBERS:
        if isinstance(data[key], bool) or not isinstance(data[key], (int, float)) or data[key] < 0:
            _bad(key, data[key], "a non-negative number")
    for table in ("param_placements", "input_placements"):
        if not isinstance(data[table], dict):
            _bad(table, data[table], "an object of name → placements")
        for name, placements in data[table].items():
            _check_placements(f"{table}[{name!r}]", placements, len(mesh))
    kept = data.get("kept_gathered", [])
    if not isinstance(kept, (list, tuple)) or not all(isinstance(group, str) for group in kept):
        _bad("kept_gathered", kept, 'a list of group names such as ["blocks.7"]')


def _check_placements(where: str, placements, axes: int) -> None:
    if not isinstance(placements, (list, tuple)) or len(placements) != axes:
        _bad(where, placements, f"one placement per mesh axis ({axes})")
    for text in placements:
        if not isinstance(text, str) or not _PLACEMENT.fullmatch(text):
            _bad(where, placements, "placements written as 'R', 'S(<dim>)' or 'P(<op>)'")


def check_shard_dims(param_placements: dict, shapes: dict) -> None:
    """Each 'S(dim)' of a parameter names one of its dims (``shapes``: parameter name → shape)."""
    for name, placements in param_placements.items():
        ndim = len(shapes.get(name, ()))
        for text in placements:
            if text.startswith("S(") and int(text[2:-1]) >= ndim:
                raise AutoparError(
                    f"plan: parameter {name!r} is placed {text} but has {ndim} dims (shape {tuple(shapes[name])}); "
                    f"expected S(0)..S({ndim - 1}) or 'R'. Fix the plan file or plan again.")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _bad(field: str, value, expected: str) -> None:
    raise AutoparError(f"plan field {field} is {value!r}; expected {expected}. The file was edited into something "
                       "that is not a plan: fix the field or plan again.")
