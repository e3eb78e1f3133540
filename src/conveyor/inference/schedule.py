"""Decode schedules: a generation as a Program of items, See Note [decode programs].

    items = decode_items(num_groups=2, prompt_length=8, max_new_tokens=4)
    program = decode_program(chain(2), items)        # validated; simulate(program, chain(2))

An *item* is one pass of a group of sequences through the stages: a chunk of their prompts,
or one new token. Items are numbered round by round (a round is one chunk, or one token, of
every group), so item k belongs to group k mod G.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.graph import StageGraph
from conveyor.program import Action, Feedback, Kind, Program, add_communication
from conveyor.schedule.validate import validate
from conveyor.simulator import CostModel, UnitCost

__all__ = ["Item", "decode_items", "decode_program"]


@dataclass(frozen=True)
class Item:
    """One pass of a group of sequences through every stage: a decode program's micro-batch."""

    group: int
    start: int
    """Positions of the group already in its KV caches (this item's tokens come after)."""
    length: int
    """Tokens it runs: a prompt chunk's length, or 1 for a new token."""
    source: int | None
    """The item whose sampled token it takes at the first stage; None for a prompt chunk."""
    samples: bool
    """Whether the last stage samples a token from it: the last prompt chunk and every new
    token's item do."""


def decode_items(
    num_groups: int, prompt_length: int, max_new_tokens: int, prefill_chunk: int | None = None
) -> tuple[Item, ...]:
    """The items of generating ``max_new_tokens`` after a prompt of ``prompt_length`` tokens
    for ``num_groups`` groups: the prompt in chunks of ``prefill_chunk`` tokens (default: one),
    whose last one samples the first new token, then one item per further token."""
    if min(num_groups, prompt_length, max_new_tokens) < 1:
        raise ValueError(
            f"need at least one group, prompt token and new token; got {num_groups} groups, "
            f"a prompt of {prompt_length} and {max_new_tokens} new tokens"
        )
    chunk = prefill_chunk or prompt_length
    rounds = [
        (start, min(chunk, prompt_length - start)) for start in range(0, prompt_length, chunk)
    ]
    num_chunks = len(rounds)
    rounds += [(prompt_length + t, 1) for t in range(max_new_tokens - 1)]
    return tuple(
        Item(
            group,
            start,
            length,
            (r - 1) * num_groups + group if r >= num_chunks else None,
            r >= num_chunks - 1,
        )
        for r, (start, length) in enumerate(rounds)
        for group in range(num_groups)
    )


# 2 stages, 2 groups, 4 new tokens: group 0's token round trip (rank 0 -> rank 1 -> sampled,
# fed back to rank 0) overlaps group 1's, so both ranks stay busy; with one group (the naive
# pipeline) each rank would idle every other slot
# (`conveyor simulate --decode --stages 2 --groups 2 --new-tokens 4`):
# rank 0 | 0F0 0F1 0F2 0F3 0F4 0F5 0F6 0F7  .
# rank 1 |  .  1F0 1F1 1F2 1F3 1F4 1F5 1F6 1F7
def decode_program(
    graph: StageGraph, items: tuple[Item, ...], cost: CostModel | None = None
) -> Program:
    """The validated Program that runs ``items`` through ``graph`` (a chain, any placement).

    Each rank's order comes from list scheduling on ``cost`` (default: every item costs one
    unit): whenever a rank is free it runs, of the items whose inputs are there, the one that
    was ready first (then the lowest). A stage runs a group's items in order, since they
    extend its cache; a group's next token waits for the last stage to sample the previous.
    """
    feedback = Feedback(tuple(i.source for i in items), tuple(i.group for i in items))
    orders = _ListSchedule(graph, items, cost or UnitCost()).run()
    program = add_communication(graph, orders, len(items), feedback=feedback)
    validate(program, graph)
    return program


class _ListSchedule:
    """Event-driven list scheduling of a decode program's forwards; see ``decode_program``."""

    def __init__(self, graph: StageGraph, items: tuple[Item, ...], cost: CostModel) -> None:
        self.graph, self.items, self.cost = graph, items, cost
        self.finish: dict[tuple[int, int], float] = {}
        self.ready: dict[tuple[int, int], float] = {}
        self.free = [0.0] * graph.num_ranks
        num_groups = 1 + max(i.group for i in items)
        by_group = [[k for k, i in enumerate(items) if i.group == g] for g in range(num_groups)]
        self.queues = [  # per rank: (stage, that group's items the stage has still to run)
            [(s, list(by_group[g])) for s in graph.stages_on(rank) for g in range(num_groups)]
            for rank in range(graph.num_ranks)
        ]

    def run(self) -> list[list[Action]]:
        orders: list[list[Action]] = [[] for _ in range(self.graph.num_ranks)]
        for _ in range(self.graph.num_stages * len(self.items)):
            found = [c for c in map(self._choose, range(self.graph.num_ranks)) if c is not None]
            if not found:
                raise AssertionError("decode list scheduling stalled; this is a conveyor bug")
            start, k, s, rank, queue = min(found, key=lambda c: c[:3])
            action = Action(s, Kind.F, k)
            self.finish[(s, k)] = self.free[rank] = start + self.cost.compute(action)
            queue.pop(0)
            orders[rank].append(action)
        return orders

    def _choose(self, rank: int) -> tuple[float, int, int, int, list[int]] | None:
        """(start, item, stage, rank, queue) of what ``rank`` runs next, or None if nothing
        is ready."""
        best = None
        for s, queue in self.queues[rank]:
            if not queue:
                continue
            at = self._ready_at(s, queue[0])
            if at is not None and (best is None or (max(self.free[rank], at), queue[0]) < best[:2]):
                best = (max(self.free[rank], at), queue[0], s, rank, queue)
        return best

    def _ready_at(self, s: int, k: int) -> float | None:
        """When the input of stage ``s`` for item ``k`` is there, or None if not yet computed."""
        if (s, k) in self.ready:
            return self.ready[(s, k)]
        source = self.items[k].source
        if s > 0:
            producer = (s - 1, k)
        elif source is not None:
            producer = (self.graph.sink, source)
        else:
            return 0.0
        if producer not in self.finish:
            return None
        at = self.finish[producer]
        if self.graph.rank_of(producer[0]) != self.graph.rank_of(s):
            at += self.cost.transfer(Action(producer[0], Kind.SEND_F, producer[1], s))
        self.ready[(s, k)] = at
        return at
