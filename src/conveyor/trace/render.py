"""Renderers of a Timeline: a text grid, Chrome / Perfetto trace JSON, and a PNG Gantt chart.

print(render_grid(simulate(program)))          # unit-cost timelines, as text
write_chrome("step.json", measured, predicted)  # open at ui.perfetto.dev
write_png("step.png", measured, predicted)      # one panel per timeline
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conveyor.files import atomic_path, write_atomic
from conveyor.trace.timeline import Timeline, is_compute

__all__ = ["chrome_trace", "render_grid", "write_chrome", "write_png"]


_GRID_COLUMNS = 10_000
"""The widest text grid drawn: a timeline in seconds from the epoch would be 10^9 wide."""


def render_grid(timeline: Timeline) -> str:
    """A rank x time text grid of compute actions; for timelines in whole time units.

    rank 0 | 0F0 0F1  .   .  0B0 0B0 0B1 0B1
    rank 1 |  .  1F0 1F1 1B0 ...

    Raises:
        ValueError: the timeline is not in whole time units (a measured one, in seconds).
    """
    compute = [e for e in timeline.events if is_compute(e.action)]
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
