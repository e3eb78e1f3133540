"""Timeline: what each rank did (measured) or would do (predicted), action by action.

    pipe = conveyor.Pipeline(model, trace=True, ...); pipe.step(x, y)
    timeline = pipe.timeline()          # collective: every rank's events of the last step
    print(timeline.summary()); write_png("step.png", timeline); write_chrome("step.json", timeline)

A measured Timeline comes from a ``Recorder`` hooked into the runtime; a predicted one from
``conveyor.simulator``. Both hold the same events, so one renderer draws both, side by side.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.files import atomic_path, write_atomic

__all__ = [
    "RECOMPUTE",
    "REDUCE",
    "WAIT",
    "Event",
    "RankSummary",
    "Recorder",
    "Timeline",
    "chrome_trace",
    "load_run",
    "merge",
    "render_grid",
    "trace_file_name",
    "write_chrome",
    "write_png",
]

logger = logging.getLogger(__name__)

WAIT = "wait"
"""Action name prefix of a wait: ``wait 1RF0<0`` is time blocked on that receive,
``wait sends`` the wait for outstanding sends at the end of a step."""

RECOMPUTE = "recompute"
"""Action name prefix of a recomputation: ``recompute 1F0`` is stage 1 running micro-batch 0's
forward again inside its backward (activation checkpointing); the backward's event spans it."""

REDUCE = "reduce"
"""Action name prefix of a data-parallel gradient reduction: ``reduce 1`` reduces stage 1's
gradients over the replicas (conveyor.parallel.data_parallel)."""

_ACTION = re.compile(r"^(\d+)(F|B|I|W|SF|RF|SB|RB)(\d+)(?:[<>](\d+))?$")
_KIND_NAMES = {
    "F": "forward",
    "B": "backward",
    "I": "backward_input",
    "W": "backward_weight",
    "SF": "send",
    "SB": "send",
    "RF": "recv",
    "RB": "recv",
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
        match = _ACTION.match(self.action)
        return _KIND_NAMES[match.group(2)] if match else "other"

    @property
    def is_compute(self) -> bool:
        return self.kind in ("forward", "backward", "backward_input", "backward_weight")

    @property
    def microbatch(self) -> int | None:
        match = _ACTION.match(self.action.removeprefix(RECOMPUTE + " "))
        return int(match.group(3)) if match else None

    @property
    def stage(self) -> int | None:
        match = _ACTION.match(self.action.removeprefix(RECOMPUTE + " "))
        return int(match.group(1)) if match else None

    @property
    def waited_for(self) -> str | None:
        """The receive a wait blocked on (``1RF0<0``), None for other events."""
        if not self.action.startswith(WAIT + " "):
            return None
        target = self.action[len(WAIT) + 1 :]
        return target if _ACTION.match(target) else None


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
        return sum(e.duration for e in self.on(rank) if _is_compute(e.action))

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
                f"{_bytes(row.peak_memory) if row.peak_memory else '-':>10}"
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


def _is_compute(action: str) -> bool:
    match = _ACTION.match(action)
    return match is not None and len(match.group(2)) == 1


def _last_before(times: list[float], moment: float) -> float | None:
    """The latest of the sorted ``times`` not after ``moment`` (else the first, or None)."""
    earlier = [t for t in times if t <= moment]
    return earlier[-1] if earlier else (times[0] if times else None)


def _matching_send(recv: str) -> str:
    """``1RF0<0`` -> ``0SF0>1``: the send that a receive gets."""
    match = _ACTION.match(recv)
    assert match is not None and match.group(4) is not None
    stage, kind, microbatch, peer = match.groups()
    return f"{peer}S{kind[1]}{microbatch}>{stage}"


def _bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # unreachable; keeps type checkers content


# -- recording -------------------------------------------------------------------------------


class Recorder:
    """Collects one rank's events during a run, step by step.

    Times are ``time.perf_counter()`` readings; ``clock_offset`` turns them into wall-clock
    seconds, so ranks on other hosts line up (to the hosts' clock agreement; ranks on one host
    share the monotonic clock and line up exactly). The runtime calls ``add`` after every
    action, and ``conveyor.runtime.comm.P2P`` calls ``wait`` and ``sent`` from inside transfers.
    """

    def __init__(self, rank: int, keep: int = 64) -> None:
        self.rank = rank
        self.keep = keep
        """Steps kept in memory (older ones are dropped; a sink file keeps them all)."""
        self.clock_offset = time.time() - time.perf_counter()
        self.host = socket.gethostname()
        self.events: list[Event] = []
        """The current step's events (perf_counter times)."""
        self.steps: list[tuple[int, list[Event]]] = []
        """Finished steps: (step index, events), oldest first."""
        self.sink: Any = None
        """An open text file that receives one JSON line per finished step, or None."""
        self._step_index = 0
        self._pending_bytes = 0
        self._wait_end = 0.0

    now = staticmethod(time.perf_counter)

    def begin_step(self, index: int) -> None:
        self._step_index = index
        self.events = []

    def end_step(self) -> None:
        """Close the current step: keep it, and write it to the sink if there is one."""
        self.steps.append((self._step_index, self.events))
        del self.steps[: -self.keep]
        if self.sink is not None:
            rows = [
                [
                    e.action,
                    e.start + self.clock_offset,
                    e.end + self.clock_offset,
                    e.bytes,
                    e.memory,
                ]
                for e in self.events
            ]
            self.sink.write(json.dumps({"step": self._step_index, "events": rows}) + "\n")
        self.events = []

    def add(self, action: str, start: float, end: float, bytes: int = 0, memory: int = 0) -> None:
        """Record an action; a compute action starts when the waits inside it ended."""
        if self._wait_end > start and _is_compute(action):
            start = self._wait_end
        bytes, self._pending_bytes = bytes + self._pending_bytes, 0
        self.events.append(Event(self.rank, action, start, end, bytes, memory))

    def wait(self, describe: str, start: float, end: float, bytes: int = 0) -> None:
        """Record time blocked on ``describe`` (a receive's action text, or 'sends')."""
        self.events.append(Event(self.rank, f"{WAIT} {describe}", start, end, bytes))
        self._wait_end = end

    def recompute(self, forward: str, start: float, end: float) -> None:
        """Record a recomputation of ``forward`` (``1F0``) inside the backward now running."""
        self.events.append(Event(self.rank, f"{RECOMPUTE} {forward}", start, end))

    def sent(self, num_bytes: int) -> None:
        """Bytes handed to the transport by the action now running."""
        self._pending_bytes += num_bytes

    def header(self) -> dict[str, Any]:
        """The first line of this rank's trace file."""
        return {"rank": self.rank, "host": self.host, "clock_offset": self.clock_offset}

    def timeline(self, num_ranks: int, step: int = -1) -> Timeline:
        """This rank's events of one kept step, times in wall-clock seconds: ``step`` is a
        step's index (0: the first), or counts back from the last kept step (-1)."""
        moved = [
            Event(
                e.rank,
                e.action,
                e.start + self.clock_offset,
                e.end + self.clock_offset,
                e.bytes,
                e.memory,
            )
            for e in self._kept(step)
        ]
        return Timeline(num_ranks, moved)

    def _kept(self, step: int) -> list[Event]:
        if not self.steps:
            raise RuntimeError(
                f"rank {self.rank}: no step recorded yet; run a step with "
                "tracing on first (Pipeline(..., trace=True))"
            )
        found = [events for index, events in self.steps if index == step]
        if step < 0 and -step <= len(self.steps):
            found = [self.steps[step][1]]
        if not found:
            first, last = self.steps[0][0], self.steps[-1][0]
            raise ValueError(
                f"rank {self.rank}: step {step} is not kept; the recorder keeps steps {first} to "
                f"{last} (the last {self.keep}): pass one of them, or -1 to -{len(self.steps)} "
                "counting back from the last"
            )
        return found[0]


def merge(parts: Sequence[Timeline], meta: dict[str, Any] | None = None) -> Timeline:
    """One Timeline from per-rank parts of the same step.

    The step starts when the last rank enters it: a rank that finished the previous step
    early waits for the others inside its first receive, and that wait belongs to no step, so
    events are clipped to start no earlier than that moment (time 0).
    """
    events, origin = _clipped(parts)
    num_ranks = max((p.num_ranks for p in parts), default=0)
    return Timeline(num_ranks, events, "measured", dict(meta or {})).shifted(origin)


def _clipped(parts: Sequence[Timeline]) -> tuple[list[Event], float]:
    """The events of one step's per-rank parts, clipped to start when the last rank entered
    the step, sorted by rank and start; and that moment."""
    events = sorted((e for part in parts for e in part.events), key=lambda e: (e.rank, e.start))
    origin = max((min(e.start for e in part.events) for part in parts if part.events), default=0.0)
    clipped = [
        Event(e.rank, e.action, max(e.start, origin), max(e.end, origin), e.bytes, e.memory)
        for e in events
    ]
    return clipped, origin


def trace_file_name(rank: int, replica: int | None = None, tp_index: int = 0) -> str:
    """The trace file of a pipeline rank: ``rank<N>.jsonl``, or with a mesh
    ``replica<R>-rank<N>.jsonl`` (``replica<R>-tp<T>-rank<N>.jsonl`` with tensor parallelism)."""
    if replica is None:
        return f"rank{rank}.jsonl"
    return f"replica{replica}-{f'tp{tp_index}-' if tp_index else ''}rank{rank}.jsonl"


def load_run(
    directory: str | Path, step: int | None = None, last_step: int | None = None
) -> Timeline:
    """The Timeline of one step of a run recorded with ``--trace DIR`` (default: the last step
    every rank recorded), or of steps ``step`` to ``last_step`` on one time axis (the time
    between them, the optimizer's, shows as idle). The files of several replicas (and
    tensor-parallel ranks) become one Timeline, a row per (replica, tp rank, pipeline rank),
    labelled ``replica R rank N``; each pipeline's step starts when its own last rank enters
    it (replicas enter a step at their own pace).

    Raises:
        FileNotFoundError: the directory holds no trace files.
        ValueError: a rank's file is missing, or a requested step was not recorded by every
            rank.
    """
    per_row, rows, meta = _read_run(directory)
    common = set.intersection(*(set(steps) for steps in per_row.values()))
    if not common:
        raise ValueError(f"the ranks in {str(directory)!r} recorded no step in common")
    first = max(common) if step is None else step
    last = first if last_step is None else last_step
    if last < first:
        raise ValueError(f"steps {first}-{last}: the last step comes before the first")
    missing = [s for s in range(first, last + 1) if s not in common]
    if missing:
        raise ValueError(
            f"step {missing[0]} was not recorded by every rank; recorded steps: "
            f"{min(common)}..{max(common)}"
        )
    events: list[Event] = []
    origins = []
    pipelines = sorted({key[:2] for key in rows})  # (replica, tp rank): each steps on its own
    for chosen in range(first, last + 1):
        starts = []
        for pipeline in pipelines:
            parts = [
                Timeline(
                    len(rows),
                    [Event(row, a, s, e, b, m) for a, s, e, b, m in per_row[key][chosen]],
                )
                for row, key in enumerate(rows)
                if key[:2] == pipeline
            ]
            clipped, start = _clipped(parts)
            events += clipped
            starts.append(start)
        origins.append(min(starts))
    events.sort(key=lambda e: (e.rank, e.start))
    where = {"step": first} if first == last else {"steps": [first, last]}
    return Timeline(len(rows), events, "measured", {**meta, **where}).shifted(origins[0])


_Row = tuple[int, int, int]
"""(replica, tp rank, pipeline rank) of a trace file."""


def _read_trace_file(path: Path) -> tuple[_Row, dict[int, list[Any]], dict[str, Any]]:
    """One rank's trace file: its row (replica, tp, rank), its steps' event rows, its meta.

    Raises:
        ValueError: the file is not a trace file (or was cut short), naming it and the line.
    """
    text = path.read_text()
    lines = text.splitlines() or [""]
    steps: dict[int, list[Any]] = {}
    for number, line in enumerate(lines, start=1):
        if not line and number > 1:
            continue
        if number == len(lines) > 1 and not text.endswith("\n"):  # the run died writing it
            logger.warning("%s: leaving out line %d, cut short", path, number)
            break
        try:
            row = json.loads(line)
            if number == 1:
                head = row
                key = (int(row.get("replica", 0)), int(row.get("tp", 0)), int(row["rank"]))
            else:
                steps[row["step"]] = row["events"]
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(
                f"{str(path)!r} line {number} is not a conveyor trace ({type(error).__name__}: "
                f"{error}); record the run again, or move the file out of the directory"
            ) from error
    return key, steps, head.get("meta", {})


def _read_run(
    directory: str | Path,
) -> tuple[dict[_Row, dict[int, list[Any]]], list[_Row], dict[str, Any]]:
    """Each file's recorded steps (step -> event rows), the rows in order, and the run's meta
    (with ``row_labels`` for a mesh)."""
    files = sorted(Path(directory).glob("*rank*.jsonl"))
    if not files:
        raise FileNotFoundError(
            f"no trace files (rank*.jsonl) in {str(directory)!r}; record "
            "a run with `conveyor run --trace DIR` or "
            "`conveyor demo --trace DIR`"
        )
    read = {path: _read_trace_file(path) for path in files}
    newest = max(files, key=lambda path: path.stat().st_mtime)
    meta = dict(read[newest][2])
    stale = [path.name for path in files if read[path][2] != meta]
    if stale:  # a run on fewer ranks leaves the files of the ranks it did not have
        logger.warning(
            "leaving out %s in %s: recorded by another run than the newest file %s (their "
            "schedule, micro-batches, ranks or split differ)",
            stale,
            directory,
            newest.name,
        )
    per_row = {read[p][0]: read[p][1] for p in files if p.name not in stale}
    num_ranks = int(meta.get("ranks", 1 + max(k[2] for k in per_row)))
    replicas, tp = int(meta.get("replicas", 1)), int(meta.get("tp", 1))
    rows = [(r, t, p) for r in range(replicas) for t in range(tp) for p in range(num_ranks)]
    is_mesh = len(rows) > num_ranks
    lacking = [
        trace_file_name(p, r if is_mesh else None, t)
        for r, t, p in rows
        if (r, t, p) not in per_row
    ]
    if lacking:
        raise ValueError(
            f"{str(directory)!r} lacks the trace files {lacking[:4]}: the run had "
            f"{len(rows)} ranks; copy every rank's file there"
        )
    if is_mesh:
        meta["row_labels"] = [
            f"replica {r}{f' tp {t}' if tp > 1 else ''} rank {p}" for r, t, p in rows
        ]
    return per_row, rows, meta


# -- renderers -------------------------------------------------------------------------------


_GRID_COLUMNS = 10_000
"""The widest text grid drawn: a timeline in seconds from the epoch would be 10^9 wide."""


def render_grid(timeline: Timeline) -> str:
    """A rank x time text grid of compute actions; for timelines in whole time units.

    rank 0 | 0F0 0F1  .   .  0B0 0B0 0B1 0B1
    rank 1 |  .  1F0 1F1 1B0 ...

    Raises:
        ValueError: the timeline is not in whole time units (a measured one, in seconds).
    """
    compute = [e for e in timeline.events if _is_compute(e.action)]
    if not compute:
        return ""
    width = max(len(e.action) for e in compute)
    num_columns = round(max(e.end for e in compute))
    times = [t for e in compute for t in (e.start, e.end)]
    if num_columns > _GRID_COLUMNS or any(abs(t - round(t)) > 1e-6 for t in times):
        raise ValueError(
            f"render_grid draws timelines in whole time units (a Program simulated with unit "
            f"costs), and this one ends at {max(e.end for e in compute):g}; draw a "
            "measured or profiled timeline with write_png, or read its summary_text()"
        )
    lines = []
    for rank in range(timeline.num_ranks):
        cells = ["."] * num_columns
        for event in (e for e in compute if e.rank == rank):
            for column in range(round(event.start), round(event.end)):
                cells[column] = event.action
        lines.append(f"rank {rank} | " + " ".join(c.center(width) for c in cells))
    return "\n".join(lines)


def chrome_trace(*timelines: Timeline) -> dict[str, Any]:
    """Chrome / Perfetto trace JSON: one track per rank (per timeline), times in microseconds.

    Open the file at https://ui.perfetto.dev or chrome://tracing. Several timelines (say,
    measured and predicted) become separate groups of tracks.
    """
    events: list[dict[str, Any]] = []
    for index, timeline in enumerate(timelines):
        origin = timeline.start
        for rank in range(timeline.num_ranks):
            pid = index * timeline.num_ranks + rank if len(timelines) > 1 else rank
            name = timeline.label(rank)
            name = f"{timeline.source} {name}" if len(timelines) > 1 else name
            events.append(
                {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}
            )
            events.append(
                {
                    "name": "process_sort_index",
                    "ph": "M",
                    "pid": pid,
                    "tid": 0,
                    "args": {"sort_index": pid},
                }
            )
            for e in timeline.on(rank):
                args: dict[str, Any] = {"memory_bytes": e.memory}
                if e.bytes:
                    args["bytes"] = e.bytes
                if e.microbatch is not None:
                    args["microbatch"] = e.microbatch
                events.append(
                    {
                        "name": e.action,
                        "cat": e.kind,
                        "ph": "X",
                        "pid": pid,
                        "tid": 0,
                        "ts": (e.start - origin) * 1e6,
                        "dur": max(e.duration, 0.0) * 1e6,
                        "args": args,
                    }
                )
                if e.is_compute:
                    events.append(
                        {
                            "name": "activation memory",
                            "ph": "C",
                            "pid": pid,
                            "ts": (e.end - origin) * 1e6,
                            "args": {"bytes": e.memory},
                        }
                    )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "metadata": {"conveyor": [t.title() for t in timelines]},
    }


def write_chrome(path: str | Path, *timelines: Timeline) -> Path:
    """Write ``chrome_trace(*timelines)`` to ``path``; returns the path."""
    target = Path(path)
    write_atomic(target, json.dumps(chrome_trace(*timelines)))
    return target


_COLORS = {
    "forward": "#4C72B0",
    "backward": "#55A868",
    "backward_input": "#8FBC5A",
    "backward_weight": "#2E7D4F",
    "recompute": "#8172B2",
    "send": "#C44E52",
    "recv": "#DD8452",
    "wait": "#D0D0D0",
    "reduce": "#8172B3",
    "other": "#999999",
}


def write_png(
    path: str | Path, *timelines: Timeline, title: str | None = None, scale: float | None = None
) -> Path:
    """A Gantt chart per timeline, stacked (measured above predicted, say), sharing the x axis.

    Compute blocks carry their micro-batch number; white space is the bubble; the part of a
    backward that recomputes its forward is purple; waits on peers are thin grey bars and
    sends/receives thin red/orange ticks under each row. The title of
    each chart gives its step time and bubble fraction.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not timelines:
        raise ValueError("write_png needs at least one timeline")
    empty = [index for index, t in enumerate(timelines) if not t.events or not t.num_ranks]
    if empty:
        raise ValueError(
            f"write_png: timeline {empty[0]} has no events to draw; record or simulate a step first"
        )
    in_units = any(t.meta.get("time_unit") == "units" for t in timelines)
    unit = scale if scale is not None else (1.0 if in_units else 1e3)
    span = max(t.step_time for t in timelines) * unit
    rows = sum(t.num_ranks for t in timelines)
    fig, axes = plt.subplots(
        len(timelines),
        1,
        sharex=True,
        squeeze=False,
        figsize=(12, 1.0 + 0.45 * rows + 0.6 * len(timelines)),
    )
    for ax, timeline in zip(axes[:, 0], timelines, strict=True):
        _gantt(ax, timeline, unit, span)
    axes[-1, 0].set_xlabel("time (ms)" if unit == 1e3 else "time (units)")
    handles = [
        Patch(color=_COLORS[k], label=k.replace("_", " "))
        for k in (
            "forward",
            "backward",
            "backward_input",
            "backward_weight",
            "recompute",
            "wait",
            "send",
            "recv",
            "reduce",
        )
        if any(e.kind == k for t in timelines for e in t.events)
    ]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    target = Path(path)
    with atomic_path(target) as temporary:
        fig.savefig(temporary, dpi=110, format="png")
    plt.close(fig)
    return target


def _gantt(ax: Any, timeline: Timeline, unit: float, span: float) -> None:
    origin = timeline.start
    min_label = span / 60  # a block narrower than this gets no number
    for rank in range(timeline.num_ranks):
        y = timeline.num_ranks - 1 - rank
        for e in timeline.on(rank):
            left, width = (e.start - origin) * unit, e.duration * unit
            if e.is_compute:
                ax.barh(
                    y,
                    width,
                    left=left,
                    height=0.8,
                    color=_COLORS[e.kind],
                    edgecolor="white",
                    linewidth=0.4,
                )
                if width >= min_label and e.microbatch is not None:
                    ax.text(
                        left + width / 2,
                        y,
                        str(e.microbatch),
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white",
                    )
            elif e.kind == "recompute":  # over the part of its backward that it takes
                ax.barh(y, width, left=left, height=0.8, color=_COLORS["recompute"], zorder=3)
            elif e.kind == "wait":
                ax.barh(y - 0.3, width, left=left, height=0.12, color=_COLORS["wait"])
            else:
                ax.barh(
                    y - 0.43, max(width, span / 2000), left=left, height=0.1, color=_COLORS[e.kind]
                )
    ax.set_yticks(range(timeline.num_ranks))
    ax.set_yticklabels([timeline.label(r) for r in reversed(range(timeline.num_ranks))])
    ax.set_xlim(0, span * 1.01)
    ax.set_title(timeline.title(), fontsize=10)
