"""Peak CPU memory of one training step, from the allocator's own record (``torch.profiler``'s memory events).

``step_peak_bytes(step, *holders)``: the bytes ``holders`` (modules, optimizers) hold when the step starts —
parameters, buffers, gradients and optimizer state, each storage once, at its current size — plus the highest
count of bytes the step allocated and had not yet freed. The profiler records every allocation and free of
the CPU allocator while it runs (DTensor's internals, collectives' buffers, a storage resized back to its size),
so memory freed by resizing a storage to zero (FSDP2, ``runtime.fsdp``) is seen as freed, which ``MemTracker``
(which sizes a storage when it first sees it) cannot see. Frees of what existed before the step are not
counted: clear gradients before calling it. ``kept_bytes(run)``: what ``run()`` allocated and still holds when
it returns (after a forward: the activations kept for backward). Must never change what ``step`` computes.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
from torch.distributed.tensor import DTensor


def step_peak_bytes(step, *holders) -> int:
    """Peak bytes while ``step()`` runs: what ``holders`` hold at its start plus the step's highest allocation."""
    held = held_bytes(*holders)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()
    return held + _allocated(profiler)[0]


def kept_bytes(run) -> int:
    """Bytes ``run()`` allocated and had not freed when it returned: for a forward whose result the caller keeps,
    the activations autograd keeps for backward (and the outputs)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        run()
    return _allocated(profiler)[1]


def held_bytes(*holders) -> int:
    """Bytes of the distinct storages of the tensors ``holders`` hold (parameters, buffers, their gradients,
    optimizer state), at their current size."""
    storages = {}
    for tensor in _held_tensors(holders):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(nbytes for ptr, nbytes in storages.items() if ptr)


def _held_tensors(holders) -> list[torch.Tensor]:
    tensors = []
    for holder in holders:
        if isinstance(holder, torch.nn.Module):
            for param in holder.parameters():
                tensors += [param] + ([param.grad] if param.grad is not None else [])
            tensors += list(holder.buffers())
        elif isinstance(holder, torch.optim.Optimizer):
            tensors += [value for state in holder.state.values() for value in state.values()
                        if isinstance(value, torch.Tensor)]
        else:
            raise TypeError(f"step_peak_bytes: expected modules or optimizers, found {type(holder).__name__}")
    return tensors


def _allocated(profiler) -> tuple[int, int]:
    """The highest count of bytes allocated since the profiler started and not yet freed, and that count when it
    stopped, from the CPU memory events of its trace (each allocation by address, each free matched to one; frees
    of older memory are not the step's; an address allocated again counts as freed first)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as handle:
            events = json.load(handle).get("traceEvents", [])
    memory = sorted(((event["ts"], event["args"]) for event in events
                     if event.get("name") == "[memory]" and event.get("args", {}).get("Device Type", 0) == 0),
                    key=lambda item: item[0])
    live, current, highest = {}, 0, 0
    for _, args in memory:
        if args["Bytes"] > 0:  # an address allocated again was freed: some frees (other threads) have no event
            current += args["Bytes"] - live.get(args["Addr"], 0)
            live[args["Addr"]] = args["Bytes"]
            highest = max(highest, current)
        else:
            current -= live.pop(args["Addr"], 0)
    return highest, current
