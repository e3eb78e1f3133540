"""The planner's time budget: one clock for a whole planning call, and a deadline per phase.

    budget = Budget.of(50.0)                          # started now
    profile = profile_model(workload, sizes, deadline=budget.profile_deadline())
    report = plan(workload, 2, 2**30, 32, profile=profile, time_budget_s=budget)  # the rest

See Note [planning budget] for how the phases share it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_TIME_BUDGET_S",
    "MAX_PROFILE_SHARE",
    "PROFILE_SHARE",
    "Budget",
    "WorkClock",
    "passed",
]

DEFAULT_TIME_BUDGET_S = 50.0
"""Seconds a planning call (``plan``, ``plan_mesh``, ``conveyor plan``) takes by default."""

PROFILE_SHARE = 0.6
"""Share of the budget that measuring (link, profile, fit) may use when the search looks
long; the search gets the rest, and all of it when measuring finishes early."""

MAX_PROFILE_SHARE = 0.85
"""Share of the budget that measuring may use when the search looks short (few ranks)."""


# Note [planning budget]:
# A budget bounds the whole call, measuring included: ``plan(..., time_budget_s=2)`` profiled
# for 270 s before its 2 s search. Measuring (the two ranks' overheads and links, the
# profile, the fit to traced runs) stops when what is left is the search's guessed time
# (``search.search_seconds``), but not before PROFILE_SHARE or after MAX_PROFILE_SHARE of
# the budget; the search stops at the end. Each phase stops between pieces of work it cannot
# interrupt (one unit's measurement, one schedule x micro-batch pair's candidates, one
# simulation), and skips a piece whose estimate (``WorkClock``) would not fit, so a call ends
# within a few seconds of its budget. Sizes are profiled in the order the search prefers
# them, and micro-batch counts whose size was left unprofiled are not searched (their costs
# would be a guess). The one exception is the least a plan needs, one pass over the model's
# units at one micro-batch size: past its deadline it is finished with each unit timed
# quickly (the median of 3 runs, not one run: a preempted run would carry its whole
# preemption into the plan) rather than dropped, and the planner then simulates the default
# configuration (default schedule, preferred micro-batch count, even split) without
# searching. What was left out is said in ``PlanReport.coverage`` and the profile's
# ``budget_notes``.
@dataclass(frozen=True)
class Budget:
    """Seconds for a whole planning call (None: no limit), counted from ``start``."""

    seconds: float | None
    start: float = field(default_factory=time.monotonic)
    """``time.monotonic()`` when the call started."""

    def __post_init__(self) -> None:
        if self.seconds is not None and not self.seconds > 0:
            raise ValueError(
                f"time_budget_s must be a positive number of seconds or None (no limit), "
                f"got {self.seconds}"
            )

    @classmethod
    def of(cls, budget: float | Budget | None) -> Budget:
        """A budget started now, or ``budget`` itself when it is one already."""
        return budget if isinstance(budget, Budget) else cls(budget)

    @property
    def end(self) -> float | None:
        return None if self.seconds is None else self.start + self.seconds

    def until(self, share: float) -> float | None:
        """The deadline (``time.monotonic``) when ``share`` of the budget has passed."""
        return None if self.seconds is None else self.start + share * self.seconds

    def profile_deadline(self, search_s: float | None = None) -> float | None:
        """When measuring stops: when ``search_s`` (a guess of the search's seconds) is left,
        within PROFILE_SHARE and MAX_PROFILE_SHARE (See Note [planning budget])."""
        if self.seconds is None or search_s is None:
            return self.until(PROFILE_SHARE)
        share = 1.0 - search_s / self.seconds
        return self.until(min(max(share, PROFILE_SHARE), MAX_PROFILE_SHARE))

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float | None:
        """Seconds until the end (0 once past it); None without a limit."""
        end = self.end
        return None if end is None else max(0.0, end - time.monotonic())

    def is_over(self) -> bool:
        return passed(self.end)

    def part(self, of: int) -> Budget:
        """A budget started now with an ``of``-th of what is left (at least a millisecond):
        for the next of ``of`` calls that share the rest."""
        left = self.left()
        return Budget(None if left is None else max(left / of, 1e-3))

    def describe(self) -> str:
        return "no time budget" if self.seconds is None else f"the {self.seconds:.3g} s budget"


def passed(deadline: float | None) -> bool:
    """Whether ``deadline`` (``time.monotonic``; None: never) has passed."""
    return deadline is not None and time.monotonic() >= deadline


class WorkClock:
    """How long pieces of work of each kind took per unit of size, to skip a piece that would
    not finish before a deadline (See Note [planning budget])."""

    def __init__(self) -> None:
        self._rates: dict[str, list[float]] = {}

    def estimate(self, kind: str, size: float) -> float:
        """Seconds a piece of ``size`` should take: the median rate seen so far (0 before)."""
        rates = sorted(self._rates.get(kind, ()))
        return rates[len(rates) // 2] * size if rates else 0.0

    def fits(self, kind: str, size: float, deadline: float | None) -> bool:
        return deadline is None or time.monotonic() + self.estimate(kind, size) <= deadline

    def record(self, kind: str, size: float, seconds: float) -> None:
        self._rates.setdefault(kind, []).append(seconds / max(size, 1e-12))
