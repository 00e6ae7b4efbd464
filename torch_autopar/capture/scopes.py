"""Which submodule calls each forward node of a captured program ran inside, read from dynamo's
``nn_module_stack``: a node's scope is the paths ("blocks.0", "blocks.0.attn") of the modules it ran in,
outermost first, relative to the captured model (the model itself, path "", is no scope).

A module called more than once per forward has no single boundary (dynamo marks later calls "@1", "@2"), so it
appears in no scope: its calls count as code of the module around it. An op of the backward (and one autograd
adds to the forward for the backward, such as a weight's transpose) has the scope of the forward op it
differentiates: eager mode runs it with that op's saved inputs. Must never look at placements.
"""

from __future__ import annotations

import re

import torch.fx as fx

from torch_autopar.capture.program import CapturedProgram


def _dotted(path: str) -> str:
    """Dynamo's path of a module ("L['self'].module.layers[0]", "....blocks._modules['0']") written as
    ``named_modules`` names it ("....layers.0")."""
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    return re.sub(r"\[(\d+)\]|\['([^']+)'\]", lambda m: "." + (m.group(1) or m.group(2)), path)


def _stack(node: fx.Node) -> list[tuple[str, str]]:
    """(dynamo's key, module path) per module ``node`` ran in, outermost first; for a node of the backward, those
    of the forward op it differentiates."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    return [(key, _dotted(entry[0])) for key, entry in stack.items()]


def in_forward(node: fx.Node) -> bool:
    """Whether ``node`` is an op of the user's forward (not one autograd added for the backward)."""
    return node.op == "call_function" and "nn_module_stack" in node.meta


def module_scopes(program: CapturedProgram) -> dict[fx.Node, tuple[str, ...]]:
    """Op node → the paths of the once-called submodules it ran in (backward ops: that their forward op ran
    in), outermost first."""
    stacks = {node: _stack(node) for node in program.graph.graph.nodes if node.op == "call_function"}
    stacks = {node: stack for node, stack in stacks.items() if stack}
    roots = {stack[0][1] for stack in stacks.values() if stack}
    if len(roots) != 1:
        return {}  # no module structure recorded: no boundaries
    root = roots.pop()
    called_again = {path for stack in stacks.values() for key, path in stack if "@" in key}

    def relative(path: str) -> str | None:
        if path == root or path in called_again or not path.startswith(root + "."):
            return None
        return path[len(root) + 1:]

    return {node: tuple(p for _, path in stack[1:] if (p := relative(path)) is not None)
            for node, stack in stacks.items()}
