"""Turn a solved problem back into per-node placements and the redistributions they imply.

Must never re-solve or change the choice.
"""

from __future__ import annotations

import operator
from collections import Counter

import torch
import torch.fx as fx

from torch_autopar.capture import CapturedProgram
from torch_autopar.capture.program import tensor_nbytes
from torch_autopar.search.problem import ShardingProblem
from torch_autopar.strategies import Redistribution, Sharding
from torch_autopar.strategies.placements import spec_for


def _spec(mesh, node: fx.Node, placements):
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return spec_for(mesh, value, placements)
    if isinstance(value, (tuple, list)) and isinstance(placements, tuple):
        return tuple(_spec_of_value(mesh, v, p) for v, p in zip(value, placements))
    return value


def _spec_of_value(mesh, value, placements):
    if isinstance(value, torch.Tensor) and placements is not None:
        return spec_for(mesh, value, placements)
    return None


def _nbytes(node: fx.Node) -> int:
    return tensor_nbytes(node.meta.get("val"))


def to_sharding(program: CapturedProgram, problem: ShardingProblem, choice: list[int], mesh,
                replicated_ops: Counter, arrival) -> Sharding:
    """Specs for every decided node and a Redistribution wherever a consumer needs another layout, including
    user inputs that the plan wants in another layout than the one they arrive in (``arrival(node)``)."""
    sharding = Sharding(specs={}, replicated_ops=Counter(replicated_ops))
    chosen = lambda node: choice[problem.decision_of[node]]  # noqa: E731
    for node in program.graph.graph.nodes:
        if node in problem.decision_of:
            sharding.specs[node] = _spec(mesh, node, problem.node_output(node, chosen(node)))
    for node in program.graph.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem or node not in problem.decision_of:
            continue
        strategy = problem.node_strategy(node, chosen(node))
        for position, producer in enumerate(node.all_input_nodes):
            if producer in problem.decision_of:
                _record(sharding, program, node, position, problem.node_output(producer, chosen(producer)),
                        strategy.inputs[position], _nbytes(producer))
    for node in program.input_nodes.values():
        if node in problem.decision_of:
            _record(sharding, program, node, 0, arrival(node), problem.node_output(node, chosen(node)), _nbytes(node),
                    backward=False)
    for tangent, index in program.tangent_nodes.items():
        output = program.output_nodes.get(index)
        if output in problem.decision_of and tangent in problem.decision_of:
            _record(sharding, program, tangent, 0, problem.node_output(output, chosen(output)),
                    problem.node_output(tangent, chosen(tangent)), _nbytes(tangent))
    return sharding


def _record(sharding: Sharding, program: CapturedProgram, node: fx.Node, position: int, source, target,
            nbytes: int, backward: bool | None = None) -> None:
    if source is None or target is None or tuple(source) == tuple(target):
        return
    if backward is None:
        backward = node.op == "placeholder" or program.is_backward(node)
    sharding.redistributions.append(Redistribution(
        node=node.name, arg_index=position, source=tuple(source), target=tuple(target), global_nbytes=nbytes,
        backward=backward))
