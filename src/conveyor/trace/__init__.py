"""Timelines, measured or predicted: the type (timeline), the runtime's recorder, run files
on disk, and the renderers (text grid, Chrome trace, PNG).

    pipe = conveyor.Pipeline(model, trace=True, ...); pipe.step(x, y)
    timeline = pipe.timeline()          # collective: every rank's events of the last step
    print(timeline.summary_text()); write_png("step.png", timeline)
"""

from conveyor.trace.files import load_run, trace_file_name
from conveyor.trace.recorder import Recorder
from conveyor.trace.render import chrome_trace, render_grid, write_chrome, write_png
from conveyor.trace.timeline import (
    RECOMPUTE,
    REDUCE,
    WAIT,
    Event,
    RankSummary,
    Timeline,
    merge,
)

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
