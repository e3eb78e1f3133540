"""Resolve a schedule (a name, a file of schedule text, or a function) into a valid Program.

program = build_program("zb-h1", graph, num_microbatches=8)
program = from_text(Path("mine.txt").read_text(), graph)
"""

from __future__ import annotations

from pathlib import Path

from conveyor.graph import StageGraph
from conveyor.program import Program, Schedule, add_communication
from conveyor.schedule.registry import SCHEDULES, spec_of
from conveyor.schedule.validate import validate

__all__ = ["build_program", "from_text", "schedule_name"]


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
    spec = spec_of(schedule)
    if spec.name:
        return spec.name
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
