"""Hardware profiles: peak compute, memory bandwidth and capacity, and the links between devices.

Figures are from vendor datasheets (dense, no sparsity) unless marked "measured". ``efficiency`` scales peaks to
what large kernels reach in practice. Profiles load from and save to JSON so a measured profile
(``autopar.profile()``, later) is accepted wherever a built-in name is. Must never measure anything itself.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import asdict, dataclass, field

from torch_autopar.errors import AutoparError


@dataclass(frozen=True, slots=True)
class Link:
    """One kind of connection: ``latency_s`` per message hop (alpha), ``bandwidth`` bytes/s per device, and
    ``call_s`` seconds every collective costs once, whatever its hops: on gloo ranks sharing a CPU, meeting the
    peers at the collective (their compute ends at other times, gloo's threads wake) outweighs the hops of a
    small message, so an all_reduce of 64 KiB costs about what an all_gather does (0 on accelerators' links)."""

    latency_s: float
    bandwidth: float
    call_s: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareProfile:
    name: str
    flops: dict = field(default_factory=dict)
    """Peak FLOP/s per dtype name ("float32", "bfloat16", "float16")."""
    memory_bandwidth: float
    """Device memory bytes/s (roofline for memory-bound ops)."""
    memory_bytes: int
    """Device memory capacity, the default memory budget."""
    devices_per_node: int
    intra_node: Link
    inter_node: Link
    compute_efficiency: float = 0.6
    comm_efficiency: float = 0.8
    op_overhead_s: float = 5e-6
    """Fixed cost per kernel/op launch."""
    dtensor_overhead_s: float = 25e-6
    """Host time DTensor adds to each op (forward or backward) of a sharded plan run in eager mode (sharding
    propagation and wrapping; graph mode compiles it away). Measured here on CPU with autograd: 20-30 µs per
    op (``autopar.profile`` measures it)."""
    source: str = "datasheet"
    matmul_rates: dict = field(default_factory=dict)
    """What a matmul with one small dimension reaches, as a fraction of the square matmul's rate (``flops``), by
    shape class (``autopar.profile`` measures them): ``"rows"`` (an output dimension small: a batch of few rows,
    the forward and input-gradient matmuls of a small batch) and ``"inner"`` (the summed dimension small: a
    weight gradient over few rows), each a list of ``[small dimension, fraction]`` points, read off linearly in
    log(dimension) and held flat beyond the ends. Empty (datasheet profiles, whose ``compute_efficiency`` scales
    the peak): every matmul at the peak."""

    def peak_flops(self, dtype: str) -> float:
        return self.flops.get(dtype) or self.flops["float32"]

    def matmul_fraction(self, rows: int, inner: int, cols: int) -> float:
        """Fraction of the peak a (rows x inner) @ (inner x cols) matmul reaches (see ``matmul_rates``)."""
        outer = min(rows, cols)
        kind, small = ("rows", outer) if outer <= inner else ("inner", inner)
        points = sorted(self.matmul_rates.get(kind) or ())
        if not points:
            return 1.0
        return _interpolated_in_log(points, max(small, 1))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @staticmethod
    def from_dict(data: dict, where: str = "hardware profile") -> "HardwareProfile":
        """A profile from JSON data (``to_json``'s fields); a clear error names missing or unknown fields."""
        _check_profile_fields(data, where)
        data = dict(data)
        data["intra_node"] = Link(**data["intra_node"])
        data["inter_node"] = Link(**data["inter_node"])
        return HardwareProfile(**data)


def _interpolated_in_log(points, x: float) -> float:
    """``points`` [(x, y), ...] sorted by x, read at ``x`` linearly in log(x); flat beyond the ends."""
    if x <= points[0][0]:
        return float(points[0][1])
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            share = math.log(x / x0) / math.log(x1 / x0)
            return float(y0 + share * (y1 - y0))
    return float(points[-1][1])


def _missing_and_unknown(data: dict, cls, prefix: str = "") -> tuple[list[str], list[str]]:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    missing = [prefix + n for n in required if n not in data]
    unknown = [prefix + n for n in data if n not in fields]
    for link in ("intra_node", "inter_node"):
        if cls is HardwareProfile and isinstance(data.get(link), dict):
            more_missing, more_unknown = _missing_and_unknown(data[link], Link, f"{link}.")
            missing, unknown = missing + more_missing, unknown + more_unknown
    return missing, unknown


def _check_profile_fields(data, where: str) -> None:
    """Raise a clear error unless ``data`` has every field a profile needs (and no other), numbers where
    numbers go, and a "float32" entry in ``flops``."""
    if not isinstance(data, dict):
        raise AutoparError(f"{where}: expected a JSON object written by autopar.profile(path) or "
                           f"HardwareProfile.to_json(), found a {type(data).__name__}.")
    missing, unknown = _missing_and_unknown(data, HardwareProfile)
    bad_links = [n for n in ("intra_node", "inter_node") if n in data and not isinstance(data[n], dict)]
    flops = data.get("flops", {"float32": 1.0})
    if not isinstance(flops, dict) or not isinstance(flops.get("float32"), (int, float)):
        missing.append("flops.float32")
    if missing or unknown or bad_links:
        found = "; ".join(f"{what} {names}" for what, names in (("missing fields", missing), ("unknown fields",
                          unknown), ("not objects of latency_s and bandwidth", bad_links)) if names)
        raise AutoparError(
            f"{where} is not a complete hardware profile ({found}). Expected the fields autopar.profile(path) "
            f"writes, e.g. {_EXAMPLE_FIELDS}. Measure it again with autopar.profile(path), or add the fields "
            "(a built-in profile's values: autopar.HardwareProfile fields, e.g. PROFILES['h100'].to_json()).")


_GB = 1e9
_GIB = 1 << 30

PROFILES: dict[str, HardwareProfile] = {
    # NVIDIA A100 SXM4 80GB: 312 TFLOP/s bf16, 19.5 fp32; HBM2e 2.0 TB/s; NVLink3 300 GB/s per direction;
    # one HDR InfiniBand 200 Gb/s (25 GB/s) NIC per GPU.
    "a100": HardwareProfile(
        name="a100", flops={"float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12},
        memory_bandwidth=2.0e12, memory_bytes=80 * _GIB, devices_per_node=8,
        intra_node=Link(3e-6, 300 * _GB), inter_node=Link(10e-6, 25 * _GB)),
    # NVIDIA H100 SXM5 80GB: 989 TFLOP/s bf16, 67 fp32; HBM3 3.35 TB/s; NVLink4 450 GB/s per direction;
    # one NDR InfiniBand 400 Gb/s (50 GB/s) NIC per GPU.
    "h100": HardwareProfile(
        name="h100", flops={"float32": 67e12, "bfloat16": 989e12, "float16": 989e12},
        memory_bandwidth=3.35e12, memory_bytes=80 * _GIB, devices_per_node=8,
        intra_node=Link(3e-6, 450 * _GB), inter_node=Link(10e-6, 50 * _GB)),
    # NVIDIA H200 SXM 141GB: H100's compute; HBM3e 4.8 TB/s; same NVLink4 and NDR fabric.
    "h200": HardwareProfile(
        name="h200", flops={"float32": 67e12, "bfloat16": 989e12, "float16": 989e12},
        memory_bandwidth=4.8e12, memory_bytes=141 * _GIB, devices_per_node=8,
        intra_node=Link(3e-6, 450 * _GB), inter_node=Link(10e-6, 50 * _GB)),
    # Huawei Ascend 910B (B2): ~376 TFLOP/s fp16/bf16 (fp32 ~94 by the cube unit); HBM2e 64 GB at 1.6 TB/s;
    # HCCS 56 GB/s per link x 7 peers in an 8-NPU node (~392 GB/s); RoCE 200 Gb/s (25 GB/s) per NPU.
    "ascend-910b": HardwareProfile(
        name="ascend-910b", flops={"float32": 94e12, "bfloat16": 376e12, "float16": 376e12},
        memory_bandwidth=1.6e12, memory_bytes=64 * _GIB, devices_per_node=8,
        intra_node=Link(5e-6, 392 * _GB), inter_node=Link(15e-6, 25 * _GB)),
    # A 2-core x86 machine running gloo over loopback, rough figures measured here (one rank per core):
    # ~30 GFLOP/s fp32 matmul per rank, ~10 GB/s memory, gloo ~60 us per hop and ~1.5 GB/s. Measured inside a
    # training step (autopar.profile on 2 ranks, 5 Dec 2026) the same machine gives 117-134 GFLOP/s, 11 GB/s,
    # a collective 1.2-1.6 ms per call whatever its kind up to 64 KiB, and ~1 GB/s; bf16 matmuls ~5.7x fp32
    # (AMX). compile(hardware="measured") plans with such a measurement.
    "cpu-gloo": HardwareProfile(
        name="cpu-gloo", flops={"float32": 30e9, "bfloat16": 10e9}, memory_bandwidth=10 * _GB,
        memory_bytes=8 * _GIB, devices_per_node=64, intra_node=Link(60e-6, 1.5 * _GB),
        inter_node=Link(60e-6, 1.5 * _GB), compute_efficiency=0.7, comm_efficiency=1.0,
        op_overhead_s=10e-6, source="measured (rough)"),
}


_EXAMPLE_FIELDS = ("name, flops {\"float32\": ...}, memory_bandwidth, memory_bytes, devices_per_node, "
                   "intra_node {latency_s, bandwidth}, inter_node {latency_s, bandwidth}")


def get_profile(hardware) -> HardwareProfile:
    """A profile from a built-in name, a JSON file path, or a ``HardwareProfile``; None → "cpu-gloo"."""
    if hardware is None:
        return PROFILES["cpu-gloo"]
    if isinstance(hardware, HardwareProfile):
        return hardware
    if isinstance(hardware, str) and hardware in PROFILES:
        return PROFILES[hardware]
    if isinstance(hardware, (str, os.PathLike)) and os.path.isfile(hardware):
        return _load_profile(hardware)
    raise AutoparError(
        f"hardware={hardware!r}: expected one of {sorted(PROFILES)}, a path to a profile JSON file, or a "
        "HardwareProfile."
    )


def _load_profile(path) -> HardwareProfile:
    """A profile from a JSON file (plain JSON: nothing in it is executed or unpickled)."""
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, ValueError) as error:  # ValueError: bad JSON or UTF-8
        raise AutoparError(f"hardware={str(path)!r}: could not read a profile ({type(error).__name__}: {error}); "
                           "expected a JSON file written by autopar.profile(path).") from error
    try:
        return HardwareProfile.from_dict(data, where=f"hardware={str(path)!r}")
    except TypeError as error:  # a field of the wrong type reaching the dataclass
        raise AutoparError(f"hardware={str(path)!r}: {error}; expected the JSON autopar.profile(path) "
                           "writes.") from error
