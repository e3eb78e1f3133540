"""A batch bound to a model's forward parameters, and a split run in one process.

bound = bind_inputs(model, (tokens, patches))   # {"tokens": ..., "patches": ...}
run_stages(graph, bound)                        # == model(tokens, patches)
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch import nn

from conveyor.graph import MODEL_OUTPUT, StageGraph

__all__ = ["bind_inputs", "run_stages"]


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
            f"{type(model).__name__} takes model inputs {list(signature.parameters)}; the batch "
            f"does not fit them ({error}); pass a tensor (the first input), a tuple (positional "
            "inputs) or a dict by name"
        ) from error
    bound.apply_defaults()
    return dict(bound.arguments)
