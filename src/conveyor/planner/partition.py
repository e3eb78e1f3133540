"""Decide the cut: stage boundaries over a profiled model's units, optimal for a stage cost.

    costs = StageCosts(profile, microbatch_size=4, num_microbatches=8, batch_size=32)
    starts = bottleneck_split(lambda j: costs.time("never"), cut_points(profile, 2), 2, [0, 0])

The planner (``conveyor.planner.search``) builds its split candidates from these pieces.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from conveyor.planner.profile import Profile, UnitStats
from conveyor.runtime.recompute import RecomputeMode, recomputed_share
from conveyor.schedule import Kind, Program
from conveyor.split.cut import branch_order

__all__ = [
    "StageCosts",
    "alive_per_stage",
    "bottleneck_split",
    "branches_whole",
    "cut_points",
    "even_starts",
    "reordered",
]


def alive_per_stage(program: Program, num_stages: int) -> list[int]:
    """Most micro-batches each stage keeps alive at once (from F until B, or until W)."""
    alive = [0] * num_stages
    peak = [0] * num_stages
    for actions in program:
        for action in actions:
            if action.kind is Kind.F:
                alive[action.stage] += 1
                peak[action.stage] = max(peak[action.stage], alive[action.stage])
            elif action.kind in (Kind.B, Kind.W):
                alive[action.stage] -= 1
    return peak


def branches_whole(profile: Profile) -> list[int] | None:
    """A topological order keeping each branch whole, if it differs from forward order."""
    order = branch_order([[p for p in u.inputs if p >= 0] for u in profile.units])
    return None if order == list(range(profile.num_units)) else order


def reordered(profile: Profile, order: list[int]) -> Profile:
    """``profile`` with its units listed in ``order`` (inputs renumbered)."""
    position = {u: i for i, u in enumerate(order)}
    units = tuple(
        replace(
            profile.units[u],
            inputs=tuple(position[p] if p >= 0 else p for p in profile.units[u].inputs),
        )
        for u in order
    )
    stats = {size: tuple(values[u] for u in order) for size, values in profile.stats.items()}
    return replace(profile, units=units, stats=stats)


def cut_points(profile: Profile, num_ranks: int) -> np.ndarray:
    """Where a stage may start: before a module call (a split point), and preferably where
    one value alone crosses the cut, so that every split is a chain (which every schedule
    runs); all module calls when the model has too few such places for the ranks."""
    n = profile.num_units
    last_user = [-1] * n
    for u, unit in enumerate(profile.units):
        for p in unit.inputs:
            if p >= 0:
                last_user[p] = max(last_user[p], u)
    crossing = [sum(1 for u in range(a) if last_user[u] >= a) for a in range(n)]
    modules = [a == 0 or bool(profile.units[a].target) for a in range(n)]
    clean = [ok and (a == 0 or crossing[a] <= 1) for a, ok in enumerate(modules)]
    chosen = clean if sum(clean) >= 2 * num_ranks else modules
    return np.array([*chosen, False])


def even_starts(can_start: np.ndarray, num_stages: int) -> list[int] | None:
    """Stage starts of an even split by unit count, moved to the nearest allowed cut."""
    allowed = [a for a in range(len(can_start)) if can_start[a]]
    if len(allowed) < num_stages:
        return None
    picks = [allowed[round(i * len(allowed) / num_stages)] for i in range(num_stages)]
    return picks if len(set(picks)) == num_stages else None


# Note [bottleneck split]:
# best[j][b]: the smallest possible worst-stage cost when stages 0..j-1 cover units [0, b);
# best[j][b] = min over a of max(best[j-1][a], cost_j(a, b)) with stage j-1 = units [a, b).
# Every stage cost is looked at, so the result is optimal for the cost (not greedy); numpy
# takes the min over all a for all b at once: O(stages x units^2) in vector steps.
def bottleneck_split(
    stage_cost: Callable[[int], np.ndarray],
    can_start: np.ndarray,
    num_stages: int,
    keys: Sequence[int],
) -> list[int] | None:
    """Starts of each stage minimizing the largest stage cost; None if every split is inf."""
    n = len(can_start) - 1
    cache: dict[int, np.ndarray] = {}
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((num_stages, n + 1), dtype=np.int64)
    starts_ok = np.where(can_start, 0.0, np.inf)
    for j in range(num_stages):
        if keys[j] not in cache:
            cache[keys[j]] = stage_cost(j)
        cost = cache[keys[j]]  # cost[a, b] for stage = units [a, b)
        candidates = np.maximum((best + starts_ok)[:, None], cost)
        choice[j] = np.argmin(candidates, axis=0)
        best = candidates[choice[j], np.arange(n + 1)]
    if not math.isfinite(best[n]):
        return None
    starts, end = [], n
    for j in reversed(range(num_stages)):
        a = int(choice[j][end])
        starts.append(a)
        end = a
    starts.reverse()
    if starts[0] != 0 or any(a >= b for a, b in zip(starts, [*starts[1:], n], strict=True)):
        return None
    return starts


class StageCosts:
    """Per-micro-batch time and memory of every contiguous run of units [a, b) as matrices,
    from prefix sums of the profile (an estimate for the DP; plans are then simulated)."""

    def __init__(
        self, profile: Profile, microbatch_size: float, num_microbatches: int, batch_size: int
    ) -> None:
        stats: tuple[UnitStats, ...] = profile.at(microbatch_size)
        n = profile.num_units
        self.shape = (n + 1, n + 1)
        self.m = num_microbatches
        overheads = profile.overheads
        loss_forward, loss_backward = profile.loss_at(microbatch_size)

        def prefix(values: Sequence[float]) -> np.ndarray:
            return np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=float))])

        forward = prefix([s.forward for s in stats])
        backward = prefix([s.backward for s in stats])
        a = np.arange(n + 1)[:, None]
        b = np.arange(n + 1)[None, :]
        valid = b > a
        last = (b == n) & valid
        comm = 2 * (overheads.send + overheads.recv + overheads.wait)
        self._forward = np.where(valid, forward[b] - forward[a], 0.0)  # inf: in _work
        self._work = np.where(
            valid,
            (forward[b] - forward[a])
            + (backward[b] - backward[a])
            + overheads.forward
            + overheads.backward
            + comm
            + np.where(last, loss_forward + loss_backward, 0.0),
            np.inf,
        )
        consumers: list[int] = [-1] * n  # last consumer of each unit
        for u, unit in enumerate(profile.units):
            for p in unit.inputs:
                if p >= 0:
                    consumers[p] = max(consumers[p], u)
        crossing_msg = np.zeros(n + 1)
        crossing_out = np.zeros(n + 1)
        for u, last_user in enumerate(consumers):
            if last_user > u:  # the value crosses every cut in (u, last_user]
                crossing_msg[u + 1 : last_user + 1] += stats[u].message_bytes
                crossing_out[u + 1 : last_user + 1] += stats[u].output_bytes
        kept = [
            s.saved_bytes
            + (
                s.output_bytes
                if s.saves_output
                or any(
                    stats[c].saves_input[i]
                    for c in range(n)
                    for i, p in enumerate(profile.units[c].inputs)
                    if p == u and i < len(stats[c].saves_input)
                )
                else 0
            )
            for u, s in enumerate(stats)
        ]
        inner = prefix(kept)
        outputs = np.asarray([s.output_bytes for s in stats] + [0], dtype=float)
        boundary = crossing_out[b] + np.where(last, outputs[np.maximum(b - 1, 0)], 0.0)
        self._full = np.where(valid, crossing_msg[a] + inner[b] - inner[a] + boundary, 0.0)
        self._light = np.where(valid, crossing_msg[a] + boundary, 0.0)  # inf: in _static
        params = prefix(
            [
                u.param_bytes + u.trainable_bytes * (1 + profile.optimizer_state_per_param)
                for u in profile.units
            ]
        )
        resident = np.where(a == 0, profile.input_bytes_per_sample * batch_size, 0.0)
        self._static = np.where(valid, params[b] - params[a] + resident, np.inf)
        total_time = float(self._work[0, n])
        self.total_time = max(total_time, 1e-12)
        self.total_memory = max(float(self._static[0, n] + self._full[0, n]), 1.0)

    def time(self, mode: RecomputeMode) -> np.ndarray:
        """Forward plus backward of one micro-batch, recomputation averaged over the step."""
        result: np.ndarray = self._work + recomputed_share(mode, self.m) * self._forward
        return result

    def memory(self, mode: RecomputeMode, inflight: int) -> np.ndarray:
        """Parameters, optimizer state and ``inflight`` micro-batches' activations."""
        if mode == "never":
            activations = inflight * self._full
        elif mode == "always":
            activations = inflight * self._light
        else:
            activations = (max(inflight, 1) - 1) * self._light + self._full
        result: np.ndarray = self._static + activations
        return result
