"""Activation memory accounting: bytes a rank keeps for backward, per stage and micro-batch."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["ActivationMeter", "MemoryReport"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryReport:
    """Peaks over the steps since the last reset, for one rank."""

    peak_bytes: int
    """Most activation bytes held at once (stage inputs, outputs and tensors saved for
    backward; each storage counted once; parameters excluded)."""
    peak_microbatches: int
    """Most (stage, micro-batch) activation sets alive at once."""


@dataclass
class ActivationMeter:
    """Counts the storages a rank keeps between a micro-batch's forward and its backward.

    Tensors saved by autograd are seen through ``saved_tensors_hooks``; with activation
    checkpointing autograd saves nothing inside the stage, so only its inputs and outputs
    count, which is what recomputation keeps.
    """

    excluded: set[int] = field(default_factory=set)
    """Storage pointers never counted (parameters)."""
    _held: dict[tuple[int, int], dict[int, int]] = field(default_factory=dict)
    peak_bytes: int = 0
    peak_microbatches: int = 0

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        self.excluded.update(t.untyped_storage().data_ptr() for t in tensors)

    @contextmanager
    def saving(self, key: tuple[int, int]) -> Iterator[None]:
        """Count what autograd saves for backward while the body runs ``key``'s forward."""
        storages = self._held.setdefault(key, {})

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            self._add(storages, tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        self._update_peak()

    def hold(self, key: tuple[int, int], value: Any) -> None:
        """Count the tensors in ``value`` (a stage's inputs or outputs) as held by ``key``."""
        storages = self._held.setdefault(key, {})
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                self._add(storages, leaf)
        self._update_peak()

    def release(self, key: tuple[int, int]) -> None:
        """``key``'s backward is done: its activations are freed."""
        self._held.pop(key, None)

    @property
    def held_bytes(self) -> int:
        unique: dict[int, int] = {}
        for storages in self._held.values():
            unique.update(storages)
        return sum(unique.values())

    def report(self) -> MemoryReport:
        return MemoryReport(self.peak_bytes, self.peak_microbatches)

    def reset(self) -> None:
        self.peak_bytes = self.held_bytes
        self.peak_microbatches = len(self._held)

    def _add(self, storages: dict[int, int], tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self.excluded:
            storages[pointer] = storage.nbytes()

    def _update_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        self.peak_microbatches = max(self.peak_microbatches, len(self._held))
