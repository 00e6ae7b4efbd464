"""How graph mode's per-rank program gathers a parameter: the one home of the rule, for the planner that counts
the gathers and the program that runs them.

A value that is a parameter, its mixed-precision cast, or a chain of views that keep every element of one of
them (``gathered_root``) is not gathered itself: the program gathers its root, once, to the root's layout with
each mesh axis the move replicates replicated (``root_target``), and replays the views on that copy. Forward and
backward then read one gathered copy of each parameter: with ``Plan.reshard_after_forward`` the copy is freed
after forward and gathered again for backward (``rewrite.reshard`` tags it for recomputation), without it the
copy is kept until backward. ``gather_key`` is what the planner counts a gather under: once per step, or once
per phase when the plan reshards. Must never choose a layout.
"""

from __future__ import annotations

import operator
from typing import Callable

import torch.fx as fx
from torch.distributed.tensor import Replicate

from torch_autopar.capture.layers import CASTS, reshard_groups

ELEMENT_VIEWS = frozenset({"view", "_unsafe_view", "t", "transpose", "permute", "reshape", "unsqueeze", "squeeze",
                           "alias", "detach"})
"""Views that keep every element of their input (a slice or an expand does not): a gather of one moves the
bytes its root's gather moves."""
CHEAP = ELEMENT_VIEWS | {"split", "split_with_sizes", "cat", "slice", "narrow", "clone", "contiguous",
                         "constant_pad_nd", "_to_copy", "convert_element_type", "copy"}
"""Ops the program makes again with a gather when it frees the gathered copy after forward (``rewrite.reshard``)
where they read only the gather or its parameter: copies and views, no compute."""


def _name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def is_cheap(node: fx.Node) -> bool:
    """Whether ``node`` is one of the ``CHEAP`` ops (or a mixed-precision cast)."""
    if node.op != "call_function":
        return False
    return node.target is operator.getitem or node.target in CASTS or _name(node) in CHEAP


def gather_groups(names) -> dict[str, str]:
    """Parameter name → its group, whose gathers graph mode's program makes as one all-gather per process group,
    dtype and phase (``rewrite.gather_buckets``) and whose latencies the search prices once per group
    (``strategies.boundary.made_per_group``, ``search.problem``, ``search.estimate``): a layer of
    ``capture.layers.reshard_groups`` (what FSDP2 users wrap), or the root group "" for the others."""
    names = list(names)
    group_of = {name: group for group, members in reshard_groups(names).items() for name in members}
    return {name: group_of.get(name, "") for name in names}


def parameter_side(node: fx.Node, is_param: Callable[[fx.Node], bool]) -> tuple[set, set] | None:
    """(the parameters, the cheap ops) ``node`` is made of, itself included, when it is made of parameters only
    through ``CHEAP`` ops (a cast, a padding, a concatenation of flattened shards); None otherwise."""
    params, ops, pending = set(), set(), [node]
    while pending:
        current = pending.pop()
        if current in params or current in ops:
            continue
        if current.op == "placeholder":
            if not is_param(current):
                return None
            params.add(current)
        elif is_cheap(current) and current.all_input_nodes:
            ops.add(current)
            pending.extend(current.all_input_nodes)
        else:
            return None
    return params, ops


def param_of(root: fx.Node) -> fx.Node:
    """The parameter a gathered root is (or is the mixed-precision cast of)."""
    return root if root.op == "placeholder" else root.all_input_nodes[0]


def view_read_by_backward(program, consumer: fx.Node, is_param: Callable[[fx.Node], bool]) -> bool:
    """Whether ``consumer``, an op taking a gathered parameter, is a cheap op made of gathered parameters only that
    backward reads (itself, or through further such ops): freed after forward, the copy is then gathered again
    for backward, the chain made again with it (``rewrite.reshard`` tags an op for that when it is cheap and all
    its inputs are tagged; one that also reads an activation is kept by autograd instead)."""
    made = {node for node in consumer.all_input_nodes if gathered_root(node, is_param) is not None}
    pending = [consumer]
    while pending:
        node = pending.pop()
        if not is_cheap(node) or not set(node.all_input_nodes) <= made:
            continue
        made.add(node)
        for user in node.users:
            if program.is_backward(user):
                return True
            pending.append(user)
    return False


def is_element_view(node: fx.Node) -> bool:
    return node.op == "call_function" and _name(node) in ELEMENT_VIEWS


def gathered_root(node: fx.Node, is_param: Callable[[fx.Node], bool]) -> fx.Node | None:
    """The node a move of ``node``'s value gathers instead: the parameter ``node`` is an element view of (or
    its mixed-precision cast, gathered in the cast dtype); None when ``node`` is neither."""
    current = node
    while True:
        if current.op == "placeholder":
            return current if is_param(current) else None
        inputs = current.all_input_nodes
        if current.op != "call_function" or len(inputs) != 1:
            return None
        if current.target in CASTS:
            return current if inputs[0].op == "placeholder" and is_param(inputs[0]) else None
        if not is_element_view(current):
            return None
        current = inputs[0]


def views_from(root: fx.Node, node: fx.Node) -> list[fx.Node]:
    """The views between ``root`` and ``node`` (``gathered_root(node) is root``), in the order they apply."""
    chain = []
    while node is not root:
        chain.append(node)
        node = node.all_input_nodes[0]
    return chain[::-1]


def root_target(source: tuple, target: tuple, root_layout: tuple) -> tuple | None:
    """The layout ``root`` (in ``root_layout``) is gathered to when a view of it moves from ``source`` to
    ``target``: each axis the move takes from a shard to a replica replicated, the others as they are. None when
    the move is not only gathers, or nothing is gathered."""
    if not len(source) == len(target) == len(root_layout):
        return None
    wanted = []
    for have, want, root in zip(source, target, root_layout):
        if have == want:
            wanted.append(root)
        elif have.is_shard() and want.is_replicate() and root.is_shard():
            wanted.append(Replicate())
        else:
            return None
    return None if tuple(wanted) == tuple(root_layout) else tuple(wanted)


def gather_key(root: fx.Node, target: tuple, backward: bool, reshard_after_forward: bool) -> tuple:
    """What a gather of ``root`` to ``target`` is counted under: one per step, one per phase when the plan frees
    gathered parameters after forward (backward gathers its own copy)."""
    return root, tuple(target), backward and reshard_after_forward
