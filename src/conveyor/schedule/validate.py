"""Check a Program before anything runs: complete, ordered, matched, deadlock-free."""

from __future__ import annotations

from collections import Counter

from conveyor.graph import StageGraph
from conveyor.program import Action, Feedback, Kind, Program, receives_needed
from conveyor.simulator import DeadlockError, execute

__all__ = ["ProgramError", "validate"]


_MAX_LISTED = 8


class ProgramError(ValueError):
    """A Program that would compute the wrong thing or hang; the message lists every problem."""


def validate(program: Program, graph: StageGraph) -> None:
    """Raise ProgramError unless ``program`` runs every micro-batch through every stage.

    A training program does, for each stage and micro-batch, one F and then either one B or
    one I followed by one W; a program with no backward actions is a forward-only (inference)
    program, and one with ``feedback`` a decode program (See Note [decode programs]). Every
    compute has the messages it needs posted before it, every send has its receive in the same
    per-channel order, and execution cannot deadlock.
    """
    problems = _structure(program, graph)
    if not problems:
        try:
            execute(program, graph, record=False)
        except DeadlockError as error:
            problems.append(str(error))
    if problems:
        listed = problems[:_MAX_LISTED]
        more = len(problems) - len(listed)
        raise ProgramError(
            "invalid program:\n  "
            + "\n  ".join(listed)
            + (f"\n  ... and {more} more" if more else "")
        )


def _structure(program: Program, graph: StageGraph) -> list[str]:
    problems: list[str] = []
    if len(program) != graph.num_ranks:
        return [
            f"program has {len(program)} ranks but the stage graph places stages on "
            f"{graph.num_ranks}"
        ]
    feedback = program.feedback
    if feedback is not None:
        problems += _feedback_problems(feedback, graph, program.num_microbatches)
        if problems:
            return problems
    counts: Counter[tuple[int, Kind, int]] = Counter()
    for rank, actions in enumerate(program):
        problems += _rank_order(rank, actions, graph, program.num_microbatches, feedback)
        counts.update((a.stage, a.kind, a.microbatch) for a in actions if a.is_compute)
    problems += _completeness(counts, graph, program.num_microbatches)
    return problems


def _feedback_problems(feedback: Feedback, graph: StageGraph, num_microbatches: int) -> list[str]:
    """A decode program's items: one source and group each, fed by an earlier item of their
    group, each item feeding at most one other, on a chain of stages."""
    if len(feedback.sources) != num_microbatches or len(feedback.groups) != num_microbatches:
        return [
            f"feedback lists {len(feedback.sources)} sources and {len(feedback.groups)} groups "
            f"for {num_microbatches} micro-batches; give one of each per micro-batch"
        ]
    problems = []
    if graph.chain_break() is not None:
        problems.append(
            f"a decode program (with feedback) needs a chain of stages: {graph.chain_break()}"
        )
    seen: set[int] = set()
    for k, source in enumerate(feedback.sources):
        if source is None:
            continue
        if not 0 <= source < k or feedback.groups[source] != feedback.groups[k]:
            problems.append(
                f"micro-batch {k} (group {feedback.groups[k]}) is fed by {source}; expected "
                "an earlier micro-batch of the same group"
            )
        elif source in seen:
            problems.append(f"micro-batch {source} feeds more than one micro-batch")
        seen.add(source)
    return problems


def _rank_order(
    rank: int,
    actions: tuple[Action, ...],
    graph: StageGraph,
    num_microbatches: int,
    feedback: Feedback | None = None,
) -> list[str]:
    """Per-rank rules: placement, ranges, and each action after what it depends on."""
    problems: list[str] = []
    done: set[Action] = set()
    last_of_group: dict[tuple[int, int], int] = {}  # (stage, group) -> latest item run
    for action in actions:
        where = f"rank {rank}: {action}"
        if not 0 <= action.stage < graph.num_stages or graph.rank_of(action.stage) != rank:
            problems.append(
                f"{where}: stage {action.stage} is not on rank {rank} "
                f"(rank {rank} holds stages {graph.stages_on(rank)})"
            )
            continue
        if not 0 <= action.microbatch < num_microbatches:
            problems.append(
                f"{where}: micro-batch {action.microbatch} is outside 0..{num_microbatches - 1}"
            )
            continue
        if action in done:
            problems.append(f"{where}: appears twice")
        for before in _prerequisites(action, graph, feedback):
            if before not in done and not _done_as_split(before, done):
                problems.append(f"{where}: comes before {before}, which it depends on")
        if feedback is not None and action.kind is Kind.F:
            key = (action.stage, feedback.groups[action.microbatch])
            if last_of_group.get(key, -1) > action.microbatch:
                problems.append(
                    f"{where}: runs after {action.stage}F{last_of_group[key]} of the same "
                    f"group {key[1]}; a stage runs a group's items in index order (they extend "
                    "its KV cache)"
                )
            last_of_group[key] = action.microbatch
        done.add(action)
    return problems


def _prerequisites(
    action: Action, graph: StageGraph, feedback: Feedback | None = None
) -> list[Action]:
    """Actions on the same rank that must come earlier."""
    stage, k = action.stage, action.microbatch
    rank = graph.rank_of(stage)
    local = [s for s in range(graph.num_stages) if graph.rank_of(s) == rank]
    if action.kind.is_send:
        producing = Kind.F if action.kind is Kind.SEND_F else Kind.B
        return [Action(stage, producing, k)]
    if action.kind.is_recv:
        return []
    needs: list[Action] = list(receives_needed(graph, action, feedback))
    if action.kind is Kind.F:
        needs += [Action(p, Kind.F, k) for p in graph.producers(stage) if p in local]
        source = None if feedback is None or stage != 0 else feedback.sources[k]
        if source is not None and graph.sink in local:  # the fed-back token, sampled here
            needs.append(Action(graph.sink, Kind.F, source))
    elif action.kind in (Kind.B, Kind.I):
        needs.append(Action(stage, Kind.F, k))
        needs += [Action(c, Kind.B, k) for c in graph.consumers(stage) if c in local]
    else:  # W
        needs.append(Action(stage, Kind.I, k))
    return needs


def _done_as_split(needed: Action, done: set[Action]) -> bool:
    """A B prerequisite is also met by the I (input-gradient half) of a split backward."""
    return needed.kind is Kind.B and Action(needed.stage, Kind.I, needed.microbatch) in done


def _completeness(
    counts: Counter[tuple[int, Kind, int]], graph: StageGraph, num_microbatches: int
) -> list[str]:
    """Every (stage, micro-batch) is run once forward and, when training, once backward."""
    problems: list[str] = []
    is_training = any(kind is not Kind.F for (_, kind, _) in counts)
    for stage in range(graph.num_stages):
        for k in range(num_microbatches):
            f, b = counts[(stage, Kind.F, k)], counts[(stage, Kind.B, k)]
            i, w = counts[(stage, Kind.I, k)], counts[(stage, Kind.W, k)]
            if f != 1:
                problems.append(f"stage {stage} micro-batch {k}: {f} forwards, expected 1")
            if is_training and not ((b == 1 and i == w == 0) or (b == 0 and i == w == 1)):
                problems.append(
                    f"stage {stage} micro-batch {k}: {b} B, {i} I and {w} W actions; "
                    "expected one B, or one I and one W"
                )
    return problems
