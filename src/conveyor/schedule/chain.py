"""Classic schedules, one stage per rank: GPipe (fill-drain), 1F1B, and forward-only."""

from __future__ import annotations

from conveyor.graph import StageGraph
from conveyor.program import Action, Kind, Program, ScheduleMismatch, add_communication

__all__ = ["forward_only", "gpipe", "one_f_one_b"]


# GPipe, 2 stages, 2 micro-batches (B costs two F):
# time:    0    1    2    3    4    5    6    7
# rank 0: 0F0  0F1                      0B0  0B1   (holds 2 micro-batches' activations)
# rank 1:      1F0  1F1  1B0  1B0  1B1  1B1
def gpipe(graph: StageGraph, num_microbatches: int) -> Program:
    """All forwards, then all backwards in reverse: simple, but holds every micro-batch."""
    compute = []
    for rank in range(graph.num_ranks):
        stages = graph.stages_on(rank)
        forwards = [Action(s, Kind.F, k) for k in range(num_microbatches) for s in stages]
        backwards = [Action(a.stage, Kind.B, a.microbatch) for a in reversed(forwards)]
        compute.append(forwards + backwards)
    return add_communication(graph, compute, num_microbatches)


# 1F1B, 2 stages, 3 micro-batches: after a warm-up of (stages below) forwards, each rank
# alternates one forward and one backward, so it holds at most that many + 1 micro-batches.
# rank 0: 0F0  0F1            0B0  0F2  0B1            0B2
# rank 1:      1F0  1B0  1F1  1B1       1F2  1B2
def one_f_one_b(graph: StageGraph, num_microbatches: int) -> Program:
    """1F1B (PipeDream-flush): GPipe's bubble with activations for at most p micro-batches.

    Works on any graph with one stage per rank; a stage's warm-up is the number of stages on
    the longest path below it, so on a DAG independent branches warm up independently.
    """
    compute = []
    for rank in range(graph.num_ranks):
        stage = _only_stage(graph, rank, "1f1b")
        warmup = min(graph.distance_to_sink(stage), num_microbatches)
        order = [Action(stage, Kind.F, k) for k in range(warmup)]
        for k in range(num_microbatches - warmup):
            order += [Action(stage, Kind.F, warmup + k), Action(stage, Kind.B, k)]
        order += [
            Action(stage, Kind.B, k) for k in range(num_microbatches - warmup, num_microbatches)
        ]
        compute.append(order)
    return add_communication(graph, compute, num_microbatches)


def forward_only(graph: StageGraph, num_microbatches: int) -> Program:
    """Inference: every micro-batch forward through every stage, no backward."""
    compute = [
        [Action(s, Kind.F, k) for k in range(num_microbatches) for s in graph.stages_on(r)]
        for r in range(graph.num_ranks)
    ]
    return add_communication(graph, compute, num_microbatches)


def _only_stage(graph: StageGraph, rank: int, schedule: str) -> int:
    stages = graph.stages_on(rank)
    if len(stages) != 1:
        raise ScheduleMismatch(
            f"schedule {schedule!r} runs one stage per rank, but rank {rank} holds stages {stages}"
        )
    return stages[0]
