"""Build a Plan: place every node of a captured program, estimate it, keep the best candidate.

Two ways to place nodes:
  propagation  seeds (parameters, inputs) pushed through DTensor's rules (``strategies.propagate``): exact for
               data parallelism and the fast mode for problems too large to solve exactly;
  search       the MILP of ``search.milp`` over every node's DTensor strategies, restricted per mesh axis by the
               named strategy (``strategies.roles``): one problem per planner, each restriction bounds its leaves.
"auto" is the unrestricted search, compared with every named strategy under the same estimator, so it never
returns a plan slower than one of them; a named restriction is not solved when auto's proven optimum, priced as
its estimate, already bounds it. Each candidate gets the repeated layers the activation-checkpointing policy
recomputes (``search.recompute``: for "auto", the fewest that fit the budget) before candidates are compared, and
the search's memory constraint leaves out the activations the policy may free. Must never run a collective.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial

from torch_autopar.capture import CapturedProgram
from torch_autopar.capture.fold import Folding
from torch_autopar.capture.program import params_fingerprint
from torch_autopar.capture.layers import forward_layer_nodes, node_weights, reshard_groups
from torch_autopar.cost import CostModel, HardwareProfile, pricing
from torch_autopar.errors import AutoparError
from torch_autopar.search import estimate as est
from torch_autopar.search.buckets import DEFAULT_BUCKET_CAP_BYTES, assign_buckets, group_buckets
from torch_autopar.search.executed import Executing
from torch_autopar.search.layer_rows import layer_rows
from torch_autopar.search import module_layouts as modules
from torch_autopar.search.layouts import leaving_moves, node_layouts, with_program_boundary
from torch_autopar.search.milp import Solver
from torch_autopar.search import recompute, reshard_choice
from torch_autopar.search.plan import Plan, params_of_groups
from torch_autopar.search.problem import ProblemTooLarge, ShardingProblem, build_problem
from torch_autopar.search.role_seeds import (MegatronMatrices, gathered_at_use, megatron_splits, role_seeds,
                                             split_matrix_grads)
from torch_autopar.search.solution import to_sharding
from torch_autopar.strategies import Sharding, format_placements, propagate, seed_placements
from torch_autopar.strategies import boundary
from torch_autopar.strategies.boundary import flat_reduced
from torch_autopar.strategies.enumerate import StrategySpace, enumerate_strategies
from torch_autopar.strategies.placements import spec_for
from torch_autopar.strategies.roles import axis_roles, batch_pieces, check_batch_split, gathered_uses, leaf_filter

STRATEGIES = ("auto", "data_parallel", "stand_alone", "fully_shard", "tensor_parallel", "fsdp_tp")
"""Names accepted as ``strategy=``; a ``Plan`` object is accepted too."""
SEARCHED = ("auto", "fully_shard", "tensor_parallel", "fsdp_tp")
MAX_EXACT_EDGE_VARIABLES = 400_000
"""Above this many edge variables the exact solve is replaced by the fast propagation mode."""


def check_strategy(strategy) -> None:
    """Every name in STRATEGIES is both planned (autopar.plan) and run (autopar.compile)."""
    if isinstance(strategy, Plan):
        return
    if strategy not in STRATEGIES:
        raise AutoparError(f"strategy={strategy!r} is not a known strategy; expected one of {STRATEGIES} or a Plan.")


@dataclass(kw_only=True)
class BuiltProblem:
    """A sharding problem (None: too large to solve exactly), the strategy space it was built from, the seconds
    each took, and its solver model (built on first use, then shared by every restriction solved on it)."""

    space: StrategySpace
    problem: ShardingProblem | None
    stats: dict
    edge_variables: int
    """Of the problem; where it is too large, how many there were when building stopped."""
    _solver: Solver | None = None

    def solver(self) -> Solver:
        if self._solver is None:
            self._solver = Solver(self.problem)
        return self._solver


class Planner(Executing):
    """Plans one captured program on one mesh; ``plan(strategy)`` may be called for several strategies."""

    def __init__(self, program: CapturedProgram, mesh: DeviceMesh, axis_names, *, hardware: HardwareProfile,
                 memory_budget: int | None = None, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                 global_batch: int | None = None, solver: str = "auto", time_limit_s: float = 60.0,
                 folding=None, mode: str = "eager", param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, full_batch: bool = False,
                 reshard_after_forward: bool = True, kept_gathered: tuple[str, ...] = (), activation_checkpointing=None,
                 recompute_candidates=None):
        self.program, self.mesh, self.axis_names = program, mesh, tuple(axis_names)
        self.full_batch = full_batch
        """Every rank passes the whole batch: inputs arrive and outputs leave replicated (``strategies.boundary``)."""
        self.cost = CostModel(hardware, tuple(mesh.shape), mesh)
        self.budget = memory_budget if memory_budget is not None else hardware.memory_bytes
        self.bucket_cap_bytes, self.global_batch = bucket_cap_bytes, global_batch
        self.solver, self.time_limit_s = solver, time_limit_s
        self.folding = folding if folding is not None else Folding()
        self.weights = node_weights(program, self.folding)
        self._shared: BuiltProblem | None = None
        self._propagations: dict[tuple, Sharding] = {}
        self._enumerations: dict = {}
        """Shared by the strategy enumerations of every restriction (``enumerate_strategies``'s memo)."""
        self.mode = mode
        """How compile will run a sharded plan: "eager" pays DTensor's per-op host overhead, "graph" does not."""
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        """Mixed precision (runtime.precision): the dtype parameters are gathered in and gradients reduced in
        (None: their own). Compute and activations are priced from the captured graph, which computes in it."""
        self.reshard_after_forward = reshard_after_forward
        """Plans made here gather fully-sharded parameters per group around forward and backward (``Plan``)..."""
        self.kept_gathered = tuple(kept_gathered)
        """... except the groups kept gathered from forward to backward (``Plan.kept_gathered``)."""
        self._kept_params = frozenset(self.program.param_nodes[name] for name in
                                      params_of_groups(self.kept_gathered, self.program.param_nodes))
        """Their parameter nodes (``search.plan.params_of_groups``)."""
        self.activation_checkpointing = activation_checkpointing
        """The recompute policy (``search.recompute.POLICIES``, or a choice: module path → "full" | "selective")
        each candidate plan is given after its layouts."""
        self.recompute_candidates = None if recompute_candidates is None else list(recompute_candidates)
        """Module paths of the repeated layers the runtime can recompute (None: every layer captured as one)."""

    # one candidate ----------------------------------------------------------------------------------------------
    def propagated(self, strategy: str) -> Plan:
        seeds = seed_placements(self.program, strategy, self.mesh.ndim)
        params = {name: seeds[node] for name, node in self.program.param_nodes.items()}
        sharding = self._propagation(("seeds", strategy), seeds)
        if strategy != "data_parallel" or self.mesh.size() == 1:
            return self._plan(strategy, sharding, params)
        # Data parallelism runs the whole model locally on each slice (batch-coupled ops such as batch norm
        # see the rank's slice, as in DDP): nothing moves but the gradients, each rank computes 1/world of the
        # one-process step, and every gradient is a partial sum to all-reduce, whatever DTensor's rules say
        # (done in place on the kept propagation: doing it again changes nothing). With full batches the
        # batch-shaped outputs are gathered whole, the one move that is not a gradient's (``runtime.parallel_module``).
        whole = {output.name for output in self.program.output_nodes.values()
                 if self.full_batch and boundary.gathered_whole(output.meta.get("val"), self.global_batch)}
        sharding.redistributions[:] = [move for move in leaving_moves(self.program, sharding, self.mesh.ndim,
                                                                      self.global_batch, True) if move.node in whole]
        partial = tuple(Partial() for _ in range(self.mesh.ndim))
        for node in self.program.grad_nodes.values():
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                sharding.specs[node] = spec_for(self.mesh, value, partial)
        return self._plan(strategy, sharding, params, local_compute=True)

    def role_propagated(self, strategy: str) -> Plan:
        """Propagation from seeds that follow ``strategy``'s role on each mesh axis (``search.role_seeds``)."""
        self._check_batch(strategy)
        roles, shape = axis_roles(strategy, self.mesh.ndim), tuple(self.mesh.shape)
        matrices = megatron_splits(self.program) if "tp" in roles else MegatronMatrices({}, frozenset())
        seeds = role_seeds(self.program, roles, shape, matrices.splits)
        params = {name: seeds[node] for name, node in self.program.param_nodes.items()}
        gathered = gathered_at_use(self.program, roles, seeds, self.param_dtype)
        sharding = self._propagation(("roles", strategy), seeds, gathered, matrices.held,
                                     split_matrix_grads(self.program, roles, shape, matrices.splits))
        return self._plan(strategy, sharding, params)

    def _no_named_layout(self, names: list[str]) -> AutoparError:
        """Fast-mode auto's error when no named layout splits the batch (``_check_batch`` refused each)."""
        pieces = min(batch_pieces(name, tuple(self.mesh.shape)) for name in names)
        why = (f"the unrestricted problem has more than {MAX_EXACT_EDGE_VARIABLES:,} edge variables (the exact "
               "limit)" if self.solver == "auto" else "solver='propagate' was asked for")
        return AutoparError(
            f"strategy 'auto' on mesh {tuple(self.mesh.shape)} propagates the named layouts ({why}), but each splits "
            f"the batch into at least {pieces} pieces and the global batch has {self.global_batch} samples. Expected "
            f"a global batch of at least {pieces}; use a larger batch, a smaller mesh, or solver='milp' to solve "
            "the unrestricted problem exactly (slow at this size).")

    def _check_batch(self, strategy: str) -> None:
        """A named strategy must split the batch into no more pieces than it has (``roles.check_batch_split``);
        "auto" and "stand_alone" split only what they can."""
        if strategy not in ("auto", "stand_alone") and self.mesh.size() > 1:
            check_batch_split(strategy, tuple(self.mesh.shape), self.axis_names, self.global_batch)

    def _propagation(self, key: tuple, seeds: dict, gathered: dict | None = None, pinned: frozenset = frozenset(),
                     grad_outputs: dict | None = None) -> Sharding:
        """``propagate`` from ``seeds``, kept under ``key``: "auto" compares data parallelism and, in the fast
        mode, every named strategy's propagation again (seconds each on a 3-D mesh)."""
        if key not in self._propagations:
            self._propagations[key] = propagate(self.program, self.mesh, seeds, gathered=gathered, pinned=pinned,
                                                grad_outputs=grad_outputs)
        return self._propagations[key]

    def searched(self, strategy: str) -> Plan:
        """The exact search restricted by ``strategy``'s axis roles: bounds on the leaves of the one problem that
        "auto" solves unbounded, so auto's optimum is never slower (its own, smaller problem when that one is too
        large to solve exactly)."""
        return self.searched_many([strategy])[strategy]

    def _splits_batch(self, strategy: str) -> bool:
        """Whether ``_check_batch`` lets ``strategy`` split this batch."""
        try:
            self._check_batch(strategy)
        except AutoparError:
            return False
        return True

    def _searched_or_none(self, strategy: str) -> Plan | None:
        try:
            return self.searched(strategy)
        except AutoparError as error:  # does not fit the budget under this restriction; other candidates may
            if strategy == "auto":
                self.infeasible = error
            return None

    def _problem(self, restriction=None) -> BuiltProblem:
        """The sharding problem under ``restriction`` (None: the unrestricted one, built once per planner and
        shared by every strategy, which bounds its leaves instead)."""
        if restriction is None and self._shared is not None:
            return self._shared
        started = time.perf_counter()
        space = enumerate_strategies(self.program, self.mesh, restriction, self._enumerations)
        generated = time.perf_counter()
        limit = MAX_EXACT_EDGE_VARIABLES if self.solver == "auto" else float("inf")
        try:
            problem = build_problem(self.program, space, self.cost, self._arrival, self.budget, self.weights, limit,
                                    recomputed=self._recomputable(), compute_runs=self._compute_runs(),
                                    mode=self.mode)
            edge_variables = problem.size()[1]
        except ProblemTooLarge as too_large:
            problem, edge_variables = None, too_large.edge_variables
        built = BuiltProblem(space=space, problem=problem, edge_variables=edge_variables, stats={
            "strategy_generation_s": generated - started, "problem_build_s": time.perf_counter() - generated})
        if restriction is None:
            self._shared = built
        return built

    def _recomputable(self) -> set:
        """The saved activations the policy may free ("auto", "full": the candidates' layers'), which the search's
        memory constraint does not count: it sizes layouts as if they all recompute, and ``_recompute`` then
        chooses, on the plan, which really do."""
        policy = self.activation_checkpointing
        if isinstance(policy, dict):
            wanted = {name for name, how in policy.items() if how == "full"}
        elif policy in ("auto", "full"):
            wanted = None if self.recompute_candidates is None else set(self.recompute_candidates)
        else:
            return set()
        layers = {key: nodes for key, nodes in forward_layer_nodes(self.program).items()
                  if wanted is None or set(self._real_layers(*key)) & wanted}
        return pricing.all_recomputed(self.program, layers)

    def _compute_runs(self) -> dict:
        """Forward op → how many times a step runs it (per time the forward does) under a policy whose choice does
        not depend on the layouts ("full", "selective", a dict): once, and once more in each real layer it stands
        for that recomputes it (a "selective" layer does not redo its matmuls), the compute ``_recompute`` adds
        to the plan, so that the search optimises it. None and "auto" (chosen on each plan): nothing."""
        policy = self.activation_checkpointing
        if policy is None or policy == "auto":
            return {}
        candidates = None if self.recompute_candidates is None else set(self.recompute_candidates)
        forward, runs = pricing.forward_nodes(self.program), {}
        for (family, index), nodes in forward_layer_nodes(self.program).items():
            real = self._real_layers(family, index)
            hows = [policy.get(path) if isinstance(policy, dict) else
                    policy if candidates is None or path in candidates else None for path in real]
            for node in nodes:
                again = sum(how == "full" or how == "selective" and node.target not in pricing.SAVED_BY_SELECTIVE
                            for how in hows)
                if node in forward and again:
                    runs[node] = 1 + again / len(real)
        return runs

    def _real_layers(self, family: str, index: int) -> list[str]:
        """Module paths of the real layers captured layer ``family.index`` stands for."""
        return [f"{family}.{real}" for real in self.folding.real_layers(family, index)]

    def _recompute(self, plan: Plan) -> Plan:
        """``plan`` with the recomputed layers the policy chooses for it (``search.recompute.choose``)."""
        candidates = self.recompute_candidates
        recompute.choose(plan, self.activation_checkpointing,
                         list(plan.layer_activations) if candidates is None else candidates, self.budget)
        return plan

    def searched_many(self, strategies: list[str], restriction=None) -> dict[str, Plan]:
        """Exact searches for several named strategies over one problem (restrictions bound leaf choices)."""
        for name in strategies:
            self._check_batch(name)
        if self.solver == "propagate":  # nothing to size: the problem is never built
            return {name: self._fast_mode(name, None) for name in strategies}
        built = self._problem(restriction)
        problem = built.problem
        if problem is None:
            plans = self._too_large(strategies, built.edge_variables, restriction)
            for plan in plans.values():  # the time spent finding the problem too large, unless solved exactly
                plan.search_stats = built.stats | plan.search_stats
            return plans
        solver = built.solver()
        plans = {}
        for name in strategies:
            try:
                solution = solver.solve(self.time_limit_s, self._allowed(problem, name))
            except AutoparError:
                continue  # this restriction does not fit the budget; the others may
            sharding = to_sharding(self.program, problem, solution.choice, self.mesh, built.space.replicated_ops,
                                   self._arrival)
            params = {n: sharding.specs[node].placements for n, node in self.program.param_nodes.items()}
            # eager mode: each gradient a bucket, a parameter group's reductions paying one latency, as the MILP
            # prices them (graph mode: ``_plan`` prices the program's buckets; eager execution its flat groups)
            plan = self._plan(name, sharding, params, bucket_cap_bytes=0, group_latency=True)
            plan.search_stats.update({
                "mode": "exact", "decisions": len(problem.decisions), "variables": solution.num_variables,
                **built.stats, "solve_s": solution.seconds, "objective_s": solution.objective,
                "solver_status": solution.status, "solver_optimal": solution.optimal})
            plans[name] = plan
        if not plans:
            solver.solve(self.time_limit_s)  # raises the infeasibility error with the smallest memory needed
        return plans

    def _allowed(self, problem, strategy: str) -> dict[int, list[int]]:
        """Allowed strategy indices under ``strategy``'s roles (none for "auto"): of leaf decisions, and of the
        decisions of ops that use a parameter an fsdp axis gathers where used."""
        if strategy == "auto":
            return {}
        roles = axis_roles(strategy, self.mesh.ndim)
        keep = leaf_filter(self.program, roles)
        leaves = list(self.program.param_nodes.values()) + list(self.program.buffer_nodes.values())
        leaves += list(self.program.input_nodes.values())
        allowed = {}
        for node in leaves:
            d = problem.decision_of.get(node)
            if d is None or problem.decisions[d].node is not node:
                continue
            outputs = [s.output for s in problem.decisions[d].strategies]
            kept = set(map(tuple, keep(node, outputs)))
            allowed[d] = [a for a, out in enumerate(outputs) if tuple(out) in kept]
        gathered = gathered_uses(roles)
        for node, sources in _parameter_uses(problem, self.program).items():
            d = problem.decision_of[node]
            positions = [i for i, arg in enumerate(node.all_input_nodes) if arg in sources]
            strategies = [problem.node_strategy(node, a) for a in range(len(problem.decisions[d].strategies))]
            kept = gathered(positions, strategies)
            if kept is not None and set(kept) & set(allowed.get(d, kept)):
                allowed[d] = sorted(set(kept) & set(allowed.get(d, kept)))
        return allowed

    def _too_large(self, strategies: list[str], edge_vars: int, restriction) -> dict[str, Plan]:
        """The shared problem is too large: solve each named restriction on its own, smaller problem (exactly
        when it fits), leave the unrestricted search out, propagate as a last resort."""
        if restriction is not None or len(strategies) == 1 and strategies[0] == "auto":
            return {name: self._fast_mode(name, edge_vars) for name in strategies}
        plans = {}
        for name in strategies:
            if name != "auto":
                plans.update(self.searched_many([name], leaf_filter(self.program, axis_roles(name, self.mesh.ndim))))
        for plan in plans.values():
            plan.notes.append(f"the unrestricted problem has more than {MAX_EXACT_EDGE_VARIABLES:,} edge variables "
                              "(the exact limit): searched each named strategy on its own problem")
        return plans

    def _fast_mode(self, strategy: str, edge_vars: int | None) -> Plan:
        """Propagation instead of the exact search, seeded by the requested strategy's axis roles; "auto" takes
        the best propagation of every named strategy, so it is never worse than one it could have returned."""
        if strategy == "data_parallel":
            plan = self.propagated("data_parallel")
        elif strategy != "auto":
            plan = self.role_propagated(strategy)
        else:
            names = ["data_parallel", "fully_shard", "tensor_parallel"] + (["fsdp_tp"] if self.mesh.ndim >= 2 else [])
            plans = [self.propagated(n) if n == "data_parallel" else self.role_propagated(n)
                     for n in names if self._splits_batch(n)]
            if not plans:
                raise self._no_named_layout(names)
            plan = min(plans, key=lambda p: (p.peak_memory > self.budget, p.estimated_step_time))
            plan.search_stats["candidate"] = plan.strategy
            plan.strategy = "auto"
        plan.search_stats.update({"mode": "propagation", "edge_variables": edge_vars})
        plan.notes.append(f"fast propagation mode: the problem has more than {MAX_EXACT_EDGE_VARIABLES:,} edge "
                          "variables (the exact limit)" if self.solver == "auto" else "propagation mode requested")
        return plan

    def _real_params(self, captured: dict) -> dict:
        """Per real parameter name, the value given for the captured parameter standing for it."""
        return {real: value for name, value in captured.items() for real in self.folding.real_names(name)}

    def _plan(self, strategy: str, sharding, captured_placements: dict, bucket_cap_bytes: int | None = None,
              local_compute: bool = False, as_searched: bool = True, flat_grads: list | None = None,
              group_latency: bool = False) -> Plan:
        """The plan of ``sharding``. In graph mode a sharded placement the search chose (``as_searched``) is what
        the per-rank program runs: with the program's boundary moves, its gradient buckets (up to the planner's
        cap; only gradients synced by one reduction share one, ``_bucket_keys``) and the batch-size check.
        ``flat_grads``: eager mode's flat groups (``Executing._flat_gathers``, real names), whose gradients are
        reduced as one bucket each, of their padded bytes. ``group_latency``: eager mode's gradients priced as the
        search prices them, one bucket each with one latency per parameter group (``est.add_grad_sync``)."""
        program, fold = self.program, self.folding
        graph_program = as_searched and self.mode == "graph" and not local_compute and self.mesh.size() > 1
        if graph_program:
            sharding = with_program_boundary(program, sharding, self.mesh.ndim, self.global_batch, self.full_batch)
            bucket_cap_bytes = self.bucket_cap_bytes
        ready = fold.real_order(program.grad_ready_order())
        infos = self._real_params(program.params)
        placements = self._real_params(captured_placements)
        grad_layout = lambda n: getattr(sharding.specs.get(program.grad_nodes.get(fold.captured_name(n))),  # noqa: E731
                                        "placements", None)
        groups = {n: (infos[n].dtype, tuple(placements[n]), grad_layout(n)) for n in ready}
        if graph_program:
            groups = _bucket_keys(groups)
        cap = self.bucket_cap_bytes if bucket_cap_bytes is None else bucket_cap_bytes
        buckets = assign_buckets(ready, {n: infos[n].nbytes for n in ready}, cap, groups)
        flat_nbytes = {n: nbytes for flat in flat_grads or () for n, nbytes in flat.grad_nbytes.items()}
        if flat_grads:
            buckets = group_buckets(ready, self._reduced_first(flat_grads, grad_layout, placements))
        estimate = est.Estimate(weights=self.weights, backward_frees=self.mode != "graph")
        if local_compute:  # each rank runs the one-process step on its 1/world of the batch
            est.add_compute(estimate, program, Sharding(specs={}), self.cost, scale=1.0 / self.mesh.size())
        else:
            est.add_compute(estimate, program, sharding, self.cost)
        est.add_redistributions(estimate, program, sharding, self.cost, self.axis_names,
                                once_per_value=self.mode == "graph", reshard_after_forward=self.reshard_after_forward,
                                kept=self._kept_params, regather_views=as_searched,
                                grouped_in=self.mode if as_searched or self.mode == "graph" else None)
        est.add_grad_sync(estimate, sharding, self.cost, buckets,
                          lambda name: program.grad_nodes.get(fold.captured_name(name)), infos, self.reduce_dtype,
                          placements, self.axis_names, flat_nbytes,
                          grouped_in=self.mode if group_latency and not graph_program else None)
        if graph_program or local_compute and self._checks_batch_apart():
            estimate.collectives.append(self._batch_check(background=local_compute and not self.full_batch))
        est.add_exposed_comm(estimate)
        est.add_optimizer(estimate, infos, placements, self.cost)
        est.add_memory(estimate, program, sharding, self.cost)
        layouts = node_layouts(program, sharding)
        inputs = {i: format_placements(sharding.specs[n].placements) for i, n in program.input_nodes.items()
                  if hasattr(sharding.specs.get(n), "placements")}
        plan = Plan(
            strategy=strategy, mesh_shape=tuple(self.mesh.shape), axis_names=self.axis_names,
            hardware=self.cost.hardware.name, fingerprint=params_fingerprint(infos), global_batch=self.global_batch,
            param_placements={k: format_placements(v) for k, v in placements.items()},
            input_placements=inputs, grad_buckets=buckets, collectives=estimate.collectives,
            layers=layer_rows(program, infos, placements, buckets, self.cost, estimate, fold, sharding),
            replicated_ops=dict(sharding.replicated_ops), compute_time=estimate.compute,
            exposed_comm_time=estimate.exposed_comm, estimated_step_time=estimate.step_time,
            peak_memory=estimate.peak_memory, memory_breakdown=estimate.memory,
            search_stats={"seed": strategy, "folded_layers": dict(fold.lengths), "optimizer_s": estimate.optimizer,
                          "backward_frees": estimate.backward_frees},
            node_layouts=layouts, module_layouts={} if local_compute else modules.module_layouts(program, layouts),
            param_compute_placements={} if local_compute else self._real_params(modules.compute_layouts(program, layouts)),
            full_batch=self.full_batch, reshard_after_forward=self.reshard_after_forward,
            kept_gathered=self.kept_gathered,
            layer_activations={path: row for key, row in estimate.layers.items() for path in self._real_layers(*key)},
        )
        self._optimizer_dispatch(plan, len(infos), local_compute)
        return plan

    def _checks_batch_apart(self) -> bool:
        """Whether data parallelism checks its input batch with a collective of its own (``_batch_check``): with
        full batches (the same batch on every rank, before the forward), in graph mode (its slices' sizes, issued
        with the forward and waited for as backward ends), and in eager mode when its first gradient bucket is
        reduced in a dtype that cannot carry them exactly (``rewrite.reducer``)."""
        low_precision = self.reduce_dtype is not None and self.reduce_dtype not in (torch.float32, torch.float64)
        return self.full_batch or self.mode == "graph" or low_precision

    def _optimizer_dispatch(self, plan: Plan, tensors: int, local_compute: bool) -> None:
        """The sharded runtime keeps parameters as DTensors (data parallelism keeps plain tensors), so each kernel
        of the optimizer step (``cost.pricing.ADAMW_UPDATE_OPS`` per parameter) goes through DTensor's dispatch:
        a constant of the runtime that runs the plan, left out of the MILP's objective
        (``search_stats["optimizer_dispatch_s"]``)."""
        sharded = not local_compute and self.mesh.size() > 1 and not plan.is_data_parallel()
        seconds = pricing.ADAMW_UPDATE_OPS * tensors * self.cost.hardware.dtensor_overhead_s if sharded else 0.0
        plan.compute_time += seconds
        plan.estimated_step_time += seconds
        plan.search_stats["optimizer_s"] += seconds
        plan.search_stats["optimizer_dispatch_s"] = seconds

    @staticmethod
    def _reduced_first(flat_grads: list, grad_layout, placements: dict) -> list[list[str]]:
        """The flat groups whose reduce-scatter runs (some gradient is a partial sum over the axis:
        ``boundary.flat_reduced``), each led by such a gradient (a bucket is priced by its first)."""
        groups = []
        for flat in flat_grads:
            reduced = [n for n in flat.names if grad_layout(n) is not None
                       and flat_reduced(tuple(grad_layout(n)), tuple(placements[n]), flat.axis)]
            if reduced:
                groups.append(reduced[:1] + [n for n in flat.names if n != reduced[0]])
        return groups

    # choosing ---------------------------------------------------------------------------------------------------
    def plan(self, strategy: str, *, executable: bool = False) -> Plan:
        check_strategy(strategy)
        if strategy == "auto":
            return self._auto(executable)
        self._check_batch(strategy)
        plan = self.propagated(strategy) if strategy in ("data_parallel", "stand_alone") else self.searched(strategy)
        return self._within_budget([self._recompute(self.executed(plan) if executable else plan)])

    def _auto(self, executable: bool) -> Plan:
        if self.mesh.size() == 1:
            return self._within_budget([self._recompute(self.propagated("stand_alone"))])
        names = ["data_parallel", "auto", "fully_shard", "tensor_parallel"] + (["fsdp_tp"] if self.mesh.ndim >= 2 else [])
        if executable and self.program.buffer_updates:
            # Batch statistics (batch norm in training): data parallelism computes them per rank, as DDP does
            # (the compile contract); a sharded plan would compute them over the global batch. auto keeps the
            # contract; a sharded strategy asked for by name gets global statistics (documented).
            plan = self.propagated("data_parallel")
            plan.search_stats["candidate"] = "data_parallel"
            plan.notes.append("the forward updates batch statistics (" + ", ".join(sorted(self.program.buffer_updates))[:120]
                              + "): auto keeps data parallelism so that they stay per rank, as with DDP; name a "
                              "sharded strategy to get statistics over the global batch")
            best = self._within_budget([self._recompute(plan)])
            best.strategy = "auto"
            return best
        # Each named strategy is planned exactly as plan(strategy=name) plans it, so auto can never lose to one
        # of them; "auto" itself is the unrestricted search, solved first: when its optimum dominates the named
        # restrictions by construction they are not solved at all (see _dominates_restrictions).
        plans, skipped, refused = [], [], []
        for name in names:
            if name != "auto" and not self._splits_batch(name):
                refused.append(name)
                continue
            if name not in ("data_parallel", "auto") and not executable and self._dominates_restrictions(plans):
                skipped.append(name)
                continue
            plan = self.propagated(name) if name == "data_parallel" else self._searched_or_none(name)
            if plan is not None:
                plan = self._recompute(self.executed(plan) if executable else plan)
                plan.search_stats["candidate"] = name
                plans.append(plan)
        if not any(plan.peak_memory <= self.budget for plan in plans) and getattr(self, "infeasible", None):
            if self.activation_checkpointing == "auto":  # the search sized it with every candidate recomputed
                raise AutoparError(f"{self.infeasible} (activation_checkpointing='auto': even with every repeated "
                                   "layer recomputed)")
            raise self.infeasible  # the search's error states the smallest memory any plan needs
        best = self._within_budget(plans)
        best.notes.append("auto compared " + ", ".join(
            f"{p.search_stats['candidate']} {p.estimated_step_time * 1e3:.3f} ms"
            + (" (over budget)" if p.peak_memory > self.budget else "") for p in plans)
            + f"; chose {best.search_stats['candidate']}"
            + (" (estimates of the layouts as executed)" if executable else "")
            + (f"; {', '.join(skipped)} not solved: each is auto's problem with its leaves bounded, so auto's proven "
               "optimum is no slower" if skipped else "")
            + (f"; {', '.join(refused)} left out: each splits the batch into more pieces than its "
               f"{self.global_batch} samples" if refused else ""))
        best.strategy = "auto"
        return best

    def _dominates_restrictions(self, plans: list[Plan]) -> bool:
        """Whether the unrestricted search among ``plans`` is no slower than any named restriction, without
        solving them: those are bounds on its very problem, it was solved to optimality, it fits the budget and
        its estimate is the solver's objective (it is not, e.g., in graph mode, with mixed precision's reduce
        dtype, with a parameter gathered again for backward, or when activation checkpointing "auto" chooses layers
        on each plan: then the restrictions are solved)."""
        searched = [p for p in plans if p.search_stats.get("candidate") == "auto" and p.search_stats.get("mode") == "exact"]
        return any(p.search_stats["solver_optimal"] and p.peak_memory <= self.budget
                   and abs(p.estimated_step_time - p.search_stats["optimizer_dispatch_s"] - p.search_stats["objective_s"])
                   <= 1e-9 * p.estimated_step_time
                   for p in searched)

    def _within_budget(self, plans: list[Plan]) -> Plan:
        fitting = [plan for plan in plans if plan.peak_memory <= self.budget]
        if not fitting:
            smallest = min(plan.peak_memory for plan in plans)
            recomputing = (" even with the repeated layers recomputed that lower it (activation_checkpointing='auto')"
                           if self.activation_checkpointing == "auto" else "")
            raise AutoparError(
                f"no plan fits the memory budget of {self.budget:,} bytes per device: the smallest candidate "
                f"({', '.join(p.strategy for p in plans)}) needs {smallest:,} bytes{recomputing}. Raise "
                "memory_budget, use more devices, or a smaller batch."
            )
        return min(fitting, key=lambda plan: plan.estimated_step_time)


def _bucket_keys(groups: dict) -> dict:
    """Graph mode's bucket key per gradient, from its (dtype, parameter layout, gradient layout): gradients whose
    sync is one reduction share buckets by its kind and mesh axis (``cost.pricing.bucket_key``); any other gets a
    key of its own (the program moves it alone). Reduce-scattered gradients share buckets within one layer only
    (``capture.layers.reshard_groups``), as FSDP reduce-scatters each layer: a bucket's unreduced gradients live
    until its last one is computed, one bucket of the whole model would hold them all to the end of backward."""
    layer = {name: group for group, names in reshard_groups(list(groups)).items() for name in names}
    keys = {}
    for name, (dtype, target, source) in groups.items():
        key = pricing.bucket_key(dtype, source, target)
        scattered = key is not None and key[1] == "reduce_scatter"
        keys[name] = (key + (layer.get(name, ""),) if scattered else key) or (name,)
    return keys


def build_plan(program: CapturedProgram, mesh: DeviceMesh, axis_names, *, strategy: str = "auto",
               hardware: HardwareProfile, memory_budget: int | None = None,
               bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, global_batch: int | None = None,
               executable: bool = False, solver: str = "auto", folding=None, mode: str = "eager",
               param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
               full_batch: bool = False, reshard_after_forward: bool | str = True, activation_checkpointing=None,
               recompute_candidates=None) -> Plan:
    """The best plan for ``program`` on ``mesh`` among the candidates ``strategy`` allows, with the layers
    ``activation_checkpointing`` recomputes (among ``recompute_candidates``, module paths; None: every repeated
    layer captured); ``reshard_after_forward="auto"``: the fastest setting per group that fits (``reshard_choice``)."""

    def planned(reshard: bool, kept: tuple = ()) -> Plan:
        planner = Planner(program, mesh, axis_names, hardware=hardware, memory_budget=memory_budget,
                          bucket_cap_bytes=bucket_cap_bytes, global_batch=global_batch, solver=solver,
                          folding=folding, mode=mode, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                          full_batch=full_batch, reshard_after_forward=reshard, kept_gathered=kept,
                          activation_checkpointing=activation_checkpointing, recompute_candidates=recompute_candidates)
        return planner.plan(strategy, executable=executable)

    reshard_choice.check_reshard_after_forward(reshard_after_forward)
    if reshard_after_forward == "auto" and not executable:  # a folded capture: priced as searched, not as run
        plan = reshard_choice.unchosen(planned(True))
    elif reshard_after_forward == "auto":
        plan = reshard_choice.chosen(planned, list(reshard_groups(program.params)))
    else:
        plan = planned(reshard_after_forward)
    if param_dtype is not None:
        plan.notes.append(f"mixed precision: compute and activations in {param_dtype}, gradient reductions in "
                          f"{reduce_dtype}, parameters and optimizer state in their own dtype")
    return plan


def plan_from_parameters(params: dict, world_size: int, axis_names, *, strategy: str, reason: str,
                         bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES) -> Plan:
    """A data-parallel (or stand-alone) plan from the parameter list alone, for models that cannot be captured.

    Buckets follow reverse registration order (backward usually finishes the last layers first, as DDP assumes);
    nothing is estimated. Eager mode runs such a plan; graph mode cannot (it needs the graph)."""
    strategy = "stand_alone" if world_size == 1 or strategy == "stand_alone" else "data_parallel"
    ready = list(reversed(params))
    groups = {name: params[name].dtype for name in ready}
    buckets = assign_buckets(ready, {n: params[n].nbytes for n in ready}, bucket_cap_bytes, groups)
    replicated = tuple("R" for _ in axis_names)
    return Plan(
        strategy=strategy, mesh_shape=(world_size,), axis_names=tuple(axis_names)[:1] or ("dp",), hardware="unknown",
        fingerprint=params_fingerprint(params), global_batch=None, param_placements={n: replicated[:1] for n in params},
        input_placements={0: ("S(0)",) if strategy == "data_parallel" else ("R",)}, grad_buckets=buckets,
        collectives=[], layers=[], replicated_ops={}, compute_time=0.0, exposed_comm_time=0.0,
        estimated_step_time=0.0, peak_memory=0, notes=[f"planned from the parameter list only: {reason}"],
    )


def _parameter_uses(problem: ShardingProblem, program: CapturedProgram) -> dict:
    """Op node → its inputs that are parameters, or views of one placed by the parameter's own decision (a
    transposed weight follows its parameter): the ops where a parameter is used."""
    uses: dict = {}
    for param in program.param_nodes.values():
        own, frontier = problem.decision_of.get(param), [param]
        while frontier:
            source = frontier.pop()
            for user in source.users:
                d = problem.decision_of.get(user)
                if d is not None and d == own:
                    frontier.append(user)
                elif d is not None:
                    uses.setdefault(user, set()).add(source)
    return uses
