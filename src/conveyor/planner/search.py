"""Plan a pipeline: profile the model once, then search split x schedule x micro-batches x
activation checkpointing with the simulator.

    report = plan(example("gpt"), num_ranks=2, memory_budget=2**30, batch_size=32)

Splits come from a dynamic program over the model's units (layers, or graph nodes) that
minimizes the slowest stage (balance by time), the largest stage memory (by memory) or the
larger of the two relative to an even share (both), subject to the memory budget; each stage
then gets the cheapest checkpointing that fits. Every candidate is simulated
(``conveyor.planner.cost``) and a plan whose predicted memory exceeds the budget is never
recommended.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from torch import nn

from conveyor.graph import MODEL_OUTPUT, StageGraph, chain
from conveyor.planner.cost import ProfileCost, Replicas, layout, predict
from conveyor.planner.partition import (
    StageCosts,
    alive_per_stage,
    bottleneck_split,
    branches_whole,
    cut_points,
    even_starts,
    reordered,
)
from conveyor.planner.profile import Profile, Workload, profile_model, trace_units
from conveyor.planner.report import Objective, Plan, PlanReport
from conveyor.program import Program
from conveyor.runtime.recompute import RECOMPUTE_MODES, RecomputeMode
from conveyor.schedule import SCHEDULES, spec_of, stage_placement
from conveyor.simulator import DeadlockError

__all__ = ["microbatch_counts", "microbatch_sizes", "plan", "unit_depth"]

logger = logging.getLogger(__name__)


def plan(
    workload: Workload | None,
    num_ranks: int,
    memory_budget: int,
    batch_size: int,
    *,
    profile: Profile | None = None,
    schedules: Sequence[str] | None = None,
    microbatches: Sequence[int] | None = None,
    objectives: Sequence[Objective] = ("time", "memory", "both", "even"),
    checkpointing: bool = True,
    keep: int = 10,
    time_budget_s: float | None = 50.0,
    replicas: Replicas | None = None,
) -> PlanReport:
    """Search splits, schedules, micro-batch counts and checkpointing; simulate each candidate.

    Args:
        workload: the model, its batches and loss; profiled here unless ``profile`` is given
            (then only used to name layers and may be None).
        memory_budget: bytes per rank for parameters, gradients, optimizer state and
            activations.
        schedules: names from ``SCHEDULES`` (default: every one).
        microbatches: micro-batch counts to try (default: the divisors of ``batch_size`` from
            the number of ranks up to 8 x the stages).
        checkpointing: also consider activation checkpointing per stage.
        keep: candidates are simulated fastest lower bound first, and once ``keep`` plans
            that fit are known, a candidate whose lower bound (its busiest rank's compute) is
            slower than all of them is not simulated: the top ``keep`` stay exact.
        time_budget_s: seconds for the search, counted after profiling: preparing
            candidates (smaller micro-batch counts first) stops after half of this,
            simulating them (lowest bound first) after all of it once a plan that fits is
            known; what was skipped is listed in ``notes``. None: no limit.
        replicas: data-parallel replicas of each pipeline (``batch_size`` is then one
            replica's share): their gradient reductions are simulated, and FSDP's memory.

    Raises:
        ValueError: a bad rank count or batch size, a profile that does not match the
            workload's model, or no configuration the search could place.
    """
    start = time.perf_counter()
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if batch_size < 1 or memory_budget <= 0:
        raise ValueError(
            f"batch_size and memory_budget must be positive, got {batch_size} and {memory_budget}"
        )
    names = list(SCHEDULES) if schedules is None else list(schedules)
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown:
        raise ValueError(f"unknown schedules {unknown}; expected names from {sorted(SCHEDULES)}")
    counts = microbatch_counts(batch_size, num_ranks, names, microbatches)
    if any(m < 1 or m > batch_size for m in counts):
        raise ValueError(f"micro-batch counts {counts} must lie in 1..{batch_size} (the batch)")
    profile, children = _profile_for(
        workload,
        profile,
        num_ranks,
        batch_size,
        counts,
        max(spec_of(n).virtual_stages for n in names),
    )
    searching = time.perf_counter()  # the time budget is the search's: profiling is not in it
    # a graph model is also cut along an order that keeps each branch whole (conveyor.split.cut),
    # so that independent branches can sit on different ranks side by side
    orders: list[list[int] | None] = [None]
    branches = branches_whole(profile)
    if branches is not None:
        orders.append(branches)
    notes: list[str] = []
    plans: list[Plan] = []
    pruned = 0
    # cheapest first: some schedules take far longer to build than others (list schedules
    # over a graph), so a probe on a small pipeline orders them
    probe = {name: _build_time(name, min(num_ranks, 8)) for name in names}
    for order in orders:
        search = _Search(
            profile if order is None else reordered(profile, order),
            num_ranks,
            memory_budget,
            batch_size,
            checkpointing,
            order,
            replicas,
        )
        pending: list[_Candidate] = []
        for m, name in sorted(
            ((m, n) for m in counts for n in names),
            key=lambda pair: (probe[pair[1]] * pair[0], pair[0]),
        ):
            if time_budget_s is not None and time.perf_counter() - searching > time_budget_s / 2:
                notes.append(
                    f"{name} with {m} micro-batches: not tried, the search used its "
                    f"time budget ({time_budget_s:.0f} s)"
                )
                continue
            pending += _attempt(search, name, m, objectives, notes)
        deadline = None if time_budget_s is None else searching + time_budget_s
        found, skipped = search.simulate_best(_dedupe(pending), keep, deadline)
        plans += found
        pruned += skipped
        notes += search.notes
    if not plans:
        raise ValueError(
            f"no configuration could be placed on {num_ranks} ranks: " + "; ".join(notes[:4])
        )
    plans.sort(key=lambda p: (not p.fits, p.step_time, max(p.total_memory)))
    report = PlanReport(
        plans,
        profile,
        num_ranks,
        memory_budget,
        batch_size,
        time.perf_counter() - start,
        _unique(notes),
        children,
        pruned,
        replicas,
    )
    logger.info(
        "planned %s for %d ranks: %d plans simulated (%d pruned by their bound) in %.1f s",
        profile.model,
        num_ranks,
        len(plans),
        pruned,
        report.elapsed_s,
    )
    return report


def _build_time(name: str, num_ranks: int) -> float:
    """Seconds a schedule takes to build a small pipeline's program (0 if it cannot)."""
    placement = stage_placement(name, num_ranks)
    began = time.perf_counter()
    try:
        SCHEDULES[name](chain(len(placement), placement=placement), 2 * num_ranks)
    except ValueError:
        return 0.0
    return time.perf_counter() - began


def _attempt(
    search: _Search, name: str, m: int, objectives: Sequence[Objective], notes: list[str]
) -> list[_Candidate]:
    """Candidates of one schedule and micro-batch count; a note if it cannot run here."""
    try:
        return search.candidates(name, m, objectives)
    except (ValueError, DeadlockError) as error:
        notes.append(f"{name} with {m} micro-batches: {error}".splitlines()[0])
        return []


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _dedupe(candidates: list[_Candidate]) -> list[_Candidate]:
    seen: dict[tuple[Any, ...], _Candidate] = {}
    for c in candidates:
        seen.setdefault((c.schedule, c.m, c.cuts, c.modes), c)
    return list(seen.values())


@dataclass(frozen=True)
class _Candidate:
    """A configuration to simulate, with a lower bound on its step time."""

    schedule: str
    m: int
    cuts: tuple[tuple[int, ...], ...]
    placement: tuple[int, ...]
    modes: tuple[RecomputeMode, ...]
    objective: Objective
    bound: float
    """The busiest rank's compute: no schedule finishes sooner."""


def microbatch_counts(
    batch_size: int, num_ranks: int, names: Sequence[str], microbatches: Sequence[int] | None
) -> list[int]:
    if microbatches is not None:
        return list(microbatches)
    counts = _divisors(batch_size, 8 * num_ranks * max(spec_of(n).virtual_stages for n in names))
    enough = [m for m in counts if m >= num_ranks]  # fewer than one per rank idles ranks
    return enough or counts


def microbatch_sizes(batch_size: int, counts: Sequence[int]) -> list[int]:
    return sorted({max(1, round(batch_size / m)) for m in counts})


def _profile_for(
    workload: Workload | None,
    profile: Profile | None,
    num_ranks: int,
    batch_size: int,
    counts: Sequence[int],
    max_virtual: int,
) -> tuple[Profile, list[str] | None]:
    """The profile to plan with (measured now if not given), at a depth with enough units."""
    if workload is None and profile is None:
        raise ValueError("plan needs a workload to profile or a profile")
    if profile is None:
        assert workload is not None
        depth = unit_depth(workload.model, num_ranks * max_virtual)
        profile = profile_model(workload, microbatch_sizes(batch_size, counts), depth=depth)
    elif workload is not None:
        profile.check(trace_units(workload.model, profile.depth)[2])
    cut_points = sum(1 for u in profile.units if u.target)
    if cut_points < num_ranks:
        raise ValueError(
            f"{profile.model} has {cut_points} layers to cut at, too few for "
            f"{num_ranks} ranks (every rank needs a stage of at least one layer); "
            f"plan for at most {cut_points} ranks"
        )
    children = None
    if workload is not None and isinstance(workload.model, nn.Sequential):
        names = [name for name, _ in workload.model.named_children()]
        if [u.target for u in profile.units] == names:
            children = names
    return profile, children


def unit_depth(model: nn.Module, num_stages: int, max_depth: int = 3) -> int:
    """The shallowest unit depth with a layer to cut at for each of ``num_stages`` stages;
    deeper only when the layers can be traced into (else the deepest that traces)."""
    chosen = 1
    for depth in range(1, max_depth + 1):
        try:
            units = trace_units(model, depth)[2]
        except TypeError:
            if depth == 1:
                raise
            break
        chosen = depth
        if sum(1 for u in units if u.target) >= num_stages:
            break
    return chosen


class _Search:
    """Candidates for one (schedule, micro-batch count): DP splits, checkpointing, simulation."""

    def __init__(
        self,
        profile: Profile,
        num_ranks: int,
        memory_budget: int,
        batch_size: int,
        checkpointing: bool,
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
        self.modes: tuple[RecomputeMode, ...] = RECOMPUTE_MODES if checkpointing else ("never",)
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

    def candidates(
        self, schedule: str, m: int, objectives: Sequence[Objective]
    ) -> list[_Candidate]:
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
            for modes in self._checkpointing(costs, cuts, inflight, per_rank):
                plans.append(
                    _Candidate(
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
        self, candidates: list[_Candidate], keep: int, deadline: float | None
    ) -> tuple[list[Plan], int]:
        """Simulate candidates by increasing bound until ``keep`` fitting plans beat the rest
        (or the deadline passes with one that fits); equal programs (two schedules that agree
        on this layout) are simulated once."""
        plans: list[Plan] = []
        fitting: list[float] = []
        seen: dict[tuple[Any, ...], Plan] = {}
        ordered = sorted(candidates, key=lambda c: c.bound)
        for index, c in enumerate(ordered):
            if len(fitting) >= keep and c.bound > sorted(fitting)[keep - 1]:
                return plans, len(ordered) - index
            if fitting and deadline is not None and time.perf_counter() > deadline:
                self.notes.append(
                    f"{len(ordered) - index} candidates with larger lower bounds "
                    "were not simulated: the search used its time budget"
                )
                return plans, len(ordered) - index
            graph, units = layout(self.profile, [list(u) for u in c.cuts], list(c.placement))
            try:
                program = self._program(c.schedule, graph, c.m)
            except ValueError as error:  # e.g. a split whose skip connections make a graph
                self.notes.append(
                    f"{c.schedule} with {c.m} micro-batches, stages of "
                    f"{[len(u) for u in c.cuts]} units: {error}"
                )
                continue
            key = (program.ranks, c.cuts, c.modes)
            if key in seen:
                plan_ = replace(seen[key], schedule=c.schedule, balanced_by=c.objective)
            else:
                plan_ = seen[key] = self._simulate(c, graph, units, program)
            plans.append(plan_)
            if plan_.fits:
                fitting.append(plan_.step_time)
        return plans, 0

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

    def _checkpointing(
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
        self, c: _Candidate, graph: StageGraph, units: list[list[int]], program: Program
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
