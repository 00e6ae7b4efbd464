"""Enumerate candidate strategies for every node of a captured graph from DTensor's op strategy registry.

A ``NodeStrategy`` is one way to run a node on the mesh: the placements of its output(s) and the placements it
needs for each tensor input. Leaves (parameters, buffers, user inputs, tangents) may take any placement that
shards each tensor dim at most once. Ops without a registered strategy, or whose strategy fails on these shapes,
get the single all-Replicate strategy and are reported. Identical nodes (same op, arguments and input
candidates) share one enumeration, which is what keeps repeated transformer layers cheap.
Must never estimate cost.
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from torch_autopar import _compat
from torch_autopar.capture import CapturedProgram
from torch_autopar.strategies.placements import tensor_meta

OpStrategy, OpSpec, TupleStrategy = _compat.strategy_types()


@dataclass(frozen=True, slots=True)
class NodeStrategy:
    output: tuple
    """Placements of the output (a tuple per mesh axis), or a tuple of those for multi-output ops (None entries
    for non-tensor outputs)."""
    inputs: tuple
    """Placements required for each tensor input node, in ``node.all_input_nodes`` order."""


@dataclass(kw_only=True)
class StrategySpace:
    candidates: dict[fx.Node, list[NodeStrategy]]
    replicated_ops: Counter = field(default_factory=Counter)


def leaf_placements(value: torch.Tensor, mesh_ndim: int, mesh_shape) -> list[tuple]:
    """All placements of a leaf tensor: Replicate or Shard(d) per axis (a dim may be split over several axes),
    only where every shard is non-empty."""
    options = [Replicate()] + [Shard(d) for d in range(value.ndim)]
    result = []
    for combo in itertools.product(options, repeat=mesh_ndim):
        pieces = [1] * value.ndim
        for axis, placement in enumerate(combo):
            if isinstance(placement, Shard):
                pieces[placement.dim] *= mesh_shape[axis]
        if all(value.shape[d] >= pieces[d] for d in range(value.ndim)):
            result.append(combo)
    return result


def _spec_placements(spec):
    return None if spec is None else tuple(spec.placements)


class _Enumerator:
    def __init__(self, program: CapturedProgram, mesh: DeviceMesh, leaf_filter, memo: dict):
        self.program, self.mesh, self.leaf_filter = program, mesh, leaf_filter
        self.space = StrategySpace(candidates={})
        self.op_strategy: dict[fx.Node, object] = {}
        self.cache: dict[tuple, tuple] = memo.setdefault("cache", {})
        """Keyed by content (op, arguments, input candidates): (strategies, op strategy, replicated for lack of a
        rule) for ops, (strategies, op strategy) for leaves."""
        self.tokens: dict[tuple, int] = memo.setdefault("tokens", {})
        self.seen: set[tuple] = set()

    def run(self) -> StrategySpace:
        for node in self.program.graph.graph.nodes:
            if node.op == "placeholder":
                self._leaf(node)
            elif node.op == "get_attr":  # a constant the forward creates (an empty tensor, a fill value)
                self._leaf(node, constant=True)
            elif node.op == "call_function":
                self._call(node)
        return self.space

    def _leaf(self, node: fx.Node, constant: bool = False) -> None:
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            return
        if constant:
            placements = [tuple(Replicate() for _ in range(self.mesh.ndim))]
        else:
            placements = self.leaf_filter(node, leaf_placements(value, self.mesh.ndim, tuple(self.mesh.shape)))
        key = ("leaf", tuple(value.shape), value.dtype, tuple(placements))
        if key not in self.cache:  # equal leaves share one candidate list (lets the search tie them)
            meta = tensor_meta(value)
            self.cache[key] = ([NodeStrategy(output=p, inputs=()) for p in placements],
                               OpStrategy([OpSpec(_compat.DTensorSpec(self.mesh, p, meta)) for p in placements]))
        self.space.candidates[node], self.op_strategy[node] = self.cache[key]

    def _call(self, node: fx.Node) -> None:
        if node.target is operator.getitem:
            return self._getitem(node)
        key = self._cache_key(node)
        if key not in self.cache:
            self.cache[key] = self._enumerate(node)
        strategies, op_strategy, replicated = self.cache[key]
        if replicated and key not in self.seen:  # reported once per distinct op, as the first enumeration did
            self.space.replicated_ops[str(node.target)] += 1
        self.seen.add(key)
        self.space.candidates[node] = strategies
        self.op_strategy[node] = op_strategy

    def _cache_key(self, node: fx.Node):
        inputs = tuple(self._token(a) for a in node.all_input_nodes)
        shape = lambda a: tuple(a.meta["val"].shape) if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) else None  # noqa: E731
        args = fx.node.map_aggregate(node.args, lambda a: ("node", shape(a)) if isinstance(a, fx.Node) else a)
        kwargs = fx.node.map_aggregate(node.kwargs, lambda a: ("node", shape(a)) if isinstance(a, fx.Node) else a)
        value = node.meta.get("val")
        out = tuple(value.shape) if isinstance(value, torch.Tensor) else None
        return (node.target, repr(args), repr(kwargs), inputs, out)

    def _token(self, node: fx.Node) -> int:
        """A small integer naming the content of ``node``'s candidate list (equal lists, equal tokens)."""
        candidates = self.space.candidates.get(node)
        if candidates is None:
            return -1
        key = tuple(repr(s.output) for s in candidates)
        return self.tokens.setdefault(key, len(self.tokens))

    def _getitem(self, node: fx.Node) -> None:
        source, index = node.args
        parents = self.space.candidates.get(source)
        if parents is None:
            return
        strategies = [NodeStrategy(output=s.output[index], inputs=(s.output[index],)) for s in parents]
        # one strategy per parent strategy, in the same order: the search ties them 1:1
        self.space.candidates[node] = strategies
        value = node.meta["val"]
        self.op_strategy[node] = OpStrategy([OpSpec(_compat.DTensorSpec(self.mesh, s.output, tensor_meta(value)))
                                             for s in strategies]) if isinstance(value, torch.Tensor) else None

    def _enumerate(self, node: fx.Node):
        value = node.meta.get("val")
        try:
            found = self._from_dtensor(node, value)
        except Exception:  # a registered rule that cannot handle these shapes: replicate, always correct
            found = None
        replicated = not found and bool(node.all_input_nodes)
        if not found:
            found = [self._replicated(node, value)]
        return found, self._as_op_strategy(found, value), replicated

    def _from_dtensor(self, node: fx.Node, value):
        if not isinstance(node.target, torch._ops.OpOverload):
            return None
        to_schema = lambda a: self.op_strategy.get(a) if isinstance(a, fx.Node) else a  # noqa: E731
        args = fx.node.map_aggregate(node.args, to_schema)
        args = tuple(TupleStrategy(tuple(a)) if isinstance(a, list) and a and all(isinstance(e, OpStrategy) for e in a)
                     else a for a in args)
        kwargs = fx.node.map_aggregate(node.kwargs, to_schema)
        if any(a is None for a in args if not isinstance(a, (int, float, bool, str, list, tuple, torch.dtype))) and \
                any(self.op_strategy.get(a) is None for a in node.all_input_nodes):
            return None
        output_meta = tensor_meta(value) if isinstance(value, torch.Tensor) else (
            [(tensor_meta(v) if isinstance(v, torch.Tensor) else None) for v in value] if isinstance(value, (tuple, list)) else None)
        result = _compat.op_strategies(node.target, args, kwargs, self.mesh, output_meta)
        if not isinstance(result, OpStrategy):
            return None
        return _dedupe([self._node_strategy(node, spec) for spec in result.strategies])

    def _node_strategy(self, node: fx.Node, spec) -> NodeStrategy:
        outputs = spec.output_specs
        output = tuple(_spec_placements(s) for s in outputs) if isinstance(outputs, (tuple, list)) else _spec_placements(outputs)
        tensor_args = [a for a in _flat_args(node) if isinstance(a, fx.Node)]
        wanted = list(spec.input_specs) if spec.input_specs is not None else [outputs] * len(tensor_args)
        by_node = {}
        for arg, want in zip(tensor_args, wanted):
            by_node.setdefault(arg, _spec_placements(want))
        inputs = tuple(by_node.get(a, tuple(Replicate() for _ in range(self.mesh.ndim))) for a in node.all_input_nodes)
        return NodeStrategy(output=output, inputs=inputs)

    def _replicated(self, node: fx.Node, value) -> NodeStrategy:
        replicate = tuple(Replicate() for _ in range(self.mesh.ndim))
        if isinstance(value, (tuple, list)):
            output = tuple(replicate if isinstance(v, torch.Tensor) else None for v in value)
        else:
            output = replicate
        return NodeStrategy(output=output, inputs=tuple(replicate for _ in node.all_input_nodes))

    def _as_op_strategy(self, strategies: list[NodeStrategy], value):
        if not isinstance(value, torch.Tensor):
            return None
        meta = tensor_meta(value)
        return OpStrategy([OpSpec(_compat.DTensorSpec(self.mesh, s.output, meta)) for s in strategies])


def _flat_args(node: fx.Node) -> list:
    flat = []
    for arg in list(node.args) + list(node.kwargs.values()):
        if isinstance(arg, (list, tuple)):
            flat.extend(arg)
        else:
            flat.append(arg)
    return flat


def _is_exotic(placement) -> bool:
    """Interleaved shards (from views of sharded dims) and partial values reduced by anything but a sum."""
    name = type(placement).__name__
    return name == "_StridedShard" or placement.is_partial() and getattr(placement, "reduce_op", "sum") != "sum"


def _has_exotic(strategy: NodeStrategy) -> bool:
    def check(placements):
        if placements is None:
            return False
        if placements and (isinstance(placements[0], tuple) or placements[0] is None):
            return any(check(p) for p in placements)
        return any(_is_exotic(p) for p in placements)

    return check(strategy.output) or any(check(p) for p in strategy.inputs)


def _dedupe(strategies: list[NodeStrategy]) -> list[NodeStrategy]:
    """Unique strategies, without exotic layouts (interleaved shards, partial averages/maxima: valid, but their
    sum-partial or plain counterparts cost the same to produce and resolve) unless nothing else is left."""
    plain = [s for s in strategies if not _has_exotic(s)]
    strategies = plain or strategies
    seen, result = set(), []
    for strategy in strategies:
        key = (repr(strategy.output), repr(strategy.inputs))
        if key not in seen:
            seen.add(key)
            result.append(strategy)
    return result


def enumerate_strategies(program: CapturedProgram, mesh: DeviceMesh, leaf_filter=None,
                         memo: dict | None = None) -> StrategySpace:
    """Candidate strategies for every node; ``leaf_filter(node, placements) -> placements`` restricts leaves
    (this is how named strategies such as data_parallel restrict the search). ``memo``: a dict kept between
    calls on one program and mesh, so that calls under different restrictions share the enumerations of
    identical nodes with identical input candidates."""
    with _compat.without_dtensor_redistribute_costs():
        return _Enumerator(program, mesh, leaf_filter or (lambda node, placements: placements),
                           {} if memo is None else memo).run()
