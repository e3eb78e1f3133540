"""Execute a Program on paper: a cost model and the runtime's blocking rules give a Timeline.

    graph, stage_units = layout(profile, split_units(profile.num_units, [3, 3]))
    program = build_program("1f1b", graph, num_microbatches=8)
    prediction = predict(program, graph, ProfileCost(profile, graph, stage_units, 4, 8))

``execute`` runs any Program (any schedule, chain or DAG) on any cost model; ``UnitCost``
charges whole units of time (schedules are drawn and validated with it), ``ProfileCost``
charges what ``conveyor.profile`` measured, so the predicted Timeline can be compared with a
measured one, on the same picture.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from conveyor.graph import MODEL_OUTPUT, Stage, StageGraph
from conveyor.schedule.program import Action, Kind, Program, matching_recv, receives_needed
from conveyor.trace import WAIT, Event, Timeline

if TYPE_CHECKING:  # conveyor.profile imports the splitter, which imports this module
    from conveyor.profile import Profile, UnitStats

__all__ = [
    "CostModel", "DeadlockError", "Prediction", "ProfileCost", "UnitCost", "execute", "layout",
    "predict", "split_units",
]

logger = logging.getLogger(__name__)

CheckpointMode = Literal["always", "except_last", "never"]

RNG_STATE_BYTES = int(torch.get_rng_state().numel())
"""Bytes of the CPU generator state that travels with every forward message."""


class DeadlockError(ValueError):
    """The program cannot finish: some rank waits for a message that is never sent."""


class CostModel(Protocol):
    """Durations the simulator charges, in seconds (or any unit, used consistently).

    A cost model may also define ``overhead(action)`` (time a send or a receive's posting
    takes on its own rank), ``wait(action)`` (collecting an arrived message),
    ``activation_bytes(stage, microbatch)`` (bytes held from a forward until its backward
    ends), ``activation_after_input(stage, microbatch)`` (bytes still held between a split
    backward's I and W) and ``resident_bytes(stage)`` (bytes held while any micro-batch of the
    stage is); they default to zero.
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
        return {Kind.F: self.forward, Kind.I: self.backward_input, Kind.W: self.backward_weight,
                Kind.B: self.backward_input + self.backward_weight}[action.kind]

    def transfer(self, action: Action) -> float:
        return self.latency


# See Note [execution semantics]
# Each rank runs its actions in order. A send never blocks: its message becomes available at
# the send's end + transfer. A receive only posts a buffer, in order per (sender, receiver)
# pair; the k-th receive posted on a pair gets the k-th message sent on it. A compute action
# blocks until every message it needs has arrived (a wait, recorded as ``wait <receive>``),
# and at the end a rank waits until the messages it sent have arrived (``wait sends``). The
# runtime follows the same rules, so a Program that executes here cannot deadlock there.
def execute(program: Program, graph: StageGraph, cost: CostModel | None = None, *,
            record: bool = True) -> Timeline:
    """Run ``program`` against ``cost`` and return the predicted Timeline.

    With ``record=False`` the Timeline has no events (``predict`` still gets step time,
    bubble and memory; searches run faster).

    Raises:
        DeadlockError: a rank waits forever, or a receive would get another action's message.
    """
    cost = cost or UnitCost()
    timeline = _Execution(program, graph, cost, record).run()
    if isinstance(cost, UnitCost):
        timeline.meta["time_unit"] = "units"
    return timeline


class _Execution:
    """State of one simulated step; see Note [execution semantics]."""

    def __init__(self, program: Program, graph: StageGraph, cost: CostModel,
                 record: bool) -> None:
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
            {} for _ in range(num_ranks)]
        self.num_posted: dict[tuple[int, int], int] = {}
        self.last_arrival = [0.0] * num_ranks
        self.events: list[Event] = []
        self.busy = [0.0] * num_ranks
        self.overhead = getattr(cost, "overhead", None)
        self.wait_cost = getattr(cost, "wait", None)
        self.activation = getattr(cost, "activation_bytes", None)
        self.after_input = getattr(cost, "activation_after_input", None)
        self.resident = getattr(cost, "resident_bytes", None)

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
                blocked = [f"rank {r} at {program[r][self.pc[r]]} (action {self.pc[r]})"
                           for r in range(num_ranks) if self.pc[r] < len(program[r])]
                raise DeadlockError("program deadlocks: " + "; ".join(blocked) +
                                    " wait for messages that are never sent")
        _check_channels(self.sent, self.num_posted)
        for rank in range(num_ranks):  # the runtime waits for its sends before returning
            if self.last_arrival[rank] > self.clock[rank]:
                self.add(Event(rank, f"{WAIT} sends", self.clock[rank], self.last_arrival[rank],
                               memory=self.held[rank]))
                self.clock[rank] = self.last_arrival[rank]
        return Timeline(num_ranks, sorted(self.events, key=lambda e: (e.rank, e.start)),
                        "simulated")

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
        for need in receives_needed(self.graph, action):
            if need not in self.posted[rank]:
                raise DeadlockError(f"rank {rank}: {action} needs {need}, which is not "
                                    "posted before it")
            channel, index = self.posted[rank][need]
            messages = self.sent.get(channel, [])
            if len(messages) <= index:
                return False
            message, arrival = messages[index]
            if matching_recv(message) != need:
                raise DeadlockError(
                    f"rank {rank}: receive {need} is matched with {message} from rank "
                    f"{channel[0]}; ranks must post receives in the order their peer sends")
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
        self.peak[rank] = max(self.peak[rank], self.held[rank])
        self.busy[rank] += end - clock
        self.clock[rank] = end
        return True

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


def _check_channels(sent: dict[tuple[int, int], list[tuple[Action, float]]],
                    num_posted: dict[tuple[int, int], int]) -> None:
    for channel in sorted(set(sent) | set(num_posted)):
        num_sent, num_received = len(sent.get(channel, [])), num_posted.get(channel, 0)
        if num_sent != num_received:
            raise DeadlockError(f"rank {channel[0]} sends {num_sent} messages to rank "
                                f"{channel[1]}, which posts {num_received} receives")


# -- costs from a profile ----------------------------------------------------------------------


def split_units(num_units: int, balance: Sequence[int]) -> list[list[int]]:
    """Unit indices of each stage of a chain split into ``balance`` consecutive counts."""
    if any(b < 1 for b in balance) or sum(balance) != num_units:
        raise ValueError(f"balance {list(balance)} covers {sum(balance)} units but the profile "
                         f"has {num_units}; pass positive counts that sum to {num_units}")
    starts = [sum(balance[:i]) for i in range(len(balance))]
    return [list(range(a, a + b)) for a, b in zip(starts, balance, strict=True)]


def layout(profile: Profile, stage_units: Sequence[Sequence[int]],
           placement: Sequence[int] | None = None) -> tuple[StageGraph, list[list[int]]]:
    """The StageGraph (no modules) of a unit-to-stage assignment, and the assignment.

    A value crosses from stage i to stage j when a unit of j consumes a unit of i; stages
    must be in topological order (a unit's producers in its stage or an earlier one).
    """
    units = [list(s) for s in stage_units]
    stage_of = _stage_of(profile, units)
    names = [u.name for u in profile.units]
    output_unit = _output_unit(profile)
    consumers = _consumers(profile)
    stages = []
    for index, members in enumerate(units):
        inputs: list[str] = []
        for u in members:
            for p in profile.units[u].inputs:
                name = "input" if p < 0 else names[p]
                if (p < 0 or stage_of[p] != index) and name not in inputs:
                    if p >= 0 and stage_of[p] > index:
                        raise ValueError(f"unit {names[u]} in stage {index} consumes "
                                         f"{names[p]} of the later stage {stage_of[p]}; "
                                         "stages must follow the model's order")
                    inputs.append(name)
        outputs = [names[u] for u in members
                   if any(stage_of[c] != index for c in consumers[u])]
        if output_unit in members:
            outputs.append(MODEL_OUTPUT)
        rank = index if placement is None else placement[index]
        stages.append(Stage(index, rank, tuple(inputs), tuple(outputs)))
    return StageGraph(tuple(stages), ("input",)), units


def _stage_of(profile: Profile, stage_units: Sequence[Sequence[int]]) -> list[int]:
    stage_of = [-1] * profile.num_units
    for s, members in enumerate(stage_units):
        for u in members:
            if not 0 <= u < profile.num_units or stage_of[u] != -1:
                raise ValueError(f"unit {u} is assigned twice or is not one of the profile's "
                                 f"{profile.num_units} units")
            stage_of[u] = s
    missing = [profile.units[u].name for u in range(profile.num_units) if stage_of[u] == -1]
    if missing:
        raise ValueError(f"units {missing[:5]} belong to no stage; assign every unit once")
    return stage_of


def _consumers(profile: Profile) -> list[list[int]]:
    table: list[list[int]] = [[] for _ in profile.units]
    for u, unit in enumerate(profile.units):
        for p in unit.inputs:
            if p >= 0 and u not in table[p]:
                table[p].append(u)
    return table


def _output_unit(profile: Profile) -> int:
    consumers = _consumers(profile)
    unused = [u for u in range(profile.num_units) if not consumers[u]]
    return unused[-1] if unused else profile.num_units - 1


class ProfileCost:
    """Costs of one split of a profiled model: per-stage sums of its units' measured costs,
    the runtime's per-action overheads, transfers over the measured link, and activation
    memory as ``conveyor.memory.ActivationMeter`` counts it.

    Args:
        stage_units: unit indices of each stage of ``graph`` (see ``layout``).
        microbatch_size: samples per micro-batch (may be fractional: batch / micro-batches).
        checkpoint: activation checkpointing, one mode or one per stage (runtime semantics:
            a recomputed stage keeps only its inputs and outputs and reruns its forward in
            backward; 'except_last' keeps the last micro-batch).
    """

    def __init__(self, profile: Profile, graph: StageGraph,
                 stage_units: Sequence[Sequence[int]], microbatch_size: float,
                 num_microbatches: int,
                 checkpoint: CheckpointMode | Sequence[CheckpointMode] = "never") -> None:
        if len(stage_units) != graph.num_stages:
            raise ValueError(f"stage_units lists {len(stage_units)} stages but the graph has "
                             f"{graph.num_stages}")
        self.profile = profile
        self.graph = graph
        self.num_microbatches = num_microbatches
        self.busy_share: dict[int, float] = {}
        """Each rank's share of the step spent computing (set by ``predict``)."""
        self.microbatch_size = microbatch_size
        self.modes = ([checkpoint] * graph.num_stages if isinstance(checkpoint, str)
                      else list(checkpoint))
        if len(self.modes) != graph.num_stages:
            raise ValueError(f"checkpoint lists {len(self.modes)} modes for "
                             f"{graph.num_stages} stages; give one per stage")
        stats = profile.at(microbatch_size)
        loss_forward, loss_backward = profile.loss_at(microbatch_size)
        stage_of = _stage_of(profile, stage_units)
        consumers = _consumers(profile)
        output_unit = _output_unit(profile)
        self._forward, self._backward, self._input, self._weight = [], [], [], []
        self._kept, self._recomputed, self._resident = [], [], []
        self._after_input, self._after_input_recomputed = [], []
        for s, members in enumerate(stage_units):
            is_sink = output_unit in members
            self._forward.append(sum(stats[u].forward for u in members) +
                                 (loss_forward if is_sink else 0.0))
            tail = loss_backward if is_sink else 0.0
            self._backward.append(sum(stats[u].backward for u in members) + tail)
            # a stage none of whose inputs needs a gradient (the first) has no input path: its
            # I has nothing to do, and its W is the whole backward (see conveyor.backward)
            takes_gradients = any(p >= 0 and stage_of[p] != s
                                  for u in members for p in profile.units[u].inputs)
            if takes_gradients:
                self._input.append(sum(stats[u].backward_input for u in members) + tail)
                self._weight.append(sum(stats[u].backward_weight for u in members))
            else:
                self._input.append(0.0)
                self._weight.append(self._backward[-1])
            remote = {p for u in members for p in profile.units[u].inputs
                      if p >= 0 and stage_of[p] != s
                      and graph.rank_of(stage_of[p]) != graph.rank_of(s)}
            received = sum(stats[p].message_bytes for p in remote)
            outputs = sum(stats[u].output_bytes for u in members
                          if u == output_unit or any(stage_of[c] != s for c in consumers[u]))
            inner = sum(stats[u].saved_bytes for u in members) + sum(
                stats[u].output_bytes for u in members
                if u != output_unit and not any(stage_of[c] != s for c in consumers[u])
                and _is_kept(profile, stats, u, consumers[u]))
            self._kept.append(received + outputs + inner)
            self._recomputed.append(received + outputs)
            # after I: what autograd saved (the stage's own saves, and the inputs and outputs
            # it saved) and the gradients W starts from
            # without an input path, W starts from the gradients of the stage's outputs
            weight_grads = (sum(stats[u].weight_grad_bytes for u in members) if takes_gradients
                            else sum(stats[u].message_bytes for u in members
                                     if any(stage_of[c] != s for c in consumers[u])))
            saved = sum(stats[u].saved_bytes for u in members) + sum(
                stats[u].output_bytes for u in members
                if _is_kept(profile, stats, u, [c for c in consumers[u] if stage_of[c] == s]))
            saved += sum(stats[p].message_bytes for p in remote if _is_kept(
                profile, stats, p, [c for c in consumers[p] if stage_of[c] == s], own=False))
            self._after_input.append(saved + weight_grads)
            # recomputed: checkpointing saves the stage's inputs (through autograd) for I
            self._after_input_recomputed.append(received + weight_grads)
            # the runtime's micro-batches are views of the batch: a stage holds the whole batch
            # of each model input it takes while any of its micro-batches is alive
            taken = {-1 - p for u in members for p in profile.units[u].inputs if p < 0}
            per_sample = (sum(profile.model_input_bytes[i] for i in taken)
                          if len(profile.model_input_bytes) > max(taken, default=-1)
                          else profile.input_bytes_per_sample if taken else 0)
            self._resident.append(round(per_sample * microbatch_size * num_microbatches))
        self._edge_bytes: dict[tuple[int, int], int] = {}
        for u in range(profile.num_units):
            for d in {stage_of[c] for c in consumers[u] if stage_of[c] != stage_of[u]}:
                key = (stage_of[u], d)
                self._edge_bytes[key] = self._edge_bytes.get(key, 0) + stats[u].message_bytes
        self._static = [0] * graph.num_ranks
        for s, members in enumerate(stage_units):
            params = sum(profile.units[u].param_bytes for u in members)
            trainable = sum(profile.units[u].trainable_bytes for u in members)
            self._static[graph.rank_of(s)] += round(
                params + trainable * (1 + profile.optimizer_state_per_param))

    def _is_recomputed(self, s: int, k: int) -> bool:
        mode = self.modes[s]
        return mode == "always" or (mode == "except_last" and k < self.num_microbatches - 1)

    def compute(self, action: Action) -> float:
        s, k, overheads = action.stage, action.microbatch, self.profile.overheads
        redo = self._forward[s] if self._is_recomputed(s, k) else 0.0
        if action.kind is Kind.F:
            return self._forward[s] + overheads.forward
        if action.kind is Kind.B:
            return self._backward[s] + redo + overheads.backward
        if action.kind is Kind.I:
            return self._input[s] + redo + overheads.backward
        if action.kind is Kind.W:
            return self._weight[s] + overheads.backward
        raise ValueError(f"{action} is not a compute action")

    def message_bytes(self, action: Action) -> int:
        """Bytes a send or receive carries: the edge's values (and, forward, the RNG state)."""
        assert action.peer is not None
        forward = action.kind in (Kind.SEND_F, Kind.RECV_F)
        if action.kind.is_send:
            edge = (action.stage, action.peer) if forward else (action.peer, action.stage)
        else:
            edge = (action.peer, action.stage) if forward else (action.stage, action.peer)
        return self._edge_bytes.get(edge, 0) + (RNG_STATE_BYTES if forward else 0)

    def transfer(self, action: Action) -> float:
        link = self.profile.link
        return 0.0 if link is None else link.transfer(self.message_bytes(action))

    def overhead(self, action: Action) -> float:
        overheads, link = self.profile.overheads, self.profile.link
        assert action.peer is not None  # Note [busy ranks]: the peer's share, not its own
        busy = overheads.busy_call * self.busy_share.get(self.graph.rank_of(action.peer), 0.0)
        if action.kind.is_send:
            per_byte = 0.0 if link is None else link.send_per_byte
            return overheads.send + per_byte * self.message_bytes(action) + busy
        per_byte = 0.0 if link is None else link.recv_per_byte
        return overheads.recv + per_byte * self.message_bytes(action) + busy

    def wait(self, action: Action) -> float:
        return self.profile.overheads.wait

    def activation_bytes(self, stage: int, microbatch: int) -> int:
        if self._is_recomputed(stage, microbatch):
            return self._recomputed[stage]
        return self._kept[stage]

    def stage_work(self, stage: int) -> float:
        """Seconds of compute a stage does in one step: every micro-batch's forward and
        backward, recomputation included (split backward costs about the same)."""
        overheads, m = self.profile.overheads, self.num_microbatches
        redone = sum(self._is_recomputed(stage, k) for k in range(m))
        return (m * (self._forward[stage] + self._backward[stage] + overheads.forward +
                     overheads.backward) + redone * self._forward[stage])

    def activation_after_input(self, stage: int, microbatch: int) -> int:
        if self._is_recomputed(stage, microbatch):
            return self._after_input_recomputed[stage]
        return self._after_input[stage]

    def resident_bytes(self, stage: int) -> int:
        return self._resident[stage]

    def static_bytes(self, rank: int) -> int:
        """Parameters, gradients and optimizer state ``rank`` holds."""
        return self._static[rank]


def _is_kept(profile: Profile, stats: Sequence[UnitStats], u: int,
             consumers: list[int], own: bool = True) -> bool:
    """Whether autograd keeps unit ``u``'s output for backward: ``u`` itself (with ``own``) or
    one of ``consumers`` saves it."""
    if own and stats[u].saves_output:
        return True
    for c in consumers:
        saves = stats[c].saves_input
        if any(saves[i] for i, p in enumerate(profile.units[c].inputs)
               if p == u and i < len(saves)):
            return True
    return False


@dataclass(frozen=True)
class Prediction:
    """What the simulator predicts for one step of one configuration."""

    timeline: Timeline
    step_time: float
    """Seconds per step: the timeline's span plus the runtime's per-step overhead."""
    bubble_fraction: float
    peak_activation: tuple[int, ...]
    """Per rank: most activation bytes held at once."""
    static_memory: tuple[int, ...]
    """Per rank: parameters, gradients and optimizer state."""

    @property
    def total_memory(self) -> tuple[int, ...]:
        return tuple(a + b for a, b in zip(self.peak_activation, self.static_memory, strict=True))


def predict(program: Program, graph: StageGraph, cost: ProfileCost,
            record: bool = True) -> Prediction:
    """Simulate ``program`` with profiled costs: the Timeline, step time, memory per rank.

    With ``record=False`` the Timeline is left empty (faster); the figures are the same.
    """
    if cost.profile.overheads.busy_call:  # See Note [busy ranks]: simulate again, knowing them
        first = _Execution(program, graph, cost, False)
        first.run()
        span = max(first.clock) or 1.0
        cost.busy_share = {r: busy / span for r, busy in enumerate(first.busy)}
    execution = _Execution(program, graph, cost, record)
    timeline = execution.run()
    timeline.meta.update({"microbatches": program.num_microbatches, "model": cost.profile.model})
    span = max(execution.clock)
    bubble = 1.0 - sum(execution.busy) / (span * len(program)) if span else 0.0
    return Prediction(timeline, span + cost.profile.overheads.step, bubble,
                      tuple(execution.peak),
                      tuple(cost.static_bytes(r) for r in range(graph.num_ranks)))
