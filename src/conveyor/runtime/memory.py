"""Activation memory accounting: bytes a rank keeps for backward, per stage and micro-batch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from conveyor.program import Action, Kind
from conveyor.torch_compat import pytree

__all__ = ["ActivationMeter", "LiveSavedTensors", "MemoryReport", "alive_peak"]


@dataclass(frozen=True)
class MemoryReport:
    """Peaks over the steps since the last reset, for one rank."""

    peak_bytes: int
    """Most activation bytes held at once (stage inputs, outputs and tensors saved for
    backward; each storage counted once; parameters excluded)."""
    peak_microbatches: int
    """Most (stage, micro-batch) activation sets alive at once."""
    peak_saved_bytes: int = 0
    """Most bytes of tensors autograd had saved for backward and not yet released (measured
    by liveness, as LiveSavedTensors measures any framework's step)."""


class _Saved:
    """What autograd keeps for a saved tensor while LiveSavedTensors watches: the tensor and a
    callback when autograd lets it go."""

    __slots__ = ("owner", "pointer", "tensor")

    def __init__(self, owner: LiveSavedTensors, tensor: torch.Tensor, pointer: int) -> None:
        self.owner, self.tensor, self.pointer = owner, tensor, pointer

    def __del__(self) -> None:
        self.owner._free(self.pointer)


class LiveSavedTensors:
    """Bytes of the tensors autograd has saved for backward and not released yet, for any
    framework's step: each storage counted once, excluded storages (parameters) never.

        live = LiveSavedTensors(model.parameters())
        with live.watching():
            schedule.step(x)            # e.g. torch.distributed.pipelining
        live.peak_bytes
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, list[int]] = {}  # storage -> [bytes, saved tensors alive]
        self.generation: dict[int, int] = {}
        """Per storage pointer, how often saved tensors there were all released: a pointer
        seen again after that may be new memory at a reused address."""
        self.bytes = 0
        self.peak_bytes = 0

    @contextmanager
    def watching(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.device.type == "meta":
            return tensor
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer in self.excluded:
            return tensor
        return self.track(tensor, pointer, storage.nbytes())

    def track(self, tensor: torch.Tensor, pointer: int, nbytes: int) -> _Saved:
        """``pack`` for a tensor whose storage the caller has looked up already."""
        entry = self._live.setdefault(pointer, [nbytes, 0])
        if entry[1] == 0:
            self.bytes += entry[0]
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        entry[1] += 1
        # detached: holding an output with its grad_fn would make a cycle through the graph
        return _Saved(self, tensor.detach(), pointer)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def reset(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak_bytes = self.bytes

    def identity(self, pointer: int) -> tuple[int, int]:
        """The storage at ``pointer`` told apart from earlier ones there: (address,
        generation); See Note [reused addresses]."""
        return pointer, self.generation.get(pointer, 0)

    def _free(self, pointer: int) -> None:
        entry = self._live[pointer]
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= entry[0]
            del self._live[pointer]
            self.generation[pointer] = self.generation.get(pointer, 0) + 1


# Note [reused addresses]:
# The meter counts a (stage, micro-batch)'s storages from its forward until its backward ends,
# as the schedules' theory and the simulator do, even when autograd lets one go earlier (a
# split backward's I frees what only the input gradient needed). Storages are known by their
# address, and a freed address is soon reused: counted by address alone, a new tensor there
# merged with the freed one, and a peak came out one storage short in about one run of four.
# So each address carries a generation, bumped when autograd releases the last saved tensor
# there, and the meter tells storages apart by (address, generation).
@dataclass
class ActivationMeter:
    """Counts the storages a rank keeps between a micro-batch's forward and its backward.

    Tensors saved by autograd are seen through ``saved_tensors_hooks``; with activation
    checkpointing autograd saves nothing inside the stage, so only its inputs and outputs
    count, which is what recomputation keeps. With a split backward a (stage, micro-batch)
    stays alive until its W: after I the runtime keeps the saved tensors and the gradients W
    starts from (``keep_only``), no longer the stage's inputs and outputs.
    """

    enabled: bool = True
    """Off: every method returns at once and nothing is counted (no hooks, no cost)."""
    excluded: set[int] = field(default_factory=set)
    """Storage pointers never counted (parameters)."""
    _held: dict[tuple[int, int], dict[tuple[int, int], int]] = field(default_factory=dict)
    """Storages autograd saved for each (stage, micro-batch), by (pointer, generation): see
    See Note [reused addresses]."""
    _values: dict[tuple[int, int], dict[tuple[int, int], int]] = field(default_factory=dict)
    """Storages the runtime itself holds for each: inputs and outputs, or W's gradients."""
    peak_bytes: int = 0
    peak_microbatches: int = 0
    live: LiveSavedTensors = field(default_factory=LiveSavedTensors)
    """Saved tensors by liveness: what autograd has not released yet."""

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        self.excluded.update(t.untyped_storage().data_ptr() for t in tensors)
        self.live.excluded = self.excluded

    @contextmanager
    def saving(self, key: tuple[int, int]) -> Iterator[None]:
        """Count what autograd saves for backward while the body runs ``key``'s forward
        (nothing, and no key, under ``torch.no_grad``)."""

        if not self.enabled:
            yield
            return
        excluded, live = self.excluded, self.live

        def pack(tensor: torch.Tensor) -> Any:  # hot: once per tensor autograd saves
            if tensor.device.type == "meta":
                return tensor
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
            if pointer in excluded:
                return tensor
            nbytes = storage.nbytes()
            self._held.setdefault(key, {})[live.identity(pointer)] = nbytes
            return live.track(tensor, pointer, nbytes)

        with torch.autograd.graph.saved_tensors_hooks(pack, self.live.unpack):
            yield
        self._update_peak()

    def hold(self, key: tuple[int, int], value: Any) -> None:
        """Count the tensors in ``value`` (a stage's inputs or outputs) as held by ``key``."""
        if not self.enabled:
            return
        self._held.setdefault(key, {})
        storages = self._values.setdefault(key, {})
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                self._add(storages, leaf)
        self._update_peak()

    def keep_only(self, key: tuple[int, int], value: Any) -> None:
        """``key``'s input gradient is done (I): of what the runtime held, only ``value``
        (the gradients W starts from) stays; what autograd saved stays until ``release``."""
        self._values.pop(key, None)
        self.hold(key, value)

    def release(self, key: tuple[int, int]) -> None:
        """``key``'s backward is done (B, or W after I): its activations are freed."""
        self._held.pop(key, None)
        self._values.pop(key, None)

    @property
    def held_bytes(self) -> int:
        unique: dict[tuple[int, int], int] = {}
        for table in (self._held, self._values):
            for storages in table.values():
                unique.update(storages)
        return sum(unique.values())

    @property
    def held_microbatches(self) -> int:
        """(stage, micro-batch) pairs whose activations are alive now."""
        return len(self._held.keys() | self._values.keys())

    def report(self) -> MemoryReport:
        return MemoryReport(self.peak_bytes, self.peak_microbatches, self.live.peak_bytes)

    def reset(self) -> None:
        self.peak_bytes = self.held_bytes
        self.peak_microbatches = self.held_microbatches
        self.live.reset()

    def _add(self, storages: dict[tuple[int, int], int], tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self.excluded:
            storages[self.live.identity(pointer)] = storage.nbytes()

    def _update_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        self.peak_microbatches = max(self.peak_microbatches, self.held_microbatches)


def alive_peak(actions: Iterable[Action]) -> int:
    """Most (stage, micro-batch) pairs one rank's actions keep alive at once: from F until B,
    or until W after I. The runtime's ``MemoryReport.peak_microbatches`` measures the same."""
    alive: set[tuple[int, int]] = set()
    peak = 0
    for action in actions:
        key = (action.stage, action.microbatch)
        if action.kind is Kind.F:
            alive.add(key)
            peak = max(peak, len(alive))
        elif action.kind in (Kind.B, Kind.W):
            alive.discard(key)
    return peak
