"""Plan a pipeline: profile the model once, then search split x schedule x micro-batches x
activation checkpointing with the simulator, and write the winner as a plan file.

    report = plan(example("gpt"), num_ranks=2, memory_budget=2**30, batch_size=32)
    print(report.table())                  # the top plans, predicted
    report.write("plan.json")              # Pipeline(model, plan="plan.json"), conveyor run --plan

Splits come from a dynamic program over the model's units (layers, or graph nodes) that
minimizes the slowest stage (balance by time), the largest stage memory (by memory) or the
larger of the two relative to an even share (both), subject to the memory budget; each stage
then gets the cheapest checkpointing that fits. Every candidate is simulated
(``conveyor.simulate``) and a plan whose predicted memory exceeds the budget is never
recommended.
"""

from __future__ import annotations

import importlib
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
from torch import nn

from conveyor.graph import MODEL_OUTPUT, StageGraph, place
from conveyor.partition import (
    StageCosts,
    alive_per_stage,
    bottleneck_split,
    branches_whole,
    cut_points,
    even_starts,
    reordered,
)
from conveyor.profile import (
    Profile,
    Workload,
    profile_model,
    trace_units,
)
from conveyor.schedule import SCHEDULES, Program, layout_of
from conveyor.simulate import CheckpointMode, DeadlockError, ProfileCost, layout, predict

__all__ = [
    "EXAMPLES", "Objective", "Plan", "PlanReport", "example", "load_workload",
    "measured_profile", "plan", "scaled", "schedule_layout", "stage_graph_for",
]

logger = logging.getLogger(__name__)

Objective = Literal["time", "memory", "both", "even"]
_MODES: tuple[CheckpointMode, ...] = ("never", "except_last", "always")


# -- workloads -------------------------------------------------------------------------------


def _gpt() -> Workload:
    from conveyor.models import gpt, gpt_loss, text_batches

    return Workload("gpt", gpt(seq_len=64, dim=64, num_layers=4),
                    lambda n: text_batches(n, 64, 1)[0], gpt_loss)


def _unbalanced() -> Workload:
    from conveyor.models.unbalanced import mse, regression_batch, unbalanced_mlp

    return Workload("unbalanced", unbalanced_mlp(), regression_batch, mse)


EXAMPLES: dict[str, Callable[[], Workload]] = {"gpt": _gpt, "unbalanced": _unbalanced}
"""Models the planner and benchmarks know by name: name -> factory of a Workload."""


def example(name: str) -> Workload:
    """The Workload of a named example (see ``EXAMPLES``)."""
    if name not in EXAMPLES:
        raise ValueError(f"unknown example {name!r}; expected one of {sorted(EXAMPLES)} or an "
                         "importable factory 'package.module:function'")
    return EXAMPLES[name]()


def load_workload(spec: str) -> Workload:
    """An example name, or ``package.module:function`` returning a Workload (or a tuple
    ``(model, batch_fn, loss_fn)`` where ``batch_fn(batch_size) -> (inputs, targets)``)."""
    if ":" not in spec:
        return example(spec)
    module_name, _, attribute = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot import {spec!r} ({error}); expected 'package.module:function' "
                         "naming a function that returns a Workload") from error
    made = factory()
    if isinstance(made, Workload):
        return made
    if isinstance(made, tuple) and len(made) == 3 and isinstance(made[0], nn.Module):
        return Workload(spec, made[0], made[1], made[2])
    raise TypeError(f"{spec} returned {type(made).__name__}; expected a conveyor.profile."
                    "Workload or a tuple (model, batch_fn, loss_fn)")


# -- layouts ---------------------------------------------------------------------------------


def schedule_layout(schedule: str, num_ranks: int) -> tuple[int, list[int]]:
    """(number of stages, rank of each stage) that ``schedule`` wants on ``num_ranks`` ranks."""
    wanted = layout_of(schedule)
    num_stages = wanted.virtual_stages * num_ranks
    return num_stages, place(num_stages, num_ranks, wanted.placement)


# -- plans -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """One configuration and its prediction."""

    schedule: str
    num_microbatches: int
    stage_units: tuple[tuple[int, ...], ...]
    """Unit indices of each stage (see ``conveyor.profile``)."""
    placement: tuple[int, ...]
    checkpoint: tuple[CheckpointMode, ...]
    """Activation checkpointing of each stage."""
    balanced_by: Objective
    step_time: float
    bubble_fraction: float
    peak_activation: tuple[int, ...]
    total_memory: tuple[int, ...]
    """Per rank: parameters, gradients, optimizer state and peak activations."""
    fits: bool
    batch_size: int

    @property
    def samples_per_s(self) -> float:
        return self.batch_size / self.step_time if self.step_time > 0 else 0.0

    @property
    def balance(self) -> tuple[int, ...]:
        return tuple(len(units) for units in self.stage_units)


@dataclass
class PlanReport:
    """The plans the search simulated, fastest first (plans that fit before those that don't)."""

    plans: list[Plan]
    profile: Profile
    num_ranks: int
    memory_budget: int
    batch_size: int
    elapsed_s: float
    notes: list[str] = field(default_factory=list)
    """Schedules or settings the search skipped, and why."""
    sequential_children: list[str] | None = None
    """Names of the model's layers when the units are exactly an nn.Sequential's children."""
    pruned: int = 0
    """Candidates not simulated: their lower bound could not make the top plans."""

    @property
    def best(self) -> Plan:
        """The fastest plan that fits the budget."""
        fitting = [p for p in self.plans if p.fits]
        if not fitting:
            raise ValueError(self._nothing_fits())
        return fitting[0]

    def _nothing_fits(self) -> str:
        smallest = min(self.plans, key=lambda p: max(p.total_memory))
        return (f"no plan fits in {_gib(self.memory_budget)} per rank; the smallest memory any "
                f"plan needs is {_gib(max(smallest.total_memory))} per rank "
                f"({smallest.schedule}, {smallest.num_microbatches} micro-batches, "
                f"checkpointing {_modes(smallest.checkpoint)}); raise the budget, add ranks or "
                "use a smaller batch")

    def pipeline_config(self, chosen: Plan | None = None) -> dict[str, Any]:
        """PipelineConfig fields that run ``chosen`` (default: the best plan)."""
        chosen = chosen or self.best
        fields: dict[str, Any] = {"schedule": chosen.schedule,
                                  "num_microbatches": chosen.num_microbatches}
        flat = [u for units in chosen.stage_units for u in units]
        if flat != sorted(flat):  # branches on their own stages: name each stage's modules
            fields["stage_modules"] = [",".join(self.profile.units[u].target for u in units
                                                if self.profile.units[u].target)
                                       for units in chosen.stage_units]
        elif self.sequential_children is not None:
            fields["balance"] = list(chosen.balance)
        else:
            fields["split_points"] = [self.profile.units[units[0]].target
                                      for units in chosen.stage_units[1:]]
        if list(chosen.placement) != list(range(len(chosen.placement))):
            fields["placement"] = list(chosen.placement)
        if any(mode != "never" for mode in chosen.checkpoint):
            fields["stage_checkpoint"] = list(chosen.checkpoint)
        return fields

    def write(self, path: str | os.PathLike[str], chosen: Plan | None = None) -> Path:
        """Write a plan file that ``Pipeline(model, plan=path)`` and ``conveyor run --plan``
        accept: the PipelineConfig fields under ``pipeline``, the prediction beside them."""
        chosen = chosen or self.best
        data = {
            "pipeline": self.pipeline_config(chosen),
            "model": self.profile.model, "ranks": self.num_ranks,
            "batch_size": self.batch_size, "memory_budget": self.memory_budget,
            "prediction": {
                "step_time_s": chosen.step_time, "samples_per_s": chosen.samples_per_s,
                "bubble_fraction": chosen.bubble_fraction,
                "peak_activation_bytes": list(chosen.peak_activation),
                "total_memory_bytes": list(chosen.total_memory),
                "stage_units": [[self.profile.units[u].name for u in units]
                                for units in chosen.stage_units]},
        }
        target = Path(path)
        target.write_text(json.dumps(data, indent=1) + "\n")
        return target

    def table(self, top: int = 10) -> str:
        """The top plans as a text table."""
        rows = [f"{'#':>2}  {'schedule':<17}{'mb':>4}  {'split':<16}{'checkpoint':<14}"
                f"{'step ms':>9}{'samples/s':>11}{'bubble':>8}  {'memory/rank (max)':>17}  fits"]
        for index, p in enumerate(self.plans[:top], start=1):
            split = ",".join(map(str, p.balance))
            rows.append(
                f"{index:>2}  {p.schedule:<17}{p.num_microbatches:>4}  {_short(split, 15):<16}"
                f"{_short(_modes(p.checkpoint), 13):<14}{p.step_time * 1e3:>9.2f}"
                f"{p.samples_per_s:>11.1f}{p.bubble_fraction:>8.1%}  "
                f"{_gib(max(p.total_memory)):>17}  {'yes' if p.fits else 'NO'}")
        return "\n".join(rows)


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "~"


def _modes(modes: Sequence[str]) -> str:
    if len(set(modes)) == 1:
        return modes[0]
    letters = {"never": "N", "except_last": "E", "always": "A"}
    return "".join(letters[m] for m in modes)


def _gib(value: float) -> str:
    if value >= 2**30:
        return f"{value / 2**30:.2f} GiB"
    return f"{value / 2**20:.1f} MiB"


# -- search ----------------------------------------------------------------------------------


def plan(workload: Workload | None, num_ranks: int, memory_budget: int, batch_size: int, *,
         profile: Profile | None = None, schedules: Sequence[str] | None = None,
         microbatches: Sequence[int] | None = None,
         objectives: Sequence[Objective] = ("time", "memory", "both", "even"),
         checkpointing: bool = True, keep: int = 10,
         time_budget_s: float | None = 50.0) -> PlanReport:
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
        time_budget_s: preparing candidates (smaller micro-batch counts first) stops after
            half of this, simulating them (lowest bound first) after all of it once a plan
            that fits is known; what was skipped is listed in ``notes``. None: no limit.

    Raises:
        ValueError: a bad rank count or batch size, a profile that does not match the
            workload's model, or no configuration the search could place.
    """
    start = time.perf_counter()
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if batch_size < 1 or memory_budget <= 0:
        raise ValueError(f"batch_size and memory_budget must be positive, got {batch_size} "
                         f"and {memory_budget}")
    names = list(SCHEDULES) if schedules is None else list(schedules)
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown:
        raise ValueError(f"unknown schedules {unknown}; expected names from {sorted(SCHEDULES)}")
    counts = _counts(batch_size, num_ranks, names, microbatches)
    if any(m < 1 or m > batch_size for m in counts):
        raise ValueError(f"micro-batch counts {counts} must lie in 1..{batch_size} (the batch)")
    profile, children = _profile_for(workload, profile, num_ranks, batch_size, counts,
                                     max(layout_of(n).virtual_stages for n in names))
    # a graph model is also cut along an order that keeps each branch whole (conveyor.cut),
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
        search = _Search(profile if order is None else reordered(profile, order), num_ranks,
                         memory_budget, batch_size, checkpointing, order)
        pending: list[_Candidate] = []
        for m, name in sorted(((m, n) for m in counts for n in names),
                              key=lambda pair: (probe[pair[1]] * pair[0], pair[0])):
            if time_budget_s is not None and time.perf_counter() - start > time_budget_s / 2:
                notes.append(f"{name} with {m} micro-batches: not tried, the search used its "
                             f"time budget ({time_budget_s:.0f} s)")
                continue
            pending += _attempt(search, name, m, objectives, notes)
        deadline = None if time_budget_s is None else start + time_budget_s
        found, skipped = search.simulate_best(_dedupe(pending), keep, deadline)
        plans += found
        pruned += skipped
        notes += search.notes
    if not plans:
        raise ValueError(f"no configuration could be placed on {num_ranks} ranks: " +
                         "; ".join(notes[:4]))
    plans.sort(key=lambda p: (not p.fits, p.step_time, max(p.total_memory)))
    report = PlanReport(plans, profile, num_ranks, memory_budget, batch_size,
                        time.perf_counter() - start, _unique(notes), children, pruned)
    logger.info("planned %s for %d ranks: %d plans simulated (%d pruned by their bound) in "
                "%.1f s", profile.model, num_ranks, len(plans), pruned, report.elapsed_s)
    return report


def _build_time(name: str, num_ranks: int) -> float:
    """Seconds a schedule takes to build a small pipeline's program (0 if it cannot)."""
    from conveyor.graph import chain

    num_stages, placement = schedule_layout(name, num_ranks)
    began = time.perf_counter()
    try:
        SCHEDULES[name](chain(num_stages, placement=placement), 2 * num_ranks)
    except ValueError:
        return 0.0
    return time.perf_counter() - began


def _attempt(search: _Search, name: str, m: int, objectives: Sequence[Objective],
             notes: list[str]) -> list[_Candidate]:
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
    modes: tuple[CheckpointMode, ...]
    objective: Objective
    bound: float
    """The busiest rank's compute: no schedule finishes sooner."""


def measured_profile(workload: Workload, num_ranks: int, batch_size: int,
                     microbatches: Sequence[int] | None = None,
                     schedules: Sequence[str] | None = None, spec: str | None = None) -> Profile:
    """The profile ``plan`` would measure, plus the runtime's overheads and the link between
    two ranks started on this machine; with ``spec`` (the workload's example name or import
    path) the profile is made on those two ranks and fitted to a traced run
    (``conveyor.calibrate.profile_local``)."""
    from conveyor.calibrate import measure_local, profile_local

    names = list(SCHEDULES) if schedules is None else list(schedules)
    counts = _counts(batch_size, num_ranks, names, microbatches)
    max_virtual = max(layout_of(n).virtual_stages for n in names)
    depth = _depth_for(workload.model, num_ranks * max_virtual)
    if spec is not None:
        return profile_local(spec, _sizes(batch_size, counts), depth, batch_size,
                             [m for m in counts if batch_size % m == 0])
    profile = profile_model(workload, _sizes(batch_size, counts), depth=depth)
    profile.overheads, profile.link = measure_local()
    return profile


def _counts(batch_size: int, num_ranks: int, names: Sequence[str],
            microbatches: Sequence[int] | None) -> list[int]:
    if microbatches is not None:
        return list(microbatches)
    counts = _divisors(batch_size, 8 * num_ranks * max(layout_of(n).virtual_stages for n in names))
    enough = [m for m in counts if m >= num_ranks]  # fewer than one per rank idles ranks
    return enough or counts


def _sizes(batch_size: int, counts: Sequence[int]) -> list[int]:
    return sorted({max(1, round(batch_size / m)) for m in counts})


def _profile_for(workload: Workload | None, profile: Profile | None, num_ranks: int,
                 batch_size: int, counts: Sequence[int],
                 max_virtual: int) -> tuple[Profile, list[str] | None]:
    """The profile to plan with (measured now if not given), at a depth with enough units."""
    if workload is None and profile is None:
        raise ValueError("plan needs a workload to profile or a profile")
    if profile is None:
        assert workload is not None
        depth = _depth_for(workload.model, num_ranks * max_virtual)
        profile = profile_model(workload, _sizes(batch_size, counts), depth=depth)
    elif workload is not None:
        profile.check(trace_units(workload.model, profile.depth)[2])
    cut_points = sum(1 for u in profile.units if u.target)
    if cut_points < num_ranks:
        raise ValueError(f"{profile.model} has {cut_points} layers to cut at, too few for "
                         f"{num_ranks} ranks (every rank needs a stage of at least one layer); "
                         f"plan for at most {cut_points} ranks")
    children = None
    if workload is not None and isinstance(workload.model, nn.Sequential):
        names = [name for name, _ in workload.model.named_children()]
        if [u.target for u in profile.units] == names:
            children = names
    return profile, children


def _depth_for(model: nn.Module, num_stages: int, max_depth: int = 3) -> int:
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

    def __init__(self, profile: Profile, num_ranks: int, memory_budget: int, batch_size: int,
                 checkpointing: bool, order: list[int] | None = None) -> None:
        self.profile = profile
        self.order = order
        """The original index of each unit of ``profile`` when it was reordered."""
        self.num_ranks = num_ranks
        self.budget = memory_budget
        self.batch_size = batch_size
        self.modes: tuple[CheckpointMode, ...] = _MODES if checkpointing else ("never",)
        self.num_units = profile.num_units
        self.can_start = cut_points(profile, num_ranks)
        self.notes: list[str] = []
        self._programs: dict[tuple[Any, ...], Program] = {}

    def _program(self, schedule: str, graph: StageGraph, m: int) -> Program:
        """A schedule's Program, made once per shape: it depends only on which stages feed
        which and where they sit, not on what the stages compute."""
        key = (schedule, m, tuple((s.rank, tuple(graph.producers(s.index)),
                                   MODEL_OUTPUT in s.outputs) for s in graph.stages))
        if key not in self._programs:
            self._programs[key] = SCHEDULES[schedule](graph, m)
        return self._programs[key]

    def candidates(self, schedule: str, m: int,
                   objectives: Sequence[Objective]) -> list[_Candidate]:
        num_stages, placement = schedule_layout(schedule, self.num_ranks)
        if num_stages > int(self.can_start.sum()):
            raise ValueError(f"needs {num_stages} stages but the model has only "
                             f"{int(self.can_start.sum())} layers to cut at")
        from conveyor.graph import chain

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
                plans.append(_Candidate(schedule, m, cuts, tuple(placement), modes, objective,
                                        self._bound(m, cuts, placement, modes)))
        return plans

    def _bound(self, m: int, cuts: tuple[tuple[int, ...], ...], placement: list[int],
               modes: tuple[CheckpointMode, ...]) -> float:
        """The busiest rank's compute over the step, as the simulator charges it."""
        graph, units = layout(self.profile, [list(c) for c in cuts], placement)
        cost = ProfileCost(self.profile, graph, units, self.batch_size / m, m, list(modes))
        work = [0.0] * self.num_ranks
        for s in range(graph.num_stages):
            work[placement[s]] += cost.stage_work(s)
        return max(work) + self.profile.overheads.step

    def simulate_best(self, candidates: list[_Candidate], keep: int,
                      deadline: float | None) -> tuple[list[Plan], int]:
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
                self.notes.append(f"{len(ordered) - index} candidates with larger lower bounds "
                                  "were not simulated: the search used its time budget")
                return plans, len(ordered) - index
            graph, units = layout(self.profile, [list(u) for u in c.cuts], list(c.placement))
            try:
                program = self._program(c.schedule, graph, c.m)
            except ValueError as error:  # e.g. a split whose skip connections make a graph
                self.notes.append(f"{c.schedule} with {c.m} micro-batches, stages of "
                                  f"{[len(u) for u in c.cuts]} units: {error}")
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

    def _split(self, costs: StageCosts, objective: Objective, inflight: list[int],
               num_stages: int, per_rank: int, only: CheckpointMode | None = None
               ) -> tuple[tuple[int, ...], ...] | None:
        """Stage boundaries from the DP (or an even split), as unit index tuples."""
        if objective == "even":
            starts = even_starts(self.can_start, num_stages)
        else:
            starts = bottleneck_split(
                lambda j: self._stage_cost(costs, objective, inflight[j], per_rank, only),
                self.can_start, num_stages, [inflight[j] for j in range(num_stages)])
        if starts is None:
            return None
        bounds = [*starts, self.num_units]
        return tuple(tuple(range(a, b)) for a, b in itertools.pairwise(bounds))

    def _stage_cost(self, costs: StageCosts, objective: Objective, inflight: int,
                    per_rank: int, only: CheckpointMode | None) -> np.ndarray:
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

    def _checkpointing(self, costs: StageCosts, cuts: tuple[tuple[int, ...], ...],
                       inflight: list[int], per_rank: int) -> list[tuple[CheckpointMode, ...]]:
        """Per stage, the fastest mode that fits its share of the budget; and all-always."""
        budget = self.budget / per_rank
        chosen: list[CheckpointMode] = []
        for j, units in enumerate(cuts):
            a, b = units[0], units[-1] + 1
            fitting = [mode for mode in self.modes
                       if costs.memory(mode, inflight[j])[a, b] <= budget]
            chosen.append(fitting[0] if fitting else self.modes[-1])
        options = [tuple(chosen)]
        if "always" in self.modes:
            options.append(tuple("always" for _ in cuts))
        return list(dict.fromkeys(options))

    def _simulate(self, c: _Candidate, graph: StageGraph, units: list[list[int]],
                  program: Program) -> Plan:
        cost = ProfileCost(self.profile, graph, units, self.batch_size / c.m, c.m, list(c.modes))
        prediction = predict(program, graph, cost, record=False)
        fits = all(total <= self.budget for total in prediction.total_memory)
        order = self.order
        cuts = c.cuts if order is None else tuple(tuple(order[u] for u in cut) for cut in c.cuts)
        return Plan(c.schedule, c.m, cuts, c.placement, c.modes, c.objective,
                    prediction.step_time, prediction.bubble_fraction,
                    prediction.peak_activation, prediction.total_memory, fits, self.batch_size)


def scaled(profile: Profile, factor: float, bandwidth_factor: float = 1.0) -> Profile:
    """A profile with every time multiplied by ``factor`` and the link's bandwidth by
    ``bandwidth_factor`` (what-if studies: a faster device, a slower network)."""
    stats = {size: tuple(replace(s, forward=s.forward * factor, backward=s.backward * factor,
                                 backward_input=s.backward_input * factor,
                                 backward_weight=s.backward_weight * factor) for s in values)
             for size, values in profile.stats.items()}
    loss = {size: (f * factor, b * factor) for size, (f, b) in profile.loss.items()}
    link = None if profile.link is None else replace(
        profile.link, bandwidth=profile.link.bandwidth * bandwidth_factor)
    return replace(profile, stats=stats, loss=loss, link=link)


def stage_graph_for(report: PlanReport, chosen: Plan) -> StageGraph:
    """The module-less StageGraph of a plan (for simulating or drawing it)."""
    return layout(report.profile, [list(u) for u in chosen.stage_units],
                  list(chosen.placement))[0]
