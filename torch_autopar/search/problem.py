"""Build the sharding problem: decisions (tied node groups), their strategy costs and memory, edge costs.

A decision is a representative node plus the nodes tied to it (repeated layers, ``getitem`` of a multi-output
node). Choosing strategy ``a`` for a decision places every member accordingly. Costs are seconds from
``CostModel``: compute of each strategy, resharding between a producer's output and the placement a consumer's
strategy needs (summed over all tied edges), gradient synchronisation (gradient placement → parameter placement)
and tangent layout (forward output → its tangent). Must never solve anything.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx

from torch_autopar import _compat
from torch_autopar.capture import CapturedProgram
from torch_autopar.capture.layers import find_repeated_layers
from torch_autopar.cost import CostModel, collectives_for, is_sharded
from torch_autopar.strategies.enumerate import StrategySpace

OPTIMIZER_COPIES = 4
"""Bytes kept per parameter byte: the parameter, its gradient and Adam's two moments."""


@dataclass(kw_only=True)
class Decision:
    node: fx.Node
    strategies: list
    members: int = 1
    cost: np.ndarray = None
    memory: np.ndarray = None


@dataclass(kw_only=True)
class ShardingProblem:
    decisions: list[Decision]
    edges: dict[tuple[int, int], np.ndarray]
    """(producer decision, consumer decision) → cost matrix [producer strategy, consumer strategy] in seconds."""
    decision_of: dict[fx.Node, int]
    output_of: dict[fx.Node, object] = field(default_factory=dict)
    """For nodes that are not representatives: a function strategy index → output placements."""
    memory_budget: float = float("inf")

    def node_output(self, node: fx.Node, choice: int):
        """Output placements of ``node`` when its decision takes strategy ``choice``."""
        getter = self.output_of.get(node)
        if getter is not None:
            return getter(choice)
        return self.decisions[self.decision_of[node]].strategies[choice].output

    def size(self) -> tuple[int, int]:
        return (sum(len(d.strategies) for d in self.decisions), sum(m.size for m in self.edges.values()))


class _Builder:
    def __init__(self, program: CapturedProgram, space: StrategySpace, cost: CostModel, arrival):
        self.program, self.space, self.cost, self.arrival = program, space, cost, arrival
        self.tied = find_repeated_layers(program)
        self.problem = ShardingProblem(decisions=[], edges={}, decision_of={})
        self.reshard_cache: dict = {}
        self.saved_for_backward = self._saved_for_backward()

    def build(self) -> ShardingProblem:
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
            return
        rep = self.tied.get(node)
        if rep is not None and rep in decision_of and self.space.candidates[rep] == self.space.candidates[node]:
            decision = self.problem.decisions[decision_of[rep]]
            decision_of[node] = decision_of[rep]
            decision.members += 1
            decision.cost += self._node_cost(node, decision.strategies)
            decision.memory += self._node_memory(node, decision.strategies)
            if rep in self.problem.output_of:
                self.problem.output_of[node] = self.problem.output_of[rep]
            return
        strategies = self.space.candidates[node]
        decision_of[node] = len(self.problem.decisions)
        self.problem.decisions.append(Decision(node=node, strategies=strategies,
                                               cost=self._node_cost(node, strategies),
                                               memory=self._node_memory(node, strategies)))

    def _node_cost(self, node: fx.Node, strategies) -> np.ndarray:
        if node.op == "placeholder":
            if node in self.program.input_nodes.values():
                value = node.meta["val"]
                return np.array([self.reshard(self.arrival(node), s.output, _nbytes(value)) for s in strategies])
            return np.zeros(len(strategies))
        return np.array([self._compute(node, s) for s in strategies])

    def _compute(self, node: fx.Node, strategy) -> float:
        if _is_free(node):
            return 0.0
        flops = _node_flops(node)
        split = 1
        for axis in range(len(self.cost.mesh_shape)):
            if any(is_sharded(p[axis]) for p in strategy.inputs if p is not None):
                split *= self.cost.mesh_shape[axis]
        accessed = sum(_nbytes(a.meta.get("val")) for a in node.all_input_nodes) + _nbytes(node.meta.get("val"))
        value = node.meta.get("val")
        dtype = str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else "float32"
        return self.cost.compute_time(flops / split, accessed / split, dtype)

    def _node_memory(self, node: fx.Node, strategies) -> np.ndarray:
        value = node.meta.get("val")
        if node in self.program.param_nodes.values():
            factor = OPTIMIZER_COPIES
        elif node in self.saved_for_backward:
            factor = 1
        else:
            return np.zeros(len(strategies))
        return np.array([factor * _nbytes(value) / self.cost.shard_factor(s.output) for s in strategies])

    def _saved_for_backward(self) -> set:
        saved = set()
        for node in self.program.graph.graph.nodes:
            if node.op == "call_function" and not self.program.is_backward(node) and not _is_free(node):
                if any(self.program.is_backward(user) for user in node.users):
                    saved.add(node)
        return saved

    # edges ------------------------------------------------------------------------------------------------------
    def reshard(self, source, target, nbytes: int) -> float:
        if source is None or target is None or tuple(source) == tuple(target):
            return 0.0
        key = (tuple(source), tuple(target), nbytes)
        if key not in self.reshard_cache:
            moves = collectives_for(source, target, nbytes, self.cost.mesh_shape)
            self.reshard_cache[key] = sum(self.cost.collective_time(m.kind, m.axis, m.nbytes) for m in moves)
        return self.reshard_cache[key]

    def _add_edge(self, producer: fx.Node, consumer: fx.Node, wanted, nbytes: int) -> None:
        du, dv = self.problem.decision_of[producer], self.problem.decision_of[consumer]
        ku, kv = len(self.problem.decisions[du].strategies), len(self.problem.decisions[dv].strategies)
        outputs = [self.problem.node_output(producer, a) for a in range(ku)]
        matrix = np.array([[self.reshard(outputs[a], wanted(b), nbytes) for b in range(kv)] for a in range(ku)])
        if du == dv:
            self.problem.decisions[du].cost += np.diag(matrix)
        elif matrix.any():
            key = (du, dv)
            self.problem.edges[key] = self.problem.edges[key] + matrix if key in self.problem.edges else matrix

    def _input_edges(self, node: fx.Node) -> None:
        strategies = self.space.candidates[node]
        for position, producer in enumerate(node.all_input_nodes):
            if producer not in self.problem.decision_of:
                continue
            wanted = lambda b, p=position: strategies[b].inputs[p]  # noqa: E731
            self._add_edge(producer, node, wanted, _nbytes(producer.meta.get("val")))

    def _gradient_edges(self) -> None:
        for name, grad in self.program.grad_nodes.items():
            param = self.program.param_nodes[name]
            if grad in self.problem.decision_of and param in self.problem.decision_of:
                wanted = lambda b, p=param: self.problem.node_output(p, b)  # noqa: E731
                self._add_edge(grad, param, wanted, _nbytes(param.meta["val"]))

    def _tangent_edges(self) -> None:
        for tangent, index in self.program.tangent_nodes.items():
            output = self.program.output_nodes.get(index)
            if output in self.problem.decision_of and tangent in self.problem.decision_of:
                wanted = lambda b, t=tangent: self.problem.node_output(t, b)  # noqa: E731
                self._add_edge(output, tangent, wanted, _nbytes(tangent.meta["val"]))


def build_problem(program: CapturedProgram, space: StrategySpace, cost: CostModel, arrival,
                  memory_budget: float = float("inf")) -> ShardingProblem:
    """``arrival(node)``: the placements a user input arrives in (each rank's slice: Shard(0) on every axis)."""
    problem = _Builder(program, space, cost, arrival).build()
    problem.memory_budget = memory_budget
    return problem


_VIEW_LIKE = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "detach", "alias", "unsqueeze", "squeeze",
              "reshape", "slice", "select", "split", "getitem", "split_with_sizes"}


def _is_free(node: fx.Node) -> bool:
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    return name in _VIEW_LIKE


def _nbytes(value) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _node_flops(node: fx.Node) -> float:
    if not isinstance(node.target, torch._ops.OpOverload):
        return 0.0
    values = lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a  # noqa: E731
    args = fx.node.map_aggregate(node.args, values)
    kwargs = fx.node.map_aggregate(node.kwargs, values)
    return float(_compat.node_flops(node.target, args, kwargs, node.meta.get("val")))
