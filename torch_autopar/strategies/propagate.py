"""Propagate placements through a captured graph with DTensor's per-op sharding rules.

Starting from seeded placements (parameters, inputs), every node gets the output placement DTensor's rule
chooses; where the rule asks for its inputs in another layout, a ``Redistribution`` is recorded (those are the
collectives a plan needs). Ops without a rule, or whose rule fails, are computed replicated and reported.
Must never insert anything into the graph: it only annotates.
"""

from __future__ import annotations

import math
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
from torch_autopar.strategies import boundary
from torch_autopar.strategies.placements import parse_placements, spec_for


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


@dataclass(frozen=True, kw_only=True)
class ModulePins:
    """Layouts forced at submodule boundaries (eager mode's hooks): ``scopes`` gives each forward node the
    submodules it ran in (``capture.scopes``); a value entering module ``path`` is moved to
    ``entering[(path, value)]``, one leaving it to ``leaving[(path, value)]`` (absent: it stays as it is)."""

    scopes: dict
    entering: dict
    leaving: dict

    def crossings(self, value: fx.Node, user: fx.Node) -> list[tuple[str, tuple | None]]:
        """The boundaries ``value`` crosses on its way to ``user``, in order: out of the modules it was made in
        that ``user`` is not in (innermost first), then into those of ``user`` it was not made in."""
        made, used = self.scopes.get(value, ()), self.scopes.get(user, ())
        shared = 0
        while shared < min(len(made), len(used)) and made[shared] == used[shared]:
            shared += 1
        out = [(path, self.leaving.get((path, value))) for path in reversed(made[shared:])]
        return out + [(path, self.entering.get((path, value))) for path in used[shared:]]


@dataclass(kw_only=True)
class Sharding:
    """Result of propagation: a spec per node, the redistributions needed, and ops replicated for lack of rules."""

    specs: dict[fx.Node, object]
    redistributions: list[Redistribution] = field(default_factory=list)
    replicated_ops: Counter = field(default_factory=Counter)
    returned: dict = field(default_factory=dict)
    """Forward output node → its spec as the model returns it, where module boundaries moved it."""


class _Propagator:
    def __init__(self, program: CapturedProgram, mesh: DeviceMesh, seeds: dict, pins: ModulePins | None = None,
                 gathered: dict | None = None, pinned: frozenset = frozenset(), grad_outputs: dict | None = None):
        self.program, self.mesh, self.seeds, self.pins = program, mesh, seeds, pins
        self.gathered = gathered or {}
        """Node → the placements each of its uses moves it to (a fully-sharded parameter's gather, or that of its
        mixed-precision cast, which then takes the parameter's shard)."""
        self.pinned = pinned
        """Nodes whose consumers take them in the layout they have: where DTensor's rule would move one, the
        cheapest strategy that does not is chosen, and the other inputs move (tensor parallelism's matrices)."""
        self.grad_outputs = grad_outputs or {}
        """Node → {mesh axis: the placement its output must have there} (tensor parallelism's weight gradients,
        computed split as their matrices are rather than summed over a split sequence and reduced whole)."""
        self.choosing = bool(pinned or self.grad_outputs)
        """Whether layouts are chosen here rather than as DTensor picks them at run time (the named strategies'
        propagation at scale): then also a rule that fails replicates one axis, not all, and moves out of
        strided shards are priced (``_compat.op_choice``)."""
        self.result = Sharding(specs={})
        self.output_node = program.graph.graph.find_nodes(op="output")[0]
        self.crossed: dict[tuple, object] = {}
        """(value, module path) → the spec the value has after crossing that module's boundary (moved once)."""

    def run(self) -> Sharding:
        for node in self.program.graph.graph.nodes:
            if node.op in ("placeholder", "get_attr"):  # get_attr: a constant, replicated
                self._placeholder(node)
            elif node.op == "call_function":
                self.result.specs[node] = self._call(node)
        for value in self.program.output_nodes.values():
            if self.pins is not None and isinstance(self.result.specs.get(value), _compat.DTensorSpec):
                self.result.returned[value] = self._returned(value)
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
            spec = spec_for(self.mesh, node.meta["val"], tangent_placements(self._returned(output).placements))
            self.result.specs[node] = spec
        return spec

    def _returned(self, output: fx.Node):
        """The spec forward output ``output`` has as the model returns it (past every module boundary)."""
        if self.pins is None:
            return self.result.specs[output]
        return self._seen_by(output, self.output_node)

    def _seen_by(self, value: fx.Node, user: fx.Node):
        """``value``'s spec as ``user`` receives it: moved at each pinned module boundary on the way (the
        move recorded once per value and boundary, as the hook runs once per call)."""
        spec = self._spec_of(value)
        if self.pins is None or not isinstance(spec, _compat.DTensorSpec):
            return spec
        for path, pinned in self.pins.crossings(value, user):
            if pinned is None:
                continue
            key = (value, path)
            if key not in self.crossed:
                target = boundary.move_target(tuple(spec.placements), parse_placements(pinned))
                if tuple(spec.placements) != target:
                    self.result.redistributions.append(Redistribution(
                        node=value.name, arg_index=-1, source=tuple(spec.placements), target=target,
                        global_nbytes=tensor_nbytes(value.meta.get("val")), backward=False))
                self.crossed[key] = spec_for(self.mesh, value.meta["val"], target)
            spec = self.crossed[key]
        return spec

    def _call(self, node: fx.Node):
        return self._dispatch(node, lambda value: self._used_by(value, node))

    def _used_by(self, value: fx.Node, user: fx.Node):
        """``value``'s spec as ``user`` receives it, gathered first where ``gathered`` says so (once per use)."""
        spec, wanted = self._seen_by(value, user), self.gathered.get(value)
        if wanted is None or not isinstance(spec, _compat.DTensorSpec) or tuple(spec.placements) == wanted \
                or user in self.gathered:  # a use that is gathered itself (a parameter's cast) takes the shard
            return spec
        self.result.redistributions.append(Redistribution(
            node=user.name, arg_index=user.all_input_nodes.index(value), source=tuple(spec.placements),
            target=wanted, global_nbytes=tensor_nbytes(value.meta.get("val")), backward=self.program.is_backward(user)))
        return spec_for(self.mesh, value.meta["val"], wanted)

    def _dispatch(self, node: fx.Node, spec_of_input):
        """``node``'s output spec from DTensor's rule, given the spec each input node arrives in."""
        if node.target is operator.getitem:
            container = spec_of_input(node.args[0])
            return container[node.args[1]] if isinstance(container, (tuple, list)) else container
        map_arg = lambda a: spec_of_input(a) if isinstance(a, fx.Node) else a  # noqa: E731
        args = fx.node.map_aggregate(node.args, map_arg)
        kwargs = fx.node.map_aggregate(node.kwargs, map_arg)
        if isinstance(node.target, torch._ops.OpOverload) and _compat.has_sharding_rule(node.target):
            try:
                return self._apply_rule(node, args, kwargs)
            except Exception:  # a rule that cannot handle these shapes: replicate, which is always correct
                spec = self._apply_rule_on_fewer_axes(node, args, kwargs) if self.choosing else None
                if spec is not None:
                    return spec
        return self._replicate(node, args)

    def _apply_rule_on_fewer_axes(self, node: fx.Node, args, kwargs):
        """The rule applied with every input replicated on one mesh axis, the last axis first (None when that
        fails on each): a shape the rule cannot split on one axis (a view regrouping a dim split more ways than
        a new dim has) need not replicate the batch split on the others. Reported as replicated on that axis.
        Only where propagation chooses layouts of its own (``choosing``): at run time DTensor replicates such an
        op on every axis."""
        for axis in reversed(range(self.mesh.ndim)):
            replicated = lambda a: _replicated_on(a, axis)  # noqa: E731, B023
            moved = fx.node.map_aggregate(args, replicated)
            try:
                wanted, spec = self._choose(node, moved, fx.node.map_aggregate(kwargs, replicated))
            except Exception:
                continue
            self.result.replicated_ops[f"{node.target} (on mesh axis {axis})"] += 1
            self._record_moves(node, args, [w if isinstance(w, _compat.DTensorSpec) else m
                                            for w, m in zip(wanted, moved)])
            return self._respec(node, spec)
        return None

    def _apply_rule(self, node: fx.Node, args, kwargs):
        wanted, spec = self._choose(node, args, kwargs)
        self._record_moves(node, args, wanted)
        return self._respec(node, spec)

    def _choose(self, node: fx.Node, args, kwargs) -> tuple[list, object]:
        """(the spec each argument is moved to, the output spec) as DTensor's rule chooses them for these input
        specs; where this propagation chooses (``choosing``), chosen again by ``_compat.op_choice`` when the rule
        would move a pinned input, leaves a required gradient layout, or met a strided shard."""
        output = _compat.propagate_sharding(node.target, args, kwargs)
        spec, required = output.output_spec, self.grad_outputs.get(node, {})
        moves = output.needs_redistribute and output.redistribute_schema is not None
        wanted = list(output.redistribute_schema.args_schema) if moves else list(args)
        if not self.choosing or not moves and not (
                isinstance(spec, _compat.DTensorSpec) and any(spec.placements[a] != p for a, p in required.items())):
            return wanted, spec
        pinned = {index for index, (arg, have, want) in enumerate(zip(node.args, args, wanted))
                  if isinstance(arg, fx.Node) and arg in self.pinned and _placements_of(have) != _placements_of(want)}
        strided = any(_compat.is_strided_shard(p) for a in args for p in (_placements_of(a) or ()))
        value = node.meta.get("val")
        if (pinned or strided or required) and isinstance(value, torch.Tensor):
            meta = _compat.TensorMeta(value.shape, value.stride(), value.dtype)
            choice = _compat.op_choice(node.target, args, kwargs, self.mesh, meta, pinned, required)
            if choice is not None:
                wanted, spec = choice
        return wanted, spec

    def _record_moves(self, node: fx.Node, args, wanted) -> None:
        for index, (have, want) in enumerate(zip(args, wanted)):
            self._record(node, index, have, getattr(want, "placements", None))

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


class _Follower(_Propagator):
    """The per-rank program's run of a plan's node layouts: every node's inputs moved to the layouts the plan
    gives them (never into a partial sum: ``boundary.move_target``), DTensor's rule applied to them (with any
    further move it asks for), the output moved to the plan's layout where the rule leaves it elsewhere."""

    def __init__(self, program: CapturedProgram, mesh: DeviceMesh, layouts: dict):
        super().__init__(program, mesh, seeds={})
        self.layouts = layouts

    def _placeholder(self, node: fx.Node) -> None:
        layout, value = self.layouts.get(node.name), node.meta.get("val")
        if isinstance(value, torch.Tensor) and layout is not None and _one_tensor(layout.output):
            self.result.specs[node] = spec_for(self.mesh, value, parse_placements(layout.output))
        else:
            super()._placeholder(node)

    def _call(self, node: fx.Node):
        layout = self.layouts.get(node.name)
        if layout is None:
            return super()._call(node)
        moved = {producer: self._moved(node, position, producer, layout.inputs[position] if position < len(layout.inputs) else None)
                 for position, producer in enumerate(node.all_input_nodes)}
        output = self._dispatch(node, moved.__getitem__)
        if node.target is operator.getitem:
            return output
        if isinstance(output, (tuple, list)) and isinstance(layout.output, tuple) and not _one_tensor(layout.output):
            return tuple(self._conformed(node, spec, wanted) for spec, wanted in zip(output, layout.output))
        return self._conformed(node, output, layout.output)

    def _moved(self, node: fx.Node, position: int, producer: fx.Node, wanted):
        """Input ``position`` of ``node`` as the program moves it to ``wanted`` before the op."""
        return self._move(node, position, self._spec_of(producer), wanted)

    def _conformed(self, node: fx.Node, spec, wanted):
        """``node``'s output, left by its rule in ``spec``, as the program moves it to the plan's ``wanted``."""
        return self._move(node, -1, spec, wanted)

    def _move(self, node: fx.Node, arg_index: int, spec, wanted):
        if not isinstance(spec, _compat.DTensorSpec) or not _one_tensor(wanted):
            return spec
        target = boundary.move_target(tuple(spec.placements), parse_placements(wanted))
        if target == tuple(spec.placements):
            return spec
        self.result.redistributions.append(Redistribution(
            node=node.name, arg_index=arg_index, source=tuple(spec.placements), target=target,
            global_nbytes=_spec_nbytes(spec), backward=self.program.is_backward(node)))
        return _compat.DTensorSpec(self.mesh, target, spec.tensor_meta)


def _replicated_on(spec, axis: int):
    """``spec`` replicated on mesh ``axis`` (anything else as it is)."""
    if not isinstance(spec, _compat.DTensorSpec) or isinstance(spec.placements[axis], Replicate):
        return spec
    placements = list(spec.placements)
    placements[axis] = Replicate()
    return _compat.DTensorSpec(spec.mesh, tuple(placements), spec.tensor_meta)


def _placements_of(spec):
    return tuple(spec.placements) if isinstance(spec, _compat.DTensorSpec) else None


def _spec_nbytes(spec) -> int:
    meta = spec.tensor_meta
    return math.prod(meta.shape) * meta.dtype.itemsize if meta is not None else 0


def _one_tensor(layout) -> bool:
    return isinstance(layout, tuple) and all(isinstance(p, str) for p in layout)


def follow_layouts(program: CapturedProgram, mesh: DeviceMesh, layouts: dict) -> Sharding:
    """What the per-rank program does with ``layouts`` (node name → an object with ``output`` and ``inputs``
    placements as text, as ``search.plan.NodeLayout``): each node's spec as it runs and every move it makes,
    including those a hand-edited layout implies (an op whose rule cannot give the planned output is moved
    after it)."""
    _compat.prefer_early_partial_reduction()
    return _Follower(program, mesh, layouts).run()


def tangent_placements(output_placements) -> tuple:
    """The layout of an output's gradient: as the output's, except that the gradient of a partial sum is
    replicated (what DTensor's backward of a redistribution hands back)."""
    return tuple(Replicate() if p.is_partial() else p for p in output_placements)


def propagate(program: CapturedProgram, mesh: DeviceMesh, seeds: dict, pins: ModulePins | None = None,
              gathered: dict | None = None, pinned: frozenset = frozenset(),
              grad_outputs: dict | None = None) -> Sharding:
    """Placements for every node of ``program`` given ``seeds`` (node → placements per mesh axis), chosen as
    the sharded runtime's DTensor chooses them (``_compat.prefer_early_partial_reduction`` included), with
    values moved at the module boundaries ``pins`` forces (eager mode's hooks) and the placeholders of
    ``gathered`` (node → placements) moved at each use (fully-sharded parameters stored split, used whole), and
    the ``pinned`` nodes taken by every op as they are (the others moved instead), and the nodes of
    ``grad_outputs`` computed in the placements it gives them on its mesh axes."""
    _compat.prefer_early_partial_reduction()
    return _Propagator(program, mesh, seeds, pins, gathered, pinned, grad_outputs).run()
