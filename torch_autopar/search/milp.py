"""Exact strategy choice as a mixed-integer linear program, solved by HiGHS (through scipy).

The problem
-----------
Decisions d = 1..D (node groups, see search.problem), each with strategies a = 1..K_d.

Variables
    x[d, a] ∈ {0, 1}       decision d takes strategy a                                   (``_add_choice_vars``)
    y[e, p, q] ∈ [0, 1]    on edge e = (u → v): u's output is in layout p and v needs layout q
                           (layouts, not strategies: many strategies share a layout)     (``_add_edge_vars``)

    g ≥ 0                  gradient synchronisation left on the step                   (``_exposed_grad_sync``)
    z[k] ∈ [0, 1]          parameter group k (group, dtype, phase, collective, weight) runs that collective
                                                                                       (``_group_latencies``)

Objective (seconds per step)
    minimise  Σ_d Σ_a cost[d, a] · x[d, a]  +  Σ_{e not grad} Σ_p Σ_q C_e[p, q] · y[e, p, q]  +  g
              +  Σ_{k not grad} L_k · z[k]
    cost: compute of each strategy (times the members tied to d) and, for user inputs, resharding from the
    layout they arrive in; C_e: resharding between producer output and consumer requirement, gradient sync,
    tangent layout, summed over all edges tied to e; L_k: the latency of one of k's collectives on its mesh axis
    (times the layers k stands for), which a parameter's move starting with an all-gather, and a gradient's
    sync that is one reduction, pay with their group instead of in C_e where the mode's runtime makes them per
    group (``strategies.boundary.made_per_group``; the gradient ready last keeps its own). Every term is priced
    by ``cost.pricing``, as a plan's estimate prices it, so the optimum is the estimate of the plan returned
    (but for what no edge carries: a gathered parameter freed after forward and gathered again for backward
    through a view backward reads, gradients reduced in another dtype than the parameters', graph mode's program
    boundary).

Constraints
    (1) Σ_a x[d, a] = 1                               one strategy per decision     (``_one_strategy_rows``)
    (2) Σ_q y[e, p, q] = Σ_{a: rows_e[a] = p} x[u, a]   for every p   producer marginals (``_edge_rows``)
    (3) Σ_p y[e, p, q] = Σ_{b: cols_e[b] = q} x[v, b]   for every q   consumer marginals (``_edge_rows``)
    (4) Σ_d Σ_a mem[d, t, a] · x[d, a] ≤ memory budget  bytes per device at either end t of backward
        (activations held as it starts, gradients made as it ends: ``cost.pricing.peak_bytes``) (``_memory_rows``)
    (5) g ≥ Σ_{e grad} Σ_p Σ_q C_e[p, q] · y[e, p, q] + Σ_{k grad} L_k · z[k] − Σ_d Σ_a bwd[d, a] · x[d, a]
        g ≥ Σ_p Σ_q last_e · C_e[p, q] · y[e, p, q]    for the edge e of the gradient ready last
        gradient syncs overlap the backward compute (bwd: its share of cost) except the last one, which
        nothing follows (``cost.pricing.exposed_grad_sync``)                          (``_exposed_grad_sync``)
    (6) z[k] ≥ Σ_{(p, q) whose latency is k's collective's} y[e, p, q]   for every edge e of group k
                                                                                       (``_group_latencies``)
    (7) x[d, a] = 0 for strategies a a named strategy forbids (data_parallel, fully_shard, ...): an upper
        bound, so one problem serves every restriction                                 (``_Model.solve``)

With x integral, (2)-(3) force y[e, p, q] = [u's layout is p] · [v needs q], and at the optimum (6) holds z[k] at
[any edge of k runs k's collective] (a gradient group's z where row (5) binds; elsewhere it costs nothing), so
the objective is exact. Edges whose cost matrix is all zero and whose moves pay no group latency get no y
variables. Must never build the problem (search.problem does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from torch_autopar.cost.pricing import PEAK_PHASES, exposed_grad_sync
from torch_autopar.errors import AutoparError
from torch_autopar.search.problem import ShardingProblem


@dataclass(kw_only=True)
class Solution:
    choice: list[int]
    """Chosen strategy index per decision."""
    objective: float
    seconds: float
    num_variables: int
    status: str
    optimal: bool
    """Proved optimal (within HiGHS's relative gap), not stopped by the time limit."""


MICROSECONDS = 1e6


class _Model:
    def __init__(self, problem: ShardingProblem):
        self.problem = problem
        self.cost: list[float] = []
        self.integral: list[int] = []
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.x_offset: list[int] = []
        self.exposed_index: int | None = None

    def _new_vars(self, costs, integral: bool) -> int:
        """Variables with objective coefficients given in seconds (stored in microseconds)."""
        start = len(self.cost)
        self.cost.extend(float(c) * MICROSECONDS for c in costs)
        self.integral.extend([int(integral)] * len(costs))
        return start

    def _row(self, entries, lower: float, upper: float) -> None:
        row = len(self.lower)
        for col, val in entries:
            self.rows.append(row)
            self.cols.append(col)
            self.vals.append(val)
        self.lower.append(lower)
        self.upper.append(upper)

    def _add_choice_vars(self) -> None:
        for decision in self.problem.decisions:
            self.x_offset.append(self._new_vars(decision.cost, integral=True))

    def _one_strategy_rows(self) -> None:
        for d, decision in enumerate(self.problem.decisions):
            start = self.x_offset[d]
            self._row([(start + a, 1.0) for a in range(len(decision.strategies))], 1.0, 1.0)

    def _add_edge_vars(self) -> None:
        self.y_offset = {}
        for key, edge in self.problem.edges.items():
            costs = np.zeros(edge.cost.size) if edge.grad_sync else edge.cost.reshape(-1)
            self.y_offset[key] = self._new_vars(costs, integral=False)

    def _exposed_grad_sync(self) -> None:
        grad = [(key, edge) for key, edge in self.problem.edges.items() if edge.grad_sync]
        if not grad:
            return
        exposed = self.exposed_index = self._new_vars([1.0 / MICROSECONDS], integral=False)  # g in microseconds
        entries = [(exposed, -1.0)]
        for key, edge in grad:
            entries += self._edge_terms(key, edge, 1.0)
        entries += [(z, seconds * MICROSECONDS) for z, seconds in self.grad_latencies]
        for d, decision in enumerate(self.problem.decisions):
            entries += [(self.x_offset[d] + a, -float(c) * MICROSECONDS) for a, c in enumerate(decision.backward_cost) if c]
        self._row(entries, -np.inf, 0.0)
        for key, edge in grad:
            if edge.last_share:
                self._row([(exposed, -1.0)] + self._edge_terms(key, edge, edge.last_share), -np.inf, 0.0)

    def _edge_terms(self, key, edge, share: float) -> list[tuple[int, float]]:
        """``share`` of edge ``key``'s cost as row entries on its y variables, in microseconds."""
        return [(self.y_offset[key] + i, share * float(c) * MICROSECONDS)
                for i, c in enumerate(edge.cost.reshape(-1)) if c]

    def _edge_rows(self) -> None:
        for key, edge in self.problem.edges.items():
            kp, kq = edge.cost.shape
            start = self.y_offset[key]
            for p in range(kp):
                choices = [(self.x_offset[edge.producer] + a, -1.0) for a in np.flatnonzero(edge.rows == p)]
                self._row([(start + p * kq + q, 1.0) for q in range(kq)] + choices, 0.0, 0.0)
            for q in range(kq):
                choices = [(self.x_offset[edge.consumer] + b, -1.0) for b in np.flatnonzero(edge.cols == q)]
                self._row([(start + p * kq + q, 1.0) for p in range(kp)] + choices, 0.0, 0.0)

    def _group_latencies(self) -> None:
        self.grad_latencies = []
        for (_, _, phase, code, _), (seconds, keys) in self.problem.latency_groups().items():
            grad = phase == "grad_sync"
            z = self._new_vars([0.0 if grad else seconds], integral=False)  # a gradient's: in g (exposed rows)
            if grad:
                self.grad_latencies.append((z, seconds))
            for key in keys:
                moving = np.flatnonzero(self.problem.edges[key].latency_codes.reshape(-1) == code)
                self._row([(self.y_offset[key] + int(i), 1.0) for i in moving] + [(z, -1.0)], -np.inf, 0.0)

    def _memory_rows(self) -> None:
        if np.isinf(self.problem.memory_budget):
            return
        for phase in range(len(PEAK_PHASES)):
            entries = [(self.x_offset[d] + a, float(m)) for d, decision in enumerate(self.problem.decisions)
                       for a, m in enumerate(decision.memory[phase]) if m]
            self._row(entries, -np.inf, float(self.problem.memory_budget))

    def build(self) -> None:
        self._add_choice_vars()
        self._add_edge_vars()
        self._one_strategy_rows()
        self._edge_rows()
        self._memory_rows()
        self._group_latencies()
        self._exposed_grad_sync()

    def solve(self, time_limit_s: float, allowed: dict[int, list[int]] | None = None) -> Solution:
        started = time.perf_counter()
        n = len(self.cost)
        if not hasattr(self, "_matrix"):
            self._matrix = coo_matrix((self.vals, (self.rows, self.cols)), shape=(len(self.lower), n)).tocsr()
        upper = np.ones(n)
        if self.exposed_index is not None:
            upper[self.exposed_index] = np.inf  # seconds, not a 0/1 choice
        for d, keep in (allowed or {}).items():  # restriction (7): x[d, a] = 0 for strategies not allowed
            start = self.x_offset[d]
            upper[start:start + len(self.problem.decisions[d].strategies)] = 0.0
            upper[[start + a for a in keep]] = 1.0
        # NOTE [microseconds]: HiGHS accepts a MIP solution within an absolute gap of 1e-6 and a primal
        # infeasibility of 1e-7; in seconds both are sizeable fractions of a small model's step time, so every
        # time in the model (objective and the exposed-gradient-sync row) is in microseconds.
        result = milp(np.array(self.cost), constraints=LinearConstraint(self._matrix, self.lower, self.upper),
                      integrality=np.array(self.integral), bounds=Bounds(0.0, upper),
                      options={"time_limit": time_limit_s, "presolve": True, "mip_rel_gap": 1e-6})
        if result.x is None:
            raise AutoparError(_infeasible_message(self.problem, result.message, smallest_memory(self.problem)))
        choice = [int(np.argmax(result.x[s:s + len(d.strategies)]))
                  for s, d in zip(self.x_offset, self.problem.decisions)]
        return Solution(choice=choice, objective=float(result.fun) / MICROSECONDS, seconds=time.perf_counter() - started,
                        num_variables=n, status=str(result.message), optimal=result.status == 0)


def smallest_memory(problem: ShardingProblem, allowed: dict[int, list[int]] | None = None) -> float:
    """A lower bound of any plan's peak bytes (per phase, each decision's least memory; the larger phase)."""
    def least(index: int, decision) -> np.ndarray:
        memory = decision.memory if not allowed or index not in allowed else decision.memory[:, allowed[index]]
        return memory.min(axis=1)

    return float(max(sum(least(i, d) for i, d in enumerate(problem.decisions))))


def _infeasible_message(problem: ShardingProblem, message: str, smallest: float) -> str:
    return (f"no sharding fits the memory budget of {problem.memory_budget:,.0f} bytes per device "
            f"(solver: {message}); the smallest per-device memory any plan needs is about {smallest:,.0f} bytes. "
            "Raise memory_budget, use a larger mesh, or a smaller batch.")


class Solver:
    """Builds the model of ``problem`` once; ``solve(allowed)`` may then be called for several restrictions."""

    def __init__(self, problem: ShardingProblem):
        self.problem = problem
        self.model = _Model(problem)
        self.model.build()

    def solve(self, time_limit_s: float = 60.0, allowed: dict[int, list[int]] | None = None) -> Solution:
        smallest = smallest_memory(self.problem, allowed)
        if smallest > self.problem.memory_budget:
            raise AutoparError(_infeasible_message(self.problem, "the budget is below every plan's memory", smallest))
        return self.model.solve(time_limit_s, allowed)


def solve(problem: ShardingProblem, time_limit_s: float = 60.0, allowed: dict[int, list[int]] | None = None) -> Solution:
    """Optimal strategy per decision (see the module docstring for the formulation)."""
    return Solver(problem).solve(time_limit_s, allowed)


def objective_of(problem: ShardingProblem, choice: list[int]) -> float:
    """The objective value of a given choice (used to check the solver and to price fixed plans)."""
    total = sum(float(d.cost[a]) for d, a in zip(problem.decisions, choice))
    edge_cost = lambda e: float(e.cost[e.rows[choice[e.producer]], e.cols[choice[e.consumer]]])  # noqa: E731
    total += sum(edge_cost(e) for e in problem.edges.values() if not e.grad_sync)
    grad = sum(edge_cost(e) for e in problem.edges.values() if e.grad_sync)
    last = sum(e.last_share * edge_cost(e) for e in problem.edges.values() if e.grad_sync)
    backward = sum(float(d.backward_cost[a]) for d, a in zip(problem.decisions, choice))
    for (_, _, phase, code, _), (seconds, keys) in problem.latency_groups().items():
        edges = [problem.edges[key] for key in keys]
        if any(e.latency_codes[e.rows[choice[e.producer]], e.cols[choice[e.consumer]]] == code for e in edges):
            if phase == "grad_sync":
                grad += seconds
            else:
                total += seconds
    return total + exposed_grad_sync(grad, last, backward)
