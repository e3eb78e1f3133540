"""How many groups of sequences a generation runs in flight: each candidate's decode Program
simulated on measured stage costs, more than one group only if clearly faster than one.

    choice = choose_groups(fits, chain(2), batch_size=8, prompt_length=128, max_new_tokens=32,
                           hidden_bytes=512 * 4)
    choice.num_groups, choice.seconds, choice.one_group_seconds      # predicted, in seconds

Groups in flight keep every rank busy, but each forward then runs fewer rows, which on a CPU
(or any device streaming the weights at every token) is not proportionally faster, and every
group adds forwards and messages. Which wins depends on the model, the batch and the machine's
load, so it is measured (``conveyor.inference.cost.profile_generation``) and simulated here.
Prompts are prefilled as the caller asked (``prefill_chunk``); chunking is not chosen here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.graph import StageGraph
from conveyor.inference.cost import DecodeCost, StageFit
from conveyor.inference.prompts import groups_of
from conveyor.inference.schedule import decode_items, decode_program
from conveyor.simulator import Link, Overheads, execute

__all__ = [
    "MARGIN",
    "GroupChoice",
    "candidate_groups",
    "choose_groups",
    "measured_rows",
    "predict_seconds",
]

MARGIN = 0.05
"""More than one group only if predicted at least this much faster than one (a share of one
group's time): a doubtful prediction keeps the naive pipeline."""

_EXACT_TOKENS = 16
"""Generations of up to this many new tokens are simulated whole; longer ones from two short
ones (See Note [short simulations])."""


# Note [short simulations]:
# A Program of thousands of items takes seconds to build and simulate, so a long
# generation is predicted from two short ones whose tokens all sit at the long one's
# average position (a token's cost grows linearly with its position, so the average
# token costs what the tokens cost on average): the time of ``long`` tokens, plus each
# further token at the rate between ``short`` and ``long`` tokens, the steady rate once
# the groups are in flight (the pipeline's fill and drain cancel out).


@dataclass(frozen=True)
class GroupChoice:
    """The number of groups chosen for a generation, and the predictions it was chosen by."""

    num_groups: int
    seconds: float
    """Predicted seconds of the generation with ``num_groups`` groups."""
    one_group_seconds: float
    """Predicted seconds with one group (the naive pipeline)."""
    predicted: tuple[float, ...]
    """Predicted seconds of each candidate: 1, 2, ... groups."""

    @property
    def speedup(self) -> float:
        """One group's predicted time over the chosen one's (1.0 when one group is chosen)."""
        return self.one_group_seconds / self.seconds


def candidate_groups(batch_size: int, num_ranks: int) -> range:
    """Group counts worth predicting: 1 to two per rank, at most one per sequence."""
    return range(1, min(batch_size, 2 * num_ranks) + 1)


def measured_rows(batch_size: int, num_ranks: int) -> list[int]:
    """Group sizes a profile measures for the candidates (largest first): one group's (the
    batch), one group per rank's largest, and the smallest candidate's smallest; a stage's
    fit is linear in rows between them."""
    largest = candidate_groups(batch_size, num_ranks)[-1]
    per_rank = min(num_ranks, batch_size)
    return sorted({batch_size, -(-batch_size // per_rank), batch_size // largest}, reverse=True)


def choose_groups(
    fits: Sequence[StageFit],
    graph: StageGraph,
    *,
    batch_size: int,
    prompt_length: int,
    max_new_tokens: int,
    hidden_bytes: int,
    prefill_chunk: int | None = None,
    one_group_fits: Sequence[StageFit] | None = None,
    overheads: Overheads | None = None,
    link: Link | None = None,
    margin: float = MARGIN,
) -> GroupChoice:
    """The number of groups predicted fastest, from 1 to ``candidate_groups``; more than one
    only if predicted faster than one group by ``margin`` of its time.

    Args:
        fits: each stage's costs with every rank busy (as with groups in flight).
        one_group_fits: each stage's costs for one group, whose ranks take turns (default:
            ``fits``); on a shared machine a stage computing alone runs faster.
        hidden_bytes: bytes of one token's hidden state (hidden size x dtype size).
        overheads, link: the runtime's costs per message, and the link; default: free.
    """
    predicted = tuple(
        predict_seconds(
            (one_group_fits or fits) if g == 1 else fits,
            graph,
            num_groups=g,
            batch_size=batch_size,
            prompt_length=prompt_length,
            max_new_tokens=max_new_tokens,
            hidden_bytes=hidden_bytes,
            prefill_chunk=prefill_chunk,
            overheads=overheads,
            link=link,
        )
        for g in candidate_groups(batch_size, graph.num_ranks)
    )
    best = min(range(len(predicted)), key=lambda i: (predicted[i], i))
    if predicted[best] > predicted[0] * (1 - margin):
        best = 0
    return GroupChoice(best + 1, predicted[best], predicted[0], predicted)


def predict_seconds(
    fits: Sequence[StageFit],
    graph: StageGraph,
    *,
    num_groups: int,
    batch_size: int,
    prompt_length: int,
    max_new_tokens: int,
    hidden_bytes: int,
    prefill_chunk: int | None = None,
    overheads: Overheads | None = None,
    link: Link | None = None,
) -> float:
    """Predicted seconds of a generation in ``num_groups`` groups: its decode Program
    simulated on ``fits``."""

    def simulated(new_tokens: int, decode_start: int | None) -> float:
        items = decode_items(num_groups, prompt_length, new_tokens, prefill_chunk)
        costed = items
        if decode_start is not None:  # See Note [short simulations]
            costed = tuple(
                i if i.source is None else dataclasses.replace(i, start=decode_start) for i in items
            )
        groups = groups_of(batch_size, num_groups)
        cost = DecodeCost(fits, graph, costed, groups, hidden_bytes, link=link, overheads=overheads)
        return execute(decode_program(graph, items), graph, cost, record=False).span

    if max_new_tokens <= _EXACT_TOKENS:
        return simulated(max_new_tokens, None)
    # See Note [short simulations]
    short, long = _EXACT_TOKENS // 2, _EXACT_TOKENS
    middle = prompt_length + (max_new_tokens - 2) // 2  # decode items start at prompt_length
    first, second = simulated(short, middle), simulated(long, middle)
    return second + (max_new_tokens - long) * (second - first) / (long - short)
