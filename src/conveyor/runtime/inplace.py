"""Stage inputs that a stage modifies in place (``nn.ReLU(inplace=True)`` first thing in a
stage): found in the stage's traced code, and given to it as copies.

    call = copying_inputs(module)   # the module itself, or a function that copies first
    out = call(*args)

See Note [in-place stage inputs].
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from conveyor.torch_compat import pytree

__all__ = ["INPLACE_ON_LEAF", "copying_inputs", "modified_inputs"]


# Note [in-place stage inputs]:
# A stage receives its inputs as new autograd leaves (so that it can backpropagate alone, and
# hand the input gradients to their producer), and autograd refuses to modify a leaf that
# requires a gradient in place: nn.ReLU(inplace=True) as the first layer of a stage, fine in
# the unsplit model where it modifies the previous layer's output, fails once a cut falls
# before it. Stages are traced (torch.fx), so conveyor finds the inputs that the stage's code
# modifies in place, directly or through a view, and gives the stage copies of those (made
# inside the stage call, so that recomputation copies again from the unmodified input); a
# copy costs one input's memory per micro-batch, and only such stages pay it. An in-place
# write that tracing cannot see (inside a module kept whole) still fails, with a message that
# says what to change.
INPLACE_ON_LEAF = "leaf Variable that requires grad is being used in an in-place operation"
"""Part of autograd's error for an in-place write to a leaf that requires a gradient."""

_VIEWS = {
    "view",
    "view_as",
    "reshape",
    "transpose",
    "permute",
    "narrow",
    "select",
    "squeeze",
    "unsqueeze",
    "expand",
    "flatten",
    "unflatten",
    "t",
    "contiguous",
    "split",
    "chunk",
    "unbind",
    "detach",
    "getitem",
    "as_strided",
}
"""Functions and methods whose result may share the memory of their first argument."""


def modified_inputs(module: nn.Module) -> tuple[int, ...]:
    """Positions of the inputs that ``module`` (an fx.GraphModule; other modules: none known)
    modifies in place, directly or through a view."""
    if not isinstance(module, fx.GraphModule):
        return ()
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    return tuple(i for i, p in enumerate(placeholders) if _is_written(module, p))


def _is_written(module: nn.Module, value: fx.Node) -> bool:
    """Whether ``module``'s code writes ``value``, or a view of it, in place."""
    seen, frontier = {value}, [value]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if not user.args or user.args[0] is not node:
                continue
            if _writes_first(module, user):
                return True
            if _is_view(user) and user not in seen:
                seen.add(user)
                frontier.append(user)
    return False


def copying_inputs(module: nn.Module) -> Callable[..., Any]:
    """``module``, or a function that calls it with copies of the inputs it modifies in place
    (of their tensors that are leaves requiring a gradient)."""
    positions = modified_inputs(module)
    if not positions:
        return module

    def call(*args: Any) -> Any:
        copied = [
            pytree.tree_map_only(torch.Tensor, _copy, a) if i in positions else a
            for i, a in enumerate(args)
        ]
        return module(*copied)

    return call


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone() if tensor.is_leaf and tensor.requires_grad else tensor


def _name(node: fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def _is_view(node: fx.Node) -> bool:
    return node.op in ("call_method", "call_function") and _name(node) in _VIEWS


def _writes_first(module: nn.Module, node: fx.Node) -> bool:
    """Whether ``node`` writes its first argument in place."""
    if node.op == "call_module":
        return bool(getattr(module.get_submodule(str(node.target)), "inplace", False))
    if node.op not in ("call_method", "call_function"):
        return False
    if node.kwargs.get("inplace") is True or node.target in _OPERATORS:
        return True
    name = _name(node)
    return name.endswith("_") and not name.startswith("_")


_OPERATORS = {
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.imod,
    operator.ipow,
    operator.iand,
    operator.ior,
    operator.ixor,
    operator.ilshift,
    operator.irshift,
    operator.imatmul,
    operator.setitem,
}
"""Python's in-place operators as fx records them (``x[i] = v`` is ``setitem``)."""
