"""Execute a Program on paper: a cost model and the runtime's blocking rules give a Timeline."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from conveyor.graph import StageGraph
from conveyor.schedule.program import Action, Kind, Program, matching_recv, receives_needed
from conveyor.trace import Event, Timeline

__all__ = ["CostModel", "DeadlockError", "UnitCost", "execute"]

logger = logging.getLogger(__name__)


class DeadlockError(ValueError):
    """The program cannot finish: some rank waits for a message that is never sent."""


class CostModel(Protocol):
    """Durations the simulator charges, in seconds (or any unit, used consistently)."""

    def compute(self, action: Action) -> float: ...

    def transfer(self, action: Action) -> float:
        """Time from a send's start until its message is available to the receiver."""
        ...


@dataclass(frozen=True)
class UnitCost:
    """Fixed costs per kind of action: by default F=1, B=2 (I=1 plus W=1), free transfers."""

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    latency: float = 0.0

    def compute(self, action: Action) -> float:
        return {Kind.F: self.forward, Kind.I: self.backward_input, Kind.W: self.backward_weight,
                Kind.B: self.backward_input + self.backward_weight}[action.kind]

    def transfer(self, action: Action) -> float:
        return self.latency


# See Note [execution semantics]
# Each rank runs its actions in order. A send never blocks: its message becomes available at
# send time + transfer. A receive only posts a buffer, in order per (sender, receiver) pair;
# the k-th receive posted on a pair gets the k-th message sent on it. A compute action blocks
# until every message it needs has arrived. The runtime follows the same rules, so a Program
# that executes here cannot deadlock there.
def execute(program: Program, graph: StageGraph, cost: CostModel | None = None) -> Timeline:
    """Run ``program`` against ``cost`` and return the predicted Timeline.

    Raises:
        DeadlockError: a rank waits forever, or a receive would get another action's message.
    """
    cost = cost or UnitCost()
    num_ranks = len(program)
    clock = [0.0] * num_ranks
    pc = [0] * num_ranks
    sent: dict[tuple[int, int], list[tuple[Action, float]]] = {}
    posted: list[dict[Action, tuple[tuple[int, int], int]]] = [{} for _ in range(num_ranks)]
    num_posted: dict[tuple[int, int], int] = {}
    events: list[Event] = []

    def step(rank: int) -> bool:
        """Run ``rank``'s next action if it can; False if it is blocked."""
        action = program[rank][pc[rank]]
        if action.kind.is_send:
            assert action.peer is not None
            channel = (rank, graph.rank_of(action.peer))
            sent.setdefault(channel, []).append((action, clock[rank] + cost.transfer(action)))
            events.append(Event(rank, str(action), clock[rank], clock[rank]))
        elif action.kind.is_recv:
            assert action.peer is not None
            channel = (graph.rank_of(action.peer), rank)
            posted[rank][action] = (channel, num_posted.get(channel, 0))
            num_posted[channel] = num_posted.get(channel, 0) + 1
        else:
            ready = clock[rank]
            for need in receives_needed(graph, action):
                if need not in posted[rank]:
                    raise DeadlockError(f"rank {rank}: {action} needs {need}, which is not "
                                        "posted before it")
                channel, index = posted[rank][need]
                messages = sent.get(channel, [])
                if len(messages) <= index:
                    return False
                message, arrival = messages[index]
                if matching_recv(message) != need:
                    raise DeadlockError(
                        f"rank {rank}: receive {need} is matched with {message} from rank "
                        f"{channel[0]}; ranks must post receives in the order their peer sends")
                ready = max(ready, arrival)
            end = ready + cost.compute(action)
            events.append(Event(rank, str(action), ready, end))
            clock[rank] = end
        pc[rank] += 1
        return True

    while True:
        progressed = False
        for rank in range(num_ranks):
            while pc[rank] < len(program[rank]) and step(rank):
                progressed = True
        if all(pc[r] == len(program[r]) for r in range(num_ranks)):
            break
        if not progressed:
            blocked = [f"rank {r} at {program[r][pc[r]]} (action {pc[r]})"
                       for r in range(num_ranks) if pc[r] < len(program[r])]
            raise DeadlockError("program deadlocks: " + "; ".join(blocked) +
                                " wait for messages that are never sent")
    _check_channels(sent, num_posted)
    return Timeline(num_ranks, sorted(events, key=lambda e: (e.rank, e.start)), "simulated")


def _check_channels(sent: dict[tuple[int, int], list[tuple[Action, float]]],
                    num_posted: dict[tuple[int, int], int]) -> None:
    for channel in sorted(set(sent) | set(num_posted)):
        num_sent, num_received = len(sent.get(channel, [])), num_posted.get(channel, 0)
        if num_sent != num_received:
            raise DeadlockError(f"rank {channel[0]} sends {num_sent} messages to rank "
                                f"{channel[1]}, which posts {num_received} receives")
