"""DualPipeV: DeepSeek's DualPipe cut in half, two chunks per rank in a V."""

from __future__ import annotations

from collections import deque

from conveyor.graph import StageGraph
from conveyor.program import Action, Kind, Program, add_communication
from conveyor.schedule.zero_bubble import v_chunks

__all__ = ["dualpipe_v"]


# DualPipeV, 2 ranks, 4 stages in a V (rank 0: stages 0 and 3, rank 1: stages 1 and 2), 5
# micro-batches, F = I = W = 1 unit per chunk, in two halves (`conveyor simulate --schedule
# dualpipev --stages 2 --microbatches 5`). Rank 0's pairs, from 0F3 on: 0F3 with 3B1,
# 3F2 with 0B0, 0F4 with 3B2, 3F3 with 0B1, 3F4 with 0B2; in the cool-down 0I3 and 0I4 run
# before their W's (a B fills two units, an I or a W one):
# rank 0 | 0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3B1 3F2 0B0 0B0 0F4 3B2 3B2
# rank 1 |  .  1F0 2F0 1F1 2F1 1F2 2B0 2B0 2F2 1B0 1B0 1F3 2B1 2B1 2F3 1B1
#   ...  | 3F3 0B1 0B1 3B3 3B3 3F4  .  0B2 0B2 3B4 3B4 0I3 0W3 0I4 0W4
#        | 1B1 1F4 2B2 2B2 2F4 1B2 1B2 2B3 2B3 1B3 1B3 2I4 1I4 2W4 1W4
# Rank r of p, with down chunk d = r and up chunk u = 2p-1-r:
#   warm-up    2(p-1-r) F_d; (r+1) x [F_d F_u]; (p-1-r) x [I_u W_u F_u]
#   steady     (m-2p+r+1) x [(F_d, B_u) (F_u, B_d)], each (F, B) a pair
#   cool-down  (p-1-r) x [B_u (F_u, B_d)]; (r+1) x [B_u B_d], the last r+1 of these
#              backwards an I holding its W back; (p-1-r) x [a held W, I_d holding its W];
#              the r+1 W's still held
# A backward that keeps its W with it runs whole (B), as DeepSeek's and torch's do: one pass
# of autograd costs less than an I and a W (run split, conveyor's DualPipeV took 5% more CPU
# a step than torch's on the schedules benchmark's GPT), though the gradient then leaves
# after the whole backward rather than after its I. DeepSeek's DualPipeV overlaps the two
# halves of each pair on a GPU (one chunk's messages hide under the other's compute, and an
# MoE layer's all-to-all under the other's matmuls); a CPU rank on gloo cannot overlap inside
# one action, so conveyor runs a pair as its F, then its B, in the pair's order. With
# F = I = W every rank then idles p-1 units, as under ZB-V.
def dualpipe_v(graph: StageGraph, num_microbatches: int) -> Program:
    """DualPipeV: two chunks per rank in a V (rank r holds stages r and 2p-1-r); after a
    warm-up each rank pairs a forward of one chunk with a backward of the other (of another
    micro-batch), and the cool-down holds weight gradients back into the waits. The order,
    and which backwards run whole (B) or split (I, W), is DeepSeek's, which
    torch.distributed.pipelining's ScheduleDualPipeV runs too.

    With F = I = W = 1 unit per chunk and m >= 2p (what its steady state needs: every rank
    runs at least one round of pairs), a step takes 6m + p - 1 units: every rank idles p - 1,
    as under ZB-V. Rank r keeps at most min(2p + 1, 2m, m + 1 + r) (stage, micro-batch)
    activation sets alive: 2p + 1 half-size chunk sets once m >= 2p, one more than ZB-V.
    With m < 2p the schedule is the one for 2p micro-batches with the missing ones' actions
    left out and every backward split into its I and its W (whole ones would hold the
    gradients the cut-short cool-down waits for); it stays valid, at 4(m + p) - 2 units for
    m <= p (ZB-V's too) and min(6m + 2p - 2, 4m + 5p - 1) for p < m < 2p.
    """
    chunks = v_chunks(graph, "dualpipev")
    p = graph.num_ranks  # p: ranks, r: this rank, m: micro-batches (at least 2p here)
    m = max(num_microbatches, 2 * p)
    compute = []
    for r, (down, up) in enumerate(chunks):
        order = _DualOrder(whole=num_microbatches >= 2 * p)
        order.forward(down, 2 * (p - 1 - r))
        for _ in range(r + 1):
            order.forward(down)
            order.forward(up)
        for _ in range(p - 1 - r):
            order.backward(up, split=True)
            order.forward(up)
        for _ in range(m - 2 * p + r + 1):
            order.pair(forward=down, backward=up)
            order.pair(forward=up, backward=down)
        for _ in range(p - 1 - r):
            order.backward(up)
            order.pair(forward=up, backward=down)
        for i in range(r + 1):  # of these 2(r + 1) backwards, the last r + 1 hold back W
            order.backward(up, hold_weight=2 * i >= r + 1)
            order.backward(down, hold_weight=2 * i + 1 >= r + 1)
        for _ in range(p - 1 - r):
            order.weight()
            order.backward(down, hold_weight=True)
        for _ in range(r + 1):
            order.weight()
        assert not order.held, f"rank {r} holds back {list(order.held)}"
        compute.append([a for a in order.actions if a.microbatch < num_microbatches])
    return add_communication(graph, compute, num_microbatches)


class _DualOrder:
    """One rank's compute actions, built by asking for the next forward or backward of a
    stage; a backward is a B, or an I and its W, at once or held back in a queue (oldest
    first)."""

    def __init__(self, whole: bool) -> None:
        self.whole = whole
        """Whether backwards that keep their W run whole (B), as in DeepSeek's order; the
        schedule cut short (m < 2p) splits every one, which a whole B there would delay."""
        self.actions: list[Action] = []
        self.held: deque[Action] = deque()
        self._next: dict[tuple[Kind, int], int] = {}

    def _take(self, kind: Kind, stage: int) -> Action:
        k = self._next.get((kind, stage), 0)
        self._next[(kind, stage)] = k + 1
        return Action(stage, kind, k)

    def forward(self, stage: int, count: int = 1) -> None:
        for _ in range(count):
            self.actions.append(self._take(Kind.F, stage))

    def backward(self, stage: int, *, hold_weight: bool = False, split: bool = False) -> None:
        """The next backward of ``stage``: whole (B); with ``split`` its I and then its W; with
        ``hold_weight`` its I, and its W into the queue."""
        if self.whole and not (split or hold_weight):  # a B counts as the I and W it replaces
            k = self._take(Kind.I, stage).microbatch
            self._take(Kind.W, stage)
            self.actions.append(Action(stage, Kind.B, k))
            return
        self.actions.append(self._take(Kind.I, stage))
        weight = self._take(Kind.W, stage)
        if hold_weight:
            self.held.append(weight)
        else:
            self.actions.append(weight)

    def pair(self, *, forward: int, backward: int) -> None:
        """A forward and a backward of two different chunks, which DualPipeV overlaps on a GPU
        (one chunk's messages hide under the other's compute); here they run in turn."""
        self.forward(forward)
        self.backward(backward)

    def weight(self) -> None:
        """The oldest held-back W."""
        if self.held:
            self.actions.append(self.held.popleft())
