"""One profile's candidates for the planner (``conveyor.planner.search``): for a schedule and
a micro-batch count, the optimal splits of each objective, each stage's recomputation and a
lower bound on the step; then simulated, lowest bound first, within a deadline.

    search = Candidates(profile, 2, memory_budget=2**30, batch_size=32, recompute=True)
    found = dedupe(search.attempt("1f1b", 8, ["time", "memory"], notes))
    plans, pruned, left_out = search.simulate_best(found, 10, None, WorkClock())
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from conveyor.graph import MODEL_OUTPUT, StageGraph, chain
from conveyor.planner.budget import WorkClock
from conveyor.planner.cost import ProfileCost, Replicas, layout, predict
from conveyor.planner.partition import (
    StageCosts,
    alive_per_stage,
    bottleneck_split,
    cut_points,
    even_starts,
)
from conveyor.planner.profile import Profile
from conveyor.planner.report import Objective, Plan
from conveyor.program import Program
from conveyor.runtime.recompute import RECOMPUTE_MODES, RecomputeMode
from conveyor.schedule import SCHEDULES, stage_placement
from conveyor.simulator import DeadlockError

__all__ = ["Candidate", "Candidates", "dedupe"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """A configuration to simulate, with a lower bound on its step time."""

    schedule: str
    m: int
    cuts: tuple[tuple[int, ...], ...]
    placement: tuple[int, ...]
    modes: tuple[RecomputeMode, ...]
    objective: Objective
    bound: float
    """The busiest rank's compute: no schedule finishes sooner."""


def dedupe(candidates: list[Candidate]) -> list[Candidate]:
    """One candidate per schedule, count, split and recomputation (objectives can agree)."""
    seen: dict[tuple[Any, ...], Candidate] = {}
    for c in candidates:
        seen.setdefault((c.schedule, c.m, c.cuts, c.modes), c)
    return list(seen.values())


class Candidates:
    """Candidates for one (schedule, micro-batch count): DP splits, recomputation, simulation."""

    def __init__(
        self,
        profile: Profile,
        num_ranks: int,
        memory_budget: int,
        batch_size: int,
        recompute: bool,
        order: list[int] | None = None,
        replicas: Replicas | None = None,
    ) -> None:
        self.profile = profile
        self.replicas = replicas
        self.order = order
        """The original index of each unit of ``profile`` when it was reordered."""
        self.num_ranks = num_ranks
        self.budget = memory_budget
        self.batch_size = batch_size
        self.modes: tuple[RecomputeMode, ...] = RECOMPUTE_MODES if recompute else ("never",)
        self.num_units = profile.num_units
        self.can_start = cut_points(profile, num_ranks)
        self.notes: list[str] = []
        self._programs: dict[tuple[Any, ...], Program] = {}

    def _program(self, schedule: str, graph: StageGraph, m: int) -> Program:
        """A schedule's Program, made once per shape: it depends only on which stages feed
        which and where they sit, not on what the stages compute."""
        key = (
            schedule,
            m,
            tuple(
                (s.rank, tuple(graph.producers(s.index)), MODEL_OUTPUT in s.outputs)
                for s in graph.stages
            ),
        )
        if key not in self._programs:
            self._programs[key] = SCHEDULES[schedule](graph, m)
        return self._programs[key]

    def attempt(
        self, name: str, m: int, objectives: Sequence[Objective], notes: list[str]
    ) -> list[Candidate]:
        """Candidates of one schedule and micro-batch count; a note if it cannot run here."""
        try:
            return self.candidates(name, m, objectives)
        except (ValueError, DeadlockError) as error:
            notes.append(f"{name} with {m} micro-batches: {error}".splitlines()[0])
            return []

    def candidates(self, schedule: str, m: int, objectives: Sequence[Objective]) -> list[Candidate]:
        placement = stage_placement(schedule, self.num_ranks)
        num_stages = len(placement)
        if num_stages > int(self.can_start.sum()):
            raise ValueError(
                f"needs {num_stages} stages but the model has only "
                f"{int(self.can_start.sum())} layers to cut at"
            )
        shape = chain(num_stages, placement=placement)
        program = self._program(schedule, shape, m)  # ValueError if it cannot run here
        inflight = alive_per_stage(program, num_stages)
        costs = StageCosts(self.profile, self.batch_size / m, m, self.batch_size)
        per_rank = num_stages // self.num_ranks
        plans = []
        splits: dict[tuple[tuple[int, ...], ...], Objective] = {}
        for objective in objectives:
            cuts = self._split(costs, objective, inflight, num_stages, per_rank)
            if cuts is not None:
                splits.setdefault(cuts, objective)
        if self.modes != ("never",):  # the least memory: balanced by memory, all recomputed
            cuts = self._split(costs, "memory", inflight, num_stages, per_rank, "always")
            if cuts is not None:
                splits.setdefault(cuts, "memory")
        for cuts, objective in splits.items():
            for modes in self._recomputing(costs, cuts, inflight, per_rank):
                plans.append(
                    Candidate(
                        schedule,
                        m,
                        cuts,
                        tuple(placement),
                        modes,
                        objective,
                        self._bound(m, cuts, placement, modes),
                    )
                )
        return plans

    def _bound(
        self,
        m: int,
        cuts: tuple[tuple[int, ...], ...],
        placement: list[int],
        modes: tuple[RecomputeMode, ...],
    ) -> float:
        """The busiest rank's compute over the step, as the simulator charges it."""
        graph, units = layout(self.profile, [list(c) for c in cuts], placement)
        cost = ProfileCost(self.profile, graph, units, self.batch_size / m, m, list(modes))
        work = [0.0] * self.num_ranks
        for s in range(graph.num_stages):
            work[placement[s]] += cost.stage_work(s)
        return max(work) + self.profile.overheads.step

    def simulate_best(
        self, candidates: list[Candidate], keep: int, deadline: float | None, clock: WorkClock
    ) -> tuple[list[Plan], int, int]:
        """Simulate candidates by increasing bound until ``keep`` fitting plans beat the rest;
        equal programs (two schedules that agree on this layout) are simulated once.

        A candidate whose simulation would end past ``deadline`` is left out, but one is
        always simulated, and if none of those simulated fits, the one likely to need the
        least memory too (See Note [planning budget]).

        Returns:
            the plans, the candidates their bound pruned, the candidates left out for time.
        """
        plans: list[Plan] = []
        seen: dict[tuple[Any, ...], Plan] = {}
        left_out: list[Candidate] = []
        ordered = sorted(candidates, key=lambda c: c.bound)
        for index, c in enumerate(ordered):
            fitting = sorted(p.step_time for p in plans if p.fits)
            if len(fitting) >= keep and c.bound > fitting[keep - 1]:
                return plans, len(ordered) - index, len(left_out)
            if plans and not clock.fits("simulate", c.m * len(c.placement), deadline):
                left_out.append(c)
                continue
            self._simulate_into(plans, c, seen, clock)
        if left_out and not any(p.fits for p in plans):
            least = min(
                left_out,
                key=lambda c: (set(c.modes) != {"always"}, c.objective != "memory", c.bound),
            )
            left_out.remove(least)
            self._simulate_into(plans, least, seen, clock)
        return plans, 0, len(left_out)

    def _simulate_into(
        self, plans: list[Plan], c: Candidate, seen: dict[tuple[Any, ...], Plan], clock: WorkClock
    ) -> None:
        began = time.monotonic()
        graph, units = layout(self.profile, [list(u) for u in c.cuts], list(c.placement))
        try:
            program = self._program(c.schedule, graph, c.m)
        except ValueError as error:  # e.g. a split whose skip connections make a graph
            self.notes.append(
                f"{c.schedule} with {c.m} micro-batches, stages of "
                f"{[len(u) for u in c.cuts]} units: {error}"
            )
            return
        key = (program.ranks, c.cuts, c.modes)
        if key in seen:
            plans.append(replace(seen[key], schedule=c.schedule, balanced_by=c.objective))
            return
        plans.append(self._simulate(c, graph, units, program))
        seen[key] = plans[-1]
        clock.record("simulate", c.m * len(c.placement), time.monotonic() - began)

    def _split(
        self,
        costs: StageCosts,
        objective: Objective,
        inflight: list[int],
        num_stages: int,
        per_rank: int,
        only: RecomputeMode | None = None,
    ) -> tuple[tuple[int, ...], ...] | None:
        """Stage boundaries from the DP (or an even split), as unit index tuples."""
        if objective == "even":
            starts = even_starts(self.can_start, num_stages)
        else:
            starts = bottleneck_split(
                lambda j: self._stage_cost(costs, objective, inflight[j], per_rank, only),
                self.can_start,
                num_stages,
                [inflight[j] for j in range(num_stages)],
            )
        if starts is None:
            return None
        bounds = [*starts, self.num_units]
        return tuple(tuple(range(a, b)) for a, b in itertools.pairwise(bounds))

    def _stage_cost(
        self,
        costs: StageCosts,
        objective: Objective,
        inflight: int,
        per_rank: int,
        only: RecomputeMode | None,
    ) -> np.ndarray:
        """Matrix of one stage's cost for every (first unit, end unit) pair."""
        budget = self.budget / per_rank
        modes = (only,) if only else self.modes
        if objective == "time":
            best = np.full(costs.shape, np.inf)
            for mode in modes:
                fits = costs.memory(mode, inflight) <= budget
                best = np.where(fits, np.minimum(best, costs.time(mode)), best)
            return best
        memory = costs.memory(only or "never", inflight)
        if objective == "memory":
            return memory
        time_share = costs.time("never") / costs.total_time
        memory_share = memory / max(costs.total_memory, 1.0)
        return np.maximum(time_share, memory_share)

    def _recomputing(
        self,
        costs: StageCosts,
        cuts: tuple[tuple[int, ...], ...],
        inflight: list[int],
        per_rank: int,
    ) -> list[tuple[RecomputeMode, ...]]:
        """Per stage, the fastest mode that fits its share of the budget; and all-always."""
        budget = self.budget / per_rank
        chosen: list[RecomputeMode] = []
        for j, units in enumerate(cuts):
            a, b = units[0], units[-1] + 1
            fitting = [
                mode for mode in self.modes if costs.memory(mode, inflight[j])[a, b] <= budget
            ]
            chosen.append(fitting[0] if fitting else self.modes[-1])
        options = [tuple(chosen)]
        if "always" in self.modes:
            options.append(tuple("always" for _ in cuts))
        return list(dict.fromkeys(options))

    def _simulate(
        self, c: Candidate, graph: StageGraph, units: list[list[int]], program: Program
    ) -> Plan:
        cost = ProfileCost(
            self.profile, graph, units, self.batch_size / c.m, c.m, list(c.modes), self.replicas
        )
        prediction = predict(program, graph, cost, record=False)
        fits = all(total <= self.budget for total in prediction.total_memory)
        order = self.order
        cuts = c.cuts if order is None else tuple(tuple(order[u] for u in cut) for cut in c.cuts)
        return Plan(
            c.schedule,
            c.m,
            cuts,
            c.placement,
            c.modes,
            c.objective,
            prediction.step_time,
            prediction.bubble_fraction,
            prediction.peak_activation,
            prediction.total_memory,
            fits,
            self.batch_size,
        )
