"""Pipeline schedules: pure functions StageGraph x micro-batches -> Program."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from conveyor.graph import PlacementStyle, StageGraph
from conveyor.schedule.chain import forward_only, gpipe, one_f_one_b
from conveyor.schedule.graph import graph_1f1b, graph_gpipe, list_schedule
from conveyor.schedule.interleaved import interleaved_1f1b
from conveyor.schedule.program import Action, Kind, Program, add_communication
from conveyor.schedule.validate import ProgramError, validate
from conveyor.schedule.zero_bubble import zb_h1, zb_v

__all__ = [
    "LAYOUTS", "SCHEDULES", "Action", "Kind", "Layout", "Program", "ProgramError", "Schedule",
    "build_program", "forward_only", "from_text", "gpipe", "graph_1f1b", "graph_gpipe",
    "interleaved_1f1b", "layout_of", "list_schedule", "one_f_one_b", "validate", "zb_h1", "zb_v",
]

Schedule = Callable[[StageGraph, int], Program]
"""A schedule: (stage graph, number of micro-batches) -> Program."""

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


@dataclass(frozen=True)
class Layout:
    """How a schedule wants stages laid out: its default stages per rank and placement."""

    virtual_stages: int = 1
    """Stages per rank when the split does not say (balance or split points do)."""
    placement: PlacementStyle = "loop"
    """'loop': stage s on rank s mod p; 'v': down the ranks and back (see graph.place)."""


LAYOUTS: dict[str, Layout] = {
    "interleaved-1f1b": Layout(virtual_stages=2, placement="loop"),
    "zb-v": Layout(virtual_stages=2, placement="v"),
}
"""Layouts of the schedules that need more than one stage per rank; others use Layout()."""


def layout_of(schedule: str | Schedule) -> Layout:
    """The layout a named schedule wants; ``Layout()`` for others, files and callables."""
    return LAYOUTS.get(schedule, Layout()) if isinstance(schedule, str) else Layout()


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
