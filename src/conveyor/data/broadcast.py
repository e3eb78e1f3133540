"""One rank of a pipeline loads every batch and sends it to the others, which follow its position.

batches = broadcast_batches(loader, group=pipe.group)   # on every rank of the pipeline
inputs, targets = next(batches)                         # loaded and augmented on rank 0
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["Loader", "broadcast_batches"]


class Loader(Protocol):
    """What broadcast_batches needs of a loader (ResumableLoader and Refurbish are ones)."""

    def forever(self) -> Iterator[Any]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class _Slot:
    """Where a batch's tensor goes back in (its position in the broadcast order)."""

    position: int


def broadcast_batches(
    loader: Loader, group: dist.ProcessGroup | None = None, src: int = 0
) -> Iterator[Any]:
    """Batches of ``loader.forever()``, loaded only on rank ``src`` of ``group`` and broadcast
    to its other ranks: Pipeline.step needs the same batch on every rank of a pipeline, and
    decoding and augmenting it once, on the first stage's rank, spares the others' cores.

    Every rank passes a loader built alike; on the ranks that receive, it is never iterated
    but follows ``src``'s position (``load_state_dict`` after each batch), so
    ``Checkpointer(data=loader)`` saves the same position on every rank. Batches are tensors in
    tuples, lists and dicts (other values are sent pickled). A collective: every rank of
    ``group`` takes each batch, in the same order.
    """
    is_source = dist.get_rank(group) == src
    source = loader.forever() if is_source else None
    while True:
        header: list[Any] = [None]
        tensors: list[torch.Tensor] = []
        if source is not None:
            skeleton = _split(next(source), tensors)
            tensors = [t.contiguous() for t in tensors]
            layout = [(t.shape, t.dtype) for t in tensors]
            header = [(skeleton, layout, loader.state_dict())]
        dist.broadcast_object_list(header, group=group, group_src=src)
        skeleton, layout, state = header[0]
        if source is None:
            tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in layout]
        for tensor in tensors:
            dist.broadcast(tensor, group=group, group_src=src)
        if source is None:
            loader.load_state_dict(state)
        yield _join(skeleton, tensors)


def _split(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by a _Slot, the tensors appended to ``tensors``."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Slot(len(tensors) - 1)
    if isinstance(value, tuple | list):
        return _rebuild(value, [_split(item, tensors) for item in value])
    if isinstance(value, dict):
        return {key: _split(item, tensors) for key, item in value.items()}
    return value


def _join(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, _Slot):
        return tensors[skeleton.position]
    if isinstance(skeleton, tuple | list):
        return _rebuild(skeleton, [_join(item, tensors) for item in skeleton])
    if isinstance(skeleton, dict):
        return {key: _join(item, tensors) for key, item in skeleton.items()}
    return skeleton


def _rebuild(like: tuple[Any, ...] | list[Any], items: list[Any]) -> Any:
    """A sequence of ``like``'s type (a named tuple too) holding ``items``."""
    return type(like)(*items) if hasattr(like, "_fields") else type(like)(items)
