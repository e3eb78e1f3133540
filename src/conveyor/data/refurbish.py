"""Refurbish: reuse each partially augmented sample a bounded number of times, finished fresh."""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

from conveyor.data.feeder import Feeder, FeederStats, PartialView, nbytes, seeded
from conveyor.data.loader import _seed, check_share
from conveyor.data.reuse import ReuseOrder, Use

__all__ = ["Refurbish"]

logger = logging.getLogger(__name__)

_SAVED = ("num_samples", "batch_size", "seed", "shuffle", "reuse", "echo", "window", "num_replicas")


class Refurbish:
    """Batches of a map-style dataset in which each partially augmented sample is used
    ``reuse`` times, each use finished by ``final`` with its own randomness;
    ``state_dict`` is the position, as ResumableLoader's.

        loader = Refurbish(images, 64, partial=DecodeCrop(32), batch_final=FlipJitter(),
                           reuse=3, cache_bytes=64 * 2**20, num_workers=2)
        for inputs, targets in loader.forever(): ...

    ``partial`` (the expensive part: decode, resize, random crop) runs once per sample per
    ``reuse`` uses, in ``num_workers`` worker processes (forked where the platform can;
    ``start_method`` otherwise) that compute ahead into a cache of at most ``cache_bytes``
    (``window`` batches of reuses, half the cache by default; ``prefetch_factor`` samples per
    worker in flight besides); ``final`` (per sample) and ``batch_final`` (on the collated batch:
    flip, colour jitter, normalize, cutout) run on every use, in this process. The uses of a
    sample land in different batches (See Note [reuse windows]). An epoch has ``reuse`` times
    the batches of ResumableLoader's; with ``reuse=1`` it is ResumableLoader's epoch, batch for
    batch. ``echo=True`` is Data Echoing instead: the fully augmented sample
    is reused, ``final`` runs once per sample. Any callables serve; conveyor.data.vision has
    image ones.

    Randomness is drawn from seeds alone: ``partial`` from (seed, epoch, sample), ``final``
    from (seed, epoch, sample, use), ``batch_final`` from (seed, epoch, batch, replica), with
    torch's, ``random``'s and numpy's global generators seeded around each call (and restored
    after). So a position, saved by ``conveyor.checkpoint.Checkpointer(data=loader)``, resumes
    the same batches bit for bit: the cache is recomputed from the seeds. ``num_replicas`` and
    ``replica`` split each global batch as ResumableLoader does; with reuse, each replica reuses
    its own samples only, and every sample belongs to one replica per epoch.

    Raises:
        ValueError: ``reuse`` < 1, a cache smaller than one batch of partial samples, ...
        TypeError: the partial sample cannot be pickled (worker processes send it).
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        *,
        partial: Callable[[Any], Any] | None = None,
        final: Callable[[Any], Any] | None = None,
        batch_final: Callable[[Any], Any] | None = None,
        reuse: int = 1,
        echo: bool = False,
        cache_bytes: int = 256 * 2**20,
        window: int | None = None,
        num_workers: int = 0,
        prefetch_factor: int = 4,
        start_method: str | None = None,
        seed: int = 0,
        shuffle: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_replicas: int = 1,
        replica: int = 0,
    ) -> None:
        _check_counts(batch_size, reuse, num_workers, prefetch_factor, num_replicas, replica)
        if echo and batch_final is not None and collate_fn is not None:
            raise ValueError(
                "echo=True with batch_final keeps each sample's row of the finished batch, "
                "which needs the default collate_fn; pass collate_fn=None, or do the final "
                "augmentation per sample with final="
            )
        self.dataset = dataset
        self.num_samples: int = len(dataset)  # type: ignore[arg-type]  # map-style datasets have len
        self.batch_size = batch_size
        self.reuse = reuse
        self.echo = echo
        self.final = final
        self.batch_final = batch_final
        self.cache_bytes = cache_bytes
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.start_method = start_method or _start_method()
        """How worker processes start: fork where the platform has it (they share the
        dataset's memory and start in milliseconds), else Python's default."""
        self.seed = seed
        self.shuffle = shuffle
        self.collate_fn = collate_fn or default_collate
        self.num_replicas = num_replicas
        self.replica = replica
        if self.num_samples < batch_size:
            raise ValueError(
                f"a dataset of {self.num_samples} samples gives no batch of {batch_size}; "
                "use a smaller batch_size"
            )
        self.view = PartialView(dataset, partial, seed)
        self.sample_bytes = self._probe()
        """Bytes of one cached sample (the first one's, measured at construction)."""
        self.window = self._window(window)
        """Batches per window of reuses (See Note [reuse windows])."""
        self.order = ReuseOrder(
            self.num_samples, batch_size, reuse, self.window, seed, shuffle, num_replicas, replica
        )
        self.epoch = 0
        """Epoch of the next batch."""
        self.batch_index = 0
        """Index, within its epoch, of the next batch."""
        self._feeder: Feeder | None = None
        self._feeder_at = (-1, -1)
        logger.info(
            "refurbish: reuse=%d%s workers=%d cache=%.1f MiB (%d samples of %.1f KiB) "
            "window=%d batches of %d (replica %d of %d) batches/epoch=%d",
            reuse,
            " (data echoing)" if echo else "",
            num_workers,
            cache_bytes / 2**20,
            cache_bytes // self.sample_bytes,
            self.sample_bytes / 2**10,
            self.window,
            self.order.local_batch_size,
            replica,
            num_replicas,
            self.num_batches,
        )

    @property
    def num_batches(self) -> int:
        """Batches per epoch: ``reuse`` times the loader's (each sample used ``reuse`` times)."""
        return self.order.num_batches

    def __len__(self) -> int:
        return self.num_batches

    @property
    def stats(self) -> FeederStats:
        """The cache's counts since the current run of batches started (a resume restarts it)."""
        return self._feeder.stats if self._feeder is not None else FeederStats()

    def __iter__(self) -> Iterator[Any]:
        """The rest of the current epoch, from the current position."""
        epoch, start = self.epoch, self.batch_index
        feeder = self._feeder_from(epoch, start)
        for batch_index in range(start, self.num_batches):
            batch = self._batch(feeder, epoch, batch_index)
            # count the batch as used before handing it out: a save after this step records it
            if batch_index + 1 == self.num_batches:
                self.epoch, self.batch_index = epoch + 1, 0
            else:
                self.batch_index = batch_index + 1
            self._feeder_at = (self.epoch, self.batch_index)
            yield batch

    def forever(self) -> Iterator[Any]:
        """Batches epoch after epoch, from the current position."""
        while True:
            yield from self

    def sample(self, epoch: int, index: int, use: int = 0) -> Any:
        """Use ``use`` of sample ``index`` in ``epoch``, computed afresh: ``final`` of
        ``partial`` with the seeds a batch uses (``batch_final`` acts on batches, not here)."""
        value = self.view.compute(epoch, index)
        return self._finish(value, epoch, index, 0 if self.echo else use)

    def close(self) -> None:
        """Stop the worker processes and drop the cache (the position is kept)."""
        if self._feeder is not None:
            self._feeder.close()
        self._feeder, self._feeder_at = None, (-1, -1)

    def __enter__(self) -> Refurbish:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """The position, and what the order and the cache are drawn from (checked when
        loading): the cache's contents are recomputed from the seeds, not saved."""
        state: dict[str, Any] = {"epoch": self.epoch, "batch_index": self.batch_index}
        return state | {name: getattr(self, name) for name in _SAVED}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position. Raises ValueError if the data, batching, seeds,
        reuse or window changed, since the position would then point elsewhere in another
        order (with reuse 1, another number of replicas or window is fine, as for
        ResumableLoader)."""
        free = {"num_replicas", "window"} if self.reuse == 1 else set()
        changed = [
            f"{name} {state[name]!r} -> {getattr(self, name)!r}"
            for name in _SAVED
            if name in state and name not in free and state[name] != getattr(self, name)
        ]
        if changed:
            raise ValueError(
                f"the saved data position does not fit this loader: {', '.join(changed)}; "
                "resume with the same dataset, batching and Refurbish settings (pass "
                "window= the saved one if the cache size changed), or start a new run"
            )
        if not 0 <= state["batch_index"] < self.num_batches:
            raise ValueError(
                f"saved batch_index {state['batch_index']} is outside the "
                f"{self.num_batches} batches of an epoch"
            )
        self.epoch, self.batch_index = int(state["epoch"]), int(state["batch_index"])

    # -- batches ----------------------------------------------------------------------------

    def _batch(self, feeder: Feeder, epoch: int, batch_index: int) -> Any:
        uses = self.order.uses(epoch, batch_index)
        echoed = self.echo and uses[0].use > 0  # a round is whole batches
        samples = []
        for index, use in uses:
            value = feeder.take((epoch, index))
            samples.append(value if echoed else self._finish(value, epoch, index, use))
        batch = self.collate_fn(samples)
        if self.batch_final is not None and not echoed:
            with seeded(_seed("batch", self.seed, epoch, batch_index, self.replica)):
                batch = self.batch_final(batch)
        if self.echo and not echoed and self.reuse > 1:
            self._keep_finished(feeder, epoch, uses, samples, batch)
        for index, _ in uses:
            feeder.release((epoch, index))
        return batch

    def _finish(self, value: Any, epoch: int, index: int, use: int) -> Any:
        if self.final is None:
            return value
        with seeded(_seed("final", self.seed, epoch, index, use)):
            return self.final(value)

    def _keep_finished(
        self, feeder: Feeder, epoch: int, uses: list[Use], samples: list[Any], batch: Any
    ) -> None:
        """Data Echoing: cache what this first use produced, for the later uses."""
        for row, (index, _) in enumerate(uses):
            finished = samples[row] if self.batch_final is None else _row(batch, row)
            feeder.replace((epoch, index), finished)

    def _feeder_from(self, epoch: int, batch_index: int) -> Feeder:
        if self._feeder is None or self._feeder_at != (epoch, batch_index):
            self.close()
            start = batch_index
            if self.echo:
                # the cache holds finished samples, which the window's first round made (its
                # batch_final drew for whole batches): replay the window up to the position
                start = self.order.windows[self.order.locate(batch_index)[0]][0] * self.reuse
            self._feeder = Feeder(
                self.view,
                self.order.jobs(epoch, start),
                num_workers=self.num_workers,
                cache_bytes=self.cache_bytes,
                prefetch_factor=self.prefetch_factor,
                start_method=self.start_method,
                generator_seed=_seed("workers", self.seed, epoch, start),
            )
            # a loader dropped without close() stops its workers too (not at exit: they die
            # with this process, and joining the thread could delay the exit)
            weakref.finalize(self, self._feeder.close).atexit = False
            for replayed in range(start, batch_index):
                self._batch(self._feeder, epoch, replayed)
            self._feeder_at = (epoch, batch_index)
        return self._feeder

    # -- checks at construction ---------------------------------------------------------------

    def _probe(self) -> int:
        """Bytes of one cached sample, from the first sample; refuses what cannot be cached."""
        value = self.view.compute(0, 0)
        try:
            pickle.dumps(value)
            if self.num_workers and self.start_method != "fork":
                pickle.dumps(self.view)  # spawned workers receive the dataset and transforms
        except Exception as error:
            raise TypeError(
                f"refurbish: the partially augmented sample ({type(value).__name__}) or the "
                f"dataset and partial transform cannot be pickled ({error}); worker processes "
                "send samples back pickled: return tensors, arrays or other picklable values "
                "from partial=, and make it a module-level function or class instance"
            ) from error
        size = nbytes(value)
        if self.echo and (self.final is not None or self.batch_final is not None):
            finished = self._finish(value, 0, 0, 0)
            if self.batch_final is not None:
                with seeded(0):
                    finished = _row(self.batch_final(self.collate_fn([finished])), 0)
            size = max(size, nbytes(finished))  # the cache holds the finished sample
        if size > self.cache_bytes:
            raise ValueError(
                f"refurbish: a cached sample takes {size} bytes, more than "
                f"cache_bytes={self.cache_bytes}; pass cache_bytes of at least "
                f"{size * self.batch_size // self.num_replicas} (one batch), or make partial= "
                "return a smaller sample (crop before converting to float)"
            )
        return max(size, 1)

    def _window(self, window: int | None) -> int:
        """Batches per window: as given, or half of what the cache holds (the other half
        is for samples computed ahead), at most an epoch."""
        local = self.batch_size // self.num_replicas
        capacity = self.cache_bytes // self.sample_bytes  # samples
        num_source_batches = self.num_samples // self.batch_size
        if capacity < local:
            raise ValueError(
                f"refurbish: cache_bytes={self.cache_bytes} holds {capacity} samples of "
                f"{self.sample_bytes} bytes, fewer than one batch of {local}; pass "
                f"cache_bytes >= {2 * local * self.sample_bytes} (a batch, and as much again "
                "to compute ahead), or a smaller batch_size"
            )
        if window is None:
            return max(1, min(num_source_batches, capacity // (2 * local)))
        if window < 1 or window * local > capacity:
            raise ValueError(
                f"refurbish: window={window} batches of {local} samples of {self.sample_bytes} "
                f"bytes does not fit cache_bytes={self.cache_bytes} (at most "
                f"{capacity // local} batches); pass window between 1 and {capacity // local}, "
                "or omit it to use half the cache"
            )
        return window


def _start_method() -> str:
    methods = multiprocessing.get_all_start_methods()
    return "fork" if "fork" in methods else multiprocessing.get_start_method()


def _check_counts(
    batch_size: int,
    reuse: int,
    num_workers: int,
    prefetch_factor: int,
    num_replicas: int,
    replica: int,
) -> None:
    check_share(batch_size, num_replicas, replica)
    if isinstance(reuse, bool) or not isinstance(reuse, int) or reuse < 1:
        raise ValueError(
            f"reuse must be an integer >= 1 (uses of each partially augmented sample), got "
            f"{reuse!r}; pass reuse=1 to augment every use afresh, 2 to 4 to reuse"
        )
    if num_workers < 0 or prefetch_factor < 1:
        raise ValueError(
            f"num_workers must be >= 0 and prefetch_factor >= 1, got {num_workers} and "
            f"{prefetch_factor}; pass num_workers=0 to augment in this process"
        )


def _row(batch: Any, row: int) -> Any:
    """Row ``row`` of a collated batch (tensors, and tuples, lists and dicts of them)."""
    if isinstance(batch, torch.Tensor):
        return batch[row].clone()  # its own storage: the batch may be freed
    if isinstance(batch, tuple | list):
        return type(batch)(_row(item, row) for item in batch)
    if isinstance(batch, dict):
        return {key: _row(item, row) for key, item in batch.items()}
    raise TypeError(
        f"echo=True with batch_final keeps each sample's row of the finished batch, but the "
        f"batch holds a {type(batch).__name__}; return tensors (in tuples, lists or dicts) "
        "from the dataset, or do the final augmentation per sample with final="
    )
