"""Capture a module's forward and backward into a ``CapturedProgram`` (joint graph + what each input is)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from torch_autopar import _compat
from torch_autopar.errors import AutoparError

pytree = _compat.pytree()  # torch.utils._pytree: no public equivalent in torch 2.13


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Shape and dtype of one tensor, without its data."""

    shape: tuple[int, ...]
    dtype: str

    @staticmethod
    def of(tensor: torch.Tensor) -> "TensorInfo":
        return TensorInfo(tuple(int(s) for s in tensor.shape), str(tensor.dtype).removeprefix("torch."))

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass(kw_only=True)
class CapturedProgram:
    """The joint forward+backward graph of one model call, with its inputs and outputs identified."""

    graph: fx.GraphModule
    """Joint aten graph: placeholders are params, buffers, user inputs, tangents; outputs are forward
    outputs followed by gradients. Every node carries ``meta["val"]`` (a fake or meta tensor)."""
    params: dict[str, TensorInfo]
    """Trainable parameters by fully qualified name, in the module's registration order."""
    buffers: dict[str, TensorInfo]
    param_nodes: dict[str, fx.Node]
    buffer_nodes: dict[str, fx.Node]
    input_nodes: dict[int, fx.Node]
    """User input placeholders keyed by their flat index among the (args, kwargs) leaves."""
    tangent_nodes: dict[fx.Node, int]
    """Tangent placeholder → flat index of the forward output it is the gradient of."""
    output_nodes: dict[int, fx.Node]
    """Forward output leaves (flat index → node); non-tensor outputs are absent."""
    grad_nodes: dict[str, fx.Node] = field(default_factory=dict)
    """Parameter name → node computing its gradient (absent when the parameter gets no gradient)."""
    buffer_updates: dict[str, fx.Node] = field(default_factory=dict)
    """Buffer name → node computing its new value (running statistics updated by the forward)."""

    def grad_ready_order(self) -> list[str]:
        """Parameters in the order their gradients become final during backward (earliest first)."""
        position = {node: i for i, node in enumerate(self.graph.graph.nodes)}
        named = sorted(self.grad_nodes.items(), key=lambda item: position[item[1]])
        return [name for name, _ in named]

    def is_backward(self, node: fx.Node) -> bool:
        """Whether ``node`` belongs to the backward pass (depends on a tangent)."""
        return node in self._backward_nodes()

    def _backward_nodes(self) -> set[fx.Node]:
        cached = getattr(self, "_backward_cache", None)
        if cached is None:
            cached = set(self.tangent_nodes)
            for node in self.graph.graph.nodes:
                if any(arg in cached for arg in node.all_input_nodes):
                    cached.add(node)
            self._backward_cache = cached
        return cached

    def fingerprint(self) -> str:
        """Identifies the model's parameters (names, shapes, dtypes): a plan is only valid for this."""
        return params_fingerprint(self.params)


def tensor_nbytes(value) -> int:
    """Bytes of a tensor (fake or meta too), summed over a tuple or list of them; 0 for anything else."""
    if isinstance(value, (list, tuple)):
        return sum(tensor_nbytes(v) for v in value)
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def params_fingerprint(params: dict[str, TensorInfo]) -> str:
    """A short hash of parameter names, shapes and dtypes (order-independent)."""
    text = ";".join(f"{name}:{info.shape}:{info.dtype}" for name, info in sorted(params.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _param_device(module: torch.nn.Module) -> torch.device:
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return torch.device("cpu")


def fake_global_inputs(module: torch.nn.Module, args: tuple, kwargs: dict, batch_factor: int):
    """Shape-only copies of the inputs with dim 0 of every tensor multiplied by ``batch_factor``.

    Meta tensors for a meta-device model, fake tensors otherwise: no input data is read or allocated.
    """
    device = _param_device(module)
    fake_mode = _compat.FakeTensorMode(allow_non_fake_inputs=True) if device.type != "meta" else None

    def scale(leaf):
        if not isinstance(leaf, torch.Tensor):
            return leaf
        shape = list(leaf.shape)
        if shape:
            shape[0] *= batch_factor
        if fake_mode is None:
            return torch.empty(shape, dtype=leaf.dtype, device="meta")
        with fake_mode:
            return torch.empty(shape, dtype=leaf.dtype, device=device)

    return pytree.tree_map(scale, (tuple(args), dict(kwargs)))


def without_opaque_outputs(output):
    """``output`` with every leaf that is neither a tensor nor a plain constant (a key/value cache object)
    replaced by None: what a captured or compiled graph can hand back. Training needs none of them."""
    plain = (torch.Tensor, int, float, bool, str, type(None))
    return pytree.tree_map(lambda leaf: leaf if isinstance(leaf, plain) else None, output)


class _CapturableOutputs(torch.nn.Module):
    """Calls the model (through ``call``, e.g. on parameters cast for mixed precision, when given) and hands back
    ``without_opaque_outputs`` of its output.

    The program's output indices count the tensor outputs; they pair each tangent with its output inside the
    captured graph, and nothing matches them against the real call's output leaves."""

    def __init__(self, module: torch.nn.Module, call=None):
        super().__init__()
        self.module = module
        self.call = call

    def forward(self, *args, **kwargs):
        return without_opaque_outputs((self.call or self.module)(*args, **kwargs))


def capture(module: torch.nn.Module, args: tuple, kwargs: dict | None = None, *, call=None) -> CapturedProgram:
    """Trace ``module(*args, **kwargs)`` with its backward; ``args`` should be fake or meta tensors. ``call``:
    what runs instead of ``module`` itself (a callable that calls ``module``: its parameters stay the graph's)."""
    try:
        graph, _ = _compat.export_joint(_CapturableOutputs(module, call), tuple(args), kwargs or {}, names_from=module)
    except Exception as error:  # dynamo's Unsupported/UserError, fake tensors' DataDependentOutputException, ...
        if _compat.dispatch_mode_active():
            raise under_dispatch_mode(type(module).__name__, error) from error
        raise AutoparError(
            f"could not capture {type(module).__name__}.forward as one graph: {_compat.graph_break_reason(error)}. "
            "Planning a sharded strategy needs the whole forward as one graph (dynamo, as torch.export); remove "
            "or guard that line (for example `if not torch.compiler.is_compiling():`, or torch.where for a branch "
            "on tensor values), or run data parallelism (strategy='data_parallel'), which needs no capture."
        ) from error
    return _describe(graph)


def under_dispatch_mode(name: str, error: Exception) -> AutoparError:
    """The error of a capture that failed under an active dispatch mode, which may be the cause: FlopCounterMode's
    module tracker cannot be traced. Captures run to plan (``compile``, ``plan``) and on graph mode's first call
    for each input shape."""
    return AutoparError(
        f"could not capture {name}.forward under the dispatch mode active here (FlopCounterMode's module tracker, "
        f"for one): {_compat.graph_break_reason(error)}. autopar captures a forward to plan it (compile, plan) and, "
        "in graph mode, on the first call for each input shape: make those calls outside the mode (what runs "
        "afterwards runs under it, with the same numbers), or run that call in eager mode (mode='eager').")


def _describe(graph: fx.GraphModule) -> CapturedProgram:
    program = CapturedProgram(graph=graph, params={}, buffers={}, param_nodes={}, buffer_nodes={},
                              input_nodes={}, tangent_nodes={}, output_nodes={})
    for node in graph.graph.find_nodes(op="placeholder"):
        _describe_placeholder(program, node)
    output = graph.graph.find_nodes(op="output")[0]
    for value, desc in zip(output.args[0], output.meta["desc"]):
        if value is None:
            continue
        name = _compat.grad_target(desc)
        if name is not None:
            program.grad_nodes[name] = value
        elif (index := _compat.output_index(desc)) is not None:
            program.output_nodes[index] = value
        elif (buffer := _compat.mutated_buffer(desc)) is not None:
            program.buffer_updates[buffer] = value
    return program


def _describe_placeholder(program: CapturedProgram, node: fx.Node) -> None:
    desc = node.meta["desc"]
    kind = _compat.input_kind(desc)
    value = node.meta.get("val")
    if kind == "param":
        program.params[desc.target] = TensorInfo.of(value)
        program.param_nodes[desc.target] = node
    elif kind == "buffer":
        program.buffers[desc.target] = TensorInfo.of(value)
        program.buffer_nodes[desc.target] = node
    elif kind == "input":
        program.input_nodes[_compat.user_input_index(desc)] = node
    elif kind == "tangent":
        program.tangent_nodes[node] = _compat.tangent_output_index(desc)
