"""The planner's result: the plans it simulated, the best one, and the plan file it writes.

report.table()                 # the top plans, predicted
report.write("plan.json")      # Pipeline(model, plan="plan.json"), conveyor run --plan
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from conveyor.files import write_atomic
from conveyor.graph import StageGraph
from conveyor.planner.cost import Replicas, layout
from conveyor.planner.input import input_bound
from conveyor.planner.profile import Profile
from conveyor.runtime.recompute import RecomputeMode

__all__ = ["RAISE_BUDGET", "Coverage", "Objective", "Plan", "PlanReport", "stage_graph_for"]

Objective = Literal["time", "memory", "both", "even"]
"""What a split balances: stage time, stage memory, both (relative to even shares), or an
even count of units."""


@dataclass(frozen=True)
class Plan:
    """One configuration and its prediction."""

    schedule: str
    num_microbatches: int
    stage_units: tuple[tuple[int, ...], ...]
    """Unit indices of each stage (see ``conveyor.planner.profile``)."""
    placement: tuple[int, ...]
    recompute: tuple[RecomputeMode, ...]
    """Activation recomputation of each stage."""
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


@dataclass(frozen=True)
class Coverage:
    """What a plan's search covered within its time budget (See Note [planning budget])."""

    budget_s: float | None
    elapsed_s: float
    """Seconds the whole call took."""
    schedules: tuple[str, ...]
    """Schedules asked for."""
    microbatches: tuple[int, ...]
    """Micro-batch counts asked for."""
    tried: tuple[tuple[str, int], ...] = ()
    """(schedule, micro-batch count) pairs whose candidates were made, or found impossible."""
    untried: int = 0
    """Pairs not tried for lack of time (per cut order of a graph model)."""
    unprofiled: tuple[int, ...] = ()
    """Micro-batch counts not searched: the profile has not measured their size."""
    unsimulated: int = 0
    """Candidates not simulated for lack of time (those pruned by their bound not counted)."""
    profile_notes: tuple[str, ...] = ()
    """What the budget cut from the profile (``Profile.budget_notes``)."""
    default_only: bool = False
    """Measuring used the whole budget: the default configuration, unsearched."""

    @property
    def is_complete(self) -> bool:
        return not (
            self.untried
            or self.unprofiled
            or self.unsimulated
            or self.profile_notes
            or self.default_only
        )

    def describe(self, separator: str = "; ", *, head: bool = True, profile: bool = True) -> str:
        """What was not explored, parts joined by ``separator``; '' when everything was.

        Args:
            head: start with the budget and how to raise it.
            profile: include the profile's notes (a mesh's layouts share them).
        """
        if self.is_complete:
            return ""
        names = list(dict.fromkeys(name for name, _ in self.tried))
        counts = sorted({m for _, m in self.tried})
        pairs = len(self.schedules) * len(self.microbatches)
        if self.default_only:
            parts = [
                f"measuring used the whole budget: returned the default ({', '.join(names)}, "
                f"{_count(counts[0], 'micro-batch')}, an even split) unsearched"
            ]
        elif self.untried or self.unsimulated:
            parts = [
                f"searched {len(names)} of {len(self.schedules)} schedules "
                f"({', '.join(names)}), micro-batch counts {_braces(counts)} of "
                f"{_braces(self.microbatches)}"
            ]
        else:
            parts = []
        if self.untried:
            parts.append(f"{self.untried} of {pairs} schedule x micro-batch pairs not tried")
        if self.unprofiled:
            parts.append(f"micro-batch counts {_braces(self.unprofiled)} not profiled")
        if self.unsimulated:
            parts.append(f"{_count(self.unsimulated, 'candidate')} not simulated")
        if profile:
            parts += [f"profile: {note}" for note in self.profile_notes]
        if head and self.budget_s is not None:  # else only the profile was cut, by its own
            parts.insert(
                0,
                f"cut short by the {self.budget_s:.3g} s time budget (took "
                f"{self.elapsed_s:.1f} s; {RAISE_BUDGET})",
            )
        return separator.join(parts)


RAISE_BUDGET = (
    "pass a larger time_budget_s, conveyor plan --time-budget, or None to search everything"
)
"""How to search more than a time budget allowed."""


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 'es' if noun.endswith('h') else 's'}"


def _braces(values: Sequence[int]) -> str:
    return "{" + ", ".join(map(str, sorted(values))) + "}"


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
    replicas: Replicas | None = None
    """Data-parallel replicas of each pipeline (``batch_size`` is one replica's share)."""
    coverage: Coverage | None = None
    """What the search explored within its time budget."""
    input_s: float | None = None
    """Seconds the loader takes per batch, if measured (conveyor.planner.input)."""

    def input_bound(self, chosen: Plan | None = None) -> str:
        """Why ``chosen`` (default: the best plan) would wait for its input, and what to
        do; '' when the loader keeps up or was not measured."""
        return input_bound(self.input_s, (chosen or self.best).step_time)

    @property
    def unexplored(self) -> str:
        """What the time budget left out ('' when everything was searched)."""
        return "" if self.coverage is None else self.coverage.describe()

    @property
    def best(self) -> Plan:
        """The fastest plan that fits the budget."""
        fitting = [p for p in self.plans if p.fits]
        if not fitting:
            raise ValueError(self._nothing_fits())
        return fitting[0]

    def _nothing_fits(self) -> str:
        smallest = min(self.plans, key=lambda p: max(p.total_memory))
        return (
            f"no plan fits in {_gib(self.memory_budget)} per rank; the smallest memory any "
            f"plan needs is {_gib(max(smallest.total_memory))} per rank "
            f"({smallest.schedule}, {smallest.num_microbatches} micro-batches, "
            f"recomputing {_modes(smallest.recompute)}); raise the budget, add ranks or "
            "use a smaller batch"
            + (f" (not everything was searched: {self.unexplored})" if self.unexplored else "")
        )

    def pipeline_config(self, chosen: Plan | None = None) -> dict[str, Any]:
        """PipelineConfig fields that run ``chosen`` (default: the best plan)."""
        chosen = chosen or self.best
        fields: dict[str, Any] = {
            "schedule": chosen.schedule,
            "num_microbatches": chosen.num_microbatches,
        }
        flat = [u for units in chosen.stage_units for u in units]
        if flat != sorted(flat):  # branches on their own stages: name each stage's modules
            fields["stage_modules"] = [
                ",".join(
                    self.profile.units[u].target for u in units if self.profile.units[u].target
                )
                for units in chosen.stage_units
            ]
        elif self.sequential_children is not None:
            fields["balance"] = list(chosen.balance)
        else:
            fields["split_points"] = [
                self.profile.units[units[0]].target for units in chosen.stage_units[1:]
            ]
        if list(chosen.placement) != list(range(len(chosen.placement))):
            fields["placement"] = list(chosen.placement)
        fields["stage_recompute"] = list(chosen.recompute)  # "never" too: it was predicted
        if self.replicas is not None and self.replicas.count > 1:
            fields["dp"] = self.replicas.count
            fields["fsdp"] = self.replicas.fsdp
        return fields

    def write(self, path: str | os.PathLike[str], chosen: Plan | None = None) -> Path:
        """Write a plan file that ``Pipeline(model, plan=path)`` and ``conveyor run --plan``
        accept: the PipelineConfig fields under ``pipeline``, the prediction beside them."""
        chosen = chosen or self.best
        data = {
            "pipeline": self.pipeline_config(chosen),
            "model": self.profile.model,
            "ranks": self.num_ranks,
            "batch_size": self.batch_size,
            "memory_budget": self.memory_budget,
            "prediction": {
                "step_time_s": chosen.step_time,
                "samples_per_s": chosen.samples_per_s,
                "bubble_fraction": chosen.bubble_fraction,
                "peak_activation_bytes": list(chosen.peak_activation),
                "total_memory_bytes": list(chosen.total_memory),
                "stage_units": [
                    [self.profile.units[u].name for u in units] for units in chosen.stage_units
                ],
            },
        }
        return write_atomic(path, json.dumps(data, indent=1) + "\n")

    def table(self, top: int = 10) -> str:
        """The top plans as a text table."""
        rows = [
            f"{'#':>2}  {'schedule':<17}{'mb':>4}  {'split':<16}{'recompute':<14}"
            f"{'step ms':>9}{'samples/s':>11}{'bubble':>8}  {'memory/rank (max)':>17}  fits"
        ]
        for index, p in enumerate(self.plans[:top], start=1):
            split = ",".join(map(str, p.balance))
            rows.append(
                f"{index:>2}  {p.schedule:<17}{p.num_microbatches:>4}  {_short(split, 15):<16}"
                f"{_short(_modes(p.recompute), 13):<14}{p.step_time * 1e3:>9.2f}"
                f"{p.samples_per_s:>11.1f}{p.bubble_fraction:>8.1%}  "
                f"{_gib(max(p.total_memory)):>17}  {'yes' if p.fits else 'NO'}"
            )
        return "\n".join(rows)


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "~"


def _modes(modes: Sequence[str]) -> str:
    if len(set(modes)) == 1:
        return modes[0]
    letters = {"never": "N", "except_last": "E", "always": "A"}
    return "".join(letters[m] for m in modes)


def _gib(value: float) -> str:
    if value >= 2**30:
        return f"{value / 2**30:.2f} GiB"
    if value >= 2**20:
        return f"{value / 2**20:.1f} MiB"
    return f"{value / 2**10:.1f} KiB"


def stage_graph_for(report: PlanReport, chosen: Plan) -> StageGraph:
    """The module-less StageGraph of a plan (for simulating or drawing it)."""
    return layout(report.profile, [list(u) for u in chosen.stage_units], list(chosen.placement))[0]
