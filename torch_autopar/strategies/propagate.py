"""Propagate placements through a captured graph with DTensor's per-op sharding rules.

Starting from seeded placements (parameters, inputs), every node gets the output placement DTensor's rule
chooses; where the rule asks for its inputs in another layout, a ``Redistribution`` is recorded (those are the
collectives a plan needs). Ops without a rule, or whose rule fails, are computed replicated and reported.
Must never insert anything into the graph: it only annotates.
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from torch_autopar import _compat
from torch_autopar.capture import CapturedProgram
from torch_autopar.capture.program import tensor_nbytes
from torch_autopar.strategies.placements import spec_for


@dataclass(frozen=True, slots=True)
class Redistribution:
    """Input ``arg_index`` of ``node`` (its position in ``node.all_input_nodes``; -1: ``node``'s own value, as
    it leaves the program or after it arrives) must move from ``source`` to ``target`` placements."""

    node: str
    arg_index: int
    source: tuple
    target: tuple
    global_nbytes: int
    backward: bool


@dataclass(kw_only=True)
class Sharding:
    """Result of propagation: a spec per node, the redistributions needed, and ops replicated for lack of rules."""

    specs: dict[fx.Node, object]
    redistributions: list[Redistribution] = field(default_factory=list)
    replicated_ops: Counter = field(default_factory=Counter)


class _Propagator:
    def __init__(self, program: CapturedProgram, mesh: DeviceMesh, seeds: dict):
        self.program, self.mesh, self.seeds = program, mesh, seeds
        self.result = Sharding(specs={})

    def run(self) -> Sharding:
        for node in self.program.graph.graph.nodes:
            if node.op in ("placeholder", "get_attr"):  # get_attr: a constant, replicated
                self._placeholder(node)
            elif node.op == "call_function":
                self.result.specs[node] = self._call(node)
        return self.result

    def _placeholder(self, node: fx.Node) -> None:
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            self.result.specs[node] = value
        elif node in self.seeds:
            self.result.specs[node] = spec_for(self.mesh, value, self.seeds[node])
        elif node in self.program.tangent_nodes:
            self.result.specs[node] = None  # resolved on first use, once its forward output has a spec
        else:
            self.result.specs[node] = spec_for(self.mesh, value, [Replicate()] * self.mesh.ndim)

    def _spec_of(self, node: fx.Node):
        spec = self.result.specs[node]
        if spec is None and node in self.program.tangent_nodes:
            output = self.program.output_nodes[self.program.tangent_nodes[node]]
            spec = spec_for(self.mesh, node.meta["val"], tangent_placements(self.result.specs[output].placements))
            self.result.specs[node] = spec
        return spec

    def _call(self, node: fx.Node):
        if node.target is operator.getitem:
            container = self._spec_of(node.args[0])
            return container[node.args[1]] if isinstance(container, (tuple, list)) else container
        map_arg = lambda a: self._spec_of(a) if isinstance(a, fx.Node) else a  # noqa: E731
        args = fx.node.map_aggregate(node.args, map_arg)
        kwargs = fx.node.map_aggregate(node.kwargs, map_arg)
        if isinstance(node.target, torch._ops.OpOverload) and _compat.has_sharding_rule(node.target):
            try:
                return self._apply_rule(node, args, kwargs)
            except Exception:  # a rule that cannot handle these shapes: replicate, which is always correct
                pass
        return self._replicate(node, args)

    def _apply_rule(self, node: fx.Node, args, kwargs):
        output = _compat.propagate_sharding(node.target, args, kwargs)
        if output.needs_redistribute and output.redistribute_schema is not None:
            wanted = output.redistribute_schema.args_schema
            for index, (have, want) in enumerate(zip(args, wanted)):
                self._record(node, index, have, getattr(want, "placements", None))
        return self._respec(node, output.output_spec)

    def _respec(self, node: fx.Node, rule_spec):
        """The rule's placements on this node's own shapes (a rule's tensor_meta may describe its input)."""
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            if not isinstance(rule_spec, _compat.DTensorSpec):
                raise AssertionError(f"rule for {node.format_node()} gave {rule_spec!r} for a tensor output")
            return spec_for(self.mesh, value, rule_spec.placements)
        if isinstance(value, (tuple, list)):
            specs = rule_spec if isinstance(rule_spec, (tuple, list)) else [rule_spec] * len(value)
            return tuple(spec_for(self.mesh, v, s.placements) if isinstance(v, torch.Tensor) and s is not None else None
                         for v, s in zip(value, specs))
        return rule_spec

    def _replicate(self, node: fx.Node, args):
        if node.all_input_nodes:  # factory ops (no tensor inputs) are replicated by nature, not for lack of a rule
            self.result.replicated_ops[str(node.target)] += 1
        replicate = tuple(Replicate() for _ in range(self.mesh.ndim))
        for index, have in enumerate(args):
            self._record(node, index, have, replicate)
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            return spec_for(self.mesh, value, replicate)
        if isinstance(value, (tuple, list)):
            return tuple(spec_for(self.mesh, v, replicate) if isinstance(v, torch.Tensor) else None for v in value)
        return None

    def _record(self, node: fx.Node, index: int, have, want) -> None:
        if not isinstance(have, _compat.DTensorSpec) or want is None or tuple(have.placements) == tuple(want):
            return
        source_node = node.all_input_nodes[0] if index >= len(node.args) else node.args[index]
        value = source_node.meta.get("val") if isinstance(source_node, fx.Node) else None
        position = node.all_input_nodes.index(source_node) if isinstance(source_node, fx.Node) else index
        self.result.redistributions.append(Redistribution(
            node=node.name, arg_index=position, source=tuple(have.placements), target=tuple(want),
            global_nbytes=tensor_nbytes(value), backward=self.program.is_backward(node)))


def tangent_placements(output_placements) -> tuple:
    """The layout of an output's gradient: as the output's, except that the gradient of a partial sum is
    replicated (what DTensor's backward of a redistribution hands back)."""
    return tuple(Replicate() if p.is_partial() else p for p in output_placements)


def propagate(program: CapturedProgram, mesh: DeviceMesh, seeds: dict) -> Sharding:
    """Placements for every node of ``program`` given ``seeds`` (node → placements per mesh axis), chosen as
    the sharded runtime's DTensor chooses them (``_compat.prefer_early_partial_reduction`` included)."""
    _compat.prefer_early_partial_reduction()
    return _Propagator(program, mesh, seeds).run()
