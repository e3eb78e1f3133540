"""Capture a model's graph with torch.fx for splitting: only modules that contain a cut are
traced.

Internal to conveyor.split: ``capture_graph`` returns the fx graph the split methods assign to
stages, and turns a tracing failure into an error that names the operation, the module and
the line of user code, and says how to avoid tracing it.
"""

from __future__ import annotations

import difflib
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from conveyor.split.skip import SKIPS_KWARG, skip_names

__all__: list[str] = []

COMPUTE_OPS = ("call_module", "call_function", "call_method")
HOW_TO_ANNOTATE = (
    "To split by hand instead, name the submodules of each stage (split_by_modules, or "
    "Pipeline(stage_modules=('text', 'image', 'head,norm'))): only modules that contain an "
    "annotated one are traced, so untraceable code inside a stage's modules is fine"
)


class SkipError(ValueError):
    """Stash/pop layers that do not match; raised as is, never wrapped as a tracing failure."""


class _Tracer(fx.Tracer):
    """Traces into the modules that contain a split point and keeps every other one whole.

    A module wholly inside one stage is never traced, so its own code may do anything (data
    dependent control flow included). Stash/pop layers (conveyor.split.skip) are called with their
    popped values and return their stashed ones, so each skip becomes a graph edge.
    """

    def __init__(
        self, split_points: Sequence[str], leaf: Callable[[nn.Module, str], bool] | None = None
    ) -> None:
        super().__init__()
        self.containers = {
            p.rsplit(".", i)[0] for p in split_points for i in range(1, p.count(".") + 1)
        }
        self.leaf = leaf
        self.skips: dict[str, Any] = {}
        self.skip_owner: dict[str, str] = {}

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self.leaf is not None:
            return self.leaf(m, module_qualified_name)
        return module_qualified_name not in self.containers

    def call_module(
        self,
        m: nn.Module,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        names = skip_names(m)
        if names is None:
            return super().call_module(m, forward, args, kwargs)
        label = f"{self.path_of_module(m)} ({type(m).__name__})"
        popped = {}
        for name in names.pops:
            if name not in self.skips:
                raise SkipError(
                    f"layer {label} pops {name!r}, which no layer before it "
                    "stashes (or an earlier layer already popped it)"
                )
            popped[name] = self.skips.pop(name)
            del self.skip_owner[name]
        result = super().call_module(m, forward, args, {**kwargs, SKIPS_KWARG: popped})
        stashed = result[1] if names.stashes else None
        for name in names.stashes:
            if name in self.skips:
                raise SkipError(
                    f"layers {self.skip_owner[name]} and {label} both stash "
                    f"{name!r} before it is popped; rename one with "
                    "conveyor.split.skip.rename"
                )
            self.skips[name] = stashed[name]  # type: ignore[index]  # a dict or a Proxy
            self.skip_owner[name] = label
        return result[0]


def capture_graph(
    model: nn.Module,
    split_points: Sequence[str] = (),
    concrete_args: dict[str, Any] | None = None,
    leaf: Callable[[nn.Module, str], bool] | None = None,
    hint: str | Callable[[str], str] = "",
) -> fx.Graph:
    """Trace ``model`` with torch.fx; on failure, say where tracing stopped and what to do.

    ``hint`` is the advice to give, or a function of the qualified name of the module whose
    code stopped tracing ('' for the model's own forward) that returns it.

    Raises:
        TypeError: tracing failed; the message names the operation and the module being
            traced, the line of user code, and how to avoid tracing it.
        ValueError: stash/pop layers do not match (conveyor.split.skip).
    """
    tracer = _Tracer(split_points, leaf)
    try:
        graph = tracer.trace(model, concrete_args)
    except SkipError:
        raise
    except Exception as error:
        stack = list(tracer.module_stack.values())
        name = stack[-1][0] if stack else ""
        inside = f" inside module {name!r} ({stack[-1][1].__name__})" if name else ""
        advice = (hint(name) if callable(hint) else hint) or (
            "Only the modules that contain a split point are traced, so move the untraceable "
            "code into a submodule that lies wholly inside one stage, choose split points "
            "around it, pass concrete_args for inputs that steer control flow, or use an "
            "nn.Sequential with balance"
        )
        raise TypeError(
            f"cannot trace {type(model).__name__} with torch.fx to split it: tracing stopped "
            f"at {type(error).__name__}: {error}{inside}{where(error)}. {advice}"
        ) from error
    taken = {str(n.target) for n in graph.nodes if n.op == "placeholder"}
    for node in graph.nodes:  # fx renames specialized arguments ('scale' -> 'scale_1')
        base = str(node.target).rpartition("_")[0]
        if (
            node.op == "placeholder"
            and concrete_args
            and base in concrete_args
            and base not in taken
        ):
            node.target = base
    if tracer.skips:
        owners = ", ".join(
            f"{name!r} (stashed by {tracer.skip_owner[name]})" for name in tracer.skips
        )
        raise SkipError(
            f"skips {owners} are never popped; pop each stashed name in a later "
            "layer, or stop stashing it"
        )
    return graph


def where(error: BaseException) -> str:
    """' (at file:line in func: code)' for the last frame of model code in the traceback:
    neither torch's nor conveyor.split's own."""
    skipped = (str(Path(torch.__file__).parent), str(Path(__file__).parent))
    frames = [
        f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(skipped)
    ]
    if not frames:
        return ""
    frame = frames[-1]
    return f" (at {frame.filename}:{frame.lineno} in {frame.name}: {frame.line})"


NO_MODULE = "_empty_nn_module_stack_from_metadata_hook"
"""The module path torch.export records for code outside every module."""


def module_path(node: fx.Node) -> str:
    """Qualified name of the innermost submodule that runs ``node`` ("" for the model's own
    code): the called module for an fx ``call_module``, else the module stack the tracer
    recorded."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for path, _ in stack.values() if path and path != NO_MODULE]
    return paths[-1] if paths else ""


def within(path: str, prefix: str) -> bool:
    """Whether submodule ``path`` is ``prefix`` or inside it."""
    return path == prefix or path.startswith(prefix + ".")


def unknown_module(model: nn.Module, name: str, what: str) -> ValueError:
    """The error for a ``what`` (a split point, an annotated module) naming no submodule of
    ``model``: it offers the closest names (``vit.layers.2`` for ``vit.encoder.layer.2``)."""
    names = [n for n, _ in model.named_modules() if n]
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    offered = close or [n for n, _ in model.named_children()][:6]
    offer = f"did you mean one of {offered}?" if close else f"expected such names as {offered}"
    return ValueError(f"{what} {name!r} is not a submodule of {type(model).__name__}; {offer}")
