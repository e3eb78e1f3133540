"""Partially augmented samples, computed ahead by worker processes into a cache bounded in bytes."""

from __future__ import annotations

import logging
import pickle
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from conveyor.data.loader import _seed
from conveyor.data.reuse import Job

__all__ = ["Feeder", "FeederStats", "PartialView", "nbytes", "seeded"]

logger = logging.getLogger(__name__)


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the body with torch's CPU generator, ``random`` and numpy's global generator seeded
    from ``seed``; the caller's generator states are restored afterwards, so augmenting never
    shifts the training's own random streams (dropout, a resumed run's RNG state). About
    0.1 ms a call, mostly numpy's state."""
    numpy = sys.modules.get("numpy")  # augmentation libraries draw from it when it is loaded
    generator = torch.default_generator  # torch.manual_seed seeds every device too: slower
    torch_state = generator.get_state()
    python_state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    generator.manual_seed(seed)
    random.seed(seed)
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
    try:
        yield
    finally:
        generator.set_state(torch_state)
        random.setstate(python_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


def nbytes(value: Any) -> int:
    """Bytes that ``value`` holds: tensors' and arrays' elements, bytes and strings by length,
    containers by their items, anything else by its pickled size."""
    if isinstance(value, torch.Tensor):
        return value.nelement() * value.element_size()
    if isinstance(value, bytes | bytearray | str):
        return len(value)
    if isinstance(value, tuple | list):
        return sum(nbytes(item) for item in value)
    if isinstance(value, dict):
        return sum(nbytes(item) for item in value.values())
    if value is None or isinstance(value, int | float | bool):
        return 8
    size = getattr(value, "nbytes", None)  # numpy arrays
    if isinstance(size, int):
        return size
    return len(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


class PartialView(Dataset[tuple[Job, Any]]):
    """``partial(dataset[index])`` with randomness seeded by (seed, epoch, index), keyed by Job:
    what worker processes compute."""

    def __init__(self, dataset: Any, partial: Callable[[Any], Any] | None, seed: int) -> None:
        self.dataset = dataset
        self.partial = partial
        self.seed = seed

    def __getitem__(self, job: Job) -> tuple[Job, Any]:
        return job, self.compute(job.epoch, job.sample)

    def compute(self, epoch: int, index: int) -> Any:
        """Sample ``index`` partially augmented as in ``epoch``."""
        sample = self.dataset[index]
        if self.partial is None:
            return sample
        with seeded(_seed("partial", self.seed, epoch, index)):
            return self.partial(sample)


@dataclass
class _Entry:
    value: Any
    uses: int
    nbytes: int


@dataclass
class FeederStats:
    """What the cache did, for logs, tests and benchmarks."""

    partials: int = 0
    """Partially augmented samples that entered the cache."""
    bytes: int = 0
    """Bytes held now."""
    peak_bytes: int = 0
    wait_s: float = 0.0
    """Time the consumer waited for workers (0 when they kept ahead)."""
    over_bound: int = 0
    """Samples let in beyond cache_bytes: only when samples are larger than the first one was."""


class Feeder:
    """Samples of ``jobs`` (in order) partially augmented and cached until their uses are taken.

        feeder = Feeder(view, order.jobs(epoch, batch_index), num_workers=2, cache_bytes=2**26)
        value = feeder.take((epoch, index))     # waits only if the workers are behind
        feeder.release((epoch, index))          # one use done; evicted after its last

    With workers, a thread of this process moves results from a DataLoader (its worker
    processes compute ``view``) into the cache while there is room, so the workers stay busy
    ahead of the consumer; without, ``take`` computes samples in order when asked. The cache
    holds at most ``cache_bytes``; the DataLoader holds up to ``prefetch_factor`` samples per
    worker besides, in flight.
    """

    def __init__(
        self,
        view: PartialView,
        jobs: Iterator[Job],
        *,
        num_workers: int,
        cache_bytes: int,
        prefetch_factor: int = 2,
        generator_seed: int = 0,
        start_method: str | None = None,
    ) -> None:
        self.view = view
        self.cache_bytes = cache_bytes
        self.stats = FeederStats()
        self._cache: dict[tuple[int, int], _Entry] = {}
        self._changed = threading.Condition()
        self._wanted = False
        self._closing = False
        self._error: BaseException | None = None
        self._jobs = jobs
        self._thread: threading.Thread | None = None
        if num_workers > 0:
            loader = DataLoader(
                view,
                batch_size=None,
                sampler=_Once(jobs),  # any iterable of keys serves
                num_workers=num_workers,
                collate_fn=_unchanged,
                prefetch_factor=prefetch_factor,
                multiprocessing_context=start_method,
                # its own generator: drawing the workers' base seed from the global one would
                # shift the training's random streams
                generator=torch.Generator().manual_seed(generator_seed),
            )
            self._results: Iterator[tuple[Job, Any]] | None = iter(loader)  # forks here
            self._thread = threading.Thread(target=self._fill, name="refurbish-feeder", daemon=True)
            self._thread.start()

    def take(self, key: tuple[int, int]) -> Any:
        """The cached value of (epoch, index), waiting for the workers if it is not there yet."""
        with self._changed:
            if key not in self._cache:
                start = time.perf_counter()
                while key not in self._cache:
                    self._raise_if_failed()
                    if self._thread is None:
                        job = next(self._jobs)
                        self._insert(job, self.view.compute(job.epoch, job.sample))
                        continue
                    self._wanted = True
                    self._changed.notify_all()
                    self._changed.wait(timeout=1.0)
                self._wanted = False
                self.stats.wait_s += time.perf_counter() - start
            return self._cache[key].value

    def replace(self, key: tuple[int, int], value: Any) -> None:
        """Cache ``value`` for (epoch, index) instead (Data Echoing keeps the final sample)."""
        with self._changed:
            entry = self._cache[key]
            size = nbytes(value)
            self._count(size - entry.nbytes)
            entry.value, entry.nbytes = value, size

    def release(self, key: tuple[int, int]) -> None:
        """One use of (epoch, index) is done; the last one evicts it."""
        with self._changed:
            entry = self._cache[key]
            entry.uses -= 1
            if entry.uses == 0:
                del self._cache[key]
                self._count(-entry.nbytes)
                self._changed.notify_all()

    def close(self) -> None:
        """Stop computing ahead; worker processes exit once the thread lets go of them."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5.0)  # it may be waiting on a worker's sample
        self._results = None
        self._cache.clear()

    def _fill(self) -> None:
        """The feeder thread: move workers' samples into the cache while there is room."""
        results = self._results
        assert results is not None
        try:
            for job, value in results:
                size = nbytes(value)
                with self._changed:
                    while (
                        not self._closing
                        and self.stats.bytes + size > self.cache_bytes
                        and not self._wanted
                    ):
                        self._changed.wait()
                    if self._closing:
                        return
                    self._insert(job, value, size)
        except BaseException as error:  # surfaced by take(), in the consumer's thread
            with self._changed:
                self._error = error
                self._changed.notify_all()

    def _insert(self, job: Job, value: Any, size: int | None = None) -> None:
        size = nbytes(value) if size is None else size
        if self.stats.bytes + size > self.cache_bytes:
            if not self.stats.over_bound:
                logger.warning(
                    "refurbish: a partial sample of %d bytes does not fit the cache "
                    "(%d of %d bytes held, all needed by the current window); letting it in. "
                    "Samples are larger than the first one measured: pass a larger "
                    "cache_bytes, or a smaller window",
                    size,
                    self.stats.bytes,
                    self.cache_bytes,
                )
            self.stats.over_bound += 1
        self._cache[(job.epoch, job.sample)] = _Entry(value, job.uses, size)
        self.stats.partials += 1
        self._count(size)
        self._changed.notify_all()

    def _count(self, change: int) -> None:
        self.stats.bytes += change
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.bytes)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"refurbish: computing a partially augmented sample failed in a worker "
                f"({type(self._error).__name__}: {self._error}); the partial transform raised "
                "or a worker process died (see the error above); fix the transform, or pass "
                "num_workers=0 to run it in this process and see the full traceback"
            ) from self._error
        if self._closing:
            raise RuntimeError("refurbish: the loader was closed; create a new one")


def _unchanged(item: Any) -> Any:
    """The DataLoader's collate_fn: samples arrive as the partial transform made them."""
    return item


class _Once:
    """An iterable over an iterator, for DataLoader's sampler (iterated once)."""

    def __init__(self, items: Iterator[Job]) -> None:
        self.items = items

    def __iter__(self) -> Iterator[Job]:
        return self.items
