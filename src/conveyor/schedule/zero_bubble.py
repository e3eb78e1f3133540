"""Zero-bubble schedules: split backward, weight gradients in the bubbles."""

from __future__ import annotations

from conveyor.graph import StageGraph
from conveyor.program import Action, Kind, Program, ScheduleMismatch, add_communication
from conveyor.schedule.interleaved import require_chain

__all__ = ["v_chunks", "zb_h1", "zb_v"]


# ZB-H1, 3 stages, 6 micro-batches, F = I = W = 1 unit: 1F1B with each B split into I (input
# gradient, on the critical path) and W (weight gradient, off it). Stage r holds back r W's and
# runs them where 1F1B would idle at the end, so the bubble shrinks from (p-1)(F+B) to
# (p-1)(F+I-W) while no rank keeps more than p micro-batches alive, 1F1B's peak
# (`conveyor simulate --schedule zb-h1 --stages 3 --microbatches 6`):
# rank 0 | 0F0 0F1 0F2  .   .  0I0 0W0 0F3 0I1 0W1 0F4 0I2 0W2 0F5 0I3 0W3 0I4 0W4 0I5 0W5
# rank 1 |  .  1F0 1F1  .  1I0 1F2 1I1 1W1 1F3 1I2 1W2 1F4 1I3 1W3 1F5 1I4 1W4 1I5 1W5 1W0
# rank 2 |  .   .  2F0 2I0 2F1 2I1 2F2 2I2 2W2 2F3 2I3 2W3 2F4 2I4 2W4 2F5 2I5 2W5 2W0 2W1
# The paper (and torch.distributed.pipelining) hold back W's by shifting each W(k) to after
# I(k + r); conveyor holds back the *first* r W's to the end instead and runs every other W
# right after its I. Step time and peak memory are the same (the tests check both over a
# grid), and a W that follows its I at once finds its operands still in cache, which on a CPU
# makes it markedly cheaper.
def zb_h1(graph: StageGraph, num_microbatches: int) -> Program:
    """ZB-H1: 1F1B's order and memory, with weight gradients deferred into the bubble at the
    end. One stage per rank; on a DAG, as 1F1B, a stage's warm-up is its distance to the end,
    and it holds back (depth - 1 - distance) weight gradients."""
    compute = []
    for rank in range(graph.num_ranks):
        stages = graph.stages_on(rank)
        if len(stages) != 1:
            raise ScheduleMismatch(
                f"schedule 'zb-h1' runs one stage per rank, but rank {rank} holds stages {stages}"
            )
        stage = stages[0]
        below = graph.distance_to_sink(stage)
        held_back = min(graph.depth - 1 - below, num_microbatches)
        warmup = min(below, num_microbatches)
        order = [Action(stage, Kind.F, k) for k in range(warmup)]
        for k in range(num_microbatches):
            if warmup + k < num_microbatches:
                order.append(Action(stage, Kind.F, warmup + k))
            order.append(Action(stage, Kind.I, k))
            if k >= held_back:
                order.append(Action(stage, Kind.W, k))
        order += [Action(stage, Kind.W, k) for k in range(held_back)]
        compute.append(order)
    return add_communication(graph, compute, num_microbatches)


# ZB-V, 2 ranks, 4 stages in a V (rank 0: stages 0 and 3, rank 1: stages 1 and 2), 4
# micro-batches, F = I = W = 1 unit per chunk. Each micro-batch goes down the ranks through the
# first chunk and back up through the second, so the last stage sits on rank 0 next to the
# first: the loss's gradient turns around without crossing ranks, and the warm-up of one chunk
# overlaps the cool-down of the other (`conveyor simulate --schedule zb-v --stages 2
# --microbatches 4`):
# rank 0 | 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 ...
# rank 1 |  .  1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 ...
def zb_v(graph: StageGraph, num_microbatches: int) -> Program:
    """ZB-V: two chunks per rank in a V (rank r holds stages r and 2p-1-r), F, I and W of each
    micro-batch in a steady rhythm; the bubble nearly vanishes when F, I and W cost the same,
    with 1F1B's peak activation memory (2p half-size chunks per rank).

    Fewer than 2p - 1 micro-batches cannot fill the V; the schedule is then the one for
    2p - 1 with the missing micro-batches' actions left out.
    """
    chunks = v_chunks(graph, "zb-v")
    num_ranks = graph.num_ranks
    padded = max(num_microbatches, 2 * num_ranks - 1)
    compute = []
    for rank, (down, up) in enumerate(chunks):
        order = _RankOrder(padded)
        order.run(Kind.F, down, 2 * (num_ranks - rank) - 1)
        for _ in range(rank):
            order.run(Kind.F, up)
            order.run(Kind.F, down)
        for _ in range(num_ranks - rank):
            order.run(Kind.F, up)
            order.run(Kind.I, up)
            order.run(Kind.W, up)
        while order.remaining(Kind.F, down) or order.remaining(Kind.F, up):
            order.run(Kind.F, down)
            order.run(Kind.I, down)
            order.run(Kind.W, down)
            order.run(Kind.F, up)
            order.run(Kind.I, up)
            order.run(Kind.W, up)
        for _ in range(rank):
            order.run(Kind.I, down)
            order.run(Kind.I, up)
        for _ in range(num_ranks - rank):
            order.run(Kind.I, down)
            order.run(Kind.W, down)
        order.run(Kind.W, up, padded)
        order.run(Kind.W, down, padded)
        compute.append([a for a in order.actions if a.microbatch < num_microbatches])
    return add_communication(graph, compute, num_microbatches)


class _RankOrder:
    """One rank's compute actions, built by asking for the next F, I or W of a stage."""

    def __init__(self, num_microbatches: int) -> None:
        self.num_microbatches = num_microbatches
        self.actions: list[Action] = []
        self._next: dict[tuple[Kind, int], int] = {}

    def run(self, kind: Kind, stage: int, count: int = 1) -> None:
        """Append the next ``count`` actions of ``kind`` on ``stage``; none past the last
        micro-batch, and no W before its I."""
        for _ in range(count):
            k = self._next.get((kind, stage), 0)
            limit = self._next.get((Kind.I, stage), 0) if kind is Kind.W else self.num_microbatches
            if k >= limit:
                return
            self.actions.append(Action(stage, kind, k))
            self._next[(kind, stage)] = k + 1

    def remaining(self, kind: Kind, stage: int) -> int:
        return self.num_microbatches - self._next.get((kind, stage), 0)


def v_chunks(graph: StageGraph, schedule: str) -> list[tuple[int, int]]:
    """Each rank's (down, up) stages, checking the V placement: rank r holds r and 2p-1-r."""
    num_ranks = graph.num_ranks
    expected = [min(s, 2 * num_ranks - 1 - s) for s in range(2 * num_ranks)]
    placement = [graph.rank_of(s) for s in range(graph.num_stages)]
    if placement != expected:
        raise ValueError(
            f"schedule {schedule!r} needs {2 * num_ranks} stages placed in a V over "
            f"{num_ranks} ranks ({expected}: rank r holds stages r and {2 * num_ranks - 1}-r); "
            f"got placement {placement}. Use placement_style='v' with 2 stages per rank"
        )
    require_chain(graph, schedule)
    return [(rank, 2 * num_ranks - 1 - rank) for rank in range(num_ranks)]
