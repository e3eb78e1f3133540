"""Decode costs for the simulator: stages profiled at decode and prefill shapes, fitted, and
charged per item, with the runtime's overheads and the measured link.

    fits = [profile_stage(lm, units, rows=[4, 8], starts=[128, 1024]) for units in stages]
    cost = DecodeCost(fits, graph, items, groups, hidden_bytes, link=link)
    timeline = simulate(program, graph, cost)                 # predicted, in seconds

A stage's time is fitted as ``fixed + per_token * tokens + per_pair * pairs``, where tokens
are rows x the item's length and pairs are the query-key pairs its attention scores (rows x
the sum over its tokens of the positions each sees); decode items (one token) and prefill
chunks get separate fits, since a one-row-per-sequence matrix product runs at another speed
than a chunk's. ``profile_stage`` measures wherever it is asked to (benchmarks, the planner's
comparison of parallelisms); ``profile_generation`` measures a stage in a fraction of a
generation's time, at the shapes ``DecodePipeline`` chooses its groups by
(conveyor.inference.groups).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from conveyor.graph import StageGraph
from conveyor.inference.config import GenerationConfig
from conveyor.inference.context import ContextParallelLM
from conveyor.inference.lm import CausalLM, Context, CpPlace
from conveyor.inference.prompts import positions_of
from conveyor.inference.sampling import Sampler
from conveyor.inference.schedule import Item
from conveyor.parallel.context_parallel import zigzag
from conveyor.program import Action, Kind
from conveyor.simulator import Link, Overheads

__all__ = [
    "DecodeCost",
    "Fit",
    "StageFit",
    "decode_point",
    "pairs",
    "profile_generation",
    "profile_stage",
]


def pairs(rows: int, length: int, start: int) -> float:
    """Query-key pairs the attention of ``rows`` sequences scores for ``length`` tokens after
    ``start`` cached ones."""
    return rows * (length * start + length * (length + 1) / 2)


@dataclass(frozen=True)
class Fit:
    """Seconds = fixed + per_token * tokens + per_pair * pairs + per_slot * slots, all
    coefficients >= 0; slots are rows x tokens x the cache's capacity, for attention that
    scores every slot of a preallocated cache (see ``StageFit.resumed``)."""

    fixed: float
    per_token: float
    per_pair: float
    per_slot: float = 0.0

    def time(self, rows: int, length: int, start: int, capacity: int | None = None) -> float:
        """Seconds for ``length`` tokens of ``rows`` sequences after ``start`` cached ones, in
        a cache of ``capacity`` positions (default: just large enough)."""
        slots = rows * length * (start + length if capacity is None else capacity)
        return (
            self.fixed
            + self.per_token * rows * length
            + self.per_pair * pairs(rows, length, start)
            + self.per_slot * slots
        )

    def __add__(self, other: Fit) -> Fit:
        """Both, one after the other (a stage of several units)."""
        return Fit(
            self.fixed + other.fixed,
            self.per_token + other.per_token,
            self.per_pair + other.per_pair,
            self.per_slot + other.per_slot,
        )

    def __mul__(self, count: float) -> Fit:
        """``count`` of these in a row (a stage of ``count`` equal blocks)."""
        return Fit(
            self.fixed * count, self.per_token * count, self.per_pair * count,
            self.per_slot * count,
        )  # fmt: skip

    @classmethod
    def of(
        cls,
        points: Sequence[tuple[int, int, int, float]],
        capacities: Sequence[int] | None = None,
    ) -> Fit:
        """Least squares through (rows, length, start, seconds) points, coefficients >= 0;
        per_slot only with each point's cache ``capacities`` given.

        A coefficient the points cannot tell from the others is left at 0 rather than given an
        arbitrary share that would not extrapolate: per_pair when every point's pairs are a
        multiple of its tokens (one chunk length from empty caches), per_token when every
        point has one token (decode on one sequence, where it is fixed's copy).
        """
        columns = [
            [1.0, rows * length, pairs(rows, length, start)] for rows, length, start, _ in points
        ]
        if capacities is not None:
            for column, (rows, length, _, _), capacity in zip(
                columns, points, capacities, strict=True
            ):
                column.append(rows * length * capacity)
        a, y = np.array(columns), np.array([p[3] for p in points])
        keep = list(range(a.shape[1]))
        while True:  # drop what the points cannot tell apart, or a negative, and refit
            if len(keep) > 1 and _rank(a[:, keep]) < len(keep):
                keep.remove(_redundant(a, keep))
                continue
            solution = np.linalg.lstsq(a[:, keep], y, rcond=None)[0]
            if (solution >= 0).all() or len(keep) == 1:
                break
            keep.pop(int(np.argmin(solution)))  # (a tiny NNLS)
        values = [0.0, 0.0, 0.0, 0.0]
        for index, value in zip(keep, solution, strict=True):
            values[index] = max(float(value), 0.0)
        return cls(*values)


def _redundant(a: np.ndarray, keep: list[int]) -> int:
    """The column of ``keep`` to leave out: one whose removal leaves the others independent,
    per_pair first, then per_token (one-token decode points make per_token a copy of fixed:
    there, per_token goes and per_pair stays)."""
    for column in sorted(keep, reverse=True):
        rest = [c for c in keep if c != column]
        if _rank(a[:, rest]) == len(rest):
            return column
    return keep[-1]


def _rank(a: np.ndarray) -> int:
    """Rank of ``a`` with its columns scaled alike (seconds, tokens and pairs differ by orders
    of magnitude, which would hide a dependence from lstsq's own cut-off)."""
    norms = np.linalg.norm(a, axis=0)
    scaled = a / np.where(norms > 0, norms, 1.0)
    return int(np.linalg.matrix_rank(scaled, tol=1e-9 * max(a.shape)))


@dataclass(frozen=True)
class StageFit:
    """A stage's costs: one fit for decode items (one token), one for prompt chunks from an
    empty cache, and one for chunks after cached ones (``resumed``; default: ``prefill``).

    The last is apart because a model may run a chunk that follows cached tokens another way
    than a first one: a cache that hands attention every preallocated slot, masked (Hugging
    Face's StaticCache; conveyor's hands it the written ones, Note [filled slots]), makes such
    a chunk cost its tokens x the cache's capacity, wherever it starts: measured on a
    256-wide Llama block, 2,048 tokens after 2,048 cost 0.21 s in a cache of 4,096 and 0.70 s
    in one of 16,384, against 0.13 s for the first chunk."""

    decode: Fit
    prefill: Fit
    resumed: Fit | None = None

    def time(self, rows: int, length: int, start: int, capacity: int | None = None) -> float:
        """Seconds for an item of ``length`` tokens after ``start`` cached ones, in a cache
        of ``capacity`` positions (default: just large enough)."""
        if length == 1:
            fit = self.decode
        elif start > 0 and self.resumed is not None:
            fit = self.resumed
        else:
            fit = self.prefill
        return fit.time(rows, length, start, capacity)

    def __add__(self, other: StageFit) -> StageFit:
        resumed = None
        if self.resumed is not None or other.resumed is not None:
            resumed = (self.resumed or self.prefill) + (other.resumed or other.prefill)
        return StageFit(self.decode + other.decode, self.prefill + other.prefill, resumed)

    def __mul__(self, count: float) -> StageFit:
        resumed = None if self.resumed is None else self.resumed * count
        return StageFit(self.decode * count, self.prefill * count, resumed)


def profile_stage(
    lm: CausalLM,
    units: range,
    rows: Sequence[int],
    starts: Sequence[int],
    chunks: Sequence[int] = (),
    *,
    resumed: int = 0,
    config: GenerationConfig | None = None,
    device: torch.device | str = "cpu",
    steps: int = 8,
    repeats: int = 3,
) -> StageFit:
    """Measure ``units`` as a decode stage runs them, and fit.

    Decode: for each row count and each start, ``steps`` one-token steps after a prompt of
    ``start`` tokens (median); prefill: a chunk of each length in ``chunks`` from an empty
    cache (median of ``repeats``), and, with ``resumed`` > 0, chunks of each length after
    cached ones at ``resumed`` starts and two cache capacities (the ``resumed`` fit, for
    prompts prefilled in chunks). The last stage is timed with its sampling (``config``).

    A ContextParallelLM is measured as its cp group runs it: every rank of the group calls
    this at once, prompts go over the ring in zigzag chunks and each new token attends over
    the shards; such a model takes no ``resumed`` chunks (its prompt is prefilled whole).
    """
    if resumed and isinstance(lm, ContextParallelLM):
        raise ValueError(
            "profile_stage: a context-parallel model prefills a prompt whole, so it has no "
            "chunks after cached ones to measure; pass resumed=0"
        )
    config = config or GenerationConfig()
    device = torch.device(device)
    decode: list[tuple[int, int, int, float]] = []
    prefill: list[tuple[int, int, int, float]] = []
    later: list[tuple[int, int, int, float, int]] = []
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
                if resumed:
                    later += _resumed_points(lm, units, r, length, resumed, repeats, config, device)
    decode_fit = Fit.of(decode)
    prefill_fit = Fit.of(prefill) if prefill else decode_fit
    resumed_fit = None
    if later:
        resumed_fit = Fit.of([p[:4] for p in later], capacities=[p[4] for p in later])
    return StageFit(decode_fit, prefill_fit, resumed_fit)


def _resumed_points(
    lm: CausalLM,
    units: range,
    rows: int,
    length: int,
    count: int,
    repeats: int,
    config: GenerationConfig,
    device: torch.device,
) -> list[tuple[int, int, int, float, int]]:
    """(rows, length, start, seconds, capacity): ``count`` chunks of ``length`` tokens after a
    first one in a cache of ``count + 1`` chunks, and the second chunk in a cache twice that
    size (which tells a cost that grows with the start from one that grows with the
    capacity); medians of ``repeats``."""
    capacity = length * (count + 1)
    shapes = [(i * length, capacity) for i in range(1, count + 1)] + [(length, 2 * capacity)]
    points = []
    for start, size in shapes:
        times = []
        for _ in range(repeats):
            runner = _Runner(lm, units, rows, size, config, device)
            runner.step(start)
            times.append(runner.step(length))
        points.append((rows, length, start, statistics.median(times), size))
    return points


def profile_generation(
    lm: CausalLM,
    stages: Sequence[range],
    rows: Sequence[int],
    prompt_length: int,
    max_new_tokens: int,
    *,
    config: GenerationConfig | None = None,
    device: torch.device | str = "cpu",
    chunk: int = 8,
    steps: int = 3,
    sync: Callable[[], None] | None = None,
) -> list[StageFit]:
    """Each of ``stages`` measured briefly at the shapes of a generation of ``max_new_tokens``
    after prompts of ``prompt_length`` tokens in groups of each of ``rows`` sequences, and fit.

    A cache per row count, filled with one token, except the most rows' (with a prompt chunk
    of ``chunk`` tokens), and one more of the fewest rows filled as far as the generation's
    middle, where its average token sits, so that the per-pair terms are measured over the
    lengths they are used at; the two longer fills are timed (prefill points). Filling costs
    rows x positions, so only the fewest rows go far. Then ``steps`` rounds of one token on
    every cache in turn, so that a burst of other work on the machine slows every shape alike;
    each cache's median is a decode point. ``sync`` runs before the filling and before the
    rounds: a barrier, so that ranks measure at the same time.
    """
    config = config or GenerationConfig()
    device = torch.device(device)
    end = prompt_length + max_new_tokens  # positions the generation reaches (within context)
    steps = max(1, min(steps, end - 1))
    longest = max(1, min(prompt_length + max_new_tokens // 2, end - steps))
    ordered = sorted(set(rows), reverse=True)
    shapes = [(r, min(chunk, longest) if r == ordered[0] else 1) for r in ordered]
    if longest > shapes[-1][1]:
        shapes.append((ordered[-1], longest))
    prefill: list[list[tuple[int, int, int, float]]] = [[] for _ in stages]
    runners: list[tuple[int, _Runner, list[float]]] = []
    with torch.no_grad():
        for units in stages:  # untimed: a model's first calls allocate
            warm = _Runner(lm, units, ordered[-1], 2, config, device)
            warm.step(1)
            warm.step(1)
        if sync is not None:
            sync()
        for r, fill in shapes:
            for index, units in enumerate(stages):
                runner = _Runner(lm, units, r, fill + steps, config, device)
                seconds = runner.step(fill)
                if fill > 1:
                    prefill[index].append((r, fill, 0, seconds))
                runners.append((index, runner, []))
        if sync is not None:
            sync()
        for _ in range(steps):
            for _, runner, times in runners:
                times.append(runner.step(1))
    decode: list[list[tuple[int, int, int, float]]] = [[] for _ in stages]
    for index, runner, times in runners:
        start = runner.start - steps + steps // 2  # the middle step's
        decode[index].append((runner.rows, 1, start, statistics.median(times)))
    return [
        StageFit(Fit.of(d), Fit.of(p) if p else Fit.of(d))
        for d, p in zip(decode, prefill, strict=True)
    ]


def decode_point(
    lm: CausalLM,
    units: range,
    rows: int,
    *,
    config: GenerationConfig | None = None,
    device: torch.device | str = "cpu",
    steps: int = 3,
) -> tuple[int, int, int, float]:
    """(rows, 1, start, seconds): the median of ``steps`` one-token steps of ``units`` on
    ``rows`` sequences after a one-token prompt, a point as ``Fit.of`` takes them."""
    config = config or GenerationConfig()
    with torch.no_grad():
        runner = _Runner(lm, units, rows, 1 + steps, config, torch.device(device))
        runner.step(1)
        times = [runner.step(1) for _ in range(steps)]
    return rows, 1, 1 + steps // 2, statistics.median(times)


class _Runner:
    """A stage with its cache, fed random inputs, timed step by step. The inputs come from a
    generator of its own: measuring leaves the process's random stream as it was (ranks that
    draw the same batches after a generate still do)."""

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
        self.shards: tuple[tuple[range, ...], ...] = ()
        """Under context parallelism, each rank's positions of the prompt."""
        self.generator = torch.Generator(device).manual_seed(0)

    def step(self, length: int) -> float:
        """Seconds to run ``length`` more tokens (and sample, on the last stage)."""
        end = self.start + length
        context = self._context(length)
        length = context.length
        if 0 in self.units:
            ids = (self.rows, length)
            x = torch.randint(
                0, self.lm.vocab_size, ids, generator=self.generator, device=self.device
            )
        else:
            hidden = (self.rows, length, self.lm.hidden_size)
            x = torch.randn(hidden, generator=self.generator, device=self.device)
            x = x.to(self.lm.dtype)
        begin = time.perf_counter()
        out = self.lm.run(self.units, x, self.cache, context)
        if self.sampler is not None:
            self.sampler(out)
        seconds = time.perf_counter() - begin
        self.start = end
        return seconds

    def _context(self, length: int) -> Context:
        """The next ``length`` tokens' context; under context parallelism, this rank's of
        them: a prompt's zigzag chunks, or a new token that every rank runs."""
        end = self.start + length
        columns = list(range(self.start, end))
        place = None
        if isinstance(self.lm, ContextParallelLM):
            if self.start == 0:
                self.shards = tuple(tuple(r) for r in zigzag(length, self.lm.size))
            elif length > 1:
                raise ValueError("a context-parallel model prefills a prompt whole")
            place = CpPlace(self.lm.rank, self.shards, self.start > 0, self.start)
            columns = place.mine
        return Context(self.positions[:, columns], self.mask[:, :end], self.start, place)


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
        capacity: int | None = None,
    ) -> None:
        """
        Args:
            fits: each stage's fit.
            groups: the batch's rows in each group.
            hidden_bytes: bytes of one token's hidden state (hidden size x dtype size).
            capacity: positions of each sequence's KV cache (prompt + new tokens), for
                fits that depend on it (``StageFit.resumed``).
        """
        if len(fits) != graph.num_stages:
            raise ValueError(f"{len(fits)} stage fits for {graph.num_stages} stages; give one each")
        self.fits, self.graph, self.items, self.groups = fits, graph, items, groups
        self.hidden_bytes = hidden_bytes
        self.link = link
        self.overheads = overheads or Overheads()
        self.forward_overhead = forward_overhead
        """Seconds the decode runtime adds to every forward (inputs, context, messages)."""
        self.capacity = capacity

    def compute(self, action: Action) -> float:
        if action.kind is not Kind.F:
            raise ValueError(f"{action} is not a decode action")
        item = self.items[action.microbatch]
        rows = len(self.groups[item.group])
        fit = self.fits[action.stage]
        return fit.time(rows, item.length, item.start, self.capacity) + self.forward_overhead

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
