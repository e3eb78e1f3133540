"""The schedules conveyor ships, one spec each: what builds it, where it wants its stages and
what it can run. Every other place (placement, splitting, errors, the planner, the CLI) reads
the spec; a new schedule is a function and one entry here.

    spec = SCHEDULES["zb-v"]          # spec(graph, m) builds its Program
    spec.virtual_stages, spec.placement, spec.needs_chain   # 2, 'v', True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from conveyor.graph import PlacementStyle, StageGraph, place
from conveyor.program import Program, Schedule, ScheduleMismatch
from conveyor.schedule.chain import gpipe, one_f_one_b
from conveyor.schedule.dag import graph_1f1b, graph_gpipe
from conveyor.schedule.dualpipe import dualpipe_v
from conveyor.schedule.interleaved import interleaved_1f1b
from conveyor.schedule.zero_bubble import zb_h1, zb_v

__all__ = ["SCHEDULES", "Runs", "ScheduleSpec", "schedules_for", "spec_of"]

Runs = Literal["any graph", "one stage per rank", "chain"]
"""What graphs a schedule runs: any DAG of stages, one stage per rank, or a chain of stages
placed as the schedule wants (several per rank)."""


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule: its builder, its layout of stages, and what it runs."""

    name: str
    build: Schedule
    runs: Runs
    virtual_stages: int = 1
    """Stages per rank when the split does not say (balance or split points do)."""
    placement: PlacementStyle = "loop"
    """'loop': stage s on rank s mod p; 'v': down the ranks and back (see graph.place)."""
    exact: bool = False
    """Whether it runs ``virtual_stages`` per rank only (ZB-V's V of two)."""
    split_backward: bool = False
    """Whether its Programs split backward into I and W (conveyor.program.Kind)."""

    @property
    def needs_chain(self) -> bool:
        """Whether it runs chains only, so that a value skipping stages (a skip connection,
        a transformer's mask) is relayed through every stage between."""
        return self.runs == "chain"

    def __call__(self, graph: StageGraph, num_microbatches: int) -> Program:
        """The Program; a graph it cannot run is refused naming the schedules that can."""
        try:
            return self.build(graph, num_microbatches)
        except ScheduleMismatch as error:
            raise ScheduleMismatch(
                f"{error}; use one of {schedules_for(graph)}, which run this graph as it is placed"
            ) from None

    def runs_graph(self, graph: StageGraph) -> bool:
        """Whether it runs ``graph`` as it is placed."""
        one_each = all(len(graph.stages_on(r)) == 1 for r in range(graph.num_ranks))
        if self.runs == "any graph":
            return True
        if self.runs == "one stage per rank":
            return one_each
        placement = [graph.rank_of(s) for s in range(graph.num_stages)]
        return (
            not one_each
            and graph.chain_break() is None
            and graph.num_stages % graph.num_ranks == 0
            and placement == place(graph.num_stages, graph.num_ranks, self.placement)
        )


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", gpipe, "any graph"),
        ScheduleSpec("1f1b", one_f_one_b, "one stage per rank"),
        ScheduleSpec("interleaved-1f1b", interleaved_1f1b, "chain", virtual_stages=2),
        ScheduleSpec("zb-h1", zb_h1, "one stage per rank", split_backward=True),
        ScheduleSpec("zb-v", zb_v, "chain", 2, "v", exact=True, split_backward=True),
        ScheduleSpec("dualpipev", dualpipe_v, "chain", 2, "v", exact=True, split_backward=True),
        ScheduleSpec("graph-gpipe", graph_gpipe, "any graph"),
        ScheduleSpec("graph-1f1b", graph_1f1b, "any graph"),
    )
}
"""Schedules by name, as ``Pipeline(schedule=...)`` and the CLI accept them."""

_DEFAULT = ScheduleSpec("", gpipe, "any graph")


def spec_of(schedule: str | Schedule) -> ScheduleSpec:
    """The spec of a shipped schedule (by name or function); a plain spec of one stage per
    rank, placed in a loop, for a file or a function of the user's."""
    if isinstance(schedule, str):
        return SCHEDULES.get(schedule, _DEFAULT)
    found = [spec for spec in SCHEDULES.values() if spec.build is schedule or spec is schedule]
    return found[0] if found else _DEFAULT


def schedules_for(graph: StageGraph) -> str:
    """The shipped schedules that run ``graph`` as it is placed, for error messages."""
    order = {"any graph": 0, "one stage per rank": 1, "chain": 2}
    specs = sorted(SCHEDULES.values(), key=lambda spec: (order[spec.runs], spec.name))
    return ", ".join(repr(spec.name) for spec in specs if spec.runs_graph(graph))
