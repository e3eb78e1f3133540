"""A batch bound to a model's forward parameters, and a split run in one process.

bound = bind_inputs(model, (tokens, patches))   # {"tokens": ..., "patches": ...}
run_stages(graph, bound)                        # == model(tokens, patches)
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx, nn

from conveyor.graph import MODEL_OUTPUT, StageGraph
from conveyor.torch_compat import assert_is_none, pytree

__all__ = ["TracedInputs", "bind_error", "bind_inputs", "check_concrete_args", "run_stages"]


def run_stages(graph: StageGraph, inputs: Mapping[str, Any]) -> Any:
    """The model output, computed by running every stage in order in this process.

    ``inputs`` maps each of ``graph.model_inputs`` to its value (``bind_inputs`` makes it).
    Handy to check a split before starting processes: the result equals ``model(...)``.
    """
    missing = [name for name in graph.model_inputs if name not in inputs]
    if missing:
        raise ValueError(f"inputs lack {missing}; the stage graph takes {list(graph.model_inputs)}")
    values = dict(inputs)
    for stage in graph.stages:
        if stage.module is None:
            raise ValueError(
                f"stage {stage.index} has no module; run_stages needs a split model, not a topology"
            )
        out = stage.module(*[values[name] for name in stage.inputs])
        if not isinstance(out, tuple):
            out = (out,)
        values.update(zip(stage.outputs, out, strict=True))
    return values[MODEL_OUTPUT]


def bind_inputs(model: nn.Module | StageGraph, inputs: Any) -> dict[str, Any]:
    """Map a batch to the model's forward parameters: a tensor (the first argument), a tuple or
    list (positional arguments) or a dict (keyword arguments). Defaults fill the rest.

    For a StageGraph, its own binder (the split's) if it has one; else the names are its
    ``model_inputs`` and every one must be given.
    """
    if isinstance(model, StageGraph) and model.binder is not None:
        return model.binder(inputs)
    if isinstance(model, StageGraph):
        names = model.model_inputs
        if isinstance(inputs, dict):
            given = dict(inputs)
        elif isinstance(inputs, tuple | list):
            given = dict(zip(names, inputs, strict=False))
        else:
            given = {names[0]: inputs}
        missing = [n for n in names if n not in given]
        extra = sorted(set(given) - set(names))
        if missing or extra or (isinstance(inputs, tuple | list) and len(inputs) > len(names)):
            raise ValueError(
                f"the stage graph takes model inputs {list(names)}; got "
                f"{list(given) if not extra else sorted(given)}; pass every one "
                "(a dict by name, or a tuple in that order)"
            )
        return given
    signature = inspect.signature(model.forward)
    try:
        if isinstance(inputs, dict):
            bound = signature.bind(**inputs)
        elif isinstance(inputs, tuple | list):
            bound = signature.bind(*inputs)
        else:
            bound = signature.bind(inputs)
    except TypeError as error:
        raise ValueError(
            bind_error(f"{type(model).__name__}.forward", signature, inputs, error)
        ) from error
    bound.apply_defaults()
    return dict(bound.arguments)


def bind_error(name: str, signature: inspect.Signature, inputs: Any, error: TypeError) -> str:
    """What was passed to the forward ``name``, what it takes, and how to pass it."""
    kind = type(inputs).__name__
    if isinstance(inputs, dict | tuple | list):
        given = (
            f"a dict with keys {sorted(inputs)} (keyword arguments)"
            if isinstance(inputs, dict)
            else f"a {kind} of {len(inputs)} values (positional arguments)"
        )
        example = "({'a': a},)" if isinstance(inputs, dict) else "((a, b),)"
        fix = (
            f"; to pass one {kind} as forward's first argument, wrap it in a tuple: "
            f"pipe.forward({example})"
        )
    else:
        given = f"one {kind}"
        fix = "; pass a tensor (the first input), a tuple (positional inputs) or a dict by name"
    return (
        f"{name} takes model inputs {list(signature.parameters)}; cannot pass {given} to it "
        f"({error}){fix}"
    )


class TracedInputs:
    """Binds a batch to a model's forward as ``bind_inputs`` does, for a graph torch.fx traced,
    and refuses a batch the graph would get wrong: fx traces every input as a symbolic value,
    so the forward's Python decided, once, what to do with each input, whatever it is later.

    Raises (on call):
        ValueError: a tensor for an input the graph never reads (a test such as
            ``isinstance(mask, torch.Tensor)`` was false while tracing), a value for one
            specialized to None (``concrete_args``), or None for one the graph reads.
    """

    def __init__(
        self, model: nn.Module, graph: fx.Graph, concrete_args: Mapping[str, Any] | None = None
    ) -> None:
        self.model = model
        self.baked = {k: v for k, v in (concrete_args or {}).items() if v is not None}
        """Inputs ``concrete_args`` fixed to a value: the graph keeps that value."""
        self.uses: dict[str, str] = {}
        """Input name -> 'never' (no node reads it), 'none' (only fx's check that it is None),
        'operates' (an operation of the traced code takes it: None would fail) or 'passes'
        (only modules that are not traced take it, and may take None)."""
        for node in graph.nodes:
            if node.op != "placeholder":
                continue
            users = [u for u in node.users if u.target is not assert_is_none]
            operated = any(u.op in ("call_function", "call_method") for u in users)
            self.uses[str(node.target)] = (
                ("operates" if operated else "passes")
                if users
                else ("none" if node.users else "never")
            )

    def __call__(self, inputs: Any) -> dict[str, Any]:
        bound = bind_inputs(self.model, inputs)
        forward = f"{type(self.model).__name__}.forward"
        for name, baked in self.baked.items():
            if name in bound and not _same(bound[name], baked):
                raise ValueError(
                    f"{type(self.model).__name__} was split with {name}={baked!r} "
                    f"(concrete_args), which the traced graph keeps; this batch binds "
                    f"{name}={bound[name]!r} (given, or forward's default). Pass "
                    f"{name}={baked!r} in every batch, or build another Pipeline with "
                    f"concrete_args={{{name!r}: {bound[name]!r}}}"
                )
        for name, value in bound.items():
            use = self.uses.get(name)
            tensors = any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(value))
            if use == "never" and tensors:
                raise ValueError(
                    f"{forward} was given a tensor for {name!r}, which the traced model never "
                    "reads: while tracing, the inputs were symbolic values, and code that tests "
                    f"{name!r} (isinstance(..., torch.Tensor), a shape check) took the branch "
                    f"without it. Test '{name} is not None' instead, or move that code into a "
                    "submodule that lies wholly inside one stage (only modules that contain a "
                    f"split point are traced); if forward really ignores {name!r}, do not pass it"
                )
            if use == "none" and value is not None:
                raise ValueError(
                    f"{forward} was given a value for {name!r}, which the split specialized to "
                    f"None (concrete_args); build the Pipeline without {name!r} in "
                    "concrete_args to pass it"
                )
            if use == "operates" and value is None:
                raise ValueError(
                    f"{forward} got None for {name!r}, which the traced model reads as a "
                    f"tensor (while tracing, '{name} is None' was false), so a stage would "
                    f"fail on it. Pass {name!r}, or build the Pipeline with "
                    f"concrete_args={{{name!r}: None}} to split the forward without it"
                )
        return bound


_PLAIN = (bool, int, float, str)
"""The values torch.fx keeps in a graph and can check a later value against: tuples,
tensors and other objects it bakes in element by element, or not at all."""


def check_concrete_args(model: nn.Module, concrete_args: Mapping[str, Any] | None) -> None:
    """Refuse, before tracing, ``concrete_args`` that name no forward parameter (a typo
    would be ignored) or fix a value torch.fx cannot keep and check (a tuple, a tensor).

    Raises:
        ValueError: naming the entry and what to pass instead.
    """
    names = list(inspect.signature(model.forward).parameters)
    for name, value in (concrete_args or {}).items():
        if name not in names:
            raise ValueError(
                f"concrete_args names {name!r}, which {type(model).__name__}.forward does not "
                f"take; expected some of {names}"
            )
        if value is not None and not isinstance(value, _PLAIN):
            raise ValueError(
                f"concrete_args fixes {name!r} to a {type(value).__name__}, which torch.fx "
                "cannot keep in the graph and check against later batches; fix only None, "
                "bools, numbers and strings, and pass the rest in the batch"
            )
        if value != value:  # torch.fx checks a batch's value with ==, which NaN never passes
            raise ValueError(
                f"concrete_args fixes {name!r} to NaN, which equals nothing, so no batch could "
                "pass torch.fx's check of it; pass it in the batch instead"
            )


def _same(value: Any, baked: Any) -> bool:
    """Whether a batch's ``value`` is the ``baked`` one, as fx's own check compares them."""
    return isinstance(value, _PLAIN) and bool(value == baked)
