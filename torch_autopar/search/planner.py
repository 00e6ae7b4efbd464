"""Build a Plan for a captured program: propagate each candidate strategy, estimate it, keep the best.

Candidates are the seeded strategies of ``strategies.seeds``; "auto" evaluates every candidate that can run on
the mesh and keeps the fastest that fits the memory budget. Must never run a collective.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from torch_autopar.capture import CapturedProgram
from torch_autopar.cost import CostModel, HardwareProfile
from torch_autopar.errors import AutoparError
from torch_autopar.search import estimate as est
from torch_autopar.search.buckets import DEFAULT_BUCKET_CAP_BYTES, assign_buckets
from torch_autopar.search.plan import LayerRow, Plan
from torch_autopar.strategies import format_placements, propagate, seed_placements

STRATEGIES = ("auto", "data_parallel", "stand_alone", "fully_shard", "tensor_parallel")
"""Names accepted as ``strategy=``; a ``Plan`` object is accepted too."""
NOT_YET_EXECUTABLE = ("fully_shard", "tensor_parallel")


def check_strategy(strategy) -> None:
    if isinstance(strategy, Plan):
        return
    if strategy not in STRATEGIES:
        raise AutoparError(f"strategy={strategy!r} is not a known strategy; expected one of {STRATEGIES} or a Plan.")
    if strategy in NOT_YET_EXECUTABLE:
        raise AutoparError(
            f"strategy={strategy!r} is not available yet in this version (planned: per-node sharding search); "
            "use 'data_parallel', 'stand_alone' or 'auto'."
        )


def _candidates(strategy: str, world_size: int) -> list[str]:
    if strategy != "auto":
        return [strategy]
    return ["stand_alone"] if world_size == 1 else ["data_parallel"]


def _layer_rows(program: CapturedProgram, placements: dict, buckets, cost: CostModel, estimate) -> list[LayerRow]:
    synced = {name for bucket in buckets for name in bucket} if any(c.phase == "grad_sync" for c in estimate.collectives) else set()
    rows: dict[str, dict] = {}
    for name, info in program.params.items():
        layer = name.rsplit(".", 1)[0] if "." in name else "(root)"
        row = rows.setdefault(layer, {"numel": 0, "placements": set(), "sync": 0, "memory": 0})
        local = info.nbytes // cost.shard_factor(placements[name])
        row["numel"] += info.numel
        row["placements"].add(",".join(format_placements(placements[name])))
        row["sync"] += info.nbytes if name in synced else 0
        row["memory"] += local * (2 + est.ADAM_STATE_PER_PARAM)
    return [LayerRow(name=layer, num_params=r["numel"], placements="/".join(sorted(r["placements"])),
                     grad_sync_bytes=r["sync"], memory_bytes=r["memory"]) for layer, r in rows.items()]


def _evaluate(program: CapturedProgram, mesh: DeviceMesh, axis_names, strategy: str, cost: CostModel,
              bucket_cap: int, global_batch) -> Plan:
    seeds = seed_placements(program, strategy, mesh.ndim)
    sharding = propagate(program, mesh, seeds)
    param_placements = {name: seeds[node] for name, node in program.param_nodes.items()}
    ready = program.grad_ready_order()
    nbytes = {name: program.params[name].nbytes for name in ready}
    dtypes = {name: program.params[name].dtype for name in ready}
    buckets = assign_buckets(ready, nbytes, bucket_cap, dtypes)
    estimate = est.Estimate()
    est.add_compute(estimate, program, sharding, cost)
    est.add_redistributions(estimate, sharding, cost, axis_names)
    est.add_grad_sync(estimate, program, sharding, cost, buckets, param_placements, axis_names)
    est.add_exposed_comm(estimate)
    est.add_memory(estimate, program, sharding, cost)
    return Plan(
        strategy=strategy, mesh_shape=tuple(mesh.shape), axis_names=tuple(axis_names), hardware=cost.hardware.name,
        fingerprint=program.fingerprint(), global_batch=global_batch,
        param_placements={k: format_placements(v) for k, v in param_placements.items()},
        input_placements={i: format_placements(seeds[n]) for i, n in program.input_nodes.items() if n in seeds},
        grad_buckets=buckets, collectives=estimate.collectives,
        layers=_layer_rows(program, param_placements, buckets, cost, estimate),
        replicated_ops=dict(sharding.replicated_ops), compute_time=estimate.compute,
        exposed_comm_time=estimate.exposed_comm, estimated_step_time=estimate.step_time,
        peak_memory=estimate.peak_memory, memory_breakdown=estimate.memory,
    )


def build_plan(program: CapturedProgram, mesh: DeviceMesh, axis_names, *, strategy: str = "auto",
               hardware: HardwareProfile, memory_budget: int | None = None,
               bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, global_batch: int | None = None) -> Plan:
    """The best plan for ``program`` on ``mesh`` among the candidates ``strategy`` allows."""
    check_strategy(strategy)
    cost = CostModel(hardware, tuple(mesh.shape))
    budget = memory_budget if memory_budget is not None else hardware.memory_bytes
    plans = [_evaluate(program, mesh, axis_names, name, cost, bucket_cap_bytes, global_batch)
             for name in _candidates(strategy, mesh.size())]
    fitting = [plan for plan in plans if plan.peak_memory <= budget]
    if not fitting:
        smallest = min(plan.peak_memory for plan in plans)
        raise AutoparError(
            f"no plan fits the memory budget of {budget:,} bytes per device: the smallest candidate "
            f"({', '.join(p.strategy for p in plans)}) needs {smallest:,} bytes. Raise memory_budget, use more "
            "devices, or a smaller batch."
        )
    best = min(fitting, key=lambda plan: plan.estimated_step_time)
    if strategy == "auto":
        best.notes.append(f"auto chose {best.strategy} among {[p.strategy for p in plans]} (est. step times "
                          + ", ".join(f"{p.strategy} {p.estimated_step_time * 1e3:.3f} ms" for p in plans) + ")")
    return best
