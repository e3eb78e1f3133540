"""Decode costs for the simulator: stages profiled at decode and prefill shapes, fitted, and
charged per item, with the runtime's overheads and the measured link.

    fits = [profile_stage(lm, units, rows=[4, 8], starts=[128, 1024]) for units in stages]
    cost = DecodeCost(fits, graph, items, groups, hidden_bytes, link=link)
    timeline = simulate(program, graph, cost)                 # predicted, in seconds

A stage's time is fitted as ``fixed + per_token * tokens + per_pair * pairs``, where tokens
are rows x the item's length and pairs are the query-key pairs its attention scores (rows x
the sum over its tokens of the positions each sees); decode items (one token) and prefill
chunks get separate fits, since a one-row-per-sequence matrix product runs at another speed
than a chunk's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from conveyor.graph import StageGraph
from conveyor.inference.config import GenerationConfig
from conveyor.inference.lm import CausalLM, Context
from conveyor.inference.prompts import positions_of
from conveyor.inference.sampling import Sampler
from conveyor.inference.schedule import Item
from conveyor.planner.profile import Link, Overheads
from conveyor.program import Action, Kind

__all__ = ["DecodeCost", "Fit", "StageFit", "pairs", "profile_stage"]


def pairs(rows: int, length: int, start: int) -> float:
    """Query-key pairs the attention of ``rows`` sequences scores for ``length`` tokens after
    ``start`` cached ones."""
    return rows * (length * start + length * (length + 1) / 2)


@dataclass(frozen=True)
class Fit:
    """Seconds = fixed + per_token * tokens + per_pair * pairs, all coefficients >= 0."""

    fixed: float
    per_token: float
    per_pair: float

    def time(self, rows: int, length: int, start: int) -> float:
        return (
            self.fixed + self.per_token * rows * length + self.per_pair * pairs(rows, length, start)
        )

    def __add__(self, other: Fit) -> Fit:
        """Both, one after the other (a stage of several units)."""
        return Fit(
            self.fixed + other.fixed,
            self.per_token + other.per_token,
            self.per_pair + other.per_pair,
        )

    def __mul__(self, count: float) -> Fit:
        """``count`` of these in a row (a stage of ``count`` equal blocks)."""
        return Fit(self.fixed * count, self.per_token * count, self.per_pair * count)

    @classmethod
    def of(cls, points: Sequence[tuple[int, int, int, float]]) -> Fit:
        """Least squares through (rows, length, start, seconds) points, coefficients >= 0."""
        columns = [
            [1.0, rows * length, pairs(rows, length, start)] for rows, length, start, _ in points
        ]
        a, y = np.array(columns), np.array([p[3] for p in points])
        keep = [0, 1, 2]
        while True:  # drop a coefficient the fit makes negative and refit (tiny NNLS)
            solution = np.linalg.lstsq(a[:, keep], y, rcond=None)[0]
            if (solution >= 0).all() or len(keep) == 1:
                break
            keep.pop(int(np.argmin(solution)))
        values = [0.0, 0.0, 0.0]
        for index, value in zip(keep, solution, strict=True):
            values[index] = max(float(value), 0.0)
        return cls(*values)


@dataclass(frozen=True)
class StageFit:
    """A stage's costs: one fit for decode items (one token), one for prompt chunks."""

    decode: Fit
    prefill: Fit

    def time(self, rows: int, length: int, start: int) -> float:
        return (self.decode if length == 1 else self.prefill).time(rows, length, start)

    def __add__(self, other: StageFit) -> StageFit:
        return StageFit(self.decode + other.decode, self.prefill + other.prefill)

    def __mul__(self, count: float) -> StageFit:
        return StageFit(self.decode * count, self.prefill * count)


def profile_stage(
    lm: CausalLM,
    units: range,
    rows: Sequence[int],
    starts: Sequence[int],
    chunks: Sequence[int] = (),
    *,
    config: GenerationConfig | None = None,
    device: torch.device | str = "cpu",
    steps: int = 8,
    repeats: int = 3,
) -> StageFit:
    """Measure ``units`` as a decode stage runs them, and fit.

    Decode: for each row count and each start, ``steps`` one-token steps after a prompt of
    ``start`` tokens (median); prefill: a chunk of each length in ``chunks`` from an empty
    cache (median of ``repeats``). The last stage is timed with its sampling (``config``).
    """
    config = config or GenerationConfig()
    device = torch.device(device)
    decode: list[tuple[int, int, int, float]] = []
    prefill: list[tuple[int, int, int, float]] = []
    with torch.no_grad():
        for r in rows:
            for start in starts:
                runner = _Runner(lm, units, r, start + steps + 1, config, device)
                runner.step(start)  # fill the cache with a prompt of ``start`` tokens
                times = [runner.step(1) for _ in range(steps)]
                decode.append((r, 1, start + steps // 2, statistics.median(times)))
            for length in chunks:
                times = [
                    _Runner(lm, units, r, length, config, device).step(length)
                    for _ in range(repeats)
                ]
                prefill.append((r, length, 0, statistics.median(times)))
    decode_fit = Fit.of(decode)
    return StageFit(decode_fit, Fit.of(prefill) if prefill else decode_fit)


class _Runner:
    """A stage with its cache, fed random inputs, timed step by step."""

    def __init__(
        self,
        lm: CausalLM,
        units: range,
        rows: int,
        capacity: int,
        config: GenerationConfig,
        device: torch.device,
    ) -> None:
        self.lm, self.units, self.rows, self.device = lm, units, rows, device
        self.cache = lm.new_cache(units, rows, capacity, device, config.cache or lm.default_cache)
        self.sampler = Sampler(config, range(rows), device) if lm.num_units - 1 in units else None
        self.mask = torch.ones((rows, capacity), dtype=torch.bool, device=device)
        self.positions = positions_of(self.mask)
        self.start = 0

    def step(self, length: int) -> float:
        """Seconds to run ``length`` more tokens (and sample, on the last stage)."""
        end = self.start + length
        context = Context(self.positions[:, self.start : end], self.mask[:, :end], self.start)
        if 0 in self.units:
            x = torch.randint(0, self.lm.vocab_size, (self.rows, length), device=self.device)
        else:
            shape = (self.rows, length, self.lm.hidden_size)
            x = torch.randn(shape, dtype=self.lm.dtype, device=self.device)
        begin = time.perf_counter()
        out = self.lm.run(self.units, x, self.cache, context)
        if self.sampler is not None:
            self.sampler(out)
        seconds = time.perf_counter() - begin
        self.start = end
        return seconds


class DecodeCost:
    """Costs of one decode Program: each stage's fit at each item's shape plus the runtime's
    per-action overheads, and transfers over the link (free without one)."""

    def __init__(
        self,
        fits: Sequence[StageFit],
        graph: StageGraph,
        items: Sequence[Item],
        groups: Sequence[range],
        hidden_bytes: int,
        *,
        link: Link | None = None,
        overheads: Overheads | None = None,
        forward_overhead: float = 0.0,
    ) -> None:
        """
        Args:
            fits: each stage's fit.
            groups: the batch's rows in each group.
            hidden_bytes: bytes of one token's hidden state (hidden size x dtype size).
        """
        if len(fits) != graph.num_stages:
            raise ValueError(f"{len(fits)} stage fits for {graph.num_stages} stages; give one each")
        self.fits, self.graph, self.items, self.groups = fits, graph, items, groups
        self.hidden_bytes = hidden_bytes
        self.link = link
        self.overheads = overheads or Overheads()
        self.forward_overhead = forward_overhead
        """Seconds the decode runtime adds to every forward (inputs, context, messages)."""

    def compute(self, action: Action) -> float:
        if action.kind is not Kind.F:
            raise ValueError(f"{action} is not a decode action")
        item = self.items[action.microbatch]
        rows = len(self.groups[item.group])
        return self.fits[action.stage].time(rows, item.length, item.start) + self.forward_overhead

    def message_bytes(self, action: Action) -> int:
        """A fed-back token (8 bytes a sequence) or hidden states, plus the done flag."""
        assert action.peer is not None
        item = self.items[action.microbatch]
        rows = len(self.groups[item.group])
        sender = action.stage if action.kind.is_send else action.peer
        receiver = action.peer if action.kind.is_send else action.stage
        if sender == self.graph.sink and receiver == 0:
            return rows * 8 + 1
        return rows * item.length * self.hidden_bytes + 1

    def transfer(self, action: Action) -> float:
        return 0.0 if self.link is None else self.link.transfer(self.message_bytes(action))

    def overhead(self, action: Action) -> float:
        link = self.link
        if action.kind.is_send:
            per_byte = 0.0 if link is None else link.send_per_byte
            return self.overheads.send + per_byte * self.message_bytes(action)
        per_byte = 0.0 if link is None else link.recv_per_byte
        return self.overheads.recv + per_byte * self.message_bytes(action)

    def wait(self, action: Action) -> float:
        return self.overheads.wait
