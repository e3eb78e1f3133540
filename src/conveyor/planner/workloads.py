"""Workloads the planner, the benchmarks and ``conveyor plan --model`` know by name.

workload = load_workload("gpt")                     # an example
workload = load_workload("mypkg.models:workload")   # any factory of a Workload
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import nn

from conveyor.models import gpt, gpt_loss, text_batches
from conveyor.models.unbalanced import mse, regression_batch, unbalanced_mlp
from conveyor.planner.profile import Workload

__all__ = ["EXAMPLES", "example", "load_workload"]


def _gpt() -> Workload:
    return Workload(
        "gpt", gpt(seq_len=64, dim=64, num_layers=4), lambda n: text_batches(n, 64, 1)[0], gpt_loss
    )


def _unbalanced() -> Workload:
    return Workload("unbalanced", unbalanced_mlp(), regression_batch, mse)


EXAMPLES: dict[str, Callable[[], Workload]] = {"gpt": _gpt, "unbalanced": _unbalanced}
"""Models the planner and benchmarks know by name: name -> factory of a Workload."""


def example(name: str) -> Workload:
    """The Workload of a named example (see ``EXAMPLES``)."""
    if name not in EXAMPLES:
        raise ValueError(
            f"unknown example {name!r}; expected one of {sorted(EXAMPLES)} or an "
            "importable factory 'package.module:function'"
        )
    return EXAMPLES[name]()


def load_workload(spec: str) -> Workload:
    """An example name, or ``package.module:function`` returning a Workload (or a tuple
    ``(model, batch_fn, loss_fn)`` where ``batch_fn(batch_size) -> (inputs, targets)``)."""
    if ":" not in spec:
        return example(spec)
    module_name, _, attribute = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"cannot import {spec!r} ({error}); expected 'package.module:function' "
            "naming a function that returns a Workload"
        ) from error
    made = factory()
    if isinstance(made, Workload):
        return made
    if isinstance(made, tuple) and len(made) == 3 and isinstance(made[0], nn.Module):
        return Workload(spec, made[0], made[1], made[2])
    raise TypeError(
        f"{spec} returned {type(made).__name__}; expected a conveyor.planner."
        "Workload or a tuple (model, batch_fn, loss_fn)"
    )
