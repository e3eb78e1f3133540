"""One front end for every way to split: trace the model with torch.fx or torch.export.

    traced = capture(model, cut_at=["layers.4"], example_inputs=batch)   # fx if it can, else export
    traced.graph, traced.root      # the graph and the module its attributes come from
    module_path(node)              # the submodule that runs a node: what split methods cut by

torch.fx keeps every module that contains no cut whole (its code may do anything, stages run
the model's own modules); torch.export traces what fx cannot (decorated forwards, masks built
from the inputs, branches on config values), through the example inputs. With
``tracer="auto"`` fx is tried first and export follows, logged, when fx fails and example
inputs are given. Split points, stage modules and the automatic split all assign nodes to
stages by ``module_path``, so the three agree whichever tracer ran. A model built on the meta
device is exported on fake tensors of the device its stages run on (``device``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import fx, nn

from conveyor.split.capture import NO_MODULE, capture_graph, module_path, within
from conveyor.split.export import HOLDS_FOR, export_model
from conveyor.split.inputs import TracedInputs, check_concrete_args
from conveyor.torch_compat import pytree

__all__ = ["NO_MODULE", "Traced", "Tracer", "capture", "module_path", "within"]

logger = logging.getLogger(__name__)

Tracer = Literal["auto", "fx", "export"]
TRACERS: tuple[Tracer, ...] = ("auto", "fx", "export")


@dataclass(frozen=True)
class Traced:
    """A model traced for splitting."""

    graph: fx.Graph
    root: nn.Module
    """The module the graph's attributes and submodules resolve against (the model for fx;
    export's graph module, holding the model's own parameters, for export)."""
    binder: Callable[[Any], dict[str, Any]]
    """A batch as the graph's inputs, by placeholder name."""
    output_spec: pytree.TreeSpec | None
    """How the graph's flat output becomes the model's output (export); None: as returned."""
    method: Literal["fx", "export"]
    training: bool | None = None
    """The only mode (``model.training``) the graph holds for: fx traced code that reads
    ``self.training``, or an export in eval mode lost what training needs. None: both."""


def capture(
    model: nn.Module,
    *,
    cut_at: Sequence[str] = (),
    leaf: Callable[[nn.Module, str], bool] | None = None,
    concrete_args: dict[str, Any] | None = None,
    example_inputs: Any = None,
    tracer: Tracer = "auto",
    hint: str | Callable[[str], str] = "",
    device: torch.device | str | None = None,
) -> Traced:
    """Trace ``model`` with torch.fx (into the modules that contain ``cut_at`` names, or as
    ``leaf`` says) or torch.export (on ``example_inputs``), per ``tracer``. ``device`` is where
    the stages will run (default: the example inputs' device); an export of a model built on
    the meta device traces it as if it were there (conveyor.split.fake).

    Raises:
        TypeError: the model cannot be traced; the message names the operation, the module and
            the line, and what to do.
        ValueError: an unknown tracer, or export asked for without example inputs.
    """
    if tracer not in TRACERS:
        raise ValueError(f"tracer must be one of {list(TRACERS)}, got {tracer!r}")
    check_concrete_args(model, concrete_args)
    if tracer == "export":
        return _exported(model, example_inputs, device)
    try:
        graph = capture_graph(model, cut_at, concrete_args, leaf, hint)
    except TypeError as error:
        if tracer == "fx" or example_inputs is None:
            raise TypeError(
                f"{error}. Or pass example_inputs=<a batch as step() takes it> to split "
                "through torch.export, which traces what torch.fx cannot"
            ) from error
        cause = error.__cause__ or error
        logger.info(
            "torch.fx cannot trace %s (%s: %s); splitting it through torch.export",
            type(model).__name__,
            type(cause).__name__,
            str(cause).strip().splitlines()[0][:120] if str(cause).strip() else "",
        )
        return _exported(model, example_inputs, device)
    retrace = functools.partial(capture_graph, model, cut_at, concrete_args, leaf, hint)
    mode = _mode(model, graph, retrace)
    return Traced(graph, model, TracedInputs(model, graph, concrete_args), None, "fx", mode)


def _mode(model: nn.Module, graph: fx.Graph, retrace: Callable[[], fx.Graph]) -> bool | None:
    """The mode (``model.training``) ``graph`` holds for, or None if it holds for both: traced
    code that reads ``self.training`` keeps only the branch of the mode it was traced in."""
    modes = [(module, module.training) for module in model.modules()]
    model.train(not model.training)
    try:
        other = retrace()
    finally:
        for module, training in modes:
            module.training = training
    same = other.python_code("self").src == graph.python_code("self").src
    return None if same else model.training


def _exported(model: nn.Module, example_inputs: Any, device: torch.device | str | None) -> Traced:
    if example_inputs is None:
        raise ValueError(
            f"splitting {type(model).__name__} through torch.export needs example_inputs=<a "
            "batch as step() takes it>, e.g. {'input_ids': ids, 'labels': labels}"
        )
    module, inputs, output_spec = export_model(model, example_inputs, device)
    module.training = model.training  # stages start in the model's mode (train() is refused)
    return Traced(module.graph, module, inputs.bind, output_spec, "export", module.meta[HOLDS_FOR])
