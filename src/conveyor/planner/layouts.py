"""Plan a mesh: split a world of ranks into data-parallel replicas x pipeline ranks, and plan
each pipeline, with the gradient reductions on the simulated timeline.

    report = plan_mesh(example("gpt"), world_size=8, memory_budget=2**30, batch_size=64)
    print(report.why()); report.write("plan.json")   # conveyor run --plan plan.json -n 8

For every dp x pp = world size whose replicas split the global batch evenly, the pipeline
planner (conveyor.planner.search) searches split x schedule x micro-batches x recomputation
for one replica's share of the batch, with each stage's gradient reduction over the replicas
simulated right after its last backward (conveyor.planner.cost.Replicas, a ring over the
measured link). The fastest layout that fits the memory budget wins.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.planner.budget import DEFAULT_TIME_BUDGET_S, Budget
from conveyor.planner.cost import Replicas
from conveyor.planner.profile import Link, Profile, Workload, profile_model
from conveyor.planner.report import RAISE_BUDGET, Plan, PlanReport
from conveyor.planner.search import (
    microbatch_counts,
    microbatch_sizes,
    plan,
    search_seconds,
    unit_depth,
)
from conveyor.schedule import SCHEDULES, spec_of

__all__ = ["MeshPlan", "MeshReport", "plan_mesh"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MeshPlan:
    """The best pipeline plan for one dp x pp layout."""

    dp: int
    pp: int
    report: PlanReport
    """The pipeline search for one replica's share of the batch."""

    @property
    def best(self) -> Plan | None:
        fitting = [p for p in self.report.plans if p.fits]
        return fitting[0] if fitting else None

    @property
    def samples_per_s(self) -> float:
        """The whole job's throughput (every replica), 0 if nothing fits."""
        best = self.best
        return 0.0 if best is None else self.dp * best.samples_per_s

    @property
    def is_reduction_measured(self) -> bool:
        """Whether the replicas' gradient reductions were costed over a measured link (they
        are free in the prediction otherwise)."""
        replicas = self.report.replicas
        return self.dp == 1 or (replicas is not None and replicas.link is not None)

    def reduction_s(self) -> float:
        """Seconds per step the busiest rank spends reducing gradients over the replicas
        (0 when not measured: see ``is_reduction_measured``)."""
        best, replicas = self.best, self.report.replicas
        if best is None or replicas is None or not self.is_reduction_measured:
            return 0.0
        profile = self.report.profile
        per_rank = [0.0] * self.pp
        for units, rank in zip(best.stage_units, best.placement, strict=True):
            trainable = sum(profile.units[u].trainable_bytes for u in units)
            params = sum(profile.units[u].param_bytes for u in units)
            per_rank[rank] += replicas.reduce_time(trainable) + replicas.gather_time(params)
        return max(per_rank)

    def describe(self) -> str:
        best = self.best
        if best is None:
            need = min(max(p.total_memory) for p in self.report.plans)
            return f"dp={self.dp} x pp={self.pp}: nothing fits (needs {need / 2**20:.1f} MiB/rank)"
        if self.dp == 1:
            reduction = "no gradient reduction (one replica)"
        elif self.is_reduction_measured:
            reduction = f"gradient reduction {self.reduction_s() * 1e3:.2f} ms/step"
        else:
            reduction = (
                "gradient reduction not measured (no link between ranks: --no-link, or a "
                "profile without one), counted as free"
            )
        return (
            f"dp={self.dp} x pp={self.pp}: {best.schedule}, {best.num_microbatches} "
            f"micro-batches of {best.batch_size / best.num_microbatches:g}, stages "
            f"{list(best.balance)}: {best.step_time * 1e3:.2f} ms/step, "
            f"{self.samples_per_s:.1f} samples/s (bubble {best.bubble_fraction:.0%}, "
            f"{reduction}, {max(best.total_memory) / 2**20:.1f} MiB/rank)"
        )


@dataclass
class MeshReport:
    """Every layout searched, fastest first (those where nothing fits last)."""

    layouts: list[MeshPlan]
    world_size: int
    batch_size: int
    memory_budget: int
    skipped: list[str]
    """Layouts not searched, and why."""

    @property
    def best(self) -> MeshPlan:
        """The fastest layout with a plan that fits.

        Raises:
            ValueError: no layout has one.
        """
        if not self.layouts or self.layouts[0].best is None:
            raise ValueError(
                f"no dp x pp layout of {self.world_size} ranks fits "
                f"{self.memory_budget / 2**30:.2f} GiB per rank: "
                + "; ".join(m.describe() for m in self.layouts)
                + "; raise the budget, use FSDP or recomputation, or a smaller batch"
            )
        return self.layouts[0]

    def why(self) -> str:
        """The choice and what each other layout would give, in one paragraph per layout."""
        best = self.best
        lines = [f"chosen {best.describe()}"]
        for other in self.layouts[1:]:
            if other.best is None:
                lines.append(f"  not {other.describe()}")
                continue
            slower = best.samples_per_s / other.samples_per_s - 1 if other.samples_per_s else 0
            lines.append(f"  not {other.describe()}: {slower:.0%} slower")
        lines += [f"  skipped {note}" for note in self.skipped]
        return "\n".join(lines + self._unexplored())

    def _unexplored(self) -> list[str]:
        """What the time budget left out: the profile once, then each layout's search."""
        cut = [m for m in self.layouts if m.report.coverage and m.report.unexplored]
        if not cut:
            return []
        lines = [f"  not everything was explored within the time budget ({RAISE_BUDGET}):"]
        lines += [f"    profile: {note}" for note in cut[0].report.profile.budget_notes]
        for m in cut:
            assert m.report.coverage is not None
            text = m.report.coverage.describe(head=False, profile=False)
            if text:
                lines.append(f"    dp={m.dp} x pp={m.pp}: {text}")
        return lines

    def write(self, path: str | Path) -> Path:
        """The best layout's plan file (its PipelineConfig fields include dp)."""
        return self.best.report.write(path)

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "layouts": [
                {
                    "dp": m.dp,
                    "pp": m.pp,
                    "samples_per_s": m.samples_per_s,
                    "step_time_s": None if m.best is None else m.best.step_time,
                    "reduction_s": m.reduction_s() if m.is_reduction_measured else None,
                }
                for m in self.layouts
            ],
        }


def plan_mesh(
    workload: Workload | None,
    world_size: int,
    memory_budget: int,
    batch_size: int,
    *,
    profile: Profile | None = None,
    reduce_link: Link | None = None,
    fsdp: bool = False,
    schedules: Sequence[str] | None = None,
    microbatches: Sequence[int] | None = None,
    time_budget_s: float | Budget | None = DEFAULT_TIME_BUDGET_S,
    **options: Any,
) -> MeshReport:
    """Search dp x pp layouts of ``world_size`` ranks for a global batch of ``batch_size``.

    ``options`` go to ``conveyor.planner.plan`` (objectives, recompute, keep). The
    profile is measured once for every layout's micro-batch sizes unless given. Reductions
    cost what a ring over ``reduce_link`` costs (``conveyor.planner.measure_allreduce``);
    without one, over the profile's all-reduce link, else its point-to-point link (which
    overestimates gloo's all-reduce: docs/benchmarks.md), and with none, they are free
    (``MeshPlan.is_reduction_measured``). ``time_budget_s`` bounds the whole call: profiling
    stops at its ``profile_deadline``, and each layout gets an equal part of what is left.

    Raises:
        ValueError: ``world_size`` below 1.
    """
    budget = Budget.of(time_budget_s)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    names = list(SCHEDULES) if schedules is None else list(schedules)
    layouts = [(world_size // pp, pp) for pp in range(1, world_size + 1) if world_size % pp == 0]
    even = [(dp, pp) for dp, pp in layouts if batch_size % dp == 0]
    skipped = [
        f"dp={dp} x pp={pp}: the batch of {batch_size} does not split over {dp} replicas"
        for dp, pp in layouts
        if (dp, pp) not in even
    ]
    if profile is None:
        guess = sum(
            search_seconds(pp, names, microbatch_counts(batch_size // dp, pp, names, microbatches))
            for dp, pp in even
        )
        profile = _profile_once(
            workload, even, batch_size, names, microbatches, budget.profile_deadline(guess)
        )
    found = []
    for index, (dp, pp) in enumerate(even):
        logger.info("planning dp=%d x pp=%d (%d of %d layouts)", dp, pp, index + 1, len(even))
        replicas = Replicas(dp, reduce_link or profile.reduce_link or profile.link, fsdp)
        try:
            report = plan(
                workload, pp, memory_budget, batch_size // dp, profile=profile,
                schedules=names, microbatches=microbatches, replicas=replicas,
                time_budget_s=budget.part(len(even) - index), **options,
            )  # fmt: skip
        except ValueError as error:  # too many stages for the model, ...
            skipped.append(f"dp={dp} x pp={pp}: {str(error).splitlines()[0]}")
            continue
        found.append(MeshPlan(dp, pp, report))
    found.sort(key=lambda m: (m.best is None, -m.samples_per_s))
    logger.info("planned %d layouts of %d ranks", len(found), world_size)
    return MeshReport(found, world_size, batch_size, memory_budget, skipped)


def _profile_once(
    workload: Workload | None,
    layouts: list[tuple[int, int]],
    batch_size: int,
    names: list[str],
    microbatches: Sequence[int] | None,
    deadline: float | None,
) -> Profile:
    """One profile for every layout: the micro-batch sizes any of them may use."""
    if workload is None:
        raise ValueError("plan_mesh needs a workload to profile or a profile")
    sizes: list[int] = []  # the first layout's preferred size first (see microbatch_counts)
    for dp, pp in layouts:
        counts = microbatch_counts(batch_size // dp, pp, names, microbatches)
        sizes += microbatch_sizes(batch_size // dp, counts)
    deepest = max(pp for _, pp in layouts) * max(spec_of(n).virtual_stages for n in names)
    depth = unit_depth(workload.model, deepest)
    return profile_model(workload, list(dict.fromkeys(sizes)), depth=depth, deadline=deadline)
