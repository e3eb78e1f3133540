"""Interleaved 1F1B (Megatron-LM): each rank holds several chunks of a chain, placed in a loop."""

from __future__ import annotations

from conveyor.graph import StageGraph
from conveyor.program import Action, Kind, Program, ScheduleMismatch, add_communication

__all__ = ["interleaved_1f1b", "loop_chunks", "require_chain", "rounds"]


# Interleaved 1F1B, 2 ranks x 2 chunks (stage s on rank s % 2), 4 micro-batches, F=1 B=2 per
# chunk (`conveyor simulate --schedule interleaved-1f1b --stages 2 --microbatches 4`).
# Micro-batches pass the chunks in rounds of p: rank 0 runs chunk 0 (stage 0) for micro-batches
# 0 and 1, then chunk 1 (stage 2) for the same two, then the next round; backwards go through
# the chunks in reverse. The bubble is 1F1B's divided by v, for some more activation memory.
# rank 0 | 0F0 0F1 2F0 2F1 0F2  .  2B0 2B0 0F3 2B1 2B1 2F2 0B0 0B0 2F3 0B1 0B1  .  2B2 2B2 ...
# rank 1 |  .  1F0 1F1 3F0 3B0 3B0 3F1 3B1 3B1 1F2 1B0 1B0 1F3 1B1 1B1 3F2 3B2 3B2 3F3 3B3 ...
#
# Note [interleaved remainder]:
# Megatron-LM needs m to be a multiple of p. Here the m micro-batches form max(1, m // p)
# rounds whose sizes differ by at most one, larger rounds first, so every round has at least
# p micro-batches when m >= p: a remainder makes some rounds one micro-batch longer. That
# adds (v - 1) micro-batches of warm-up on the first rounds, never a bubble, because a rank
# finishes a chunk's round no earlier than the next rank can start the following chunk.
# With m < p there is one round of m and the pipeline cannot fill (as with 1F1B).
def interleaved_1f1b(graph: StageGraph, num_microbatches: int) -> Program:
    """Interleaved 1F1B: a smaller bubble than 1F1B for some more activation memory.

    Needs a chain whose stages are placed in a loop (stage s on rank s mod p, every rank
    holding v stages, e.g. ``chain(8, num_ranks=4)``); with v = 1 it is exactly 1F1B. A rank
    warms up with (v - 1) x (first round) + 2 (p - 1 - rank) forwards, then alternates one
    forward and one backward. See Note [interleaved remainder] for m not a multiple of p.
    """
    chunks = loop_chunks(graph, "interleaved-1f1b")
    num_ranks, num_chunks = graph.num_ranks, len(chunks[0])
    sizes = rounds(num_microbatches, num_ranks)
    compute = []
    for rank, stages in enumerate(chunks):
        forwards, backwards = [], []
        start = 0
        for size in sizes:
            batch = range(start, start + size)
            forwards += [Action(s, Kind.F, k) for s in stages for k in batch]
            backwards += [Action(s, Kind.B, k) for s in reversed(stages) for k in batch]
            start += size
        below = num_ranks - 1 - rank
        warmup = below if num_chunks == 1 else (num_chunks - 1) * sizes[0] + 2 * below
        warmup = min(warmup, len(forwards))
        order = forwards[:warmup]
        for forward, backward in zip(forwards[warmup:], backwards, strict=False):
            order += [forward, backward]
        order += backwards[len(forwards) - warmup :]
        compute.append(order)
    return add_communication(graph, compute, num_microbatches)


def rounds(num_microbatches: int, num_ranks: int) -> list[int]:
    """Round sizes of interleaved schedules: max(1, m // p) rounds, sizes differing by at
    most one, larger first (See Note [interleaved remainder])."""
    count = max(1, num_microbatches // num_ranks)
    base, extra = divmod(num_microbatches, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def loop_chunks(graph: StageGraph, schedule: str) -> list[list[int]]:
    """Each rank's stages, in chain order, checking the loop placement interleaving needs."""
    num_ranks = graph.num_ranks
    expected = [s % num_ranks for s in range(graph.num_stages)]
    placement = [graph.rank_of(s) for s in range(graph.num_stages)]
    if graph.num_stages % num_ranks or placement != expected:
        raise ValueError(
            f"schedule {schedule!r} needs a chain whose stages are placed in a loop (stage s on "
            f"rank s % {num_ranks}, the same number on every rank); got placement {placement}. "
            f"Use placement_style='loop' with a multiple of {num_ranks} stages"
        )
    require_chain(graph, schedule)
    return [graph.stages_on(rank) for rank in range(num_ranks)]


def require_chain(graph: StageGraph, schedule: str) -> None:
    broken = graph.chain_break()
    if broken is not None:
        raise ScheduleMismatch(
            f"schedule {schedule!r} runs chains (stage i feeds only stage i + 1), but {broken} "
            "(a skip connection or a branch)"
        )
