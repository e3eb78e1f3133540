"""Execute a Program on paper: a cost model and the runtime's blocking rules give a Timeline.

    timeline = simulate(build_program("1f1b", chain(4), 8), chain(4))   # unit costs
    print(conveyor.trace.render_grid(timeline), timeline.bubble_fraction)

``simulate`` runs any Program (any schedule, chain or DAG) on any cost model: ``UnitCost``
charges whole units of time (schedules are drawn and validated with it), and
``conveyor.planner.cost.ProfileCost`` charges what a profile measured, so a predicted
Timeline can be compared with a measured one on the same picture. ``Link`` (transfers between
two ranks) and ``Overheads`` (the runtime's costs per action) are the measured parts that
cost models share, training's (``conveyor.planner``) and decode's (``conveyor.inference.cost``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from conveyor.graph import StageGraph
from conveyor.program import (
    Action,
    Kind,
    Program,
    last_weight_actions,
    matching_recv,
    receives_needed,
)
from conveyor.trace import RECOMPUTE, REDUCE, WAIT, Event, Timeline

__all__ = [
    "CostModel",
    "DeadlockError",
    "Execution",
    "Link",
    "Overheads",
    "UnitCost",
    "execute",
    "simulate",
]


class DeadlockError(ValueError):
    """The program cannot finish: some rank waits for a message that is never sent."""


class CostModel(Protocol):
    """Durations the simulator charges, in seconds (or any unit, used consistently).

    A cost model may also define ``overhead(action)`` (time a send or a receive's posting
    takes on its own rank), ``wait(action)`` (collecting an arrived message),
    ``activation_bytes(stage, microbatch)`` (bytes held from a forward until its backward
    ends), ``activation_after_input(stage, microbatch)`` (bytes still held between a split
    backward's I and W), ``resident_bytes(stage)`` (bytes held while any micro-batch of the
    stage is) and ``recompute(action)`` (the part of a backward's time that recomputes its
    forward, shown as its own event); they default to zero. ``reduce(stage)`` is the time
    of the stage's data-parallel gradient reduction after its last B or W: in line, unless
    ``reduces_in_flight(split_backward)`` says it runs behind the rest of the step.
    """

    def compute(self, action: Action) -> float: ...

    def transfer(self, action: Action) -> float:
        """Time from a send's end until its message is available to the receiver."""
        ...


@dataclass(frozen=True)
class UnitCost:
    """Fixed costs per kind of action: by default F=1, B=2 (I=1 plus W=1), free transfers."""

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    latency: float = 0.0

    def compute(self, action: Action) -> float:
        return {
            Kind.F: self.forward,
            Kind.I: self.backward_input,
            Kind.W: self.backward_weight,
            Kind.B: self.backward_input + self.backward_weight,
        }[action.kind]

    def transfer(self, action: Action) -> float:
        return self.latency


@dataclass(frozen=True)
class Overheads:
    """Runtime costs per action beyond the model's own compute, in seconds."""

    forward: float = 0.0
    """A forward action: random-stream handling, bookkeeping, the stage call."""
    backward: float = 0.0
    send: float = 0.0
    """Issuing one message (its tensors go out in the background)."""
    recv: float = 0.0
    """Posting one receive."""
    wait: float = 0.0
    """Collecting a receive that has already arrived."""
    step: float = 0.0
    """Once per step: splitting the batch into micro-batches and finishing the step."""
    busy_call: float = 0.0
    """Extra seconds a send or a receive's posting takes per unit of its peer's busy share:
    while the peer computes, its transport threads get a core late, and the call waits for
    them (``conveyor.planner.calibrate.fit`` measures it; See Note [busy ranks])."""


@dataclass(frozen=True)
class Link:
    """Point-to-point transfers between two ranks: time = latency + bytes / bandwidth after
    the send call returns; the calls themselves cost time per byte on each side too."""

    latency: float
    bandwidth: float
    """Bytes per second."""
    send_per_byte: float = 0.0
    """Seconds per byte the sender spends in the send call (the transport copies data)."""
    recv_per_byte: float = 0.0
    """Seconds per byte the receiver spends posting and collecting a receive."""

    def transfer(self, num_bytes: int) -> float:
        return self.latency + num_bytes / self.bandwidth


# Note [execution semantics]:
# Each rank runs its actions in order. A send never blocks: its message becomes available at
# the send's end + transfer. A receive only posts a buffer, in order per (sender, receiver)
# pair; the k-th receive posted on a pair gets the k-th message sent on it. A compute action
# blocks until every message it needs has arrived (a wait, recorded as ``wait <receive>``),
# and at the end a rank waits until the messages it sent have arrived (``wait sends``). The
# runtime follows the same rules, so a Program that executes here cannot deadlock there.
def simulate(program: Program, graph: StageGraph, cost: CostModel | None = None) -> Timeline:
    """The predicted Timeline of one step of ``program`` on ``cost`` (default: UnitCost).

    Raises:
        DeadlockError: a rank waits forever, or a receive would get another action's message.
    """
    return execute(program, graph, cost).timeline


@dataclass(frozen=True)
class Execution:
    """A simulated step: its Timeline and each rank's totals (kept without recorded events)."""

    timeline: Timeline
    finish: tuple[float, ...]
    """Each rank's clock once its actions are done and its sends delivered."""
    busy: tuple[float, ...]
    """Time each rank spent computing."""
    peak_memory: tuple[int, ...]
    """Most activation bytes each rank held (0 unless the cost model counts them)."""

    @property
    def span(self) -> float:
        return max(self.finish, default=0.0)


def execute(
    program: Program, graph: StageGraph, cost: CostModel | None = None, *, record: bool = True
) -> Execution:
    """Run ``program`` against ``cost``: the Timeline and each rank's totals.

    With ``record=False`` the Timeline has no events, and searches run faster.

    Raises:
        DeadlockError: a rank waits forever, or a receive would get another action's message.
    """
    cost = cost or UnitCost()
    state = _Execution(program, graph, cost, record)
    timeline = state.run()
    if isinstance(cost, UnitCost):
        timeline.meta["time_unit"] = "units"
    return Execution(timeline, tuple(state.clock), tuple(state.busy), tuple(state.peak))


class _Execution:
    """State of one simulated step; See Note [execution semantics]."""

    def __init__(self, program: Program, graph: StageGraph, cost: CostModel, record: bool) -> None:
        self.program = program
        self.graph = graph
        self.cost = cost
        self.record = record
        num_ranks = len(program)
        self.clock = [0.0] * num_ranks
        self.pc = [0] * num_ranks
        self.held = [0] * num_ranks
        self.peak = [0] * num_ranks
        self.live = [0] * graph.num_stages
        self.sent: dict[tuple[int, int], list[tuple[Action, float]]] = {}
        self.posted: list[dict[Action, tuple[tuple[int, int], int]]] = [
            {} for _ in range(num_ranks)
        ]
        self.num_posted: dict[tuple[int, int], int] = {}
        self.last_arrival = [0.0] * num_ranks
        self.events: list[Event] = []
        self.busy = [0.0] * num_ranks
        self.overhead = getattr(cost, "overhead", None)
        self.wait_cost = getattr(cost, "wait", None)
        self.activation = getattr(cost, "activation_bytes", None)
        self.after_input = getattr(cost, "activation_after_input", None)
        self.resident = getattr(cost, "resident_bytes", None)
        self.recompute = getattr(cost, "recompute", None)
        self.reduce = getattr(cost, "reduce", None)
        self.reduced_after = [last_weight_actions(actions) for actions in program]
        in_flight = getattr(cost, "reduces_in_flight", None)
        split_backward = program.has_split_backward
        self.reduces_in_flight = bool(in_flight and in_flight(split_backward))
        """Reductions run behind the step (DDP's reducer), one at a time per rank."""
        self.in_flight: list[list[tuple[int, float]]] = [[] for _ in range(num_ranks)]
        """(stage, end) of each rank's reductions in flight."""

    def run(self) -> Timeline:
        program = self.program
        num_ranks = len(program)
        while True:
            progressed = False
            for rank in range(num_ranks):
                actions = program[rank]
                while self.pc[rank] < len(actions) and self.step(rank, actions[self.pc[rank]]):
                    self.pc[rank] += 1
                    progressed = True
            if all(self.pc[r] == len(program[r]) for r in range(num_ranks)):
                break
            if not progressed:
                blocked = [
                    f"rank {r} at {program[r][self.pc[r]]} (action {self.pc[r]})"
                    for r in range(num_ranks)
                    if self.pc[r] < len(program[r])
                ]
                raise DeadlockError(
                    "program deadlocks: "
                    + "; ".join(blocked)
                    + " wait for messages that are never sent"
                )
        _check_channels(self.sent, self.num_posted)
        for rank in range(num_ranks):  # the runtime waits for its sends before returning
            if self.last_arrival[rank] > self.clock[rank]:
                self.add(
                    Event(
                        rank,
                        f"{WAIT} sends",
                        self.clock[rank],
                        self.last_arrival[rank],
                        memory=self.held[rank],
                    )
                )
                self.clock[rank] = self.last_arrival[rank]
            self._wait_for_reductions(rank)
        return Timeline(
            num_ranks, sorted(self.events, key=lambda e: (e.rank, e.start)), "simulated"
        )

    def add(self, event: Event) -> None:
        if self.record:
            self.events.append(event)

    def step(self, rank: int, action: Action) -> bool:
        """Run ``rank``'s next action if it can; False if it is blocked."""
        clock = self.clock[rank]
        if action.kind.is_send:
            assert action.peer is not None
            end = clock + (self.overhead(action) if self.overhead else 0.0)
            arrival = end + self.cost.transfer(action)
            channel = (rank, self.graph.rank_of(action.peer))
            self.sent.setdefault(channel, []).append((action, arrival))
            self.last_arrival[rank] = max(self.last_arrival[rank], arrival)
            self.add(Event(rank, str(action), clock, end, memory=self.held[rank]))
            self.clock[rank] = end
            return True
        if action.kind.is_recv:
            assert action.peer is not None
            channel = (self.graph.rank_of(action.peer), rank)
            self.posted[rank][action] = (channel, self.num_posted.get(channel, 0))
            self.num_posted[channel] = self.num_posted.get(channel, 0) + 1
            end = clock + (self.overhead(action) if self.overhead else 0.0)
            if end > clock:
                self.add(Event(rank, str(action), clock, end, memory=self.held[rank]))
            self.clock[rank] = end
            return True
        return self.compute(rank, action)

    def compute(self, rank: int, action: Action) -> bool:
        arrivals = []
        for need in receives_needed(self.graph, action, self.program.feedback):
            if need not in self.posted[rank]:
                raise DeadlockError(
                    f"rank {rank}: {action} needs {need}, which is not posted before it"
                )
            channel, index = self.posted[rank][need]
            messages = self.sent.get(channel, [])
            if len(messages) <= index:
                return False
            message, arrival = messages[index]
            if matching_recv(message) != need:
                raise DeadlockError(
                    f"rank {rank}: receive {need} is matched with {message} from rank "
                    f"{channel[0]}; ranks must post receives in the order their peer sends"
                )
            arrivals.append((need, arrival))
        clock = self.clock[rank]
        for need, arrival in arrivals:  # the runtime collects each message in turn
            end = max(clock, arrival) + (self.wait_cost(need) if self.wait_cost else 0.0)
            if end > clock:
                self.add(Event(rank, f"{WAIT} {need}", clock, end, memory=self.held[rank]))
            clock = end
        end = clock + self.cost.compute(action)
        self._account(rank, action)
        if self.record:
            self.events.append(Event(rank, str(action), clock, end, memory=self.held[rank]))
            redo = self.recompute(action) if self.recompute else 0.0
            if redo > 0:  # a recomputed forward runs first in its backward
                forward = f"{action.stage}F{action.microbatch}"
                self.events.append(Event(rank, f"{RECOMPUTE} {forward}", clock, clock + redo))
        self.peak[rank] = max(self.peak[rank], self.held[rank])
        self.busy[rank] += end - clock
        self.clock[rank] = end
        stage = self.reduced_after[rank].get(self.pc[rank])
        seconds = 0.0 if stage is None or self.reduce is None else self.reduce(stage)
        if seconds > 0 and self.reduces_in_flight:
            assert stage is not None
            earlier = self.in_flight[rank]
            start = max(end, earlier[-1][1]) if earlier else end
            earlier.append((stage, start + seconds))
        elif seconds > 0:
            self.clock[rank] = end + seconds
            self.add(Event(rank, f"{REDUCE} {stage}", end, self.clock[rank]))
        return True

    def _wait_for_reductions(self, rank: int) -> None:
        """The runtime waits for the reductions in flight at the step's end, stage by stage."""
        for stage, end in self.in_flight[rank]:
            if end > self.clock[rank]:
                self.add(Event(rank, f"{REDUCE} {stage}", self.clock[rank], end))
                self.clock[rank] = end

    def _account(self, rank: int, action: Action) -> None:
        """Activation bytes, as the runtime's meter counts them: held from a forward's end
        until its backward ends; with a split backward, I keeps part of them until W."""
        if self.activation is None:
            return
        s, k = action.stage, action.microbatch
        after = self.after_input(s, k) if self.after_input is not None else 0
        if action.kind is Kind.F:
            self.held[rank] += self.activation(s, k)
            if self.live[s] == 0 and self.resident is not None:
                self.held[rank] += self.resident(s)
            self.live[s] += 1
            return
        if action.kind is Kind.I:
            self.held[rank] += after - self.activation(s, k)
            return
        self.held[rank] -= self.activation(s, k) if action.kind is Kind.B else after
        self.live[s] -= 1
        if self.live[s] == 0 and self.resident is not None:
            self.held[rank] -= self.resident(s)


def _check_channels(
    sent: dict[tuple[int, int], list[tuple[Action, float]]], num_posted: dict[tuple[int, int], int]
) -> None:
    for channel in sorted(set(sent) | set(num_posted)):
        num_sent, num_received = len(sent.get(channel, [])), num_posted.get(channel, 0)
        if num_sent != num_received:
            raise DeadlockError(
                f"rank {channel[0]} sends {num_sent} messages to rank "
                f"{channel[1]}, which posts {num_received} receives"
            )
