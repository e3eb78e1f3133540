"""Plan a pipeline: profile the model once, then search split x schedule x micro-batches x
activation recomputation with the simulator.

    report = plan(example("gpt"), num_ranks=2, memory_budget=2**30, batch_size=32)

Splits come from a dynamic program over the model's units (layers, or graph nodes) that
minimizes the slowest stage (balance by time), the largest stage memory (by memory) or the
larger of the two relative to an even share (both), subject to the memory budget; each stage
then gets the cheapest recomputation that fits (``conveyor.planner.candidates``). Candidates
are simulated (``conveyor.planner.cost``) and a plan whose predicted memory exceeds the budget
is never recommended. A time budget bounds all of it, profiling included (See Note [planning
budget] in ``conveyor.planner.budget``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import time
from collections.abc import Sequence

from torch import nn

from conveyor.config import PipelineConfig
from conveyor.graph import chain
from conveyor.planner.budget import DEFAULT_TIME_BUDGET_S, Budget, WorkClock
from conveyor.planner.candidates import Candidate, Candidates, dedupe
from conveyor.planner.cost import Replicas
from conveyor.planner.partition import (
    branches_whole,
    reordered,
)
from conveyor.planner.profile import Profile, Workload, profile_model, trace_units
from conveyor.planner.report import Coverage, Objective, Plan, PlanReport
from conveyor.schedule import SCHEDULES, spec_of, stage_placement

__all__ = ["microbatch_counts", "microbatch_sizes", "plan", "search_seconds", "unit_depth"]

logger = logging.getLogger(__name__)


def _searched(
    num_ranks: int,
    memory_budget: int,
    batch_size: int,
    schedules: Sequence[str] | None,
    microbatches: Sequence[int] | None,
) -> tuple[list[str], list[int]]:
    """The schedules and micro-batch counts ``plan`` searches, its sizes checked first."""
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
    return names, counts


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
    recompute: bool = True,
    keep: int = 10,
    time_budget_s: float | Budget | None = DEFAULT_TIME_BUDGET_S,
    replicas: Replicas | None = None,
    input_s: float | None = None,
) -> PlanReport:
    """Search splits, schedules, micro-batch counts and recomputation; simulate each candidate.

    Args:
        workload: the model, its batches and loss; profiled here unless ``profile`` is given
            (then only used to name layers and may be None).
        memory_budget: bytes per rank for parameters, gradients, optimizer state and
            activations.
        schedules: names from ``SCHEDULES`` (default: every one).
        microbatches: micro-batch counts to try (default: the divisors of ``batch_size`` from
            the number of ranks up to 8 x the stages), nearest 2 x the ranks first.
        recompute: also consider activation recomputation per stage.
        keep: candidates are simulated fastest lower bound first, and once ``keep`` plans
            that fit are known, a candidate whose lower bound (its busiest rank's compute) is
            slower than all of them is not simulated: the top ``keep`` stay exact.
        time_budget_s: seconds for the whole call, profiling included (or a ``Budget``
            already started, to share one with the caller); None: no limit. Profiling stops
            at ``Budget.profile_deadline`` and the search at its end, with the best plans
            found by then; ``report.coverage`` says what was not explored (See Note [planning
            budget]).
        replicas: data-parallel replicas of each pipeline (``batch_size`` is then one
            replica's share): their gradient reductions are simulated, and FSDP's memory.
        input_s: seconds the loader takes per batch (conveyor.planner.loader_seconds):
            ``report.input_bound()`` then says whether a plan would wait for its input.

    Raises:
        ValueError: a bad rank count, batch size or time budget, a profile that does not
            match the workload's model, or no configuration the search could place.
    """
    budget = Budget.of(time_budget_s)
    names, counts = _searched(num_ranks, memory_budget, batch_size, schedules, microbatches)
    profile, children = _profile_for(
        workload,
        profile,
        num_ranks,
        batch_size,
        counts,
        max(spec_of(n).virtual_stages for n in names),
        None if profile else budget.profile_deadline(search_seconds(num_ranks, names, counts)),
    )
    unprofiled = [m for m in counts if _size(batch_size, m) in profile.unmeasured_sizes]
    explorer = _Explorer(names, [m for m in counts if m not in unprofiled] or counts, objectives)
    if budget.is_over():  # See Note [planning budget]: measuring took it all
        explorer.default_only()
    logger.info(
        "searching schedules %s x micro-batch counts %s for %d ranks (%s, %.1f s used)",
        explorer.names,
        explorer.counts,
        num_ranks,
        budget.describe(),
        budget.elapsed(),
    )
    # a graph model is also cut along an order that keeps each branch whole (conveyor.split.cut),
    # so that independent branches can sit on different ranks side by side
    orders: list[list[int] | None] = [None]
    branches = branches_whole(profile)
    if branches is not None:
        orders.append(branches)
    for index, order in enumerate(orders):
        ordered = profile if order is None else reordered(profile, order)
        sizes = (num_ranks, memory_budget, batch_size)
        search = Candidates(ordered, *sizes, recompute, order, replicas)
        explorer.explore(search, keep, budget.part(len(orders) - index).end)
    plans, notes = explorer.plans, explorer.notes
    if not plans:
        raise ValueError(
            f"no configuration could be placed on {num_ranks} ranks: " + "; ".join(notes[:4])
        )
    plans.sort(key=lambda p: (not p.fits, p.step_time, max(p.total_memory)))
    coverage = explorer.coverage(budget, names, counts, unprofiled, profile.budget_notes)
    report = PlanReport(
        plans,
        profile,
        num_ranks,
        memory_budget,
        batch_size,
        budget.elapsed(),
        _unique(notes),
        children,
        explorer.pruned,
        replicas,
        coverage,
        input_s,
    )
    logger.info(
        "planned %s for %d ranks: %d plans simulated (%d pruned by their bound) in %.1f s%s",
        profile.model,
        num_ranks,
        len(plans),
        explorer.pruned,
        report.elapsed_s,
        f"; {report.unexplored}" if report.unexplored else "",
    )
    return report


def _size(batch_size: int, m: int) -> int:
    """The micro-batch size profiled for ``m`` micro-batches of ``batch_size``."""
    return max(1, round(batch_size / m))


class _Explorer:
    """The search's walk over schedule x micro-batch pairs in order of preference, within a
    deadline: what it tried, found and left out (See Note [planning budget])."""

    def __init__(
        self, names: list[str], counts: list[int], objectives: Sequence[Objective]
    ) -> None:
        self.names, self.counts, self.objectives = names, counts, objectives
        self.is_default_only = False
        self.plans: list[Plan] = []
        self.notes: list[str] = []
        self.tried: list[tuple[str, int]] = []
        self.pruned = self.unsimulated = 0
        self.clock = WorkClock()
        self._probe: dict[str, float] | None = None

    def default_only(self) -> None:
        """Only the default schedule at the preferred count, split evenly."""
        default = PipelineConfig().schedule
        self.names = [default if default in self.names else self.names[0]]
        self.counts, self.objectives = self.counts[:1], ("even",)
        self.is_default_only = True

    def _pairs(self, num_ranks: int) -> list[tuple[str, int]]:
        """Preferred counts first; at each, cheapest schedules first: some take far longer
        to build than others (list schedules over a graph), so a small pipeline probes them."""
        if self._probe is None:
            self._probe = {name: _build_time(name, min(num_ranks, 8)) for name in self.names}
        probe = self._probe
        names = sorted(self.names, key=lambda n: probe[n])
        return [(name, m) for m in self.counts for name in names]

    def explore(self, search: Candidates, keep: int, deadline: float | None) -> None:
        """Candidates of every pair that fits before half the time left, then simulations."""
        now = time.monotonic()
        prepare_by = None if deadline is None else now + (deadline - now) / 2
        pending: list[Candidate] = []
        for name, m in self._pairs(search.num_ranks):
            assert self._probe is not None
            work = m * max(self._probe[name], 1e-4)
            if (pending or self.plans) and not self.clock.fits("attempt", work, prepare_by):
                continue
            began = time.monotonic()
            pending += search.attempt(name, m, self.objectives, self.notes)
            self.clock.record("attempt", work, time.monotonic() - began)
            self.tried.append((name, m))
        found, pruned, unsimulated = search.simulate_best(
            dedupe(pending), keep, deadline, self.clock
        )
        self.plans += found
        self.pruned += pruned
        self.unsimulated += unsimulated
        self.notes += search.notes

    def coverage(
        self,
        budget: Budget,
        names: list[str],
        counts: list[int],
        unprofiled: list[int],
        profile_notes: Sequence[str],
    ) -> Coverage:
        tried = tuple(dict.fromkeys(self.tried))
        searchable = [m for m in counts if m not in unprofiled]
        return Coverage(
            budget.seconds,
            budget.elapsed(),
            tuple(names),
            tuple(counts),
            tried,
            len(set(itertools.product(names, searchable)) - set(tried)),
            tuple(unprofiled),
            self.unsimulated,
            tuple(profile_notes),
            self.is_default_only,
        )


_BUILDS_PER_PAIR = 20
"""A schedule x micro-batch pair's candidates (splits, bounds, simulations) cost about this
many builds of its program (measured: 10-30, 2 to 64 ranks)."""


def search_seconds(num_ranks: int, names: Sequence[str], counts: Sequence[int]) -> float:
    """A rough guess of the search's seconds, to share a time budget with measuring: each
    schedule's build time on a small pipeline, scaled to the ranks and micro-batches
    searched (a program grows with both)."""
    small = min(num_ranks, 8)
    scale = num_ranks / (2 * small * small)  # the probe: small ranks x 2 small micro-batches
    return _BUILDS_PER_PAIR * sum(
        _build_time(name, small) * m * scale for name in names for m in counts
    )


@functools.cache
def _build_time(name: str, num_ranks: int) -> float:
    """Seconds a schedule takes to build a small pipeline's program (0 if it cannot)."""
    placement = stage_placement(name, num_ranks)
    began = time.perf_counter()
    try:
        SCHEDULES[name](chain(len(placement), placement=placement), 2 * num_ranks)
    except ValueError:
        return 0.0
    return time.perf_counter() - began


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def microbatch_counts(
    batch_size: int, num_ranks: int, names: Sequence[str], microbatches: Sequence[int] | None
) -> list[int]:
    """The micro-batch counts to search, in the order to try them when time is short: nearest
    2 x the ranks first (a pipeline's bubble shrinks with more micro-batches, its per-action
    costs grow), fewer first between equals."""
    if microbatches is not None:
        counts = list(dict.fromkeys(microbatches))
    else:
        limit = 8 * num_ranks * max(spec_of(n).virtual_stages for n in names)
        counts = _divisors(batch_size, limit)
        enough = [m for m in counts if m >= num_ranks]  # fewer than one per rank idles ranks
        counts = enough or counts
    return sorted(counts, key=lambda m: (abs(math.log(max(m, 1) / (2 * num_ranks))), m))


def microbatch_sizes(batch_size: int, counts: Sequence[int]) -> list[int]:
    """The micro-batch sizes ``counts`` run, in the order of ``counts`` (the first one a plan
    needs most, as ``profile_model`` measures them in order)."""
    return list(dict.fromkeys(_size(batch_size, m) for m in counts))


def _profile_for(
    workload: Workload | None,
    profile: Profile | None,
    num_ranks: int,
    batch_size: int,
    counts: Sequence[int],
    max_virtual: int,
    deadline: float | None = None,
) -> tuple[Profile, list[str] | None]:
    """The profile to plan with (measured now, until ``deadline``, if not given), at a depth
    with enough units."""
    if workload is None and profile is None:
        raise ValueError("plan needs a workload to profile or a profile")
    if profile is None:
        assert workload is not None
        depth = unit_depth(workload.model, num_ranks * max_virtual)
        profile = profile_model(
            workload, microbatch_sizes(batch_size, counts), depth=depth, deadline=deadline
        )
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
