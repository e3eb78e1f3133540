"""Costs of a profiled model for the simulator: one split's actions, transfers and memory.

    graph, stage_units = layout(profile, split_units(profile.num_units, [3, 3]))
    program = build_program("1f1b", graph, num_microbatches=8)
    prediction = predict(program, graph, ProfileCost(profile, graph, stage_units, 4, 8))

``ProfileCost`` charges what ``conveyor.planner.profile`` measured (plus the runtime's
per-action overheads and the link between ranks), and counts activation memory as the
runtime's meter does, so a predicted Timeline can be set beside a measured one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from conveyor.graph import MODEL_OUTPUT, Stage, StageGraph
from conveyor.parallel.data_parallel import reduces_in_flight
from conveyor.planner.profile import Link, Profile, UnitStats
from conveyor.program import Action, Kind, Program
from conveyor.runtime.recompute import RecomputeMode, is_recomputed
from conveyor.simulator import execute
from conveyor.trace import Timeline

__all__ = ["Prediction", "ProfileCost", "Replicas", "layout", "predict", "split_units"]

RNG_STATE_BYTES = int(torch.get_rng_state().numel())
"""Bytes of the CPU generator state that travels with every forward message."""


def split_units(num_units: int, balance: Sequence[int]) -> list[list[int]]:
    """Unit indices of each stage of a chain split into ``balance`` consecutive counts."""
    if any(b < 1 for b in balance) or sum(balance) != num_units:
        raise ValueError(
            f"balance {list(balance)} covers {sum(balance)} units but the profile "
            f"has {num_units}; pass positive counts that sum to {num_units}"
        )
    starts = [sum(balance[:i]) for i in range(len(balance))]
    return [list(range(a, a + b)) for a, b in zip(starts, balance, strict=True)]


def layout(
    profile: Profile, stage_units: Sequence[Sequence[int]], placement: Sequence[int] | None = None
) -> tuple[StageGraph, list[list[int]]]:
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
                        raise ValueError(
                            f"unit {names[u]} in stage {index} consumes "
                            f"{names[p]} of the later stage {stage_of[p]}; "
                            "stages must follow the model's order"
                        )
                    inputs.append(name)
        outputs = [names[u] for u in members if any(stage_of[c] != index for c in consumers[u])]
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
                raise ValueError(
                    f"unit {u} is assigned twice or is not one of the profile's "
                    f"{profile.num_units} units"
                )
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


@dataclass(frozen=True)
class Replicas:
    """Data-parallel replicas of a pipeline, as what they cost each rank per step.

    Gradients are reduced over the replicas once per step, from each stage's last B or W on
    (conveyor.parallel.data_parallel: behind the rest of the step, or in line with FSDP or
    a split backward), by a ring all-reduce: 2(d-1) steps that each move
    1/d of the bytes over ``link`` (``conveyor.planner.measure_allreduce`` fits one to a
    timed all-reduce; a point-to-point link also serves, paying its calls' time per byte).
    With ``fsdp`` the reduction is a reduce-scatter (half of that), the parameters are
    gathered once per step before the stage's first forward (the other half), and each rank
    keeps 1/d of the optimizer state and of the reduced gradients.
    """

    count: int
    link: Link | None
    """None: reductions are free (a profile measured without a link)."""
    fsdp: bool = False

    def ring_time(self, num_bytes: int, phases: int) -> float:
        """Seconds for ``phases`` x (d - 1) ring steps of ``num_bytes / d`` each."""
        d, link = self.count, self.link
        if d == 1 or link is None:
            return 0.0
        per_byte = 1 / link.bandwidth + link.send_per_byte + link.recv_per_byte
        return phases * (d - 1) * (link.latency + num_bytes / d * per_byte)

    def reduce_time(self, num_bytes: int) -> float:
        """Reducing ``num_bytes`` of gradients over the replicas."""
        return self.ring_time(num_bytes, 1 if self.fsdp else 2)

    def gather_time(self, num_bytes: int) -> float:
        """Gathering ``num_bytes`` of FSDP-sharded parameters (0 without FSDP)."""
        return self.ring_time(num_bytes, 1) if self.fsdp else 0.0

    def static_bytes(self, params: float, trainable: float, optimizer_per_param: float) -> float:
        """Parameters, gradients and optimizer state a rank holds at its peak."""
        if not self.fsdp:
            return params + trainable * (1 + optimizer_per_param)
        # gathered parameters and unsharded gradients during the step, and the shards
        return params + trainable + trainable * (1 + optimizer_per_param) / self.count


class ProfileCost:
    """Costs of one split of a profiled model: per-stage sums of its units' measured costs,
    the runtime's per-action overheads, transfers over the measured link, and activation
    memory as ``conveyor.runtime.memory.ActivationMeter`` counts it.

    Args:
        stage_units: unit indices of each stage of ``graph`` (see ``layout``).
        microbatch_size: samples per micro-batch (may be fractional: batch / micro-batches).
        recompute: activation recomputation, one mode or one per stage (runtime semantics:
            a recomputed stage keeps only its inputs and outputs and reruns its forward in
            backward; 'except_last' keeps the last micro-batch).
        replicas: data-parallel replicas of the pipeline: each stage's gradient reduction
            (and FSDP's parameter gathering and sharded memory); None: one replica.
    """

    def __init__(
        self,
        profile: Profile,
        graph: StageGraph,
        stage_units: Sequence[Sequence[int]],
        microbatch_size: float,
        num_microbatches: int,
        recompute: RecomputeMode | Sequence[RecomputeMode] = "never",
        replicas: Replicas | None = None,
    ) -> None:
        if len(stage_units) != graph.num_stages:
            raise ValueError(
                f"stage_units lists {len(stage_units)} stages but the graph has {graph.num_stages}"
            )
        self.profile = profile
        self.graph = graph
        self.num_microbatches = num_microbatches
        self.busy_share: dict[int, float] = {}
        """Each rank's share of the step spent computing (set by ``predict``)."""
        self.microbatch_size = microbatch_size
        self.modes = (
            [recompute] * graph.num_stages if isinstance(recompute, str) else list(recompute)
        )
        if len(self.modes) != graph.num_stages:
            raise ValueError(
                f"recompute lists {len(self.modes)} modes for "
                f"{graph.num_stages} stages; give one per stage"
            )
        stats = profile.at(microbatch_size)
        # memory is the largest micro-batch's (a batch of 30 in 4 runs 8, 8, 7, 7), times are
        # the average's: they add up over the micro-batches
        peak = profile.at(math.ceil(microbatch_size)) if microbatch_size % 1 else stats
        split = _Split(profile, graph, stage_units)
        loss = profile.loss_at(microbatch_size)
        stages = range(graph.num_stages)
        times = [split.times(s, stats, loss) for s in stages]
        self._forward, self._backward, self._input, self._weight = (
            [row[i] for row in times] for i in range(4)
        )
        memory = [split.activation_bytes(s, peak) for s in stages]
        self._kept, self._recomputed, self._after_input, self._after_input_recomputed = (
            [row[i] for row in memory] for i in range(4)
        )
        self._resident = [split.batch_bytes(s, microbatch_size, num_microbatches) for s in stages]
        self._edge_bytes = split.edge_bytes(stats)
        replicas = self.replicas = replicas or Replicas(1, None)
        self._static = [0] * graph.num_ranks
        self._reduce, self._gather = [], []
        for s, members in enumerate(stage_units):
            params = sum(profile.units[u].param_bytes for u in members)
            trainable = sum(profile.units[u].trainable_bytes for u in members)
            static = replicas.static_bytes(params, trainable, profile.optimizer_state_per_param)
            self._static[graph.rank_of(s)] += round(static)
            self._reduce.append(replicas.reduce_time(trainable))
            self._gather.append(replicas.gather_time(params))

    def _is_recomputed(self, s: int, k: int) -> bool:
        return is_recomputed(self.modes[s], k, self.num_microbatches)

    def compute(self, action: Action) -> float:
        s, k, overheads = action.stage, action.microbatch, self.profile.overheads
        redo = self._forward[s] if self._is_recomputed(s, k) else 0.0
        if action.kind is Kind.F:
            gather = self._gather[s] if k == 0 else 0.0  # FSDP: once per step
            return self._forward[s] + overheads.forward + gather
        if action.kind is Kind.B:
            return self._backward[s] + redo + overheads.backward
        if action.kind is Kind.I:
            return self._input[s] + redo + overheads.backward
        if action.kind is Kind.W:
            return self._weight[s] + overheads.backward
        raise ValueError(f"{action} is not a compute action")

    def recompute(self, action: Action) -> float:
        """Seconds of a backward (B or I) spent recomputing its forward; 0 if it keeps it."""
        if action.kind in (Kind.B, Kind.I) and self._is_recomputed(action.stage, action.microbatch):
            return self._forward[action.stage]
        return 0.0

    def reduce(self, stage: int) -> float:
        """Seconds the stage's gradient reduction over the replicas takes."""
        return self._reduce[stage]

    def reduces_in_flight(self, split_backward: bool) -> bool:
        """Whether the reductions run behind the rest of the step (DDP's reducer), as
        ``conveyor.parallel.DataParallel`` chooses, rather than in line after each stage's
        last B or W (FSDP2)."""
        return reduces_in_flight(self.replicas.fsdp, split_backward)

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
        assert action.peer is not None  # the peer's share, not its own (See Note [busy ranks])
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
        return (
            m
            * (
                self._forward[stage]
                + self._backward[stage]
                + overheads.forward
                + overheads.backward
            )
            + redone * self._forward[stage]
        )

    def activation_after_input(self, stage: int, microbatch: int) -> int:
        if self._is_recomputed(stage, microbatch):
            return self._after_input_recomputed[stage]
        return self._after_input[stage]

    def resident_bytes(self, stage: int) -> int:
        return self._resident[stage]

    def static_bytes(self, rank: int) -> int:
        """Parameters, gradients and optimizer state ``rank`` holds."""
        return self._static[rank]


class _Split:
    """A profile's units placed on stages: each stage's times and bytes, from the units'."""

    def __init__(
        self, profile: Profile, graph: StageGraph, stage_units: Sequence[Sequence[int]]
    ) -> None:
        self.profile, self.graph, self.stage_units = profile, graph, stage_units
        self.stage_of = _stage_of(profile, stage_units)
        self.consumers = _consumers(profile)
        self.output_unit = _output_unit(profile)

    def leaves(self, u: int, s: int) -> bool:
        """Whether unit ``u``'s output is consumed outside stage ``s``."""
        return any(self.stage_of[c] != s for c in self.consumers[u])

    def takes_gradients(self, s: int) -> bool:
        """Whether any input of stage ``s`` comes from another stage (the first stage's do
        not: its I has nothing to do, and its W is its whole backward, as in
        conveyor.runtime.backward)."""
        units = self.profile.units
        return any(
            p >= 0 and self.stage_of[p] != s for u in self.stage_units[s] for p in units[u].inputs
        )

    def remote_inputs(self, s: int) -> set[int]:
        """Units whose outputs stage ``s`` receives from another rank."""
        rank_of, stage_of = self.graph.rank_of, self.stage_of
        return {
            p
            for u in self.stage_units[s]
            for p in self.profile.units[u].inputs
            if p >= 0 and stage_of[p] != s and rank_of(stage_of[p]) != rank_of(s)
        }

    def times(
        self, s: int, stats: Sequence[UnitStats], loss: tuple[float, float]
    ) -> tuple[float, float, float, float]:
        """Stage ``s``'s forward, backward, input-gradient and weight-gradient seconds (the
        loss's with the model's output)."""
        members = self.stage_units[s]
        is_sink = self.output_unit in members
        forward = sum(stats[u].forward for u in members) + (loss[0] if is_sink else 0.0)
        tail = loss[1] if is_sink else 0.0
        backward = sum(stats[u].backward for u in members) + tail
        if not self.takes_gradients(s):
            return forward, backward, 0.0, backward
        backward_input = sum(stats[u].backward_input for u in members) + tail
        return forward, backward, backward_input, sum(stats[u].backward_weight for u in members)

    def activation_bytes(self, s: int, peak: Sequence[UnitStats]) -> tuple[int, int, int, int]:
        """Bytes stage ``s`` holds per micro-batch between forward and backward, kept and
        recomputed, and between its input and weight gradients, kept and recomputed."""
        members, profile = self.stage_units[s], self.profile
        remote = self.remote_inputs(s)
        received = sum(peak[p].message_bytes for p in remote)
        outputs = sum(
            peak[u].output_bytes for u in members if u == self.output_unit or self.leaves(u, s)
        )
        inner = sum(peak[u].saved_bytes for u in members) + sum(
            peak[u].output_bytes
            for u in members
            if u != self.output_unit
            and not self.leaves(u, s)
            and _is_kept(profile, peak, u, self.consumers[u])
        )
        # after I: what autograd saved (the stage's own saves, and the inputs and outputs it
        # saved) and the gradients W starts from; without an input path, W starts from the
        # gradients of the stage's outputs
        weight_grads = (
            sum(peak[u].weight_grad_bytes for u in members)
            if self.takes_gradients(s)
            else sum(peak[u].message_bytes for u in members if self.leaves(u, s))
        )
        saved = sum(peak[u].saved_bytes for u in members) + sum(
            peak[u].output_bytes for u in members if _is_kept(profile, peak, u, self._within(u, s))
        )
        saved += sum(
            peak[p].message_bytes
            for p in remote
            if _is_kept(profile, peak, p, self._within(p, s), own=False)
        )
        # recomputed: recomputation saves the stage's inputs (through autograd) for I
        return (
            received + outputs + inner,
            received + outputs,
            saved + weight_grads,
            (received + weight_grads),
        )

    def _within(self, u: int, s: int) -> list[int]:
        return [c for c in self.consumers[u] if self.stage_of[c] == s]

    def batch_bytes(self, s: int, microbatch_size: float, num_microbatches: int) -> int:
        """Bytes of the model inputs stage ``s`` takes, for the whole batch: the runtime's
        micro-batches are views of the batch, so a stage holds the whole batch of each model
        input it takes while any of its micro-batches is alive."""
        profile = self.profile
        taken = {-1 - p for u in self.stage_units[s] for p in profile.units[u].inputs if p < 0}
        if not taken:
            return 0
        if len(profile.model_input_bytes) > max(taken):
            per_sample = sum(profile.model_input_bytes[i] for i in taken)
        else:
            per_sample = profile.input_bytes_per_sample
        return round(per_sample * microbatch_size * num_microbatches)

    def edge_bytes(self, stats: Sequence[UnitStats]) -> dict[tuple[int, int], int]:
        """Bytes per micro-batch sent from each stage to each other stage."""
        found: dict[tuple[int, int], int] = {}
        stage_of = self.stage_of
        for u in range(self.profile.num_units):
            for d in {stage_of[c] for c in self.consumers[u] if stage_of[c] != stage_of[u]}:
                found[stage_of[u], d] = found.get((stage_of[u], d), 0) + stats[u].message_bytes
        return found


def _is_kept(
    profile: Profile, stats: Sequence[UnitStats], u: int, consumers: list[int], own: bool = True
) -> bool:
    """Whether autograd keeps unit ``u``'s output for backward: ``u`` itself (with ``own``) or
    one of ``consumers`` saves it."""
    if own and stats[u].saves_output:
        return True
    for c in consumers:
        saves = stats[c].saves_input
        if any(
            saves[i] for i, p in enumerate(profile.units[c].inputs) if p == u and i < len(saves)
        ):
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


def predict(
    program: Program, graph: StageGraph, cost: ProfileCost, record: bool = True
) -> Prediction:
    """Simulate ``program`` with profiled costs: the Timeline, step time, memory per rank.

    With ``record=False`` the Timeline is left empty (faster); the figures are the same.
    """
    if cost.profile.overheads.busy_call:  # See Note [busy ranks]: simulate again, knowing them
        first = execute(program, graph, cost, record=False)
        span = first.span or 1.0
        cost.busy_share = {r: busy / span for r, busy in enumerate(first.busy)}
    execution = execute(program, graph, cost, record=record)
    timeline = execution.timeline
    timeline.meta.update({"microbatches": program.num_microbatches, "model": cost.profile.model})
    span = execution.span
    bubble = 1.0 - sum(execution.busy) / (span * len(program)) if span else 0.0
    return Prediction(
        timeline,
        span + cost.profile.overheads.step,
        bubble,
        execution.peak_memory,
        tuple(cost.static_bytes(r) for r in range(graph.num_ranks)),
    )
