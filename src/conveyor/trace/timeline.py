"""Timeline: what each rank did (measured) or would do (predicted), action by action.

    timeline = pipe.timeline()          # collective: every rank's events of the last step
    print(timeline.summary_text()); timeline.save("step.json")

A measured Timeline comes from a ``Recorder`` (conveyor.trace.recorder) hooked into the
runtime; a predicted one from ``conveyor.simulator``. Both hold the same events, so one
renderer (conveyor.trace.render) draws both, side by side.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.files import write_atomic
from conveyor.program import Action, Kind, matching_send
from conveyor.text import format_bytes

__all__ = [
    "RECOMPUTE",
    "REDUCE",
    "WAIT",
    "Event",
    "RankSummary",
    "Timeline",
    "clipped",
    "is_compute",
    "merge",
]

WAIT = "wait"
"""Action name prefix of a wait: ``wait 1RF0<0`` is time blocked on that receive,
``wait sends`` the wait for outstanding sends at the end of a step."""

RECOMPUTE = "recompute"
"""Action name prefix of a recomputation: ``recompute 1F0`` is stage 1 running micro-batch 0's
forward again inside its backward (activation checkpointing); the backward's event spans it."""

REDUCE = "reduce"
"""Action name prefix of a data-parallel gradient reduction: ``reduce 1`` reduces stage 1's
gradients over the replicas (conveyor.parallel.data_parallel)."""

_KIND_NAMES = {
    Kind.F: "forward",
    Kind.B: "backward",
    Kind.I: "backward_input",
    Kind.W: "backward_weight",
    Kind.SEND_F: "send",
    Kind.SEND_B: "send",
    Kind.RECV_F: "recv",
    Kind.RECV_B: "recv",
}


@dataclass(frozen=True, slots=True)
class Event:
    """One action on one rank, with start and end in seconds from the step's start."""

    rank: int
    action: str
    """The action's text form (``1F0``, ``0SF0>1``), ``wait <receive>`` / ``wait sends``, or
    ``recompute <forward>``."""
    start: float
    end: float
    bytes: int = 0
    """Bytes sent (sends) or received (waits on a receive)."""
    memory: int = 0
    """Activation bytes this rank holds when the action ends."""

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def kind(self) -> str:
        """'forward', 'backward', 'backward_input', 'backward_weight', 'send', 'recv', 'wait',
        'recompute' or 'reduce'."""
        if self.action.startswith(WAIT):
            return "wait"
        if self.action.startswith(RECOMPUTE + " "):
            return "recompute"
        if self.action.startswith(REDUCE):
            return "reduce"
        action = Action.read(self.action)
        return _KIND_NAMES[action.kind] if action is not None else "other"

    @property
    def is_compute(self) -> bool:
        return self.kind in ("forward", "backward", "backward_input", "backward_weight")

    @property
    def microbatch(self) -> int | None:
        action = Action.read(self.action.removeprefix(RECOMPUTE + " "))
        return action.microbatch if action is not None else None

    @property
    def stage(self) -> int | None:
        action = Action.read(self.action.removeprefix(RECOMPUTE + " "))
        return action.stage if action is not None else None

    @property
    def waited_for(self) -> str | None:
        """The receive a wait blocked on (``1RF0<0``), None for other events."""
        if not self.action.startswith(WAIT + " "):
            return None
        target = self.action[len(WAIT) + 1 :]
        return target if Action.read(target) is not None else None


@dataclass(frozen=True)
class RankSummary:
    """Where one rank's step went, as shares of the step time (they sum to 1)."""

    rank: int
    busy: float
    """Computing: forward, backward and weight-gradient actions."""
    comm_wait: float
    """Blocked on a message its sender had already sent (transfer time), on posting and
    starting transfers, and on outstanding sends at the end of the step."""
    bubble: float
    """Everything else: idle, mostly waiting for a peer to compute what this rank needs."""
    peak_memory: int
    """Most activation bytes held at once."""


@dataclass
class Timeline:
    """Events per rank; the same type for a measured run and a simulated one."""

    num_ranks: int
    events: list[Event] = field(default_factory=list)
    source: str = "measured"
    """'measured' or 'simulated'."""
    meta: dict[str, Any] = field(default_factory=dict)
    """What ran: schedule, micro-batches, model, ... (shown in titles, kept in files);
    ``time_unit`` 'units' marks a timeline in abstract units rather than seconds."""

    def on(self, rank: int) -> list[Event]:
        return [e for e in self.events if e.rank == rank]

    def label(self, rank: int) -> str:
        """The name of a row: 'rank 1', or 'replica 0 rank 1' in a run of several replicas."""
        labels = self.meta.get("row_labels")
        return str(labels[rank]) if labels else f"rank {rank}"

    @property
    def start(self) -> float:
        return min((e.start for e in self.events), default=0.0)

    @property
    def step_time(self) -> float:
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - self.start

    def busy_time(self, rank: int) -> float:
        """Seconds ``rank`` spent in compute actions (forward and backward)."""
        return sum(e.duration for e in self.on(rank) if is_compute(e.action))

    @property
    def bubble_fraction(self) -> float:
        """Share of rank-time spent not computing, over the step."""
        total = self.step_time * self.num_ranks
        if total == 0:
            return 0.0
        return 1.0 - sum(self.busy_time(r) for r in range(self.num_ranks)) / total

    def peak_memory(self, rank: int) -> int:
        """Most activation bytes ``rank`` held at the end of any of its actions."""
        return max((e.memory for e in self.on(rank)), default=0)

    def comm_wait_time(self, rank: int) -> float:
        """Seconds ``rank`` was blocked on communication rather than on a peer's compute.

        A wait on a receive counts from the moment the sender started the matching send (before
        that, the rank waits for the peer's compute: a bubble); sends, posted receives,
        data-parallel reductions and the final wait for outstanding sends count whole.
        """
        sends: dict[str, list[float]] = {}  # several steps send under one name: in time order
        for e in sorted(self.events, key=lambda e: e.start):
            if e.kind == "send":
                sends.setdefault(e.action, []).append(e.start)
        total = 0.0
        for event in self.on(rank):
            if event.kind in ("send", "recv", "reduce"):
                total += event.duration
            elif event.kind == "wait":
                target = event.waited_for
                sent = (
                    _last_before(sends.get(_matching_send(target), []), event.end)
                    if target
                    else None
                )
                begin = event.start if sent is None else max(event.start, sent)
                total += max(0.0, event.end - begin)
        return total

    def summary(self) -> list[RankSummary]:
        """Per rank: busy, communication-wait and bubble shares of the step, and peak memory."""
        step = self.step_time
        rows = []
        for rank in range(self.num_ranks):
            busy = self.busy_time(rank) / step if step else 0.0
            comm = min(self.comm_wait_time(rank) / step, 1.0 - busy) if step else 0.0
            rows.append(
                RankSummary(rank, busy, comm, max(0.0, 1.0 - busy - comm), self.peak_memory(rank))
            )
        return rows

    def summary_text(self) -> str:
        """The summary as a small table, with the step time and bubble fraction on top."""
        labels = self.meta.get("row_labels")  # replicas: 'replica 0 rank 1', else the rank
        names = [str(labels[r]) if labels else str(r) for r in range(self.num_ranks)]
        width = max(4, *map(len, names))
        lines = [
            f"{self.title()}",
            f"{'' if labels else 'rank':>{width}}  {'busy':>6}  {'bubble':>6}  "
            f"{'comm wait':>9}  {'peak act.':>10}",
        ]
        for row in self.summary():
            lines.append(
                f"{names[row.rank]:>{width}}  {row.busy:>6.1%}  {row.bubble:>6.1%}  "
                f"{row.comm_wait:>9.1%}  "
                f"{format_bytes(row.peak_memory) if row.peak_memory else '-':>10}"
            )
        return "\n".join(lines)

    def title(self) -> str:
        """One line: source, what ran, step time (or the span of several steps) and the share
        of rank-time not computing (the summary's bubble and communication wait together)."""
        what = " ".join(
            f"{k}={self.meta[k]}" for k in ("model", "schedule", "microbatches") if k in self.meta
        )
        duration = (
            f"{self.step_time:g} units"
            if self.meta.get("time_unit") == "units"
            else f"{self.step_time * 1e3:.2f} ms"
        )
        first, last = self.meta.get("steps", (None, None))
        span = f"steps {first}-{last} {duration}" if first != last else f"step {duration}"
        return (
            f"{self.source}{' ' + what if what else ''}: {span}, "
            f"idle {self.bubble_fraction:.1%} (bubble + comm wait)"
        )

    def shifted(self, origin: float) -> Timeline:
        """The same events with times measured from ``origin``."""
        events = [
            Event(e.rank, e.action, e.start - origin, e.end - origin, e.bytes, e.memory)
            for e in self.events
        ]
        return Timeline(self.num_ranks, events, self.source, dict(self.meta))

    # -- files -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_ranks": self.num_ranks,
            "source": self.source,
            "meta": self.meta,
            "events": [[e.rank, e.action, e.start, e.end, e.bytes, e.memory] for e in self.events],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeline:
        events = [
            Event(int(r), str(a), float(s), float(e), int(b), int(m))
            for r, a, s, e, b, m in data["events"]
        ]
        return cls(
            int(data["num_ranks"]),
            events,
            str(data.get("source", "measured")),
            dict(data.get("meta", {})),
        )

    def save(self, path: str | Path) -> None:
        """Write the timeline as JSON (``Timeline.load`` reads it back)."""
        write_atomic(path, json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | Path) -> Timeline:
        """The timeline ``save`` wrote to ``path``.

        Raises:
            ValueError: the file is not one (a Chrome trace, a profile), naming it.
        """
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(
                f"{str(path)!r} is not a saved conveyor Timeline ({type(error).__name__}: "
                f"{error}); pass a file written by Timeline.save or `conveyor simulate "
                "--save-timeline`"
            ) from error


def is_compute(action: str) -> bool:
    """Whether an event's ``action`` text is a compute action (``1F0``, ``0W3``)."""
    found = Action.read(action)
    return found is not None and found.is_compute


def _last_before(times: list[float], moment: float) -> float | None:
    """The latest of the sorted ``times`` not after ``moment`` (else the first, or None)."""
    earlier = [t for t in times if t <= moment]
    return earlier[-1] if earlier else (times[0] if times else None)


def _matching_send(recv: str) -> str:
    """``1RF0<0`` -> ``0SF0>1``: the send that a receive gets."""
    return str(matching_send(Action.parse(recv)))


def merge(parts: Sequence[Timeline], meta: dict[str, Any] | None = None) -> Timeline:
    """One Timeline from per-rank parts of the same step.

    The step starts when the last rank enters it: a rank that finished the previous step
    early waits for the others inside its first receive, and that wait belongs to no step, so
    events are clipped to start no earlier than that moment (time 0).
    """
    events, origin = clipped(parts)
    num_ranks = max((p.num_ranks for p in parts), default=0)
    return Timeline(num_ranks, events, "measured", dict(meta or {})).shifted(origin)


def clipped(parts: Sequence[Timeline]) -> tuple[list[Event], float]:
    """The events of one step's per-rank parts, clipped to start when the last rank entered
    the step, sorted by rank and start; and that moment."""
    events = sorted((e for part in parts for e in part.events), key=lambda e: (e.rank, e.start))
    origin = max((min(e.start for e in part.events) for part in parts if part.events), default=0.0)
    clipped = [
        Event(e.rank, e.action, max(e.start, origin), max(e.end, origin), e.bytes, e.memory)
        for e in events
    ]
    return clipped, origin
