"""Graph schedules: GPipe and 1F1B orders over any DAG of stages, several stages per rank.

``gpipe`` and ``one_f_one_b`` (schedule/chain.py) already run a DAG with one stage per rank:
each rank orders its own stage, and a stage's 1F1B warm-up is its distance to the sink, so
branches warm up independently. The schedules here are built by list scheduling instead: an
event-driven simulation over the DAG that, whenever a rank is free, starts the best action
that is ready. That handles several stages per rank (a U-Net whose encoder and decoder level
share a rank, so each skip stays local) and uses per-action costs when given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from conveyor.graph import StageGraph
from conveyor.program import Action, Kind, Program, add_communication
from conveyor.simulator import CostModel, UnitCost

__all__ = ["GraphStyle", "graph_1f1b", "graph_gpipe", "list_schedule"]


GraphStyle = Literal["gpipe", "1f1b"]


def graph_gpipe(graph: StageGraph, num_microbatches: int) -> Program:
    """GPipe over a DAG: every rank runs all its forwards, then all its backwards (last
    micro-batch first); among ready forwards, the oldest micro-batch first."""
    return list_schedule(graph, num_microbatches, style="gpipe")


# 1F1B, two towers (stages 0, 1 on ranks 0, 1) feeding a head (stage 2), F=1, B=2:
# time:    0    1    2    3    4    5    6    7    8
# rank 0: 0F0  0F1            0B0  0B0  0F2  0B1  0B1 ...   (warm-up: distance to the sink)
# rank 1: 1F0  1F1            1B0  1B0  1F2  1B1  1B1 ...   (beside rank 0, not after it)
# rank 2:      2F0  2B0  2B0  2F1  2B1  2B1  2F2  2B2 ...
def graph_1f1b(graph: StageGraph, num_microbatches: int) -> Program:
    """1F1B over a DAG: a stage holds at most (its distance to the sink + 1) micro-batches,
    and a ready backward goes before a ready forward; on a chain this is one_f_one_b."""
    return list_schedule(graph, num_microbatches, style="1f1b")


@dataclass
class _Scheduler:
    """State of one list-scheduling run; see ``list_schedule``."""

    graph: StageGraph
    num_microbatches: int
    style: GraphStyle
    cost: CostModel

    def __post_init__(self) -> None:
        graph, m = self.graph, self.num_microbatches
        self.finish: dict[tuple[int, Kind, int], float] = {}
        self.free = [0.0] * graph.num_ranks
        self.next_forward = {s.index: 0 for s in graph.stages}
        self.backwards = {
            s.index: [*range(m)] if self.style == "1f1b" else [*range(m)][::-1]
            for s in graph.stages
        }
        self.limit = {
            s.index: (graph.distance_to_sink(s.index) + 1 if self.style == "1f1b" else math.inf)
            for s in graph.stages
        }
        self.orders: list[list[Action]] = [[] for _ in range(graph.num_ranks)]
        self.to_source: dict[int, int] = {}  # stages on the longest path up to a first stage
        for stage in graph.stages:
            self.to_source[stage.index] = 1 + max(
                (self.to_source[p] for p in graph.producers(stage.index)), default=-1
            )

    def run(self) -> list[list[Action]]:
        remaining = 2 * self.graph.num_stages * self.num_microbatches
        while remaining:
            choices = [c for r in range(self.graph.num_ranks) if (c := self._choose(r)) is not None]
            if not choices:
                raise AssertionError(
                    f"list scheduling stalled with {remaining} actions left; this is a conveyor bug"
                )
            start, rank, action = min(choices, key=lambda c: (c[0], c[1]))
            key = (action.stage, action.kind, action.microbatch)
            self.finish[key] = start + self.cost.compute(action)
            self.free[rank] = self.finish[key]
            self.orders[rank].append(action)
            if action.kind is Kind.F:
                self.next_forward[action.stage] += 1
            else:
                self.backwards[action.stage].pop(0)
            remaining -= 1
        return self.orders

    def _choose(self, rank: int) -> tuple[float, int, Action] | None:
        """(start, rank, action): the action ``rank`` runs next, or None if none is ready."""
        ready = [(self._ready_at(a, deps), a) for a, deps in self._candidates(rank)]
        if not ready:
            return None
        start = max(self.free[rank], min(t for t, _ in ready))
        eligible = [a for t, a in ready if t <= start]
        return start, rank, min(eligible, key=self._priority)

    def _candidates(self, rank: int) -> list[tuple[Action, list[Action]]]:
        """Next forward and backward of each stage on ``rank`` whose inputs are computed."""
        graph, m = self.graph, self.num_microbatches
        local = graph.stages_on(rank)
        found = []
        for s in local:
            k = self.next_forward[s]
            in_flight = k - (m - len(self.backwards[s]))
            if k < m and in_flight < self.limit[s]:
                deps = [Action(p, Kind.F, k) for p in graph.producers(s)]
                if self._done(deps):
                    found.append((Action(s, Kind.F, k), deps))
            if not self.backwards[s]:
                continue
            if self.style == "gpipe" and any(self.next_forward[t] < m for t in local):
                continue
            k = self.backwards[s][0]
            deps = [Action(s, Kind.F, k)] + [Action(c, Kind.B, k) for c in graph.consumers(s)]
            if self._done(deps):
                found.append((Action(s, Kind.B, k), deps))
        return found

    def _done(self, deps: Sequence[Action]) -> bool:
        return all((d.stage, d.kind, d.microbatch) in self.finish for d in deps)

    def _ready_at(self, action: Action, deps: Sequence[Action]) -> float:
        """When ``action``'s inputs are available on its rank (transfers included)."""
        rank = self.graph.rank_of(action.stage)
        ready = 0.0
        for d in deps:
            at = self.finish[(d.stage, d.kind, d.microbatch)]
            if self.graph.rank_of(d.stage) != rank:
                kind = Kind.SEND_F if d.kind is Kind.F else Kind.SEND_B
                at += self.cost.transfer(Action(d.stage, kind, d.microbatch, action.stage))
            ready = max(ready, at)
        return ready

    def _priority(self, action: Action) -> tuple[int, int, int]:
        """1F1B: backward before forward. Then the micro-batch furthest along (the oldest; in
        GPipe's backward, the last), then the stage with the most work still ahead of it on
        the critical path: for a forward the longest path to the sink, for a backward the
        longest path back to a first stage."""
        if action.kind is Kind.F:
            return (
                int(self.style == "1f1b"),
                action.microbatch,
                -self.graph.distance_to_sink(action.stage),
            )
        position = (
            action.microbatch
            if self.style == "1f1b"
            else self.num_microbatches - 1 - action.microbatch
        )
        return 0, position, -self.to_source[action.stage]


def list_schedule(
    graph: StageGraph,
    num_microbatches: int,
    *,
    style: GraphStyle = "1f1b",
    cost: CostModel | None = None,
) -> Program:
    """A Program for any stage graph, by list scheduling against ``cost`` (default F=1, B=2).

    Stages run micro-batches in order; each action waits for its inputs (forwards of its
    producers, backwards of its consumers) and, in the 1F1B style, for a free slot among the
    (distance to sink + 1) micro-batches a stage may hold. Whenever a rank is free it starts
    the ready action that ``style`` ranks first. Deadlock-free by construction; validated by
    ``build_program`` like every schedule.
    """
    if style not in ("gpipe", "1f1b"):
        raise ValueError(f"style must be 'gpipe' or '1f1b', got {style!r}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    orders = _Scheduler(graph, num_microbatches, style, cost or UnitCost()).run()
    return add_communication(graph, orders, num_microbatches)
