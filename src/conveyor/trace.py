"""Timeline: what each rank did (measured) or would do (predicted), action by action."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

__all__ = ["Event", "Recorder", "Timeline", "render_grid"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Event:
    """One action on one rank, with start and end in seconds from the step's start."""

    rank: int
    action: str
    start: float
    end: float
    bytes: int = 0
    """Bytes sent or received (communication actions)."""
    memory: int = 0
    """Activation bytes this rank holds when the action ends."""

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """Events per rank; the same type for a measured run and a simulated one."""

    num_ranks: int
    events: list[Event] = field(default_factory=list)
    source: str = "measured"
    """'measured' or 'simulated'."""

    def on(self, rank: int) -> list[Event]:
        return [e for e in self.events if e.rank == rank]

    @property
    def step_time(self) -> float:
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def busy_time(self, rank: int) -> float:
        """Seconds ``rank`` spent in compute actions (forward and backward)."""
        return sum(e.duration for e in self.on(rank) if _is_compute(e.action))

    @property
    def bubble_fraction(self) -> float:
        """Share of rank-time spent not computing, over the step."""
        total = self.step_time * self.num_ranks
        if total == 0:
            return 0.0
        return 1.0 - sum(self.busy_time(r) for r in range(self.num_ranks)) / total


def _is_compute(action: str) -> bool:
    letters = "".join(c for c in action if c.isalpha())
    return len(letters) == 1


class Recorder:
    """Collects one rank's events during a run; times are seconds on a monotonic clock."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.events: list[Event] = []

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def add(self, action: str, start: float, end: float, bytes: int = 0, memory: int = 0) -> None:
        self.events.append(Event(self.rank, action, start, end, bytes, memory))


def render_grid(timeline: Timeline) -> str:
    """A rank x time text grid of compute actions; for timelines in whole time units.

        rank 0 | 0F0 0F1  .   .  0B0 0B0 0B1 0B1
        rank 1 |  .  1F0 1F1 1B0 ...
    """
    compute = [e for e in timeline.events if _is_compute(e.action)]
    if not compute:
        return ""
    width = max(len(e.action) for e in compute)
    num_columns = round(max(e.end for e in compute))
    lines = []
    for rank in range(timeline.num_ranks):
        cells = ["."] * num_columns
        for event in (e for e in compute if e.rank == rank):
            for column in range(round(event.start), round(event.end)):
                cells[column] = event.action
        lines.append(f"rank {rank} | " + " ".join(c.center(width) for c in cells))
    return "\n".join(lines)
