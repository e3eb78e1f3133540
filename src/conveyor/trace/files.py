"""Run files: each rank's recorded steps as JSON lines in a directory, and a Timeline of any
recorded step read back from them.

    sink = open(DIR / trace_file_name(rank), "w")   # the Recorder writes a line per step
    timeline = load_run(DIR, step=3)                 # every rank's (and replica's) events
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from conveyor.trace.timeline import Event, Timeline, clipped

__all__ = ["load_run", "trace_file_name"]

logger = logging.getLogger(__name__)


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
            kept, start = clipped(parts)
            events += kept
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
