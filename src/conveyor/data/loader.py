"""Resumable data order: a seeded permutation per epoch and a loader that resumes mid-epoch."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["ResumableLoader", "epoch_order", "replica_share"]


def epoch_order(num_samples: int, epoch: int, seed: int = 0, shuffle: bool = True) -> list[int]:
    """Sample indices of ``epoch``: a permutation drawn from (seed, epoch) alone, so any process,
    before or after a restart, computes the same order without shared random state."""
    if not shuffle:
        return list(range(num_samples))
    generator = torch.Generator().manual_seed(_seed("data", seed, epoch))
    return torch.randperm(num_samples, generator=generator).tolist()


def replica_share(batch: list[int], num_replicas: int, replica: int) -> list[int]:
    """Replica ``replica``'s contiguous part of a global batch (parts differ by at most one
    sample, for a last batch kept by ``drop_last=False``)."""
    size, rest = divmod(len(batch), num_replicas)
    start = replica * size + min(replica, rest)
    return batch[start : start + size + (replica < rest)]


def check_share(batch_size: int, num_replicas: int, replica: int) -> None:
    """Refuse a global batch that replica ``replica`` of ``num_replicas`` cannot take an
    equal share of."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= replica < num_replicas or batch_size % num_replicas:
        raise ValueError(
            f"replica {replica} of {num_replicas} cannot take an equal share of batches of "
            f"{batch_size}; pass a global batch_size divisible by num_replicas and "
            "0 <= replica < num_replicas (pipe.num_replicas, pipe.replica)"
        )


def _seed(purpose: str, *parts: int) -> int:
    """A 63-bit seed drawn from ``purpose`` and integers (a seed, an epoch, a sample ...)."""
    text = ":".join([purpose, *map(str, parts)])
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ResumableLoader:
    """Batches of a map-style dataset in a seeded order per epoch; ``state_dict`` is the position.

        loader = ResumableLoader(dataset, batch_size=32, seed=0)
        batches = loader.forever()                  # epoch after epoch
        inputs, targets = next(batches)

    With data parallelism, ``batch_size`` is the global batch and each replica takes its
    share: ``ResumableLoader(dataset, 32, num_replicas=pipe.num_replicas,
    replica=pipe.replica)`` yields replica r's contiguous ``32 / num_replicas`` samples of
    each global batch (every rank of the replica the same ones), so over the replicas every
    sample is used once per epoch, and the global batch is what one process would train on.
    The position counts global batches: a checkpoint resumes at another number of replicas.

    The position counts the batches handed out, so a checkpoint taken after a step records
    that step's batch as used: a resumed run continues with the next batch, and every sample
    is used exactly once per epoch across any number of resumes. The position is a Stateful
    (``state_dict``/``load_state_dict``), so ``conveyor.checkpoint.Checkpointer(data=loader)``
    saves it. ``for batch in loader`` yields the rest of the current epoch.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        num_replicas: int = 1,
        replica: int = 0,
    ) -> None:
        check_share(batch_size, num_replicas, replica)
        self.dataset = dataset
        self.num_samples = len(dataset)  # type: ignore[arg-type]  # map-style datasets have len
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.collate_fn = collate_fn
        self.num_workers = num_workers
        self.num_replicas = num_replicas
        self.replica = replica
        if self.num_batches == 0:
            raise ValueError(
                f"a dataset of {self.num_samples} samples gives no batch of "
                f"{batch_size}{' with drop_last' if drop_last else ''}; use a "
                "smaller batch_size"
            )
        self.epoch = 0
        """Epoch of the next batch."""
        self.batch_index = 0
        """Index, within its epoch, of the next batch."""

    @property
    def num_batches(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __len__(self) -> int:
        return self.num_batches

    def batches(self, epoch: int) -> list[list[int]]:
        """The sample indices of every global batch of ``epoch``, in order."""
        order = epoch_order(self.num_samples, epoch, self.seed, self.shuffle)
        return [
            order[i : i + self.batch_size]
            for i in range(0, self.num_batches * self.batch_size, self.batch_size)
        ]

    def share(self, batch: list[int]) -> list[int]:
        """This replica's contiguous part of a global batch (see ``replica_share``)."""
        return replica_share(batch, self.num_replicas, self.replica)

    def __iter__(self) -> Iterator[Any]:
        """The rest of the current epoch, from the current position."""
        epoch, start = self.epoch, self.batch_index
        batches = self.batches(epoch)
        # its own generator: the loader seeds its workers without drawing from the global
        # generator, whose state a checkpoint restores (a resumed epoch would draw twice)
        generator = torch.Generator().manual_seed(_seed("workers", self.seed, epoch))
        loader = DataLoader(
            self.dataset,
            batch_sampler=_Fixed([self.share(b) for b in batches[start:]]),
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
            generator=generator,
        )
        for index, batch in enumerate(loader, start=start + 1):
            # count the batch as used before handing it out: a save after this step records it
            if index == len(batches):
                self.epoch, self.batch_index = epoch + 1, 0
            else:
                self.batch_index = index
            yield batch

    def forever(self) -> Iterator[Any]:
        """Batches epoch after epoch, from the current position."""
        while True:
            yield from self

    def state_dict(self) -> dict[str, Any]:
        """The position, and what the order depends on (checked when loading)."""
        return {
            "epoch": self.epoch,
            "batch_index": self.batch_index,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position. Raises ValueError if the data or batching changed,
        since the saved position would then point elsewhere in another order."""
        changed = [
            f"{name} {state[name]!r} -> {getattr(self, name)!r}"
            for name in ("num_samples", "batch_size", "seed", "shuffle", "drop_last")
            if name in state and state[name] != getattr(self, name)
        ]
        if changed:
            raise ValueError(
                f"the saved data position does not fit this loader: "
                f"{', '.join(changed)}; resume with the same dataset and batching, "
                "or start a new run"
            )
        if not 0 <= state["batch_index"] < self.num_batches:
            raise ValueError(
                f"saved batch_index {state['batch_index']} is outside the "
                f"{self.num_batches} batches of an epoch"
            )
        self.epoch, self.batch_index = int(state["epoch"]), int(state["batch_index"])


class _Fixed(torch.utils.data.Sampler[list[int]]):
    """A batch sampler over a fixed list of index batches."""

    def __init__(self, batches: Sequence[list[int]]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)
