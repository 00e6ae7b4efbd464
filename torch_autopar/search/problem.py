"""Build the sharding problem: decisions (tied node groups), their strategy costs and memory, edge costs.

A decision is a representative node plus the nodes tied to it (repeated layers, ``getitem`` of a multi-output
node). Choosing strategy ``a`` for a decision places every member accordingly. Costs are seconds from
``CostModel``: compute of each strategy, the optimizer step on a parameter's shard, resharding between a
producer's output and the placement a consumer's strategy needs (summed over all tied edges), gradient
synchronisation (gradient placement → parameter placement) and tangent layout (forward output → its tangent),
each priced by ``cost.pricing`` as a plan's estimate prices it. A collective the plan's mode makes once per
parameter group (``strategies.boundary.made_per_group``) leaves its latency out of the edges, for the group to
pay once (``ShardingProblem.latency_groups``). Building stops once the problem is too large to solve exactly
(``ProblemTooLarge``). Must never solve anything.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np
import torch.fx as fx

from torch_autopar.capture import CapturedProgram
from torch_autopar.capture.layers import find_repeated_layers
from torch_autopar.cost import CostModel
from torch_autopar.cost import pricing
from torch_autopar.cost.ops import nbytes, node_flops
from torch_autopar.strategies import boundary, param_gathers
from torch_autopar.strategies.enumerate import StrategySpace


@dataclass(kw_only=True)
class Decision:
    node: fx.Node
    strategies: list
    members: int = 1
    cost: np.ndarray = None
    """Seconds per strategy: compute of every member (forward and backward) and input arrival."""
    backward_cost: np.ndarray = None
    """The part of ``cost`` spent in backward compute (gradient synchronisation can hide behind it)."""
    memory: np.ndarray = None
    """Bytes per device, per phase of ``pricing.PEAK_PHASES`` (rows) and strategy (columns): the step's memory
    at either end of backward, which the budget bounds both (``pricing.peak_bytes``)."""


@dataclass(kw_only=True)
class Edge:
    """Resharding cost between two decisions, on layouts rather than strategies: strategy ``a`` of the producer
    gives layout ``rows[a]``, strategy ``b`` of the consumer needs layout ``cols[b]``, and moving layout ``p``
    to ``q`` costs ``cost[p, q]`` seconds (summed over every tied edge with the same layouts)."""

    producer: int
    consumer: int
    rows: np.ndarray
    cols: np.ndarray
    cost: np.ndarray
    grad_sync: bool = False
    """Gradient → parameter layout: overlaps backward compute instead of adding to the step."""
    last_share: float = 0.0
    """The share of ``cost`` that is the sync of the gradient ready last (that edge is never merged)."""
    latency_codes: np.ndarray | None = None
    """Per (p, q) as ``cost``, the collective (``LATENCY_KINDS`` code) whose latency is not in ``cost`` but paid
    once by the group (``ShardingProblem.latency_groups``), -1 where none: of a parameter's edge, the move's
    leading all-gather; of a gradient's, its one reduction. None when no pair has one."""
    groups: dict = field(default_factory=dict)
    """(group, dtype gathered in or None for a gradient, real ops its consumer stands for: folded weights) of each
    parameter the edge moves or syncs the gradient of (one, or one per tied layer); a dict for its order."""
    phase: str = "forward"
    """With ``latency_codes``: the phase the edge's move runs in, "forward", "backward" or "grad_sync"."""

    def matrix(self) -> np.ndarray:
        """The cost per (producer strategy, consumer strategy) pair."""
        return self.cost[np.ix_(self.rows, self.cols)]


@dataclass(kw_only=True)
class ShardingProblem:
    decisions: list[Decision]
    edges: dict[tuple, Edge]
    """Keyed by (producer decision, consumer decision, layout maps)."""
    decision_of: dict[fx.Node, int]
    output_of: dict[fx.Node, object] = field(default_factory=dict)
    """For nodes that are not representatives: a function strategy index → output placements."""
    strategy_of: dict[fx.Node, object] = field(default_factory=dict)
    """For nodes folded into another node's decision (followers): strategy index → their own NodeStrategy."""
    memory_budget: float = float("inf")
    latency: dict[int, float] = field(default_factory=dict)
    """``LATENCY_KINDS`` code → seconds of one such collective's latency."""

    def latency_groups(self) -> dict[tuple, tuple[float, list]]:
        """(parameter group, dtype, phase, collective code, folded weight) → (seconds of latency it adds when any
        of its edges moves that way, those edge keys): what a mode gathers and reduces once per group
        (``strategies.boundary.made_per_group``: graph mode's gather and gradient buckets, eager mode's flat
        groups) pays one latency per group, phase and collective."""
        groups: dict[tuple, tuple[float, list]] = {}
        for key, edge in self.edges.items():
            if edge.latency_codes is None:
                continue
            for code in np.unique(edge.latency_codes[edge.latency_codes >= 0]).tolist():
                for group, dtype, weight in edge.groups:
                    groups.setdefault((group, dtype, edge.phase, code, weight), (self.latency[code] * weight, []))
                    groups[(group, dtype, edge.phase, code, weight)][1].append(key)
        return groups

    def node_strategy(self, node: fx.Node, choice: int):
        """The strategy ``node`` runs with when its decision takes strategy ``choice``."""
        getter = self.strategy_of.get(node)
        if getter is not None:
            return getter(choice)
        return self.decisions[self.decision_of[node]].strategies[choice]

    def node_output(self, node: fx.Node, choice: int):
        """Output placements of ``node`` when its decision takes strategy ``choice``."""
        getter = self.output_of.get(node)
        if getter is not None:
            return getter(choice)
        return self.decisions[self.decision_of[node]].strategies[choice].output

    def size(self) -> tuple[int, int]:
        """(choice variables, edge variables)."""
        return (sum(len(d.strategies) for d in self.decisions), sum(e.cost.size for e in self.edges.values()))


LATENCY_KINDS = ("all_gather", "all_reduce", "reduce_scatter")
"""Collectives whose latency a parameter group pays once (``ShardingProblem.latency_groups``)."""


def latency_code(kind: str, axis: int) -> int:
    """The code of a ``kind`` collective on mesh axis ``axis`` (``Edge.latency_codes``)."""
    return axis * len(LATENCY_KINDS) + LATENCY_KINDS.index(kind)


class ReshardTable:
    """Resharding time between pairs of placements, as ``latency + per_byte * nbytes``, each pair priced on first
    use (a 3-D mesh sees thousands of layouts; an edge needs only its producer's and consumer's).

    Placements are interned to small integers so an edge's cost matrix is a grid of cached pairs. A move whose
    latency its parameter's group pays in ``mode`` (``boundary.made_per_group``) leaves it out (``apart``,
    ``ShardingProblem.latency_groups``): "gather", a parameter's move's leading all-gather; "reduce", a
    gradient's sync that is one reduction."""

    APART = {"gather": 0, "reduce": 2}
    """``apart`` → index of (latency left out, its collective's code) in a pair's ``apart_coefficients``."""

    def __init__(self, cost: CostModel, mode: str):
        self.cost, self.mode = cost, mode
        self.ids: dict[tuple, int] = {}
        self.placements: list = []
        self.pairs: dict[tuple[int, int], tuple[float, float]] = {}
        self.apart_pairs: dict[tuple[int, int], tuple[float, int, float, int]] = {}

    def index(self, placements) -> int:
        key = tuple(placements) if placements is not None else None
        if key not in self.ids:
            self.ids[key] = len(self.placements)
            self.placements.append(key)
        return self.ids[key]

    def coefficients(self, i: int, j: int) -> tuple[float, float]:
        """(latency, seconds per global byte) of the move from layout ``i`` to layout ``j``."""
        if (i, j) not in self.pairs:
            source, target = self.placements[i], self.placements[j]
            same = source is None or target is None or source == target
            self.pairs[i, j] = (0.0, 0.0) if same else self.cost.reshard_coefficients(source, target)
        return self.pairs[i, j]

    def apart_coefficients(self, i: int, j: int) -> tuple[float, int, float, int]:
        """(latency of a leading all-gather, its code or -1, latency of the one reduction the move is, its code or
        -1), counting only collectives the mode makes per group, of the move from layout ``i`` to layout ``j``."""
        if (i, j) not in self.apart_pairs:
            source, target = self.placements[i], self.placements[j]
            moves = [] if source is None or target is None or source == target \
                else self.cost.moves(source, target, 1 << 30)
            grouped = moves and boundary.made_per_group(self.mode, moves[0].kind, moves[0].axis, source, target)
            gather = moves[0] if grouped and moves[0].kind == "all_gather" else None
            reduce = moves[0] if grouped and len(moves) == 1 and moves[0].kind != "all_gather" else None
            self.apart_pairs[i, j] = (*self._apart(gather), *self._apart(reduce))
        return self.apart_pairs[i, j]

    def _apart(self, move) -> tuple[float, int]:
        if move is None:
            return 0.0, -1
        return self.cost.collective_coefficients(move.kind, move.axis)[0], latency_code(move.kind, move.axis)

    def matrix(self, rows: np.ndarray, cols: np.ndarray, nbytes: int,
               apart: str | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Seconds to move ``nbytes`` from each layout of ``rows`` to each of ``cols``, without the latency
        ``apart`` names, and the code of the collective whose latency that leaves out of each move (-1: none;
        None when no move leaves one out)."""
        if nbytes == 0:
            return np.zeros((len(rows), len(cols))), None
        grid = np.array([[self.coefficients(i, j) for j in cols] for i in rows]).reshape(len(rows), len(cols), 2)
        if not apart:
            return grid[..., 0] + grid[..., 1] * nbytes, None
        pairs = np.array([[self.apart_coefficients(i, j) for j in cols] for i in rows]).reshape(len(rows), len(cols), 4)
        codes = pairs[..., self.APART[apart] + 1].astype(int)
        seconds = grid[..., 0] - pairs[..., self.APART[apart]] + grid[..., 1] * nbytes
        return seconds, codes if (codes >= 0).any() else None


class ProblemTooLarge(Exception):
    """Building stopped once the edge variables passed the limit: the exact search is out of reach, and pricing
    the rest of the problem would only cost time."""

    def __init__(self, edge_variables: int):
        super().__init__(f"more than {edge_variables:,} edge variables")
        self.edge_variables = edge_variables


class _Builder:
    def __init__(self, program: CapturedProgram, space: StrategySpace, cost: CostModel, arrival, weights: dict,
                 max_edge_variables: float, recomputed: set, compute_runs: dict, mode: str):
        self.program, self.space, self.cost, self.arrival = program, space, cost, arrival
        self.weights, self.compute_runs = weights, compute_runs
        self.max_edge_variables, self.edge_variables = max_edge_variables, 0
        self.tied = find_repeated_layers(program)
        self.problem = ShardingProblem(decisions=[], edges={}, decision_of={})
        self.table = ReshardTable(cost, mode)
        self.followers: set[fx.Node] = set()
        self.id_cache: dict = {}
        self.matrix_cache: dict = {}
        self.copies = [pricing.memory_copies(program, recomputed, phase, backward_frees=mode != "graph")
                       for phase in pricing.PEAK_PHASES]
        self.params = set(program.param_nodes.values())
        self.group_of = {program.param_nodes[name]: group
                         for name, group in param_gathers.gather_groups(program.param_nodes).items()}
        self.flops: dict[fx.Node, float] = {}

    def build(self) -> ShardingProblem:
        self.problem.latency = {latency_code(kind, axis): self.cost.collective_coefficients(kind, axis)[0]
                                for kind in LATENCY_KINDS for axis in range(len(self.cost.mesh_shape))}
        for node in self.program.graph.graph.nodes:
            if node in self.space.candidates:
                self._assign(node)
        for node in self.program.graph.graph.nodes:
            if node in self.space.candidates and node.op == "call_function" and node.target is not operator.getitem:
                self._input_edges(node)
        self._gradient_edges()
        self._tangent_edges()
        return self.problem

    # decisions --------------------------------------------------------------------------------------------------
    def _assign(self, node: fx.Node) -> None:
        decision_of = self.problem.decision_of
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in decision_of:
            source, index = node.args
            decision_of[node] = decision_of[source]
            self.problem.output_of[node] = lambda a, s=source, i=index: self.problem.node_output(s, a)[i]
            self._add_output_memory(self.problem.decisions[decision_of[node]], node)
            return
        if self._try_follow(node):
            return
        rep = self.tied.get(node)
        if rep is not None and rep in decision_of and self.space.candidates[rep] == self.space.candidates[node]:
            decision = self.problem.decisions[decision_of[rep]]
            decision_of[node] = decision_of[rep]
            decision.members += 1
            self._add_cost(decision, node, self._node_cost(node, decision.strategies))
            decision.memory += self._node_memory(node, decision.strategies)
            if rep in self.problem.output_of:
                self.problem.output_of[node] = self.problem.output_of[rep]
            return
        strategies = self.space.candidates[node]
        decision_of[node] = len(self.problem.decisions)
        decision = Decision(node=node, strategies=strategies, cost=np.zeros(len(strategies)),
                            backward_cost=np.zeros(len(strategies)), memory=self._node_memory(node, strategies))
        self._add_cost(decision, node, self._node_cost(node, strategies))
        self.problem.decisions.append(decision)

    def _add_cost(self, decision: Decision, node: fx.Node, seconds: np.ndarray) -> None:
        decision.cost += seconds
        if node.op == "call_function" and self.program.is_backward(node):
            decision.backward_cost += seconds

    def _try_follow(self, node: fx.Node) -> bool:
        """Fold a single-input op into its producer's decision when, for every producer strategy, one of its
        own strategies takes that layout as is (element-wise ops, views). Alpa calls this strategy following."""
        if node.op != "call_function" or len(node.all_input_nodes) != 1:
            return False
        producer = node.all_input_nodes[0]
        if producer not in self.problem.decision_of:
            return False
        own = self.space.candidates[node]
        decision = self.problem.decisions[self.problem.decision_of[producer]]
        by_input = {}
        for b, strategy in enumerate(own):
            by_input.setdefault(strategy.inputs[0], b)
        follow = [by_input.get(self.problem.node_output(producer, a)) for a in range(len(decision.strategies))]
        if any(b is None for b in follow):
            return False
        self.problem.decision_of[node] = self.problem.decision_of[producer]
        self.problem.strategy_of[node] = lambda a, own=own, follow=follow: own[follow[a]]
        self.problem.output_of[node] = lambda a, own=own, follow=follow: own[follow[a]].output
        self.followers.add(node)
        self._add_cost(decision, node, self._node_cost(node, own)[follow])
        decision.memory += self._node_memory(node, own)[:, follow]
        return True

    def _node_cost(self, node: fx.Node, strategies) -> np.ndarray:
        return self.weights.get(node, 1) * self._unweighted_cost(node, strategies)

    def _unweighted_cost(self, node: fx.Node, strategies) -> np.ndarray:
        if node.op == "placeholder":
            if node in self.program.input_nodes.values():
                value = node.meta["val"]
                return np.array([self.reshard(self.arrival(node), s.output, nbytes(value)) for s in strategies])
            if node in self.params:  # the optimizer step on the shard this layout keeps
                return np.array([pricing.optimizer_seconds(pricing.local_nbytes(node.meta["val"], s.output, self.cost),
                                                           1, self.cost) for s in strategies])
            return np.zeros(len(strategies))
        return self.compute_runs.get(node, 1) * np.array([self._compute(node, s) for s in strategies])

    def _compute(self, node: fx.Node, strategy) -> float:
        if node not in self.flops:
            self.flops[node] = node_flops(node)
        return pricing.compute_seconds(node, self.flops[node], strategy.inputs, strategy.output, self.cost)

    def _node_memory(self, node: fx.Node, strategies) -> np.ndarray:
        """Bytes of ``node``'s copies per phase (rows) in the layout of each strategy (columns)."""
        return self._memory(node, [s.output for s in strategies])

    def _add_output_memory(self, decision: Decision, node: fx.Node) -> None:
        """The memory of one output of a multi-output op (a saved mean of a layer norm), in the layout each
        strategy of its op's decision gives it."""
        output = self.problem.node_output
        decision.memory += self._memory(node, [output(node, a) for a in range(len(decision.strategies))])

    def _memory(self, node: fx.Node, layouts: list) -> np.ndarray:
        copies = np.array([phase.get(node, 0) for phase in self.copies], dtype=float) * self.weights.get(node, 1)
        if not copies.any():
            return np.zeros((len(copies), len(layouts)))
        value = node.meta.get("val")
        return np.outer(copies, [pricing.local_nbytes(value, layout, self.cost) for layout in layouts])

    # edges ------------------------------------------------------------------------------------------------------
    def reshard(self, source, target, nbytes: int) -> float:
        """Seconds to move ``nbytes`` (global) from ``source`` to ``target`` placements."""
        return pricing.reshard_seconds(source, target, nbytes, self.cost)

    def _output_ids(self, node: fx.Node) -> np.ndarray:
        """Placement ids of ``node``'s output under each strategy of its decision (cached per candidate list)."""
        decision = self.problem.decisions[self.problem.decision_of[node]]
        plain = node not in self.problem.output_of  # its own decision: outputs are its candidate list's
        key = ("out", id(decision.strategies)) if plain else ("node", node)
        if key not in self.id_cache:
            outputs = [self.problem.node_output(node, a) for a in range(len(decision.strategies))]
            self.id_cache[key] = np.array([self.table.index(p) for p in outputs])
        return self.id_cache[key]

    def _wanted_ids(self, strategies, wanted, tag) -> np.ndarray:
        key = ("in", id(strategies), tag)
        if key not in self.id_cache:
            self.id_cache[key] = np.array([self.table.index(wanted(b)) for b in range(len(strategies))])
        return self.id_cache[key]

    def _gathered_root(self, producer: fx.Node) -> fx.Node | None:
        """The parameter (or its cast) ``producer`` is a view of, whose gathers its group makes together."""
        return param_gathers.gathered_root(producer, self.params.__contains__)

    def _apart(self, producer: fx.Node, consumer: fx.Node, grad_sync: bool, last: bool) -> tuple | None:
        """(``ReshardTable`` apart, (group, dtype)) when the edge's latency is paid by a parameter's group: a
        parameter's move to another decision (in the dtype it is gathered in, as each runtime groups them); a
        gradient's sync, but for the gradient ready last, which keeps its own (the bucket nothing follows).
        Which of their moves the group pays for is the table's to say."""
        if grad_sync:
            return None if last else ("reduce", (self.group_of[consumer], None))
        root = None if self.problem.decision_of[producer] == self.problem.decision_of[consumer] \
            else self._gathered_root(producer)
        if root is None:
            return None
        return "gather", (self.group_of[param_gathers.param_of(root)], root.meta["val"].dtype)

    def _add_edge(self, producer: fx.Node, consumer: fx.Node, wanted_ids: np.ndarray, nbytes: int,
                  grad_sync: bool = False, last: bool = False) -> None:
        du, dv = self.problem.decision_of[producer], self.problem.decision_of[consumer]
        out_ids = self._output_ids(producer)
        apart = self._apart(producer, consumer, grad_sync, last)
        left_out = apart and apart[0]
        key = (id(out_ids), id(wanted_ids), nbytes, left_out)
        if key not in self.matrix_cache:
            layouts_out, rows = np.unique(out_ids, return_inverse=True)
            layouts_in, cols = np.unique(wanted_ids, return_inverse=True)
            self.matrix_cache[key] = (rows, cols, *self.table.matrix(layouts_out, layouts_in, nbytes, left_out))
        rows, cols, cost, codes = self.matrix_cache[key]
        weight = self.weights.get(consumer, 1)
        cost = cost * weight
        if du == dv and not grad_sync:
            self.problem.decisions[du].cost += cost[rows, cols]
        elif cost.any() or codes is not None:
            edge_key = (du, dv, rows.tobytes(), cols.tobytes(), grad_sync, last)  # tied layers' edges share one
            edge = self.problem.edges.get(edge_key)
            if edge is None:
                self._count(cost.size)
                self.problem.edges[edge_key] = edge = Edge(
                    producer=du, consumer=dv, rows=rows, cols=cols, cost=cost, grad_sync=grad_sync,
                    last_share=1.0 / weight if last else 0.0)
            else:
                edge.cost = edge.cost + cost
            if codes is not None:
                if edge.latency_codes is None:  # its first move whose latency the group pays
                    edge.latency_codes = codes
                    edge.phase = "grad_sync" if grad_sync else "backward" if self.program.is_backward(consumer) \
                        else "forward"
                edge.groups[(*apart[1], weight)] = None

    def _count(self, variables: int) -> None:
        self.edge_variables += variables
        if self.edge_variables > self.max_edge_variables:
            raise ProblemTooLarge(self.edge_variables)

    def _input_edges(self, node: fx.Node) -> None:
        strategies = self.space.candidates[node]
        for position, producer in enumerate(node.all_input_nodes):
            if producer not in self.problem.decision_of or node in self.followers:
                continue
            wanted = self._wanted_ids(strategies, lambda b, p=position: strategies[b].inputs[p], position)
            self._add_edge(producer, node, wanted, nbytes(producer.meta.get("val")))

    def _gradient_edges(self) -> None:
        """One edge per gradient (parameter layouts). A reduction the mode makes per parameter group pays its
        latency with the group (``_apart``): graph mode's buckets, eager mode's flat groups (an approximation of
        graph mode's buckets, which are runs of the ready order cut by a size cap, and of their padding; the plan's
        estimate prices the buckets that run). The gradient ready last (of a folded layer: one of the real layers
        it stands for) keeps its own edge and latency."""
        order = self.program.grad_ready_order()
        for name in order:
            grad, param = self.program.grad_nodes[name], self.program.param_nodes[name]
            if grad in self.problem.decision_of and param in self.problem.decision_of:
                self._add_edge(grad, param, self._output_ids(param), nbytes(param.meta["val"]), grad_sync=True,
                               last=name == order[-1])

    def _tangent_edges(self) -> None:
        for tangent, index in self.program.tangent_nodes.items():
            output = self.program.output_nodes.get(index)
            if output in self.problem.decision_of and tangent in self.problem.decision_of:
                self._add_edge(output, tangent, self._output_ids(tangent), nbytes(tangent.meta["val"]))


def build_problem(program: CapturedProgram, space: StrategySpace, cost: CostModel, arrival,
                  memory_budget: float = float("inf"), weights: dict | None = None,
                  max_edge_variables: float = float("inf"), recomputed: set = frozenset(),
                  compute_runs: dict | None = None, mode: str = "eager") -> ShardingProblem:
    """``arrival(node)``: the placements a user input arrives in (each rank's slice: Shard(0) on every axis).
    ``weights``: how many real nodes a captured node stands for (folded layers; absent: 1).
    ``recomputed``: saved activations not counted in memory (their layers may recompute them).
    ``compute_runs``: how many times a step runs an op's compute (recomputed layers; absent: 1).
    ``mode``: the mode the plan runs in, which decides the parameter moves made once per parameter group
    (``strategies.boundary.made_per_group``).
    Raises ``ProblemTooLarge`` as soon as the problem has more than ``max_edge_variables`` edge variables."""
    problem = _Builder(program, space, cost, arrival, weights or {}, max_edge_variables, recomputed,
                       compute_runs or {}, mode).build()
    problem.memory_budget = memory_budget
    return problem
