"""Pipeline schedules: pure functions StageGraph x micro-batches -> Program."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from conveyor.graph import StageGraph
from conveyor.schedule.chain import forward_only, gpipe, one_f_one_b
from conveyor.schedule.program import Action, Kind, Program, add_communication
from conveyor.schedule.validate import ProgramError, validate

__all__ = [
    "SCHEDULES", "Action", "Kind", "Program", "ProgramError", "Schedule", "build_program",
    "forward_only", "from_text", "gpipe", "one_f_one_b", "validate",
]

Schedule = Callable[[StageGraph, int], Program]
"""A schedule: (stage graph, number of micro-batches) -> Program."""

SCHEDULES: dict[str, Schedule] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
}
"""Schedules by name, as ``Pipeline(schedule=...)`` and the CLI accept them."""


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
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {sorted(SCHEDULES)} "
                         "or the path of a schedule file (one line of actions per rank)")
    validate(program, graph)
    return program
