"""Seeds for the fast propagation mode from a named strategy's axis roles, so that a restriction takes effect on
every mesh axis even when the exact search is out of reach.

Per mesh axis (roles of ``strategies.roles``):
  dp    parameters replicated, user inputs split on dim 0
  fsdp  parameters stored split on dim 0 (where it has at least the axis's size; dim 1 where a tp axis splits
        dim 0) and gathered (replicated) at each use (``gathered_at_use``), user inputs split on dim 0
  tp    user inputs replicated, matrices split Megatron-style by the forward data flow (``megatron_splits``): a
        matrix multiplying an activation that is whole on the axis is column parallel (split along its output
        features: dim 0 of ``nn.Linear``'s weight, dim 1 of an (in, out) one such as GPT-2's ``Conv1D``), one
        multiplying an activation a column-parallel matrix split is row parallel (its input features); vectors
        (norm weights, biases of row-parallel layers) replicated, a column-parallel layer's bias split with it;
        other parameters (an embedding) split on dim 0
Buffers stay replicated. Must never look at costs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from torch_autopar.capture import CapturedProgram
from torch_autopar.capture.layers import CASTS

aten = torch.ops.aten
_VIEWS = {aten.t.default, aten.view.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default,
          aten._to_copy.default, aten.expand.default, aten.clone.default, aten.reshape.default, aten.detach.default,
          aten.alias.default, aten.unsqueeze.default}
"""Ops that hand a parameter to its matrix multiply unchanged in substance (transposed, viewed, cast)."""
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default, aten.linear.default}


_TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default}
"""Views that (on a matrix) swap its two dims."""


class MatrixSplit(NamedTuple):
    """How tensor parallelism splits a parameter its data flow reaches a matrix multiply with."""

    kind: str
    """"column" (split along the multiply's output features, the output left split) or "row" (along its input
    features, the output a partial sum)."""
    output_dim: int
    """The parameter's dim holding the output features: 0 for ``nn.Linear``'s (out, in) weight, read transposed,
    1 for an (in, out) weight multiplied as it is (``transformers``' ``Conv1D``: GPT-2), 0 for a bias."""


def _tp_dim(value: torch.Tensor, split: MatrixSplit | None) -> int | None:
    """The dim a tp axis splits a parameter on (None: replicated there)."""
    column = split is not None and split.kind == "column"
    if value.ndim == 0 or value.ndim == 1 and not column:
        return None
    if split is not None and value.ndim == 2:
        return split.output_dim if column else 1 - split.output_dim
    return 0


def _param_placement(role: str, value: torch.Tensor, size: int, tp_dim: int | None):
    """On an fsdp axis the first dim that no tp axis splits (a matrix split by its output features on dim 0 is
    stored split by its input features too: its gradient, computed split on dim 0, is then reduce-scattered on
    dim 1 without regrouping the tp split)."""
    if role == "dp" or value.ndim == 0 or role == "tp" and tp_dim is None:
        return Replicate()
    if role == "tp":
        dim = tp_dim
    else:
        dim = 1 if tp_dim == 0 and value.ndim >= 2 else 0
    return Shard(dim) if value.shape[dim] >= size else Replicate()


def _input_placement(role: str, value) -> object:
    return Replicate() if role == "tp" or getattr(value, "ndim", 0) == 0 else Shard(0)


def role_seeds(program: CapturedProgram, roles: tuple[str, ...], mesh_shape: tuple[int, ...],
               splits: dict[fx.Node, MatrixSplit]) -> dict:
    """Placements of parameters, buffers and user inputs for propagation under ``roles`` (one per mesh axis): the
    layouts parameters are stored in (``splits``: ``megatron_splits(program).splits``, used where a role is tp)."""
    seeds = {}
    for node in program.param_nodes.values():
        value = node.meta["val"]
        tp_dim = _tp_dim(value, splits.get(node)) if "tp" in roles else None
        seeds[node] = tuple(_param_placement(role, value, size, tp_dim) for role, size in zip(roles, mesh_shape))
    seeds.update({node: tuple(Replicate() for _ in roles) for node in program.buffer_nodes.values()})
    for node in program.input_nodes.values():
        seeds[node] = tuple(_input_placement(role, node.meta.get("val")) for role in roles)
    return seeds


def gathered_at_use(program: CapturedProgram, roles: tuple[str, ...], seeds: dict,
                    cast_dtype: torch.dtype | None = None) -> dict:
    """Parameter node → the layout each of its uses gathers it to: replicated on the fsdp axes, as stored on the
    others (only parameters stored split on some fsdp axis). Under a mixed-precision policy (``cast_dtype``, its
    param_dtype) a parameter's cast to that dtype is what is gathered, at the cast's uses, and the cast takes
    the shard: FSDP2 and both runtimes gather the cast copy, in its (smaller) dtype."""
    gathered = {}
    for node in program.param_nodes.values():
        stored = seeds[node]
        used = tuple(Replicate() if role == "fsdp" else p for role, p in zip(roles, stored))
        if used == tuple(stored):
            continue
        gathered[node] = used
        for user in node.users:
            if cast_dtype is not None and user.target in CASTS and user.meta["val"].dtype == cast_dtype:
                gathered[user] = used
    return gathered


def split_matrix_grads(program: CapturedProgram, roles: tuple[str, ...], mesh_shape: tuple[int, ...],
                       splits: dict[fx.Node, MatrixSplit]) -> dict[fx.Node, dict[int, Shard]]:
    """The op computing the gradient of each of tensor parallelism's split matrices (before any view or cast) →
    the placement its output must have on each tp axis: the matrix's own split, seen through the transposes
    between that op and the gradient. Propagation computes them so (``propagate``'s ``grad_outputs``). Left to
    DTensor's cheapest op, a weight gradient multiplies two activations split along the sequence into a partial
    sum of the whole matrix, which the gradient sync then reduces whole. A matrix too small to split on an axis
    (``role_seeds`` replicates it there) is left to DTensor."""
    required = {}
    for name, param in program.param_nodes.items():
        node, dim = program.grad_nodes.get(name), _tp_dim(param.meta["val"], splits.get(param))
        axes = [axis for axis, role in enumerate(roles) if role == "tp" and dim is not None
                and param.meta["val"].shape[dim] >= mesh_shape[axis]]
        if param not in splits or not axes:
            continue
        while node is not None and node.op == "call_function" and node.target in _VIEWS \
                and len(node.all_input_nodes) == 1:
            dim = 1 - dim if node.target in _TRANSPOSES and node.meta["val"].ndim == 2 else dim
            node = node.all_input_nodes[0]
        if node is not None and node.op == "call_function":
            required[node] = {axis: Shard(dim) for axis in axes}
    return required


class MegatronMatrices(NamedTuple):
    """Tensor parallelism's split matrices (``megatron_splits``)."""

    splits: dict[fx.Node, MatrixSplit]
    """Parameter node → how it is split."""
    held: frozenset
    """The nodes holding the split matrices as ops take them: the parameters and their views and casts, in
    forward and backward. Propagation keeps them as they are and moves the activations instead (``propagate``'s
    ``pinned``): left to DTensor's cheapest move, a small matrix is gathered whole where the activation arrives
    split along the sequence, which undoes the split on the tp axis and, at attention, leaves layouts no rule
    shards on any axis."""


def megatron_splits(program: CapturedProgram) -> MegatronMatrices:
    """Each parameter's ``MatrixSplit``: walking the forward graph, a matrix multiply of a parameter (through
    views and casts) and an activation whole on the tensor-parallel axis splits the parameter by columns and leaves
    its output split; of an activation already split, by rows, and its output is whole again (a partial sum);
    any other op leaves its output split when some activation input is. Which dim of the stored matrix holds the
    output features follows from where it enters the multiply and how many transposes it went through."""
    origin: dict[fx.Node, tuple[fx.Node, bool]] = {node: (node, False) for node in program.param_nodes.values()}
    split: set[fx.Node] = set()
    splits: dict[fx.Node, MatrixSplit] = {}
    for node in program.graph.graph.nodes:
        if node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        if node.target in _VIEWS and len(inputs) == 1 and inputs[0] in origin:  # forward and backward
            param, swapped = origin[inputs[0]]
            origin[node] = (param, swapped ^ (node.target in _TRANSPOSES and node.meta["val"].ndim == 2))
            continue
        if program.is_backward(node):
            continue
        params = [origin[n][0] for n in inputs if n in origin]
        activations = [n for n in inputs if n not in origin]
        matrices = [n for n in inputs if n in origin and origin[n][0].meta["val"].ndim == 2]
        if node.target in _MATMULS and len(matrices) == 1:
            kind = "row" if any(n in split for n in activations) else "column"
            matrix, swapped = origin[matrices[0]]
            for param in params:  # the matrix and its bias
                splits.setdefault(param, MatrixSplit(kind, _output_dim(node, matrices[0], swapped)
                                                     if param is matrix else 0))
            if splits[matrix].kind == "column":
                split.add(node)
        elif any(n in split for n in activations):
            split.add(node)
    return MegatronMatrices(splits, frozenset(node for node, (param, _) in origin.items() if param in splits))


def _output_dim(matmul: fx.Node, operand: fx.Node, swapped: bool) -> int:
    """The stored matrix's dim along the multiply's output features: ``linear``'s weight is (out, in); the right
    operand of ``mm``/``addmm``/``bmm``/``matmul`` gives its last dim, the left its first."""
    if matmul.target is aten.linear.default:
        return int(swapped)
    operands = matmul.args[1:3] if matmul.target is aten.addmm.default else matmul.args[:2]
    return (1 if operand is operands[1] else 0) ^ int(swapped)
