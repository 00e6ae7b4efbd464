"""``autopar.profile()``: measure the hardware at hand and return a ``HardwareProfile`` the planner accepts.

What is measured, on every rank of the default process group (or in this process alone):
  compute    fp32 matmul FLOP/s (best of a few n x n products: 2 n^3 FLOPs each), and the fraction of it that
             matmuls with one small dimension reach, by shape class (``HardwareProfile.matmul_rates``)
  memory     bandwidth of a large copy (read + write: 2 x bytes per copy)
  overhead   time of a tiny op (the per-op cost of the roofline)
  links      all_reduce and all_gather of several message sizes, each timed after a burst of compute as a
             training step meets it (``_timed_collective``), fitted by least squares to the ring formulas
             of ``CostModel``: t = steps(p)·alpha + volume(p)·n·beta (all_reduce 2(p-1) and 2(p-1)/p,
             all_gather p-1 and (p-1)/p; n: full buffer bytes per rank, the output of all_gather).
Ranks agree on one profile: the slowest rank's compute and the slowest rank's collective times count. The
measured link is the one the default group's ring crosses: the intra-node link when the job fits one node,
the inter-node link otherwise; the other link, and both in a one-process run, keep the base profile's figures.
Must never plan anything.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
from scipy.optimize import nnls

from torch_autopar.cost.hardware import PROFILES, HardwareProfile, Link, get_profile
from torch_autopar.cost.model import CostModel
from torch_autopar.errors import AutoparError
from torch_autopar.launch import detect_backend

DEFAULT_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22)
"""Collective message sizes in bytes (full buffer per rank)."""
SMALL_DIMENSIONS = (16, 64, 256)
"""The small dimension of the matmuls timed per shape class (a few rows of a batch up to a narrow layer)."""


def small_dimensions(n: int) -> tuple[int, ...]:
    """The ``SMALL_DIMENSIONS`` below the square matmul's size ``n``."""
    return tuple(s for s in SMALL_DIMENSIONS if s < n)


def ring_terms(kind: str, world: int) -> tuple[float, float]:
    """(steps, volume) of ``kind`` on ``world`` ranks as ``CostModel`` prices it: t = steps·alpha + volume·n·beta
    (read off a unit link, so the fit follows the cost model's formulas)."""
    unit = Link(latency_s=1.0, bandwidth=1.0)
    hardware = HardwareProfile(name="unit", flops={"float32": 1.0}, memory_bandwidth=1.0, memory_bytes=1,
                               devices_per_node=world, intra_node=unit, inter_node=unit, comm_efficiency=1.0)
    return CostModel(hardware, (world,)).collective_coefficients(kind, 0)


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """One timed collective: ``seconds`` for ``kind`` of ``nbytes`` (full buffer per rank) on ``world`` ranks."""

    kind: str
    nbytes: int
    world: int
    seconds: float


def fit_link(samples: list[Sample]) -> Link:
    """The ``Link`` whose formulas fit ``samples``: t = call + steps·alpha + volume·n·beta (``ring_terms``).

    Non-negative least squares on relative errors (each row divided by its time), so small messages, which
    fix the latencies, weigh as much as large ones, which fix beta. Kinds with different step counts (an
    all_reduce takes twice an all_gather's on a ring) tell a fixed cost per call from a cost per hop. A latency
    or bandwidth the data cannot resolve (fitted as 0) falls back to its upper bound from the sample that
    depends on it most, so both are positive."""
    if not samples:
        raise AssertionError("fit_link needs at least one sample")
    terms = [ring_terms(s.kind, s.world) for s in samples]
    rows = np.array([[1.0, steps, volume * s.nbytes] for (steps, volume), s in zip(terms, samples)], dtype=float)
    times = np.array([s.seconds for s in samples], dtype=float)
    (call, alpha, beta), _ = nnls(rows / times[:, None], np.ones(len(samples)))
    if not call + alpha > 0:
        smallest = int(np.argmin(rows[:, 2] / rows[:, 1]))
        alpha = times[smallest] / rows[smallest, 1]
    if not beta > 0:
        largest = int(np.argmax(rows[:, 2] / rows[:, 1]))
        beta = times[largest] / rows[largest, 2]
    return Link(latency_s=float(alpha), bandwidth=1.0 / float(beta), call_s=float(call))


# devices -----------------------------------------------------------------------------------------------------
def device_for_job() -> torch.device:
    if dist.is_initialized():
        backend = dist.get_backend()
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        if backend == "hccl":
            return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize()  # type: ignore[attr-defined]


def _best_time(fn, device: torch.device, repeats: int) -> float:
    """Fastest of ``repeats`` timed calls after one warm-up call."""
    fn()
    _sync(device)
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return best


# measurements ------------------------------------------------------------------------------------------------
def measure_matmul_flops(device: torch.device, n: int, repeats: int, dtype=torch.float32) -> float:
    """FLOP/s of an ``n x n`` by ``n x n`` matmul (2 n^3 FLOPs)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _best_time(lambda: torch.mm(a, b), device, repeats)


def measure_matmul_shape_rates(device: torch.device, n: int, repeats: int, dtype=torch.float32) -> dict:
    """FLOP/s of matmuls with one small dimension s (``small_dimensions(n)``) and the others ``n``, by shape class
    (``HardwareProfile.matmul_rates``): "rows" (s x n) @ (n x n), "inner" (n x s) @ (s x n)."""
    rates: dict[str, list[float]] = {"rows": [], "inner": []}
    for small in small_dimensions(n):
        for kind, (left, right) in (("rows", ((small, n), (n, n))), ("inner", ((n, small), (small, n)))):
            a = torch.randn(*left, device=device, dtype=dtype)
            b = torch.randn(*right, device=device, dtype=dtype)
            rates[kind].append(2 * small * n * n / _best_time(lambda: torch.mm(a, b), device, repeats))
    return rates


def measure_memory_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes/s of copying ``nbytes`` (counted twice: read and write)."""
    source = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    target = torch.empty_like(source)
    return 2 * source.numel() * 4 / _best_time(lambda: target.copy_(source), device, repeats)


def _chain(x, ops: int):
    """``ops`` small ops forward and their ``ops`` backward ops, as a training step runs them."""
    def run():
        y = x
        for _ in range(ops):
            y = y * 1.0001
        y.sum().backward()
    return run


def measure_op_overhead(device: torch.device, repeats: int, ops: int = 200) -> float:
    """Seconds per op of a training step's host work: a chain of tiny multiplies with autograd, forward and
    backward, divided by the ops run (2 per link). A bare in-place add reads 5-10 times lower than what the
    ops of a real forward/backward cost."""
    x = torch.ones(1, device=device, requires_grad=True)
    return _best_time(_chain(x, ops), device, repeats) / (2 * ops)


def measure_dtensor_overhead(device: torch.device, repeats: int, ops: int = 200) -> float:
    """Seconds DTensor adds per op of a training step: the autograd chain of ``measure_op_overhead`` on a
    batch-sharded DTensor minus the same on a plain tensor, per op. Needs a process group (0.0 without one)."""
    if not dist.is_initialized():
        return 0.0
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    plain = torch.ones(4 * dist.get_world_size(), 16, device=device, requires_grad=True)
    sharded = distribute_tensor(plain.detach(), mesh, [Shard(0)]).requires_grad_()
    extra = _best_time(_chain(sharded, ops), device, repeats) - _best_time(_chain(plain, ops), device, repeats)
    return max(extra, 0.0) / (2 * ops)


def _numel(nbytes: int, world: int) -> int:
    """fp32 elements of a buffer of about ``nbytes`` that splits evenly over ``world`` ranks."""
    return max(world, nbytes // 4 // world * world)


def _compute_burst(device: torch.device):
    """A few milliseconds of matmuls: what a rank computes between two collectives of a training step."""
    n = 256 if device.type == "cpu" else 4096
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)

    def run():
        for _ in range(20):
            torch.mm(a, b)
    return run


def _timed_collective(kind: str, nbytes: int, world: int, device: torch.device, repeats: int) -> float:
    """Median seconds of one collective as a training step meets it: each repetition starts aligned (a barrier),
    computes a burst, then runs the collective, timed from the end of this rank's burst to the collective's
    end. So it counts what a step pays and an isolated collective does not: waiting for a peer whose compute
    ends later, and buffers and communication threads gone cold while computing (on 2 gloo ranks on CPU a
    1 MiB all_reduce takes several times its isolated time this way)."""
    numel = _numel(nbytes, world)
    if kind == "all_reduce":
        buffer = torch.ones(numel, device=device)
        run = lambda: dist.all_reduce(buffer)  # noqa: E731
    else:
        output = torch.empty(numel, device=device)
        piece = torch.ones(numel // world, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        run = lambda: gather(output, piece)  # noqa: E731
    burst = _compute_burst(device)
    run()
    times = []
    for _ in range(repeats):
        dist.barrier()
        burst()
        _sync(device)
        started = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_collectives(device: torch.device, sizes, repeats: int) -> list[Sample]:
    """Median time of all_reduce and all_gather per size on the default group (the slowest rank's)."""
    world = dist.get_world_size()
    samples = []
    for kind in ("all_reduce", "all_gather"):
        for nbytes in sizes:
            seconds = _timed_collective(kind, nbytes, world, device, repeats)
            samples.append(Sample(kind=kind, nbytes=_numel(nbytes, world) * 4, world=world, seconds=seconds))
    slowest = _agree(torch.tensor([s.seconds for s in samples], dtype=torch.float32), dist.ReduceOp.MAX, device)
    return [dataclasses.replace(s, seconds=float(t)) for s, t in zip(samples, slowest)]


def _agree(values: torch.Tensor, op, device: torch.device) -> torch.Tensor:
    """``values`` reduced over all ranks with ``op`` (identity in one process)."""
    if not dist.is_initialized():
        return values
    values = values.to(device)
    dist.all_reduce(values, op=op)
    return values.cpu()


# the profile -------------------------------------------------------------------------------------------------
def base_profile(base, device: torch.device) -> HardwareProfile:
    if base is not None:
        return get_profile(base)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        return next((p for key, p in PROFILES.items() if key in name), PROFILES["a100"])
    if device.type == "npu":
        return PROFILES["ascend-910b"]
    return PROFILES["cpu-gloo"]


def _memory_capacity(device: torch.device, base: HardwareProfile, local_world: int) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(local_world, 1))
        except (ValueError, OSError):
            pass
    return base.memory_bytes


def _check_sizes(sizes) -> tuple[int, ...]:
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) < 2 or any(s <= 0 for s in sizes):
        raise AutoparError(f"profile(sizes={sizes}): expected at least two positive message sizes in bytes, "
                           "e.g. sizes=(4096, 1 << 20), so that latency and bandwidth can be told apart.")
    return sizes


def profile(path=None, *, sizes=DEFAULT_SIZES, base=None, matmul_size: int | None = None,
            copy_bytes: int | None = None, repeats: int = 5) -> HardwareProfile:
    """Measure compute, memory bandwidth and (with a process group) the collectives of the ranks at hand.

    path: where to save the profile as JSON (rank 0 writes; ``hardware=path`` then uses it).
    sizes: collective message sizes in bytes. base: the profile (name, path or object) whose figures are kept
    for what is not measured; None picks one for the device. matmul_size / copy_bytes: problem sizes (None:
    1024 / 64 MiB on CPU, 8192 / 1 GiB on accelerators). Every rank of the default group must call it."""
    sizes = _check_sizes(sizes)
    if repeats < 1:
        raise AutoparError(f"profile(repeats={repeats}): expected at least 1 timed repetition.")
    device = device_for_job()
    base = base_profile(base, device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    flops, bandwidth, overhead, matmul_rates = _measure_device(device, matmul_size, copy_bytes, repeats)
    dtensor_overhead = float(_agree(torch.tensor([measure_dtensor_overhead(device, repeats)]), dist.ReduceOp.MAX,
                                    device)[0]) if world > 1 else 0.0
    intra, inter = base.intra_node, base.inter_node
    source = "measured (compute only: one process, links from the base profile)"
    if world > 1:
        link = fit_link(measure_collectives(device, sizes, repeats))
        one_node = world <= local_world
        intra, inter = (link, inter) if one_node else (intra, link)
        source = f"measured (compute and {'intra' if one_node else 'inter'}-node collectives)"
    backend = dist.get_backend() if dist.is_initialized() else detect_backend()
    result = HardwareProfile(
        name=f"measured-{backend}-{world}", flops={"float32": flops}, memory_bandwidth=bandwidth,
        memory_bytes=_memory_capacity(device, base, local_world),
        devices_per_node=local_world if world > 1 else base.devices_per_node,
        intra_node=intra, inter_node=inter, compute_efficiency=1.0, comm_efficiency=1.0, op_overhead_s=overhead,
        dtensor_overhead_s=dtensor_overhead if world > 1 else base.dtensor_overhead_s,
        source=f"{source}; base {base.name}", matmul_rates=matmul_rates)
    if path is not None:
        _save(result, path)
    return result


def _measure_device(device: torch.device, matmul_size, copy_bytes, repeats: int):
    """(FLOP/s, memory bytes/s, seconds per op, matmul_rates) of the slowest rank."""
    accelerated = device.type != "cpu"
    n = matmul_size or (8192 if accelerated else 1024)
    shapes = measure_matmul_shape_rates(device, n, repeats)
    rates = torch.tensor([
        measure_matmul_flops(device, n, repeats),
        measure_memory_bandwidth(device, copy_bytes or ((1 << 30) if accelerated else (64 << 20)), repeats),
        *shapes["rows"], *shapes["inner"],
    ], dtype=torch.float64)
    flops, bandwidth, *shape_rates = (float(v) for v in _agree(rates, dist.ReduceOp.MIN, device))
    overhead = torch.tensor([measure_op_overhead(device, repeats)], dtype=torch.float32)
    return flops, bandwidth, float(_agree(overhead, dist.ReduceOp.MAX, device)[0]), _fractions(shape_rates, flops, n)


def _fractions(shape_rates: list[float], square_rate: float, n: int) -> dict:
    """``HardwareProfile.matmul_rates`` from the rates ``measure_matmul_shape_rates`` gives ("rows" then "inner",
    in ``small_dimensions(n)`` order): each over the square rate, with the square matmul itself as the last point."""
    dims = small_dimensions(n)
    count = len(dims)
    return {kind: [[small, rate / square_rate] for small, rate in zip(dims, rates)] + [[n, 1.0]]
            for kind, rates in (("rows", shape_rates[:count]), ("inner", shape_rates[count:]))}


def _save(result: HardwareProfile, path) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(path, "w") as handle:
            handle.write(result.to_json())
    if dist.is_initialized():
        dist.barrier()
