"""Which tensors of stages built on the meta device nothing has initialized yet.

    unset = Unset()
    entries = unset.mark("block", block, ["scale"])   # before block's initializer runs
    unset.keep(entries)                               # what the initializer left unset
    unset.problem("rank 0 (stage 0)")                 # '' once every tensor holds values

conveyor.pipeline.weights.materialize marks and keeps; Pipeline refuses steps while a problem
remains.
See Note [meta materialization].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from conveyor.text import listed
from conveyor.torch_compat import tensor_version

__all__ = ["Unset"]


# Note [meta materialization]:
# A stage built under torch.device("meta") has no memory; ``to_empty`` allocates it, full of
# whatever the allocator returns. Tensors no weights file provides are initialized by the
# modules that own them, children before parents, as constructors run them
# (nn.MultiheadAttention zeroes its out_proj's bias after out_proj initialized it): a
# transformers model's ``_init_weights``, else ``reset_parameters`` (torch's layers), else
# ``_reset_parameters`` (nn.MultiheadAttention, nn.Transformer). Initialization a constructor
# does by hand (a parameter or buffer set in ``__init__``) is not known here and is not
# replayed. So each tensor is first filled with a sentinel (NaN, or the smallest integer); a
# tensor still holding only the sentinel, still the same object and never written in place
# (its version counter unchanged) has not been initialized by anything: not by its module, by
# ``Pipeline.load_state_dict`` or by user code (``.data`` writes included, which the version
# counter misses). Such tensors are named at construction, and every rank refuses to run a
# step until they hold values (the check travels with the batch fingerprint), so nothing
# ever trains on uninitialized memory, while loading a state_dict after construction works.
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

    def mark(self, prefix: str, owner: nn.Module, leaves: Sequence[str]) -> list[_Entry]:
        """Fill ``owner``'s freshly allocated tensors ``leaves`` with sentinels, before its
        initializer runs; ``prefix`` is the owner's qualified name."""
        saved = set(owner.state_dict(keep_vars=True))
        entries = []
        for leaf in leaves:
            tensor = getattr(owner, leaf)
            sentinel = _sentinel(tensor.dtype)
            if sentinel is not None:
                with torch.no_grad():
                    tensor.fill_(sentinel)
            name = f"{prefix}.{leaf}" if prefix else leaf
            version = tensor_version(tensor)
            entries.append(_Entry(name, owner, leaf, tensor, version, leaf in saved))
        return entries

    def keep(self, entries: Sequence[_Entry], initialized: bool = True) -> None:
        """Remember the ``entries`` their initializer left unset (all of them if it could
        not run)."""
        self.entries += [e for e in entries if not (initialized and e.is_set())]

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
            f"{where}: {listed(names)} were built on the meta device and nothing has "
            f"initialized them (their modules, {owners}, have no initializer that sets "
            "them); training on them would use uninitialized memory. Load their values with "
            "pipe.load_state_dict(state) (a full model's state_dict works) or weights=DIR, "
            "give those modules a reset_parameters(), or build the model on a real device"
            + (
                f"; the non-persistent buffers {listed(buffers)} are in no state_dict, so "
                "for them only the last two work"
                if buffers
                else ""
            )
        )


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
