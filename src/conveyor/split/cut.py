"""Cut a weighted dataflow DAG into pipeline stages: pure search behind ``split.auto_split``.

nodes = DataflowGraph(costs=[4, 4, 4, 4, 1], inputs=[[], [0], [], [2], [1, 3]])
plan = best_cut(nodes, num_stages=3, num_microbatches=4)
plan.stage_of  # [0, 0, 1, 1, 2]: the two branches on stages 0 and 1, the join on 2
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from conveyor.graph import MODEL_OUTPUT, Stage, StageGraph
from conveyor.program import Action, Kind
from conveyor.schedule.chain import one_f_one_b
from conveyor.simulator import simulate

__all__ = ["Cut", "DataflowGraph", "best_cut", "branch_order", "cut_in_order"]


_TOLERANCE = 0.02
"""Relative difference in cost or step time below which estimates count as equal."""


@dataclass(frozen=True)
class DataflowGraph:
    """A model's computation as plain data: node i consumes the outputs of ``inputs[i]``.

    Nodes are listed in a topological order (every input index is smaller than the node's).
    """

    costs: Sequence[float]
    """Forward cost of each node (FLOPs, seconds, ... any unit, used consistently)."""
    inputs: Sequence[Sequence[int]]
    sizes: Sequence[float] | None = None
    """Bytes of each node's output (what a cut after it would send); default 1 each."""
    units: Sequence[Hashable] | None = None
    """A cut may fall only between nodes of different units (e.g. whole submodules);
    default: between any two nodes."""
    byte_cost: float = 0.0
    """Cost of receiving one unit of size (a byte), added to the receiving stage's cost: how
    much compute a transfer is worth. 0 uses sizes only to break ties."""
    together: Sequence[Sequence[int]] = ()
    """Groups of nodes that one stage must hold (the users of a shared weight); the stage
    then also holds every node between them in the order cut."""

    def __post_init__(self) -> None:
        if len(self.inputs) != len(self.costs):
            raise ValueError(
                f"{len(self.costs)} costs for {len(self.inputs)} nodes; give one cost per node"
            )
        for node, producers in enumerate(self.inputs):
            if any(not 0 <= p < node for p in producers):
                raise ValueError(
                    f"node {node} takes inputs {list(producers)}; nodes must be "
                    "in topological order (inputs before the node)"
                )


@dataclass(frozen=True)
class Cut:
    """Stages as contiguous runs of a topological order, with the estimates that chose them."""

    order: tuple[int, ...]
    """Node indices in the order the stages cut (position i holds node order[i])."""
    starts: tuple[int, ...]
    """Position where each stage starts."""
    stage_of: tuple[int, ...]
    """Stage of each node, by node index."""
    stage_costs: tuple[float, ...]
    """Each stage's cost: its nodes' plus ``byte_cost`` per byte it receives."""
    depth: int
    """Stages on the longest path of the stage graph."""
    sent: float
    """Bytes (or values) crossing between stages per micro-batch."""
    step_time: float
    """Simulated 1F1B step time (forward = stage cost, backward = twice that)."""


@dataclass(frozen=True)
class _Partial:
    """Stages chosen so far: their starts and depths, the worst cost and the bytes sent."""

    cost: float
    sent: float
    starts: tuple[int, ...]
    depths: tuple[int, ...]
    stage_costs: tuple[float, ...]
    """Each stage's compute plus what it receives, times ``byte_cost``."""


def branch_order(inputs: Sequence[Sequence[int]]) -> list[int]:
    """A topological order that finishes each input's whole branch before the next one.

    Depth-first from the nodes nobody consumes, inputs in argument order: the two towers of
    ``head(a(x), b(y))`` come out as all of ``a``, then all of ``b``, then ``head``, so
    contiguous runs of this order can hold independent branches.
    """
    users = [0] * len(inputs)
    for producers in inputs:
        for p in producers:
            users[p] += 1
    order: list[int] = []
    seen: set[int] = set()
    for root in (n for n in range(len(inputs)) if users[n] == 0):
        stack: list[tuple[int, int]] = [(root, 0)]
        while stack:
            node, next_input = stack.pop()
            if next_input == 0:
                if node in seen:
                    continue
                seen.add(node)
            producers = inputs[node]
            while next_input < len(producers) and producers[next_input] in seen:
                next_input += 1
            if next_input < len(producers):
                stack.append((node, next_input + 1))
                stack.append((producers[next_input], 0))
            else:
                order.append(node)
    return order


def best_cut(graph: DataflowGraph, num_stages: int, num_microbatches: int = 4) -> Cut:
    """The fastest cut (by simulated step time) over the given order and ``branch_order``."""
    natural = list(range(len(graph.costs)))
    candidates = [cut_in_order(graph, natural, num_stages, num_microbatches)]
    branches = branch_order(graph.inputs)
    if branches != natural:
        # the other order may fail, e.g. when only the natural one keeps shared weights apart
        with contextlib.suppress(ValueError):
            candidates.append(cut_in_order(graph, branches, num_stages, num_microbatches))
    return _fastest(candidates)


def cut_in_order(
    graph: DataflowGraph, order: Sequence[int], num_stages: int, num_microbatches: int = 4
) -> Cut:
    """Best cut of ``order`` into ``num_stages`` contiguous runs.

    A dynamic program over cut positions keeps, for each position, number of stages and
    depth so far, the run with the smallest worst-stage cost (then fewest bytes sent); the
    complete candidates are then compared by simulated 1F1B step time, which trades the
    worst stage against the graph's depth (``(m + depth - 1) x worst stage``).

    Raises:
        ValueError: fewer places to cut than ``num_stages - 1``.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    position = {node: i for i, node in enumerate(order)}
    if sorted(position) != list(range(len(graph.costs))):
        raise ValueError("order must list every node once")
    inputs = [sorted(position[p] for p in graph.inputs[node]) for node in order]
    if any(p >= i for i, producers in enumerate(inputs) for p in producers):
        raise ValueError("order is not topological: a node comes before one of its inputs")
    costs = [float(graph.costs[node]) for node in order]
    sizes = [1.0 if graph.sizes is None else float(graph.sizes[node]) for node in order]
    bounds = _cut_positions(graph, order, position)
    if len(bounds) - 1 < num_stages:
        raise ValueError(
            f"cannot cut {len(order)} nodes into {num_stages} stages: there are only "
            f"{len(bounds) - 2} places to cut (whole modules stay in one stage, and so do the "
            "users of a shared weight); ask for fewer stages"
        )
    finals = _search(costs, inputs, sizes, bounds, num_stages, graph.byte_cost)
    cuts = [_finish(order, inputs, p, num_microbatches) for p in finals]
    return _fastest(cuts)


def _fastest(cuts: Sequence[Cut]) -> Cut:
    """Shortest step; among steps within ``_TOLERANCE`` of it, the one that sends least."""
    shortest = min(c.step_time for c in cuts)
    close = [c for c in cuts if c.step_time <= shortest * (1 + _TOLERANCE)]
    return min(close, key=lambda c: (c.sent, c.step_time))


def _cut_positions(
    graph: DataflowGraph, order: Sequence[int], position: dict[int, int]
) -> list[int]:
    """Positions where a stage may start: 0, unit boundaries outside ``together``, the end."""
    blocked: set[int] = set()
    for group in graph.together:
        places = [position[node] for node in group]
        blocked.update(range(min(places) + 1, max(places) + 1))
    bounds = [0]
    for i in range(1, len(order)):
        same_unit = graph.units is not None and graph.units[order[i]] == graph.units[order[i - 1]]
        if not same_unit and i not in blocked:
            bounds.append(i)
    bounds.append(len(order))
    return bounds


def _search(
    costs: list[float],
    inputs: list[list[int]],
    sizes: list[float],
    bounds: list[int],
    num_stages: int,
    byte_cost: float,
) -> list[_Partial]:
    """The DP of ``cut_in_order``; returns the complete partials, one per final depth."""
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    last = len(bounds) - 1
    # states[b][j][depth]: best partial with j stages ending at bounds[b]
    states: list[list[dict[int, _Partial]]] = [[{} for _ in range(num_stages + 1)] for _ in bounds]
    states[0][0][0] = _Partial(0.0, 0.0, (), (), ())
    for b in range(last):
        for j in range(num_stages):
            for partial in states[b][j].values():
                _extend(partial, b, j, bounds, prefix, inputs, sizes, byte_cost, num_stages, states)
    return list(states[last][num_stages].values())


def _extend(
    partial: _Partial,
    b: int,
    j: int,
    bounds: list[int],
    prefix: list[float],
    inputs: list[list[int]],
    sizes: list[float],
    byte_cost: float,
    num_stages: int,
    states: list[list[dict[int, _Partial]]],
) -> None:
    """Try every end for stage ``j`` starting at ``bounds[b]``."""
    start, last = bounds[b], len(bounds) - 1
    starts = (*partial.starts, start)
    depth_in, sent, seen = 0, partial.sent, set()
    for b2 in range(b + 1, last + 1):
        for node in range(bounds[b2 - 1], bounds[b2]):
            for p in inputs[node]:
                if p < start and p not in seen:
                    seen.add(p)
                    sent += sizes[p]
                    depth_in = max(depth_in, partial.depths[bisect.bisect_right(starts, p) - 1])
        remaining = num_stages - j - 1
        if (b2 == last) != (remaining == 0) or last - b2 < remaining:
            continue
        depth = depth_in + 1
        cost = prefix[bounds[b2]] - prefix[start] + byte_cost * (sent - partial.sent)
        candidate = _Partial(
            max(partial.cost, cost),
            sent,
            starts,
            (*partial.depths, depth),
            (*partial.stage_costs, cost),
        )
        key = max(candidate.depths)
        known = states[b2][j + 1].get(key)
        if known is None or _better(candidate.cost, candidate.sent, known.cost, known.sent):
            states[b2][j + 1][key] = candidate


def _better(cost: float, sent: float, other_cost: float, other_sent: float) -> bool:
    """Lower cost wins; costs within ``_TOLERANCE`` of each other count as equal and the one
    that sends less wins (a cut beside a cheap operation should not ship two tensors)."""
    if cost < other_cost * (1 - _TOLERANCE):
        return True
    return cost <= other_cost * (1 + _TOLERANCE) and sent < other_sent


def _finish(
    order: Sequence[int], inputs: list[list[int]], partial: _Partial, num_microbatches: int
) -> Cut:
    """A Cut with its simulated step time."""
    num_stages = len(partial.starts)
    stage_costs = partial.stage_costs
    stage_at = [bisect.bisect_right(partial.starts, i) - 1 for i in range(len(order))]
    stage_of = [0] * len(order)
    for i, node in enumerate(order):
        stage_of[node] = stage_at[i]
    edges = {
        (stage_at[p], stage_at[i])
        for i in range(len(order))
        for p in inputs[i]
        if stage_at[p] != stage_at[i]
    }
    topology = _topology(num_stages, edges)
    program = one_f_one_b(topology, num_microbatches)
    timeline = simulate(program, topology, _StageCost(stage_costs))
    return Cut(
        tuple(order),
        partial.starts,
        tuple(stage_of),
        stage_costs,
        max(partial.depths),
        partial.sent,
        timeline.step_time,
    )


def _topology(num_stages: int, edges: set[tuple[int, int]]) -> StageGraph:
    """A module-less stage graph with the given stage-to-stage edges, one stage per rank."""
    stages = []
    for s in range(num_stages):
        inputs = tuple(f"s{src}" for src in range(s) if (src, s) in edges) or ("input",)
        outputs = (f"s{s}",) + ((MODEL_OUTPUT,) if s == num_stages - 1 else ())
        stages.append(Stage(s, s, inputs, outputs))
    return StageGraph(tuple(stages))


@dataclass(frozen=True)
class _StageCost:
    """Forward = the stage's cost, backward = twice that, free transfers."""

    stage_costs: tuple[float, ...]

    def compute(self, action: Action) -> float:
        cost = self.stage_costs[action.stage]
        return cost if action.kind is Kind.F else 2 * cost

    def transfer(self, action: Action) -> float:
        return 0.0
