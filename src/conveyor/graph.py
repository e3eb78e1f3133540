"""StageGraph: the split model as a DAG of stages, each placed on a rank."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from torch import nn

__all__ = [
    "MODEL_OUTPUT",
    "PLACEMENT_STYLES",
    "PlacementStyle",
    "Stage",
    "StageGraph",
    "chain",
    "place",
]


MODEL_OUTPUT = "output"
"""Value name of the model's own output; the stage that produces it computes the loss."""


@dataclass(frozen=True)
class Stage:
    """One part of the model: a module that maps named input values to named output values.

    The module is called as ``module(*inputs)`` and returns a tuple with one item per name in
    ``outputs`` (a single output may be returned bare). Values are pytrees of tensors.
    """

    index: int
    rank: int
    inputs: tuple[str, ...]
    """Value names taken, in call order: model inputs or outputs of earlier stages."""
    outputs: tuple[str, ...]
    """Value names returned, in order; ``MODEL_OUTPUT`` marks the stage that ends the model."""
    module: nn.Module | None = field(default=None, compare=False, repr=False)
    """The stage's computation; ``None`` in pure graphs used to build and test schedules."""


@dataclass(frozen=True)
class StageGraph:
    """Stages in topological order (producers before consumers) and the model inputs.

    A chain is the special case where stage i consumes only stage i-1. A skip connection is a
    value consumed by a stage further on; it travels straight from its producer's rank to its
    consumer's rank. Several stages may share a rank (virtual stages).
    """

    stages: tuple[Stage, ...]
    model_inputs: tuple[str, ...] = ("input",)
    """Values every rank takes from its own copy of the micro-batch (never sent)."""
    binder: Callable[[Any], dict[str, Any]] | None = field(default=None, compare=False, repr=False)
    """A batch as ``model_inputs`` by name, as the split's tracer laid them out (see
    ``conveyor.split.bind_inputs``); None: by position or name, every one given."""
    training: bool | None = field(default=None, compare=False)
    """The only mode (``model.training``) the stages compute the model right in (the split's
    ``Traced.training``); None: either mode."""

    def __post_init__(self) -> None:
        produced: dict[str, int] = {}
        for position, stage in enumerate(self.stages):
            if stage.index != position:
                raise ValueError(
                    f"stage at position {position} has index {stage.index}; "
                    "stages must be listed in index order 0, 1, 2, ..."
                )
            for name in stage.inputs:
                if name not in produced and name not in self.model_inputs:
                    raise ValueError(
                        f"stage {stage.index} takes {name!r}, which no earlier stage produces "
                        f"and is not a model input {list(self.model_inputs)}; stages must be in "
                        "topological order"
                    )
            for name in stage.outputs:
                if name in produced or name in self.model_inputs:
                    raise ValueError(f"value {name!r} is produced twice (stage {stage.index})")
                produced[name] = stage.index
        if MODEL_OUTPUT not in produced:
            raise ValueError(f"no stage produces the model output {MODEL_OUTPUT!r}")
        ranks = sorted({s.rank for s in self.stages})
        if ranks != list(range(len(ranks))):
            raise ValueError(
                f"stages are placed on ranks {ranks}; expected every rank in "
                f"0..{len(ranks) - 1} to hold at least one stage"
            )

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_ranks(self) -> int:
        return 1 + max(s.rank for s in self.stages)

    @cached_property
    def _producer(self) -> dict[str, int]:
        return {name: s.index for s in self.stages for name in s.outputs}

    @cached_property
    def sink(self) -> int:
        """The stage that produces the model output (and computes the loss)."""
        return self._producer[MODEL_OUTPUT]

    def producer(self, name: str) -> int | None:
        """Stage that produces ``name``, or None for a model input."""
        return self._producer.get(name)

    def producers(self, stage: int) -> list[int]:
        """Stages whose outputs ``stage`` consumes, in index order."""
        found = {self._producer[n] for n in self.stages[stage].inputs if n in self._producer}
        return sorted(found)

    @cached_property
    def _consumers(self) -> dict[int, list[int]]:
        table: dict[int, list[int]] = {s.index: [] for s in self.stages}
        for s in self.stages:
            for p in self.producers(s.index):
                table[p].append(s.index)
        return table

    def consumers(self, stage: int) -> list[int]:
        """Stages that consume an output of ``stage``, in index order."""
        return self._consumers[stage]

    def edge_values(self, src: int, dst: int) -> tuple[str, ...]:
        """Names of the values ``src`` sends to ``dst``, in ``src``'s output order."""
        wanted = set(self.stages[dst].inputs)
        return tuple(n for n in self.stages[src].outputs if n in wanted)

    def stages_on(self, rank: int) -> list[int]:
        """Indices of the stages that ``rank`` holds."""
        return [s.index for s in self.stages if s.rank == rank]

    def rank_of(self, stage: int) -> int:
        return self.stages[stage].rank

    def chain_break(self) -> str | None:
        """Where the stages stop being a chain (stage i fed by stage i - 1 alone, and feeding
        stage i + 1 alone), said in words; None for a chain."""
        for stage in range(1, self.num_stages):
            if self.producers(stage) != [stage - 1]:
                return f"stage {stage} takes inputs from stages {self.producers(stage)}"
            if self.consumers(stage - 1) != [stage]:
                return f"stage {stage - 1} feeds stages {self.consumers(stage - 1)}"
        return None

    @cached_property
    def depth(self) -> int:
        """Number of stages on the longest path; a chain's depth is its length."""
        longest: dict[int, int] = {}
        for s in self.stages:
            longest[s.index] = 1 + max((longest[p] for p in self.producers(s.index)), default=0)
        return max(longest.values())

    @cached_property
    def _to_sink(self) -> dict[int, int]:
        distance: dict[int, int] = {}
        for s in reversed(self.stages):
            below = [distance[c] for c in self.consumers(s.index)]
            distance[s.index] = 1 + max(below) if below else 0
        return distance

    def distance_to_sink(self, stage: int) -> int:
        """Stages on the longest path from ``stage`` to the end, not counting ``stage``."""
        return self._to_sink[stage]

    def topology(self) -> StageGraph:
        """The same graph without modules: plain data for schedules and the simulator."""
        stages = tuple(Stage(s.index, s.rank, s.inputs, s.outputs) for s in self.stages)
        return StageGraph(stages, self.model_inputs)


PlacementStyle = Literal["loop", "v"]
PLACEMENT_STYLES: tuple[PlacementStyle, ...] = ("loop", "v")


# 6 stages on 3 ranks:   loop: 0 1 2 0 1 2  (interleaved 1F1B)
#                        v:    0 1 2 2 1 0  (ZB-V: the last stage comes back to rank 0)
def place(num_stages: int, num_ranks: int, style: PlacementStyle = "loop") -> list[int]:
    """Rank of each stage when ``num_stages`` stages share ``num_ranks`` ranks (virtual stages).

    'loop' goes round the ranks in order; 'v' goes down the ranks and back up (and down
    again for more than two stages per rank), so consecutive laps meet on the same rank.
    """
    if num_ranks < 1 or num_stages % num_ranks:
        raise ValueError(
            f"cannot place {num_stages} stages on {num_ranks} ranks; use a "
            f"positive multiple of {num_ranks} stages (the same number per rank)"
        )
    if style not in PLACEMENT_STYLES:
        raise ValueError(f"placement style must be one of {list(PLACEMENT_STYLES)}, got {style!r}")
    ranks = []
    for stage in range(num_stages):
        lap, position = divmod(stage, num_ranks)
        backwards = style == "v" and lap % 2 == 1
        ranks.append(num_ranks - 1 - position if backwards else position)
    return ranks


def chain(
    num_stages: int, num_ranks: int | None = None, placement: Sequence[int] | None = None
) -> StageGraph:
    """A module-less chain of stages: stage i feeds stage i+1.

    Stage i sits on rank ``placement[i]`` (default: round-robin over ``num_ranks``, which
    defaults to one stage per rank).
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if placement is None:
        ranks = num_stages if num_ranks is None else num_ranks
        placement = [i % ranks for i in range(num_stages)]
    if len(placement) != num_stages:
        raise ValueError(
            f"placement {list(placement)} has {len(placement)} entries; "
            f"expected one rank per stage ({num_stages})"
        )
    stages = []
    for i, rank in enumerate(placement):
        inputs = ("input",) if i == 0 else (f"h{i - 1}",)
        outputs = (MODEL_OUTPUT,) if i == num_stages - 1 else (f"h{i}",)
        stages.append(Stage(i, rank, inputs, outputs))
    return StageGraph(tuple(stages))
