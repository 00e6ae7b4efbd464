"""What runs: a chosen plan priced as the runtime executes it (``Executing.executed``), for the planner.

Graph mode runs a plan laid out for the captured program as its per-rank program does (``_relaid``: the node
layouts, hand edits included, priced again). Eager mode runs DTensor's per-op rules between the plan's module
boundaries, with each parameter in the layout its first op takes (``_dtensor_placed``), plus the runtime's own
moves: the batch arriving and outputs leaving (``strategies.boundary``), fully-sharded groups gathered around
their forward and backward, each gradient moved into its parameter's layout, the per-step input check. A
fully-sharded group (each layer of ``capture.layers.reshard_groups``, and the root) moves the parameters that
``boundary.flat_gather_axis`` admits as ``runtime.flat`` does: ONE all_gather per axis and dtype in forward (one
more in backward where it reshards after forward), ONE reduce_scatter of their gradients, each priced with one
latency (``_flat_gathers``, the one place that lists them). Must never choose a layout and never run a collective.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from torch_autopar.capture import CapturedProgram
from torch_autopar.capture.layers import reshard_groups
from torch_autopar.cost import pricing
from torch_autopar.search import estimate as est
from torch_autopar.search import module_layouts as modules
from torch_autopar.search import recompute
from torch_autopar.search.layouts import sharding_from_layouts
from torch_autopar.search.plan import Plan, PlannedCollective, is_one_tensor_layout
from torch_autopar.strategies import Redistribution, boundary, format_placements, parse_placements, propagate
from torch_autopar.strategies.boundary import flat_gather_axis, padded_shard_numel
from torch_autopar.strategies.propagate import tangent_placements

ALL_AXES_SEPARATOR = "+"
"""A collective over every rank is on axis "dp+tp" (the axis names joined)."""
BATCH_CHECK_BYTES = 16
"""The sharded runtime's per-step check that all ranks pass equal batch slices (two float64)."""
FULL_BATCH_CHECK_BYTES = 32
"""Per input tensor, the check that all ranks pass the same full batch (two checksums and their negatives)."""
BATCH_CHECKS = ("batch size check", "full batch check")
"""The ``where`` of those checks' collectives (``Executing._batch_check``)."""


@dataclass(frozen=True, slots=True)
class FlatGather:
    """One flat all_gather of a fully-sharded group in eager mode (``runtime.flat``) and the reduce_scatter of its
    gradients: the group's parameters that move Shard(0) -> Replicate on one mesh axis, gathered in one dtype."""

    group: str
    """The group ("blocks.3"; "" for the root)."""
    axis: int
    names: tuple[str, ...]
    nbytes: int
    """Global bytes gathered: each parameter with its rows padded to a multiple of the axis's ranks."""
    grad_nbytes: dict
    """Per parameter, its padded global bytes in the dtype its gradient is reduced in."""


class Executing:
    """The planner's pricing of what runs (mixed into ``search.planner.Planner``, whose program, mesh, cost model,
    mode and ``_plan`` it uses)."""

    def executed(self, plan: Plan) -> Plan:
        """``plan`` as the sharded runtime executes it, priced from what runs. Data-parallel plans run as planned
        (bucketed all-reduces) and are returned as they are. In graph mode the per-rank program runs the plan's
        node layouts (``_relaid``). In eager mode DTensor places each op from its inputs' layouts, the plan's
        parameters and inputs, with each submodule's inputs and outputs moved to the plan's module layouts by
        the runtime's hooks (``_dtensor_placed``)."""
        if self.mesh.size() == 1 or plan.is_data_parallel() and plan.strategy == "data_parallel":
            return plan
        if plan.is_data_parallel():
            return self._run_as_data_parallel(plan)
        laid_out = self._runs_as_laid_out(plan)
        result = self._relaid(plan) if self.mode == "graph" and laid_out else self._dtensor_placed(plan, laid_out)
        recompute.apply_choice(result, plan.activation_checkpointing)
        return result

    def _run_as_data_parallel(self, plan: Plan) -> Plan:
        """A plan of another name whose layout is data parallelism's (each parameter replicated, the batch split)
        runs as data parallelism (``runtime.parallel_module``: the whole model on each slice, its gradients
        all-reduced in the planner's buckets), so it is priced as that, not by its searched node layouts."""
        result = self.propagated("data_parallel")
        result.strategy, result.search_stats = plan.strategy, {**plan.search_stats, **_priced_here(result)}
        result.notes = list(plan.notes) + [
            f"runs as data parallelism (every parameter replicated, the batch split): priced with its gradient "
            f"buckets, {result.estimated_step_time * 1e3:.3f} ms per step (as searched: "
            f"{plan.estimated_step_time * 1e3:.3f} ms)"]
        return result

    def _relaid(self, plan: Plan) -> Plan:
        """The plan priced again from its own node layouts (what graph mode's program runs): equal to ``plan``
        as searched, and the true price of a plan whose layouts were edited by hand."""
        params = {name: parse_placements(plan.param_placements[name]) for name in self.program.param_nodes}
        sharding = sharding_from_layouts(self.program, plan.node_layouts, self.mesh, self.full_batch)
        result = self._plan(plan.strategy, sharding, params)
        result.search_stats = {**plan.search_stats, **_priced_here(result)}
        result.notes = list(plan.notes)
        if result.collectives != plan.collectives:
            result.notes.append(f"priced from its node layouts: {len(result.collectives)} collectives, "
                                f"{result.estimated_step_time * 1e3:.3f} ms per step (as given: {len(plan.collectives)}, "
                                f"{plan.estimated_step_time * 1e3:.3f} ms)")
        return result

    def _dtensor_placed(self, plan: Plan, laid_out: bool) -> Plan:
        """Eager execution: the propagation of DTensor's rules from the plan's parameter and input placements
        (with a plan laid out for this program: each parameter moved to the layout its first op wants, and each
        submodule's inputs and outputs to the plan's layouts, as the runtime's hooks move them), plus the layout
        changes of the runtime itself: the batch arrives split over all ranks, batch outputs leave the same way
        (their gradients come back so), other outputs leave replicated, and each gradient is moved into its
        parameter's layout."""
        boundaries = modules.module_layouts(self.program, plan.node_layouts) if laid_out else {}
        arrival, replicate = boundary.batch_arrival(self.mesh.ndim), boundary.replicated(self.mesh.ndim)
        program = self.program
        params = {name: parse_placements(plan.param_placements[name]) for name in program.param_nodes}
        first_input = parse_placements(plan.input_placements.get(0) or next(iter(plan.input_placements.values()), ()))
        planned = {name: parse_placements(p) for name, p in modules.compute_layouts(program, plan.node_layouts).items()
                   } if laid_out else {}
        computed = boundary.compute_layouts(params, first_input, planned)
        seeds = {program.param_nodes[name]: placements for name, placements in computed.items()}
        for index, node in program.input_nodes.items():
            wanted = plan.input_placements.get(index)
            seeds[node] = parse_placements(wanted) if wanted else self._arrival(node)
        sharding = propagate(program, self.mesh, seeds, modules.pins(program, boundaries))
        regathered = self._regathered(plan, params, computed)
        flats = self._flat_gathers(program.params, params, computed)
        in_flat = {name for flat in flats for name in flat.names}
        again = {name for names in regathered.values() for name in names
                 if pricing.read_by_backward(program, program.param_nodes[name])}
        for name, node in program.param_nodes.items():  # the gathers of the forward, once per step
            if name in in_flat:
                continue
            self._note_move(sharding, node, params[name], computed[name], False, self.param_dtype)
            if name in again:  # and again for the group's backward, where backward reads them
                self._note_move(sharding, node, params[name], computed[name], True, self.param_dtype)
        for flat in flats:  # one all_gather per flat group, and one more for its backward where it is freed
            first = flat.names[0]
            for backward in (False, True) if flat.group in regathered and again & set(flat.names) else (False,):
                self._note_move(sharding, program.param_nodes[first], params[first], computed[first], backward,
                                nbytes=flat.nbytes)
        local = self._runs_locally(sharding, computed, seeds)
        for node in program.input_nodes.values():
            self._note_move(sharding, node, self._arrival(node), seeds[node], False)
        for output in program.output_nodes.values():
            value, spec = output.meta.get("val"), sharding.returned.get(output, sharding.specs.get(output))
            if not isinstance(value, torch.Tensor) or spec is None:
                continue
            leaving = boundary.leaving(value, self.mesh.ndim, self.global_batch, self.full_batch)
            self._note_move(sharding, output, spec.placements, leaving, False)
            if leaving == arrival:
                self._note_move(sharding, output, leaving, tangent_placements(spec.placements), True)
        for name, update in program.buffer_updates.items():  # new running statistics written back, replicated
            spec = sharding.specs.get(update)
            if spec is not None and hasattr(spec, "placements") and name in program.buffer_nodes:
                self._note_move(sharding, update, spec.placements, replicate, False)
        real = self._real_params
        result = self._plan(plan.strategy, sharding, params, bucket_cap_bytes=0, as_searched=False,
                            flat_grads=self._flat_gathers(real(program.params), real(params), real(computed)))
        result.reshard_after_forward, result.kept_gathered = plan.reshard_after_forward, plan.kept_gathered
        self._storage_memory(result, params, computed, regathered, flats)
        result.local_compute = local and all(
            tuple(sharding.returned.get(o, sharding.specs.get(o)).placements) == arrival
            for o in program.output_nodes.values() if isinstance(o.meta.get("val"), torch.Tensor))
        if result.local_compute:
            result.notes.append("eager mode: every op computes on local tensors (each parameter whole, the batch "
                                "split), as FSDP2 runs: no DTensor dispatch")
        else:
            self._dispatch_overhead(result)
        result.collectives.append(self._batch_check())
        result.module_layouts = dict(boundaries)
        result.param_compute_placements = {name: format_placements(p) for name, p in computed.items()}
        off_plan = _off_plan_ops(program, plan.node_layouts, result.node_layouts) if boundaries else []
        result.search_stats = {**plan.search_stats, **_priced_here(result),
                               "planned_step_time": plan.estimated_step_time,
                               "executed_as": "DTensor propagation of the plan's placements"
                               + (" between its module boundaries" if boundaries else ""), "off_plan_ops": off_plan}
        result.notes = plan.notes + [
            "executed as DTensor places each op"
            + (f" between the plan's {len(boundaries)} module boundaries" if boundaries else "")
            + f": estimated {result.estimated_step_time * 1e3:.3f} ms per step (the search's own layout: "
            f"{plan.estimated_step_time * 1e3:.3f} ms)"]
        if off_plan:
            result.notes.append(f"eager mode: {len(off_plan)} ops run in another layout than planned (priced as they "
                                "run): " + ", ".join(off_plan[:8]) + (", ..." if len(off_plan) > 8 else ""))
        return result

    def _runs_locally(self, sharding, computed: dict, seeds: dict) -> bool:
        """Whether eager mode may run the ops on local tensors (``Plan.local_compute``), judged on DTensor's
        placement of them once the parameters' moves are noted: every parameter computed replicated, every
        input split on every axis, no move but the parameters' (so no activation is ever partial or gathered),
        no random op (DTensor draws a shard's numbers as one process would; a local op would not) and no batch
        statistics."""
        program, arrival = self.program, boundary.batch_arrival(self.mesh.ndim)
        if self.mode == "graph" or self.full_batch or program.buffer_updates:
            return False
        if any(any(not p.is_replicate() for p in placements) for placements in computed.values()):
            return False
        if any(tuple(seeds[node]) != arrival for node in program.input_nodes.values()
               if isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].ndim):
            return False
        params = {node.name for node in program.param_nodes.values()}
        if any(move.node not in params for move in sharding.redistributions):
            return False
        seeded = torch.Tag.nondeterministic_seeded
        return not any(node.op == "call_function" and seeded in getattr(node.target, "tags", ())
                       for node in program.graph.graph.nodes)

    def _runs_as_laid_out(self, plan: Plan) -> bool:
        """Whether ``plan``'s node layouts are this program's and agree with its parameter placements (a plan
        edited by hand, or made on a folded capture, is executed as DTensor places its ops instead)."""
        layouts = plan.node_layouts
        nodes = [node for node in self.program.graph.graph.nodes if node.op == "call_function"]
        if not layouts or any(node.name not in layouts for node in nodes):
            return False
        return all(layouts.get(node.name) is not None and layouts[node.name].output == tuple(plan.param_placements[name])
                   for name, node in self.program.param_nodes.items())

    def _arrival(self, node) -> tuple:
        """The layout a user input arrives in (``strategies.boundary``): each rank's slice, or replicated when
        every rank passes the whole batch."""
        return boundary.arrival(node.meta["val"], self.mesh.ndim, self.full_batch)

    def _batch_check(self, background: bool = False) -> PlannedCollective:
        """The runtime's per-step input check: equal batch slices (16 bytes), or with full batches the same batch
        on every rank (``runtime.checks.check_same_full_batch``: 32 bytes per input tensor). Waited for before
        the forward, or with ``background`` (data parallelism's slice check, ``rewrite.reducer``) as backward ends,
        hidden as the gradient syncs are (``estimate.HIDDEN_PHASES``)."""
        tensors = sum(isinstance(n.meta.get("val"), torch.Tensor) for n in self.program.input_nodes.values())
        nbytes, where = (FULL_BATCH_CHECK_BYTES * tensors, BATCH_CHECKS[1]) if self.full_batch else (
            BATCH_CHECK_BYTES, BATCH_CHECKS[0])
        return PlannedCollective(kind="all_reduce", axis=ALL_AXES_SEPARATOR.join(self.axis_names), nbytes=nbytes,
                                 phase="background" if background else "forward", where=where,
                                 seconds=self.cost.collective_time("all_reduce", 0, nbytes))

    def _dispatch_overhead(self, plan: Plan) -> None:
        """Eager sharded execution: every op of forward and backward goes through DTensor's dispatch."""
        if self.mode == "graph":
            return
        ops = sum(self.weights.get(node, 1) for node in self.program.graph.graph.nodes
                  if node.op == "call_function" and node.target is not operator.getitem)
        seconds = ops * self.cost.hardware.dtensor_overhead_s
        plan.compute_time += seconds
        plan.estimated_step_time += seconds
        plan.search_stats["dtensor_dispatch_s"] = seconds
        plan.notes.append(f"eager mode: DTensor dispatch of {ops} ops adds {seconds * 1e3:.2f} ms per step "
                          "(graph mode compiles it away)")

    def _flat_gathers(self, infos: dict, storage: dict, computed: dict) -> list[FlatGather]:
        """Eager mode's flat all-gathers (``runtime.flat``): per group of ``capture.layers.reshard_groups`` and
        the root (the parameters in none), per mesh axis and gathered dtype, the parameters that
        ``boundary.flat_gather_axis`` admits. ``infos``, ``storage``, ``computed``: name → ``TensorInfo``,
        stored and compute placements (captured names, or real names of a folded capture)."""
        if self.mode != "eager":
            return []
        groups = reshard_groups(storage)
        grouped = {name for names in groups.values() for name in names}
        groups[""] = [name for name in storage if name not in grouped]
        flats = []
        for group, names in groups.items():
            members: dict[tuple, list[str]] = {}
            for name in names:
                axis, dtype = flat_gather_axis(tuple(storage[name]), tuple(computed[name])), _dtype(infos[name])
                if axis is not None and dtype.is_floating_point:
                    members.setdefault((axis, self.param_dtype or dtype), []).append(name)
            for (axis, dtype), kept in members.items():
                ranks = self.mesh.size(axis)
                padded = {name: ranks * padded_shard_numel(infos[name].shape, ranks) for name in kept}
                reduced = (self.reduce_dtype or dtype).itemsize
                flats.append(FlatGather(group=group, axis=axis, names=tuple(kept),
                                        nbytes=sum(padded.values()) * dtype.itemsize,
                                        grad_nbytes={name: numel * reduced for name, numel in padded.items()}))
        return flats

    def _regathered(self, plan: Plan, storage: dict, computed: dict) -> dict[str, list[str]]:
        """Group → its gathered parameters, for the groups eager mode frees after forward and gathers again for
        backward (``runtime.fsdp``; groups of ``capture.layers.reshard_groups``, less ``Plan.kept_gathered``);
        empty when the plan keeps them all."""
        if not plan.reshard_after_forward or self.mode == "graph":
            return {}
        groups = {group: [n for n in names if computed[n] != storage[n]]
                  for group, names in reshard_groups(storage).items() if group not in plan.kept_gathered}
        return {group: names for group, names in groups.items() if names}

    def _storage_memory(self, plan: Plan, storage: dict, computed: dict, regathered: dict, flats: list) -> None:
        """Parameters, gradients and optimizer state are held in the storage layout. Gathered parameters: those
        of ``regathered`` groups are whole one group at a time with the next one's gather in flight (the
        prefetch), at either end of backward ("gathered_parameters", with the root's, which the runner keeps for
        the step); the other groups' (``Plan.kept_gathered``, or every layer's without resharding) are kept from
        their forward until backward frees them as their gradients appear ("gathered_for_backward", which
        ``pricing.peak_bytes`` never counts with the gradients). Gradients in flight: the flat buffer a group's
        gradients are copied into as they are made, and the collective's copy of it as it is reduce-scattered
        (one parameter's whole gradient, outside flat groups)."""
        local = lambda name, placements: self.program.params[name].nbytes // self.cost.shard_factor(placements)  # noqa: E731
        held = sum(local(n, p) for n, p in storage.items())
        gathered = [n for n in storage if computed[n] != storage[n]]

        def whole(names, dtype=self.param_dtype) -> int:
            return sum(self._gathered_nbytes(n, computed[n], dtype) for n in names)

        grouped = {name for names in regathered.values() for name in names}
        in_flat = {name for flat in flats for name in flat.names}
        in_flight = max([whole([n], self.reduce_dtype) for n in grouped - in_flat]
                        + [2 * whole(flat.names, self.reduce_dtype) for flat in flats], default=0)
        in_groups = {name for names in reshard_groups(storage).values() for name in names}
        root = whole(n for n in gathered if n not in in_groups)  # kept by the runner for the whole step
        prefetched = sum(sorted(map(whole, regathered.values()))[-2:])
        transient = root + prefetched
        kept = whole(n for n in gathered if n in in_groups and n not in grouped)
        buffers = plan.memory_breakdown.get("parameters", 0) - sum(local(n, computed[n]) for n in storage)
        plan.memory_breakdown = {"parameters": held + max(buffers, 0), "gathered_parameters": transient,
                                 "gathered_for_backward": kept, "gradients": held, "gradients_in_flight": in_flight,
                                 "optimizer": est.ADAM_STATE_PER_PARAM * held,
                                 "activations": plan.memory_breakdown.get("activations", 0)}
        plan.peak_memory = pricing.peak_bytes(plan.memory_breakdown, self.mode != "graph")

    def _gathered_nbytes(self, name: str, placements: tuple, dtype: torch.dtype | None) -> int:
        """Bytes of parameter ``name`` (or its gradient) in ``placements`` and ``dtype`` (None: its own)."""
        return est.in_dtype(self.program.params[name], dtype) // self.cost.shard_factor(placements)

    @staticmethod
    def _note_move(sharding, node, source, target, backward: bool, dtype: torch.dtype | None = None,
                   nbytes: int | None = None) -> None:
        """A move of ``node``'s value (``nbytes``: of that many global bytes instead, a flat group's)."""
        if tuple(source) != tuple(target):
            value = node.meta["val"]
            sharding.redistributions.append(Redistribution(
                node=node.name, arg_index=-1, source=tuple(source), target=tuple(target),
                global_nbytes=nbytes if nbytes is not None else value.numel() * (dtype or value.dtype).itemsize,
                backward=backward))


def _dtype(info) -> torch.dtype:
    return getattr(torch, info.dtype)


def _off_plan_ops(program: CapturedProgram, planned: dict, ran: dict) -> list[str]:
    """Ops whose output layout as executed differs from the plan's ("addmm_1: S(0) instead of S(1)")."""
    off = []
    for node in program.graph.graph.nodes:
        plan_layout, ran_layout = planned.get(node.name), ran.get(node.name)
        if node.op == "call_function" and plan_layout is not None and ran_layout is not None \
                and is_one_tensor_layout(plan_layout.output) and plan_layout.output != ran_layout.output:
            off.append(f"{node.name}: {','.join(ran_layout.output)} instead of {','.join(plan_layout.output)}")
    return off


def _priced_here(plan: Plan) -> dict:
    """The figures of ``plan``'s own pricing that a re-priced plan keeps over the plan it was made from."""
    stats = plan.search_stats
    return {key: stats[key] for key in ("optimizer_s", "optimizer_dispatch_s", "dtensor_dispatch_s") if key in stats}
