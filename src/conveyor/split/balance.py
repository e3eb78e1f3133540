"""Balance a chain by measured cost: time each layer's forward and backward, cut where the
slowest stage is fastest.

    choice = balance_by_cost(model, 2, batch, loss_fn=loss_fn, targets=labels, num_microbatches=8)
    logger.info("%s", choice)   # balance by measured cost: [9, 1] (predicted per-stage ms ...)
    pipe = Pipeline(model, balance=list(choice.balance), loss_fn=loss_fn, num_microbatches=8)

Units are an nn.Sequential's layers (``balance_by_cost``) or the runs of a model between
candidate split points, such as a Hugging Face model's decoder layers
(``split_points_by_cost``). Costs are measured on one micro-batch of the example batch, by
hooks during whole forward and backward passes of the unsplit model, the way a stage runs its
layers in sequence (See Note [timing units on hooks]); they are kept per process and
optionally on disk, and ranks agree on them before they choose (See Note [ranks agree]).
This module stands below the Pipeline, which calls it; the planner (``conveyor.planner``)
stands above the Pipeline and profiles more (memory, split backward, several micro-batch
sizes) for its search.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from conveyor.files import write_atomic
from conveyor.runtime.microbatch import batch_size, split
from conveyor.split.capture import unknown_module
from conveyor.split.inputs import bind_inputs
from conveyor.split.points import balance_to_split_points, even_balance
from conveyor.split.untouched import untouched
from conveyor.split.vocab import VocabChunk, vocab_chunks
from conveyor.torch_compat import pytree

__all__ = [
    "DEFAULT_TIME_BUDGET_S",
    "BalanceChoice",
    "UnitCosts",
    "balance_by_cost",
    "decoder_layers",
    "measure_unit_costs",
    "min_max_balance",
    "split_candidates",
    "split_points_by_cost",
]

logger = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], torch.Tensor]

DEFAULT_TIME_BUDGET_S = 2.0
"""Seconds of timed passes (after one warm-up pass): a few, so that a Pipeline starts soon."""

_MAX_PASSES = 50


@dataclass(frozen=True)
class UnitCosts:
    """Seconds per micro-batch of each unit: unit 0 runs from the model's start to
    ``starts[0]``, unit i from ``starts[i - 1]`` to the next start (the last to the loss)."""

    starts: tuple[str, ...]
    """The submodules that start units 1, 2, ... (where a stage may start)."""
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    """The last unit's include the loss's (the last stage computes it)."""

    @property
    def num_units(self) -> int:
        return len(self.forward)

    @property
    def total(self) -> tuple[float, ...]:
        """Forward plus backward of each unit."""
        return tuple(f + b for f, b in zip(self.forward, self.backward, strict=True))

    def stage_times(self, balance: Sequence[int]) -> tuple[float, ...]:
        """Forward plus backward seconds per micro-batch of each stage of ``balance`` (units
        per stage)."""
        total, times, first = self.total, [], 0
        for count in balance:
            times.append(sum(total[first : first + count]))
            first += count
        return tuple(times)

    def split_points(self, balance: Sequence[int]) -> tuple[str, ...]:
        """The submodules that start stages 1, 2, ... of ``balance``."""
        firsts = np.cumsum(balance)[:-1]
        return tuple(self.starts[int(first) - 1] for first in firsts)


_MEMORY: dict[str, UnitCosts] = {}
"""Agreed unit costs by key (``_key``), for every later Pipeline of this process."""


@dataclass(frozen=True)
class BalanceChoice:
    """The balance whose slowest stage is fastest on measured costs, and the even split's."""

    balance: tuple[int, ...]
    """Units per stage (an nn.Sequential's: layers per stage, as ``Pipeline(balance=...)``)."""
    split_points: tuple[str, ...]
    """The submodules that start stages 1, 2, ... (as ``Pipeline(split_points=...)``)."""
    stage_times: tuple[float, ...]
    """Predicted forward plus backward seconds per micro-batch of each stage."""
    even: tuple[int, ...]
    even_times: tuple[float, ...]
    costs: UnitCosts
    measured: bool
    """Whether this call measured the costs (False: they came from a cache)."""
    by_points: bool = False
    """Whether the choice is described by split points (a model other than nn.Sequential)."""

    def __str__(self) -> str:
        def ms(times: Sequence[float]) -> str:
            return "[" + ", ".join(f"{1e3 * t:.1f}" for t in times) + "]"

        if self.by_points:
            even_points = list(self.costs.split_points(self.even))
            return (
                f"split points by measured cost: {list(self.split_points)} (predicted "
                f"per-stage ms {ms(self.stage_times)}; even {even_points}: "
                f"{ms(self.even_times)})"
            )
        return (
            f"balance by measured cost: {list(self.balance)} (predicted per-stage ms "
            f"{ms(self.stage_times)}; even {list(self.even)}: {ms(self.even_times)})"
        )

    def heavy_last_unit(self) -> str | None:
        """What to do when the last unit (a language model's head and loss) alone takes
        longer than a balanced stage, so that no cut between units can balance the stages;
        None when it does not."""
        total = self.costs.total
        balanced = sum(total) / len(self.balance)
        if len(total) < 2 or total[-1] <= 1.1 * balanced:
            return None
        return (
            f"the last layer (with the loss) takes {1e3 * total[-1]:.1f} ms a micro-batch, "
            f"more than a stage of an even share of the model ({1e3 * balanced:.1f} ms), so no "
            "cut between layers balances the stages: it bounds every step. If it is a language "
            "model's output head, cut it along its vocabulary so that stages may start inside "
            "it (conveyor.hf.head.ChunkedCausalLM, conveyor.split.ChunkedHeadLoss; "
            "docs/models.md)"
        )


def balance_by_cost(
    model: nn.Sequential,
    num_stages: int,
    example_inputs: Any,
    *,
    loss_fn: LossFn | None = None,
    targets: Any = None,
    num_microbatches: int = 1,
    placement: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    time_budget_s: float = DEFAULT_TIME_BUDGET_S,
) -> BalanceChoice:
    """Layers per stage of an nn.Sequential minimizing the slowest stage's measured time.

        choice = balance_by_cost(model, 2, batch, loss_fn=loss_fn, targets=labels)
        choice.balance      # (9, 1): the embedding and 8 blocks, then the head alone
        str(choice)         # the line to log

    Args:
        example_inputs: a batch as ``Pipeline.step`` takes it; one micro-batch of it (of
            ``num_microbatches``) is timed, on the model's device, in train mode.
        loss_fn, targets: the loss the last stage computes, ``loss_fn(outputs, targets)``
            (targets None for a loss that needs none, such as a Hugging Face model's own),
            timed with the last layer; without ``loss_fn`` the backward starts from a
            gradient of ones on the outputs, and the loss is not timed.
        placement: the rank of each stage, where ranks hold several (interleaved, V
            schedules): the busiest rank's sum is then minimized first.
        group: the ranks that must choose alike (every rank of the group calls this); the
            measured costs are averaged over them (See Note [ranks agree]). None: no
            collective, this process's measurement alone.
        cache_dir: a directory to keep the costs in across processes (See Note [unit costs
            kept]); they are kept in this process's memory either way.
        time_budget_s: seconds of timed passes after one warm-up pass (at least one pass).

    Raises:
        ValueError: fewer layers than stages, a model on the meta device, ranks whose models
            differ.
    """
    names = [name for name, _ in model.named_children()]
    even = even_balance(len(names), num_stages)
    balance_to_split_points(model, even)  # refuses one module at several positions
    return _choose(
        model, example_inputs, names[1:], tuple(even), False, placement,
        loss_fn=loss_fn, targets=targets, num_microbatches=num_microbatches, group=group,
        cache_dir=cache_dir, time_budget_s=time_budget_s,
    )  # fmt: skip


def split_points_by_cost(
    model: nn.Module,
    num_stages: int,
    example_inputs: Any,
    *,
    candidates: Sequence[str] | None = None,
    loss_fn: LossFn | None = None,
    targets: Any = None,
    num_microbatches: int = 1,
    placement: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    time_budget_s: float = DEFAULT_TIME_BUDGET_S,
) -> BalanceChoice:
    """Split points among ``candidates`` minimizing the slowest stage's measured time.

        choice = split_points_by_cost(llama, 2, batch, loss_fn=model_loss)
        Pipeline(llama, split_points=list(choice.split_points), example_inputs=batch)

    ``candidates`` (default: ``split_candidates(model)``) are submodules forward calls in
    that order, such as ``model.layers.0`` ... ``model.layers.31``; unit 0 is what runs
    before the first (the embedding), the last unit runs to the loss (the last layer, the
    norm, the head). The even split spreads the candidates evenly, unit 0 on stage 0. A
    Hugging Face model computes its loss itself from ``labels`` in the batch: pass
    ``loss_fn=conveyor.hf.loss.model_loss`` to start the backward from it. Other arguments
    as ``balance_by_cost``.
    """
    starts = list(split_candidates(model) if candidates is None else candidates)
    if len(set(starts)) != len(starts):
        raise ValueError(f"candidates {starts} repeat a name; give each once")
    if not 1 <= num_stages <= len(starts):
        raise ValueError(
            f"cannot split {type(model).__name__} into {num_stages} stages at "
            f"{len(starts)} candidates; give at least {num_stages} candidates (every stage "
            "holds at least one), or use fewer stages"
        )
    even = even_balance(len(starts), num_stages)
    even[0] += 1  # unit 0 (the embedding) joins the first stage
    return _choose(
        model, example_inputs, starts, tuple(even), True, placement,
        loss_fn=loss_fn, targets=targets, num_microbatches=num_microbatches, group=group,
        cache_dir=cache_dir, time_budget_s=time_budget_s,
    )  # fmt: skip


def split_candidates(model: nn.Module) -> list[str]:
    """Where a stage of a model that is not an nn.Sequential may start: its decoder layers,
    then the chunks of a head cut along the vocabulary (conveyor.split.vocab), if it has one."""
    return decoder_layers(model) + vocab_chunks(model)


def decoder_layers(model: nn.Module) -> list[str]:
    """The layers of the model's longest ``nn.ModuleList`` of one class (a transformer's
    blocks: ``model.layers.0``, ... for Llama, ``transformer.h.0``, ... for GPT-2), chunks of a
    vocabulary head aside."""
    found: list[str] = []
    for name, module in model.named_modules():
        same = isinstance(module, nn.ModuleList) and len({type(m) for m in module}) == 1
        same = same and not isinstance(module[0], VocabChunk)
        if same and len(module) > len(found):
            found = [f"{name}.{index}" for index in range(len(module))]
    if len(found) < 2:
        raise ValueError(
            f"{type(model).__name__} holds no nn.ModuleList of two or more layers of one "
            "class to split between; pass candidates=[...] naming the submodules a stage "
            "may start at, in the order forward calls them"
        )
    return found


def _choose(
    model: nn.Module,
    example_inputs: Any,
    starts: Sequence[str],
    even: tuple[int, ...],
    by_points: bool,
    placement: Sequence[int] | None,
    **options: Any,
) -> BalanceChoice:
    costs, measured = _costs(model, example_inputs, starts, **options)
    balance = tuple(min_max_balance(costs.total, len(even), placement))
    return BalanceChoice(
        balance,
        costs.split_points(balance),
        costs.stage_times(balance),
        even,
        costs.stage_times(even),
        costs,
        measured,
        by_points,
    )


# -- the min-max split ------------------------------------------------------------------------


# Note [min-max balance]:
# best[j][b]: the smallest worst-stage time when j + 1 stages cover units [0, b); stages are
# contiguous, so best[j][b] = min over a < b of max(best[j-1][a], time of units [a, b)), the
# recurrence of the planner's bottleneck split (conveyor.planner.partition), here on a
# chain's summed times. Many splits share the optimal worst stage (any that leaves a heavy
# head alone), so a second pass picks among those the one whose stages are most even (the
# least sum of squared stage times, no stage above the optimum): the other ranks then
# idle least, and the choice does not hang on which tie argmin meets first.
# When a rank holds several stages (interleaved, V), what bounds the step is the busiest
# rank's sum, which a recurrence over contiguous stages cannot see; every split is then
# tried (up to _MAX_SPLITS of them, e.g. 4 stages over 80 units), ordered by the busiest
# rank, then the slowest stage, then the sum of squares.
def min_max_balance(
    costs: Sequence[float], num_stages: int, placement: Sequence[int] | None = None
) -> list[int]:
    """Units per stage, contiguous, minimizing the largest stage sum of ``costs`` (with a
    ``placement``, the rank of each stage, the largest rank sum first); among those, the most
    even (See Note [min-max balance]).

    >>> min_max_balance([1, 1, 1, 1, 1, 1, 9], 2)
    [6, 1]
    """
    n = len(costs)
    even_balance(n, num_stages)  # the same errors for too few units
    ranks = list(range(num_stages)) if placement is None else list(placement)
    if len(ranks) != num_stages:
        raise ValueError(
            f"placement {ranks} has {len(ranks)} entries for {num_stages} stages; give the "
            "rank of each stage"
        )
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=float))])
    if len(set(ranks)) < num_stages and math.comb(n - 1, num_stages - 1) <= _MAX_SPLITS:
        return _by_rank(prefix, ranks)
    a, b = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    stage = np.where(b > a, prefix[b] - prefix[a], np.inf)  # stage = units [a, b)
    worst = np.full(n + 1, np.inf)
    worst[0] = 0.0
    for _ in range(num_stages):
        worst = np.maximum(worst[:, None], stage).min(axis=0)
    allowed = np.where(stage <= worst[n], stage**2, np.inf)
    squares = np.full(n + 1, np.inf)
    squares[0] = 0.0
    choice = np.zeros((num_stages, n + 1), dtype=np.int64)
    for j in range(num_stages):
        candidates = squares[:, None] + allowed
        choice[j] = np.argmin(candidates, axis=0)
        squares = candidates[choice[j], np.arange(n + 1)]
    assert np.isfinite(squares[n]), "the min-max split itself satisfies the bound"
    balance, end = [], n
    for j in reversed(range(num_stages)):
        first = int(choice[j][end])
        balance.append(end - first)
        end = first
    return balance[::-1]


_MAX_SPLITS = 100_000


def _by_rank(prefix: np.ndarray, ranks: list[int]) -> list[int]:
    """Every split of the units tried, for stages that share ranks (See Note [min-max
    balance])."""
    n = len(prefix) - 1
    best: tuple[float, ...] = (math.inf,)
    chosen: list[int] = []
    for cuts in itertools.combinations(range(1, n), len(ranks) - 1):
        bounds = (0, *cuts, n)
        stages = [float(prefix[b] - prefix[a]) for a, b in itertools.pairwise(bounds)]
        loads = dict.fromkeys(ranks, 0.0)
        for rank, time_s in zip(ranks, stages, strict=True):
            loads[rank] += time_s
        key = (max(loads.values()), max(stages), float(sum(t * t for t in stages)))
        if key < best:
            best, chosen = key, [b - a for a, b in itertools.pairwise(bounds)]
    return chosen


# -- measuring units ---------------------------------------------------------------------------


def _costs(
    model: nn.Module,
    example_inputs: Any,
    starts: Sequence[str],
    *,
    loss_fn: LossFn | None,
    targets: Any,
    num_microbatches: int,
    group: dist.ProcessGroup | None,
    cache_dir: str | os.PathLike[str] | None,
    time_budget_s: float,
) -> tuple[UnitCosts, bool]:
    """The agreed costs: from this process's memory, the cache directory, or measured now;
    (costs, whether measured here)."""
    inputs, labels = _first_microbatch(example_inputs, targets, num_microbatches)
    key = _key(model, starts, inputs, labels, loss_fn)
    costs = _MEMORY.get(key) or _read(cache_dir, key, starts)
    measured = costs is None
    if costs is None:
        costs = measure_unit_costs(
            model, inputs, starts, loss_fn=loss_fn, targets=labels, time_budget_s=time_budget_s
        )
    costs = _agreed(costs, group)
    _MEMORY[key] = costs
    if measured and cache_dir is not None:
        _write(cache_dir, key, costs)
    return costs, measured


def _first_microbatch(inputs: Any, targets: Any, num_microbatches: int) -> tuple[Any, Any]:
    size = batch_size(inputs)
    first = split(inputs, num_microbatches, size)[0]
    labels = None if targets is None else split(targets, num_microbatches, size)[0]
    return first, labels


# Note [timing units on hooks]:
# A whole forward and backward of the unsplit model runs with hooks that read the clock:
# forward, before each unit's first module (a unit's forward lasts until the next unit's
# starts); backward, when the gradient of a unit's input is complete, which is when the
# autograd engine is about to run the op that produced that input, the previous unit's last
# (CPU autograd runs the graph in reverse order of creation, and accumulates weight gradients
# as soon as they are computed, before moving on). A unit reads several inputs (a skip from
# far back, T5's position bias from layer 0): the earliest complete gradient among its
# positional inputs marks it, since the gradient of a value made further back completes
# later. The loss's forward and backward count with the last unit, as the last stage computes
# it; the backward ends with unit 0 (an embedding, whose inputs take no gradient). A later
# unit whose inputs take no gradient has its backward counted with the unit before it. As the
# units run in sequence, as in a stage, no correction for caches warmed by repetition is
# needed (the planner's Note [units in sequence]).
def measure_unit_costs(
    model: nn.Module,
    inputs: Any,
    starts: Sequence[str],
    *,
    loss_fn: LossFn | None = None,
    targets: Any = None,
    time_budget_s: float = DEFAULT_TIME_BUDGET_S,
) -> UnitCosts:
    """Forward and backward seconds of each unit of ``model`` on ``inputs`` (one micro-batch),
    the medians of passes for ``time_budget_s`` after a warm-up (See Note [timing units on
    hooks]), on this process's torch threads and host memory setting (a rank's, once the
    Pipeline has set them); the model is left as it was (``conveyor.split.untouched``)."""
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise ValueError(
            f"{type(model).__name__} is on the meta device, so its layers cannot be timed; "
            "materialize it (or load its weights) first, or pass balance=[...] / "
            "split_points=[...] by hand"
        )
    names = {name for name, _ in model.named_modules()}
    for name in starts:
        if name not in names:
            raise unknown_module(model, name, "split candidate")
    bound = _bound(model, inputs)
    clock = _Clock(model, starts)
    passes: list[tuple[list[float], list[float]]] = []
    with untouched(model), clock.hooked():
        model.train()
        clock.run(bound, loss_fn, targets)  # warm-up: allocations, lazy initialization
        began = time.monotonic()
        while len(passes) < _MAX_PASSES and (
            not passes or time.monotonic() - began < time_budget_s
        ):
            passes.append(clock.run(bound, loss_fn, targets))
    units = len(starts) + 1
    forward = tuple(statistics.median(p[0][u] for p in passes) for u in range(units))
    backward = tuple(statistics.median(p[1][u] for p in passes) for u in range(units))
    logger.debug(
        "timed %d units of %s in %d passes: forward %.2f ms, backward %.2f ms",
        units, type(model).__name__, len(passes), 1e3 * sum(forward), 1e3 * sum(backward),
    )  # fmt: skip
    return UnitCosts(tuple(starts), forward, backward)


def _bound(model: nn.Module, inputs: Any) -> dict[str, Any]:
    """The micro-batch as forward's arguments, on the model's device; no key/value cache, as
    the split runs it (conveyor.split.export)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    bound = {
        name: pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), value)
        for name, value in bind_inputs(model, inputs).items()
    }
    if "use_cache" in inspect.signature(model.forward).parameters:
        bound["use_cache"] = False
    return bound


class _Clock:
    """Hooks reading the clock at unit boundaries (See Note [timing units on hooks])."""

    def __init__(self, model: nn.Module, starts: Sequence[str]) -> None:
        self.model = model
        self.starts_named = list(starts)
        self.starts = [model.get_submodule(name) for name in starts]
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.forward: list[float | None] = []
        """Clock at the model's start, at each start module's first call, at the model's end."""
        self.backward: list[float | None] = []
        """Clock when each unit's input gradient completed (None: not yet, or never)."""

    def now(self) -> float:
        if self.device.type not in ("cpu", "meta"):
            torch.accelerator.synchronize(self.device)  # accelerators run ahead of the clock
        return time.perf_counter()

    @contextmanager
    def hooked(self) -> Iterator[None]:
        handles: list[RemovableHandle] = [
            self.model.register_forward_pre_hook(lambda *_: self._mark(0)),
            self.model.register_forward_hook(lambda *_: self._mark(len(self.starts) + 1)),
        ]
        for index, module in enumerate(self.starts, start=1):
            handles.append(module.register_forward_pre_hook(self._entered(index), with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _mark(self, index: int) -> None:
        if self.forward[index] is None:  # a module called twice counts from its first call
            self.forward[index] = self.now()

    def _entered(self, unit: int) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if self.forward[unit] is not None:
                return
            self._mark(unit)
            found = _grad_tensors(args) or _grad_tensors(kwargs.get("hidden_states"))
            for tensor in found:
                tensor.register_hook(  # type: ignore[no-untyped-call]  # torch leaves it untyped
                    lambda grad: self._completed(unit)
                )

        return hook

    def _completed(self, unit: int) -> None:
        if self.backward[unit] is None:  # the earliest of the unit's inputs marks it
            self.backward[unit] = self.now()

    def run(
        self, bound: dict[str, Any], loss_fn: LossFn | None, targets: Any
    ) -> tuple[list[float], list[float]]:
        """One forward and backward: each unit's forward and backward seconds."""
        units = len(self.starts) + 1
        self.forward = [None] * (units + 1)
        self.backward = [None] * (units + 1)
        output = self.model(**bound)
        loss = _loss(output, loss_fn, targets)
        loss_done = self.now()
        torch.autograd.backward(loss)
        done = self.now()
        marks = self.forward
        missing = [self.starts_named[u - 1] for u in range(1, units) if marks[u] is None]
        if missing:
            raise ValueError(
                f"split candidates {missing} are never called by forward; name submodules "
                "that forward calls, in the order it calls them"
            )
        times = [t for t in marks if t is not None]
        if len(times) != units + 1 or times != sorted(times):
            raise ValueError(
                f"forward does not call split candidates {list(self.starts_named)} in this "
                "order; list them in the order forward calls them"
            )
        forward = [later - earlier for earlier, later in itertools.pairwise(times)]
        forward[-1] += loss_done - times[-1]
        # ends[u]: when unit u's backward ended (ends[units]: the backward's start, ends[0]:
        # its end); a unit whose inputs took no gradient ends where the unit after it did
        ends = [done] * units + [loss_done]
        for u in reversed(range(1, units)):
            completed = self.backward[u]
            ends[u] = ends[u + 1] if completed is None else min(max(completed, ends[u + 1]), done)
        backward = [ends[u] - ends[u + 1] for u in range(units)]
        return forward, backward


def _grad_tensors(value: Any) -> list[torch.Tensor]:
    return [
        t
        for t in pytree.tree_leaves(value)
        if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None
    ]


def _loss(output: Any, loss_fn: LossFn | None, targets: Any) -> torch.Tensor:
    """The loss the backward starts from; without ``loss_fn``, the sum of the outputs (a
    gradient of ones)."""
    if loss_fn is not None:
        return loss_fn(output, targets)
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    graded = [t.sum() for t in leaves if t.requires_grad]
    if not graded:
        raise ValueError(
            f"the model's outputs ({type(output).__name__}) hold no tensor that needs a "
            "gradient, so there is no backward to time; pass loss_fn (and targets)"
        )
    total: torch.Tensor = torch.stack(graded).sum()
    return total


# -- keeping and agreeing ------------------------------------------------------------------------


# Note [unit costs kept]:
# The costs of a model's units depend on its structure, its parameters' shapes and dtypes, the
# micro-batch's shapes and dtypes, the loss, the split candidates and the torch threads and
# devices that run them; a digest of these keys them, in this process's memory and, with a
# cache directory, in a JSON file of its own there (written by a rename, conveyor.files), so
# a second Pipeline of the same model, in this process or a later one, does not measure
# again. The agreed costs are kept (See Note [ranks agree]), so a later choice is the same.
def _key(
    model: nn.Module, starts: Sequence[str], inputs: Any, targets: Any, loss_fn: LossFn | None
) -> str:
    def layout(value: Any) -> list[str]:
        return [
            f"{tuple(t.shape)}:{t.dtype}" if isinstance(t, torch.Tensor) else repr(t)[:100]
            for t in pytree.tree_leaves(value)
        ]

    described = {
        "modules": [
            f"{name}:{type(m).__qualname__}({m.extra_repr()})" for name, m in model.named_modules()
        ],
        "tensors": [
            f"{name}:{tuple(t.shape)}:{t.dtype}:{t.device.type}:{t.requires_grad}"
            for name, t in [*model.named_parameters(), *model.named_buffers()]
        ],
        "starts": list(starts),
        "inputs": layout(inputs),
        "targets": layout(targets),
        "loss": getattr(loss_fn, "__qualname__", repr(loss_fn)),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()[:32]


def _path(cache_dir: str | os.PathLike[str], key: str) -> Path:
    return Path(cache_dir) / f"unit-costs-{key}.json"


def _read(
    cache_dir: str | os.PathLike[str] | None, key: str, starts: Sequence[str]
) -> UnitCosts | None:
    if cache_dir is None or not _path(cache_dir, key).exists():
        return None
    try:
        data = json.loads(_path(cache_dir, key).read_text())
        costs = UnitCosts(
            tuple(data["starts"]),
            tuple(float(t) for t in data["forward"]),
            tuple(float(t) for t in data["backward"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("ignoring unreadable unit costs %s: %r", _path(cache_dir, key), error)
        return None
    ok = costs.starts == tuple(starts) and len(costs.backward) == costs.num_units
    return costs if ok and costs.num_units == len(starts) + 1 else None


def _write(cache_dir: str | os.PathLike[str], key: str, costs: UnitCosts) -> None:
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    data = {"starts": costs.starts, "forward": costs.forward, "backward": costs.backward}
    write_atomic(_path(cache_dir, key), json.dumps(data, indent=1))


# Note [ranks agree]:
# Each rank measures its own costs, and times differ between ranks (another rank's work on
# the core, a slower core), so ranks choosing alone could cut the model differently and fail
# at the first message. Every rank of the group instead sums its costs into an all_reduce and
# divides by the ranks: more samples, fewer outliers. All-reduced sums may still differ in the
# last bit between ranks, so group rank 0's result is then broadcast, and every rank runs the
# same deterministic choice on the same numbers. Ranks whose models differ in their number of
# units are refused first, on every rank.
def _agreed(costs: UnitCosts, group: dist.ProcessGroup | None) -> UnitCosts:
    if group is None:
        return costs
    device = _collective_device(group)
    num_ranks = dist.get_world_size(group)
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(num_ranks)]
    mine = torch.tensor([costs.num_units], dtype=torch.int64, device=device)
    dist.all_gather(counts, mine, group=group)
    found = [int(c.item()) for c in counts]
    if len(set(found)) > 1:
        raise ValueError(
            f"ranks measured different numbers of units {found} (by group rank): every rank "
            "must build the same model and split candidates before choosing a balance"
        )
    values = torch.tensor([*costs.forward, *costs.backward], dtype=torch.float64, device=device)
    dist.all_reduce(values, group=group)
    values /= num_ranks
    dist.broadcast(values, group_src=0, group=group)
    agreed = values.cpu().tolist()
    n = costs.num_units
    return UnitCosts(costs.starts, tuple(agreed[:n]), tuple(agreed[n:]))


def _collective_device(group: dist.ProcessGroup) -> torch.device:
    """CPU for gloo, else this process's accelerator (as the Pipeline picks its device)."""
    accelerator = torch.accelerator.current_accelerator()
    if dist.get_backend(group) == "gloo" or accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())
