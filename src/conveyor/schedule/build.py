"""Resolve a schedule (a name, a file of schedule text, or a function) into a valid Program.

program = build_program("zb-h1", graph, num_microbatches=8)
program = from_text(Path("mine.txt").read_text(), graph)
"""

from __future__ import annotations

from pathlib import Path

from conveyor.graph import StageGraph
from conveyor.program import Program, add_communication
from conveyor.schedule.chain import gpipe, one_f_one_b
from conveyor.schedule.dag import graph_1f1b, graph_gpipe
from conveyor.schedule.interleaved import interleaved_1f1b
from conveyor.schedule.layout import Schedule
from conveyor.schedule.validate import validate
from conveyor.schedule.zero_bubble import zb_h1, zb_v

__all__ = ["SCHEDULES", "build_program", "from_text", "schedule_name"]

SCHEDULES: dict[str, Schedule] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zb-v": zb_v,
    "graph-gpipe": graph_gpipe,
    "graph-1f1b": graph_1f1b,
}
"""Schedules by name, as ``Pipeline(schedule=...)`` and the CLI accept them."""


def schedule_name(schedule: str | Schedule) -> str:
    """What a schedule is called in configs, logs, traces and checkpoints: a name or file as
    given, a shipped function by its name (``zb_v`` is "zb-v", with its layout), any other
    function by its qualified name."""
    if isinstance(schedule, str):
        return schedule
    if not callable(schedule):
        raise TypeError(
            f"schedule must be a name, a schedule file or a function (graph, num_microbatches) "
            f"-> Program, got {type(schedule).__name__} {schedule!r}"
        )
    known = [name for name, function in SCHEDULES.items() if function is schedule]
    if known:
        return known[0]
    return f"{schedule.__module__}.{getattr(schedule, '__qualname__', type(schedule).__name__)}"


def from_text(text: str, graph: StageGraph, num_microbatches: int | None = None) -> Program:
    """A Program from its text form: one line of actions per rank.

    Lines may list compute actions only (``0F0 0F1 0B0 0B1``); sends and receives are then
    inserted. The result is validated.
    """
    parsed = Program.parse(text, num_microbatches)
    if all(a.is_compute for actions in parsed for a in actions):
        parsed = add_communication(graph, parsed.ranks, parsed.num_microbatches)
    validate(parsed, graph)
    return parsed


def build_program(schedule: str | Schedule, graph: StageGraph, num_microbatches: int) -> Program:
    """Resolve ``schedule`` (a name, a file of schedule text, or a callable) and validate.

    Raises:
        ValueError: unknown name, or the program is invalid (ProgramError lists why).
    """
    if callable(schedule):
        program = schedule(graph, num_microbatches)
    elif schedule in SCHEDULES:
        program = SCHEDULES[schedule](graph, num_microbatches)
    elif Path(schedule).is_file():
        return from_text(Path(schedule).read_text(), graph, num_microbatches)
    else:
        raise ValueError(
            f"unknown schedule {schedule!r}; expected one of {sorted(SCHEDULES)} "
            "or the path of a schedule file (one line of actions per rank)"
        )
    validate(program, graph)
    return program
