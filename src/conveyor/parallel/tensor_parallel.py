"""Tensor parallelism inside a stage: a user's plan applied with torch's parallelize_module.

plan = {"*.mlp.0": ColwiseParallel(), "*.mlp.2": RowwiseParallel()}
pipe = conveyor.Pipeline(model, tp=2, tp_plan=plan, ...)   # every stage, its own entries
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["TPPlan", "check_plan", "parallelize_stages"]

TPPlan = Mapping[str, "ParallelStyle"]
"""Qualified module names of the plain model (``*`` matches one name component, as in
``parallelize_module``) -> how to split that module (ColwiseParallel, RowwiseParallel, ...)."""


def _matches(pattern: str, name: str) -> bool:
    """Whether module ``name`` matches ``pattern`` component by component."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(map(fnmatchcase, names, parts))


def check_plan(plan: TPPlan, module_names: Iterable[str]) -> None:
    """Raise ValueError, before any communication, for an entry that names no module of the
    model (``module_names``: every submodule's qualified name, over all stages)."""
    names = list(module_names)
    unmatched = [key for key in plan if not any(_matches(key, n) for n in names)]
    if unmatched:
        examples = [n for n in names if n][:6]
        raise ValueError(
            f"tp_plan entries {unmatched} name no submodule of the model; expected qualified "
            f"names of the plain model such as {examples} ('*' matches one component)"
        )


def parallelize_stages(stages: Mapping[int, nn.Module], mesh: DeviceMesh, plan: TPPlan) -> None:
    """Split each stage's modules over ``mesh`` by the entries of ``plan`` it holds.

    Stage modules keep the plain model's qualified names, so one plan serves every split.
    """
    from torch.distributed.tensor.parallel import parallelize_module  # Note [DTensor unimported]

    for module in stages.values():
        names = [name for name, _ in module.named_modules() if name]
        mine = {key: style for key, style in plan.items() if any(_matches(key, n) for n in names)}
        if mine:
            parallelize_module(module, mesh, dict(mine))
