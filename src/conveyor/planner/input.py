"""Is a pipeline input-bound: does its loader take longer per batch than the pipeline's step?

    seconds = loader_seconds(loader)                      # median over a few batches
    warning = input_bound(seconds, plan.step_time)       # '' when the pipeline waits for none

In a pipeline the first stage's rank decodes and augments every micro-batch for all the
others, so a loader slower than the step leaves every rank waiting on one rank's CPU. The
remedies conveyor has: reuse partially augmented samples (conveyor.data.Refurbish, whose
expensive part runs once per ``reuse`` uses) and more loader worker processes.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["input_bound", "loader_seconds"]


def loader_seconds(batches: Iterable[Any], count: int = 5, warmup: int = 1) -> float:
    """Median seconds a loader takes to give one batch, over ``count`` batches after
    ``warmup`` (worker processes starting, caches filling).

    Raises:
        ValueError: the loader gave fewer than ``warmup + count`` batches.
    """
    iterator: Iterator[Any] = iter(batches)
    times = []
    for index in range(warmup + count):
        start = time.perf_counter()
        try:
            next(iterator)
        except StopIteration:
            raise ValueError(
                f"the loader gave {index} batches, {warmup + count} are needed to time it; "
                "pass one that runs longer (e.g. loader.forever())"
            ) from None
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def input_bound(input_s: float | None, step_s: float) -> str:
    """Why a step of ``step_s`` seconds would wait for a loader of ``input_s`` seconds per
    batch, and what to do; '' when the loader keeps up (or was not measured)."""
    if input_s is None or input_s <= step_s:
        return ""
    factor = math.ceil(input_s / step_s)
    return (
        f"input-bound: the loader takes {input_s * 1e3:.1f} ms per batch but the pipeline's "
        f"step {step_s * 1e3:.1f} ms, so every rank waits for the first stage's input; reuse "
        f"partially augmented samples (conveyor.data.Refurbish with reuse={factor}: the "
        f"expensive part of augmentation runs once per {factor} uses) or give the loader "
        f"about {factor}x the worker processes, where the CPU has cores for them"
    )
