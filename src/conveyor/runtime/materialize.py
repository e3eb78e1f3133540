"""Allocate a stage built on the meta device, initialize it as torch's modules do, and know
which of its tensors nothing has initialized yet.

    unset = Unset()
    stage = materialize(stage, device, unset)   # allocated, reset_parameters() run
    unset.problem("rank 0 (stage 0)")           # '' once every tensor holds values

See Note [meta materialization].
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from conveyor.torch_compat import tensor_version

__all__ = ["Unset", "materialize"]

logger = logging.getLogger(__name__)


# Note [meta materialization]:
# A stage built under torch.device("meta") has no memory; ``to_empty`` allocates it, full of
# whatever the allocator returns. Each submodule's own initializer then runs, children before
# parents, as constructors run them (nn.MultiheadAttention initializes its projections after
# building its out_proj): ``reset_parameters`` (torch's layers), else ``_reset_parameters``
# (nn.MultiheadAttention, nn.Transformer). Initialization a constructor did by hand (a model's
# own ``_init_weights``, a buffer computed in ``__init__``) is not known here and is not
# replayed. Every tensor is first filled with a sentinel (NaN, or the smallest integer), so a
# tensor still holding only the sentinel, still the same object and never written in place
# (its version counter unchanged) has not been initialized by anything: not by the resets, by
# ``Pipeline.load_state_dict`` or by user code (``.data`` writes included, which the version
# counter misses). Such tensors are reported, and every step refuses to run until they hold
# values, so nothing ever trains on uninitialized memory.
@dataclass
class _Entry:
    name: str
    owner: nn.Module
    attribute: str
    tensor: torch.Tensor
    version: int
    persistent: bool

    def is_set(self) -> bool:
        current = getattr(self.owner, self.attribute, None)
        if current is not self.tensor or tensor_version(self.tensor) != self.version:
            return True
        sentinel = _sentinel(self.tensor.dtype)
        return sentinel is not None and not _holds_only(self.tensor, sentinel)


@dataclass
class Unset:
    """Tensors of this rank's materialized stages that nothing has initialized yet."""

    entries: list[_Entry] = field(default_factory=list)

    def names(self) -> list[str]:
        """Qualified names of the tensors still uninitialized (checks again; cheap once all
        are set)."""
        self.entries = [e for e in self.entries if not e.is_set()]
        return [e.name for e in self.entries]

    def problem(self, where: str) -> str:
        """Why ``where`` cannot run yet, or '' if every tensor holds values."""
        names = self.names()
        if not names:
            return ""
        owners = ", ".join(sorted({type(e.owner).__name__ for e in self.entries}))
        buffers = [e.name for e in self.entries if not e.persistent]
        return (
            f"{where}: {_listed(names)} were built on the meta device and nothing has "
            f"initialized them (their modules, {owners}, have no reset_parameters() that "
            "sets them); training on them would use uninitialized memory. Load their "
            "values with pipe.load_state_dict(state) (a full model's state_dict works), "
            "give those modules a reset_parameters(), or build the model on a real device"
            + (
                f"; the non-persistent buffers {_listed(buffers)} are in no state_dict, so "
                "for them only the last two work"
                if buffers
                else ""
            )
        )


def materialize(module: nn.Module, device: torch.device, unset: Unset) -> nn.Module:
    """``module`` on ``device``; if it is on the meta device, allocated and initialized by
    its submodules' reset methods, with what they leave unset added to ``unset``."""
    if not any(slot[3].is_meta for slot in _owned(module)):
        return module.to(device)
    on_meta = {(id(owner), attribute) for _, owner, attribute, t, _ in _owned(module) if t.is_meta}
    module.to_empty(device=device)
    entries = []
    for name, owner, attribute, tensor, persistent in _owned(module):
        if (id(owner), attribute) in on_meta:
            sentinel = _sentinel(tensor.dtype)
            if sentinel is not None:
                with torch.no_grad():
                    tensor.fill_(sentinel)
            version = tensor_version(tensor)
            entries.append(_Entry(name, owner, attribute, tensor, version, persistent))
    for sub in _children_first(module):
        reset = getattr(sub, "reset_parameters", None) or getattr(sub, "_reset_parameters", None)
        if callable(reset):
            reset()
    left = [e for e in entries if not e.is_set()]
    if left:
        logger.warning(
            "%s have no initializer (no reset_parameters()); load their values with "
            "Pipeline.load_state_dict before the first step",
            _listed([e.name for e in left]),
        )
    unset.entries += left
    return module


def _owned(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor, bool]]:
    """(qualified name, owner, attribute, tensor, in the state_dict) of every parameter and
    buffer, each tensor once."""
    saved = set(module.state_dict(keep_vars=True))
    seen: set[int] = set()
    for prefix, owner in module.named_modules():
        slots = [*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)]
        for attribute, tensor in slots:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                name = f"{prefix}.{attribute}" if prefix else attribute
                yield name, owner, attribute, tensor, name in saved


def _children_first(module: nn.Module) -> Iterator[nn.Module]:
    """Every submodule once, each after its children (the order constructors finish in)."""
    seen: set[int] = set()

    def visit(current: nn.Module) -> Iterator[nn.Module]:
        seen.add(id(current))
        for child in current.children():
            if id(child) not in seen:
                yield from visit(child)
        yield current

    yield from visit(module)


def _sentinel(dtype: torch.dtype) -> float | int | None:
    """The value an allocated tensor is filled with until something initializes it."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return None
    return int(torch.iinfo(dtype).min)


def _holds_only(tensor: torch.Tensor, sentinel: float | int) -> bool:
    if isinstance(sentinel, float):
        return bool(torch.isnan(tensor).all())
    return bool((tensor == sentinel).all())


def _listed(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{f', ... ({len(names)} in all)' if len(names) > limit else ''}]"
