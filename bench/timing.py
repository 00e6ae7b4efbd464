"""Step times measured side by side on every rank of a job: the variants alternate in rounds (the order rotating
each round), each step starts after a barrier and counts as its slowest rank's time. Must be called by every
rank at once, with the same variants in the same order."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def alternating_step_times(steps: dict, rounds: int, steps_per_round: int) -> dict[str, list[float]]:
    """Variant name → its step times in seconds; ``steps``: name → a callable running one training step."""
    times = {name: [] for name in steps}
    names = list(steps)
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            for _ in range(steps_per_round):
                dist.barrier()
                started = time.perf_counter()
                steps[name]()
                elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[name].append(float(elapsed))
    return times
