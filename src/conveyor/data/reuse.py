"""The order of reuses: which sample, and which of its uses, fills each batch of an epoch."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from conveyor.data.loader import _seed, epoch_order, replica_share

__all__ = ["Job", "ReuseOrder", "Use"]


class Use(NamedTuple):
    """One use of a sample in a batch."""

    sample: int
    """The sample's index in the dataset."""
    use: int
    """Which of the sample's uses this is: 0 .. reuse - 1 (its round)."""


class Job(NamedTuple):
    """A sample to augment partially and cache: the workers' unit of work."""

    epoch: int
    sample: int
    """The sample's index in the dataset."""
    uses: int
    """Uses left when it enters the cache (fewer than reuse only where a run resumed)."""


# Note [reuse windows]:
# With reuse k, an epoch starts from the loader's order (epoch_order, and this replica's share
# of every global batch, as ResumableLoader takes it) and cuts it into windows of whole batches.
# A window's samples are used in k rounds: round 0 in that order, each later round in a fresh
# permutation of the window drawn from (seed, epoch, window, round, replica). A round is whole
# batches, so the k uses of a sample land in k different batches, hence k different steps. An
# epoch therefore has k times the loader's batches, and with k = 1 it is the loader's epoch.
#
#   reuse 3, a window of 2 batches of 2 samples (a, b, c, d):
#   batch:   0    1    2    3    4    5  | 6 ...
#   uses:   ab   cd   ca   db   bd   ac  | the next window
#   round:   0    0    1    1    2    2
#
# While its rounds run, the window's partially augmented samples are all in the cache; each is
# evicted after its k-th use, and the workers fill the room with the next window's samples. So
# the cache holds one window and what was computed ahead: the window is at most half the cache
# by default. Windows are as even as the batches allow and never longer than `window` batches.
@dataclass(frozen=True)
class ReuseOrder:
    """Which uses of which samples make up each batch of an epoch, for one replica.

    See Note [reuse windows].
    """

    num_samples: int
    batch_size: int
    """The global batch: every replica's share together."""
    reuse: int
    window: int
    """Batches per window, at most."""
    seed: int = 0
    shuffle: bool = True
    num_replicas: int = 1
    replica: int = 0

    @property
    def num_source_batches(self) -> int:
        """The loader's batches per epoch (the last, partial batch is dropped)."""
        return self.num_samples // self.batch_size

    @property
    def num_batches(self) -> int:
        """Batches per epoch: each source batch's samples are used ``reuse`` times."""
        return self.reuse * self.num_source_batches

    @property
    def local_batch_size(self) -> int:
        """This replica's share of a global batch."""
        return self.batch_size // self.num_replicas

    def source(self, epoch: int) -> tuple[int, ...]:
        """This replica's samples of ``epoch`` in the loader's order (its share of each batch)."""
        return _source(self, epoch)

    @functools.cached_property
    def windows(self) -> tuple[tuple[int, int], ...]:
        """(first source batch, number of source batches) of each window of an epoch."""
        total = self.num_source_batches
        count = -(-total // self.window)
        edges = [total * w // count for w in range(count + 1)]
        return tuple((edges[w], edges[w + 1] - edges[w]) for w in range(count))

    def locate(self, batch_index: int) -> tuple[int, int, int]:
        """(window, round, batch within the round) of batch ``batch_index`` of an epoch."""
        if not 0 <= batch_index < self.num_batches:
            raise IndexError(f"batch {batch_index} of an epoch of {self.num_batches}")
        for window, (first, size) in enumerate(self.windows):
            offset = batch_index - first * self.reuse
            if offset < size * self.reuse:
                return window, offset // size, offset % size
        raise AssertionError("windows cover the epoch")  # unreachable: checked above

    def round_order(self, epoch: int, window: int, round_index: int) -> tuple[int, ...]:
        """Positions within the window, in the order round ``round_index`` uses them."""
        return _round_order(self, epoch, window, round_index)

    def uses(self, epoch: int, batch_index: int) -> list[Use]:
        """This replica's uses in batch ``batch_index`` of ``epoch``, in order."""
        window, round_index, within = self.locate(batch_index)
        samples = self._window_samples(epoch, window)
        size = self.local_batch_size
        order = self.round_order(epoch, window, round_index)
        return [Use(samples[p], round_index) for p in order[within * size : (within + 1) * size]]

    def jobs(self, epoch: int, batch_index: int) -> Iterator[Job]:
        """The samples to cache, in order, from batch ``batch_index`` of ``epoch`` on,
        forever: the rest of its window (the uses it has left), then every later window."""
        window, round_index, within = self.locate(batch_index)
        order = self.round_order(epoch, window, round_index)
        used = set(order[: within * self.local_batch_size])
        for position, index in enumerate(self._window_samples(epoch, window)):
            left = self.reuse - round_index - (position in used)
            if left > 0:
                yield Job(epoch, index, left)
        count = len(self.windows)
        while True:
            for later in range(window + 1, count):
                for index in self._window_samples(epoch, later):
                    yield Job(epoch, index, self.reuse)
            epoch, window = epoch + 1, -1

    def _window_samples(self, epoch: int, window: int) -> tuple[int, ...]:
        first, size = self.windows[window]
        local = self.local_batch_size
        return self.source(epoch)[first * local : (first + size) * local]


@functools.lru_cache(maxsize=4)
def _source(order: ReuseOrder, epoch: int) -> tuple[int, ...]:
    samples = epoch_order(order.num_samples, epoch, order.seed, order.shuffle)
    size = order.batch_size
    return tuple(
        index
        for start in range(0, order.num_source_batches * size, size)
        for index in replica_share(samples[start : start + size], order.num_replicas, order.replica)
    )


@functools.lru_cache(maxsize=64)
def _round_order(order: ReuseOrder, epoch: int, window: int, round_index: int) -> tuple[int, ...]:
    size = order.windows[window][1] * order.local_batch_size
    if round_index == 0:  # the loader's own order: with reuse 1, exactly the loader's batches
        return tuple(range(size))
    parts = (order.seed, epoch, window, round_index, order.replica)
    generator = torch.Generator().manual_seed(_seed("reuse", *parts))
    return tuple(torch.randperm(size, generator=generator).tolist())
