"""Pipeline configuration: one frozen dataclass, validated before any process starts."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["CHECKPOINT_DIR_ENV", "CHECKPOINT_MODES", "CheckpointConfig", "PipelineConfig",
           "read_plan"]

logger = logging.getLogger(__name__)

CHECKPOINT_MODES = ("always", "except_last", "never")


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineConfig:
    """How to cut, schedule and run a model. Every field has a default that works on CPU."""

    balance: tuple[int, ...] | None = None
    """Layers per stage of an nn.Sequential; default: an even split over the ranks."""
    split_points: tuple[str, ...] | None = None
    """Qualified names of the submodules that start stages 1, 2, ... (any nn.Module)."""
    num_microbatches: int = 4
    """Micro-batches per step. Fewer than the number of stages leaves ranks idle."""
    schedule: str = "1f1b"
    """Schedule name (see conveyor.schedule.SCHEDULES: gpipe, 1f1b, interleaved-1f1b, zb-h1,
    zb-v, ...) or a schedule file (one line of actions per rank; docs/schedules.md)."""
    checkpoint: Literal["always", "except_last", "never"] = "never"
    """Activation checkpointing: recompute forwards in backward (torchgpipe semantics;
    'except_last' keeps the last micro-batch's activations, which are used at once)."""
    loss_reduction: Literal["mean", "sum"] = "mean"
    """'mean': the loss is a per-sample mean, so micro-batch losses are weighted by their share
    of the batch and the step's loss equals the full batch's. 'sum': they are added."""
    seed: int = 0
    """Seed of the per-micro-batch random streams (dropout); Note [micro-batch randomness]."""
    timeout_s: float = 60.0
    """Longest wait for a peer before the rank fails, naming the peer and the action."""
    placement: tuple[int, ...] | None = None
    """Rank of each stage; default: stage i on rank i, or placement_style with more stages
    than ranks (virtual stages)."""
    virtual_stages: int | None = None
    """Stages per rank when balance, split points or stage modules do not fix the count;
    default: what the schedule needs (2 for interleaved-1f1b and zb-v, else 1)."""
    placement_style: Literal["loop", "v"] | None = None
    """How stages share ranks when placement is not given: 'loop' (stage s on rank s mod p,
    interleaved-1f1b) or 'v' (down the ranks and back, zb-v); default: the schedule's."""
    tie_weights: tuple[str, ...] = ()
    """Parameters to keep as one across stages: each entry a comma-separated group of
    qualified names, e.g. '0.tokens.weight,5.out.weight'. One Parameter object reached from
    several stages is tied without being listed."""
    deferred_batch_norm: bool = False
    """Replace the model's BatchNorm layers by conveyor.batchnorm.DeferredBatchNorm, so the
    running statistics are those of the whole mini-batch (torchgpipe semantics)."""
    stage_modules: tuple[str, ...] | None = None
    """Submodules forming each stage, one entry per stage with comma-separated qualified names,
    e.g. ('text', 'image', 'head,norm'): stages that do not feed each other run concurrently
    (a graph pipeline; see conveyor.split.split_by_modules)."""
    auto_split: bool = False
    """Trace the model and cut it into one stage per rank (or per placement entry) for the
    shortest step, independent branches on different ranks (conveyor.autosplit)."""
    leaf_modules: tuple[str, ...] = ()
    """Submodules auto_split keeps whole and never traces: qualified names ('encoder.3') or
    class names ('Block'), e.g. for code torch.fx cannot trace."""
    stage_checkpoint: tuple[Literal["always", "except_last", "never"], ...] | None = None
    """Activation checkpointing per stage (one mode each); overrides checkpoint. The planner
    (conveyor.plan) writes it."""
    measure_memory: bool = False
    """Account activation memory for Pipeline.memory() and the trace: saved-tensor hooks on
    every forward, which cost 1.4-6% of a step on CPU (docs/benchmarks.md), hence off
    unless asked for."""
    keep_host_memory: bool = True
    """Keep host memory that tensors free for the next micro-batch instead of returning it to
    the system (glibc malloc, process-wide; Note [freed host memory] in conveyor.host_memory):
    10-25% faster backward on CPU, at the price of the process holding its peak."""
    trace: bool = False
    """Record every action's start and end, waits and bytes sent (and activation memory with
    measure_memory) (conveyor.trace); read with Pipeline.timeline(). Off costs nothing."""
    trace_dir: str | None = None
    """Also write each rank's recorded steps to <trace_dir>/rank<N>.jsonl (implies trace);
    render with `conveyor trace DIR`."""

    def __post_init__(self) -> None:
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.balance is not None and self.split_points is not None:
            raise ValueError("pass balance or split_points, not both: balance counts layers of "
                             "an nn.Sequential, split_points name submodules of any module")
        ways = [name for name in ("balance", "split_points", "stage_modules")
                if getattr(self, name) is not None] + (["auto_split"] if self.auto_split else [])
        if len(ways) > 1:
            raise ValueError(f"pass one way to split, got {ways}: balance (nn.Sequential), "
                             "split_points (a chain), stage_modules (a graph by hand) or "
                             "auto_split=True")
        if self.stage_modules is not None and not all(m.strip(" ,") for m in self.stage_modules):
            raise ValueError(f"stage_modules {list(self.stage_modules)} has an empty stage; "
                             "give each stage at least one submodule name")
        if self.balance is not None and any(b < 1 for b in self.balance):
            raise ValueError(f"balance {list(self.balance)} has a count below 1; every stage "
                             "needs at least one layer")
        if self.checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint must be one of {list(CHECKPOINT_MODES)}, "
                             f"got {self.checkpoint!r}")
        if self.loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {self.loss_reduction!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.virtual_stages is not None and self.virtual_stages < 1:
            raise ValueError(f"virtual_stages must be >= 1, got {self.virtual_stages}")
        if self.placement_style not in (None, "loop", "v"):
            raise ValueError(f"placement_style must be 'loop' or 'v', got "
                             f"{self.placement_style!r}")
        for group in self.tie_weights:
            if len([n for n in group.split(",") if n.strip()]) < 2:
                raise ValueError(f"tie_weights entry {group!r} names fewer than two "
                                 "parameters; give a comma-separated group such as "
                                 "'0.tokens.weight,5.out.weight'")
        if self.stage_checkpoint is not None:
            wrong = [m for m in self.stage_checkpoint if m not in CHECKPOINT_MODES]
            if wrong:
                raise ValueError(f"stage_checkpoint has modes {wrong}; each must be one of "
                                 f"{list(CHECKPOINT_MODES)}")

    @property
    def num_stages(self) -> int | None:
        """Stages implied by balance, split points or stage modules; None otherwise."""
        if self.balance is not None:
            return len(self.balance)
        if self.split_points is not None:
            return len(self.split_points) + 1
        if self.stage_modules is not None:
            return len(self.stage_modules)
        return None


def read_plan(path: str | os.PathLike[str]) -> dict[str, Any]:
    """PipelineConfig fields from a plan file written by ``conveyor plan --out FILE``.

    A plan file is JSON with the fields under ``"pipeline"`` (the rest describes the
    prediction). Raises ValueError naming the file if it holds no plan or unknown fields.
    """
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"plan file {str(path)!r} is not JSON ({error}); write one with "
                         "`conveyor plan ... --out plan.json`") from error
    if not isinstance(data, dict) or not isinstance(data.get("pipeline"), dict):
        raise ValueError(f"plan file {str(path)!r} has no 'pipeline' section; write one with "
                         "`conveyor plan ... --out plan.json`")
    fields = data["pipeline"]
    known = {f.name for f in dataclasses.fields(PipelineConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"plan file {str(path)!r} sets unknown fields {unknown}; expected "
                         f"PipelineConfig fields {sorted(known)}")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}


CHECKPOINT_DIR_ENV = "CONVEYOR_CHECKPOINT_DIR"
"""Set by ``conveyor run --checkpoint-dir DIR``; the default CheckpointConfig.directory."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """Where, how often and how checkpoints are saved and loaded (conveyor.checkpoint)."""

    directory: str | None = None
    """Directory of the run's checkpoints; default: $CONVEYOR_CHECKPOINT_DIR, which
    `conveyor run --checkpoint-dir DIR` sets."""
    every: int = 100
    """Steps between the checkpoints Checkpointer.maybe_save writes."""
    keep: int = 3
    """Newest complete checkpoints to keep; older ones are deleted only after a newer one is
    complete. 0 keeps all."""
    async_save: bool = True
    """Write in the background: training blocks only for an in-memory snapshot."""
    allow_reshard: bool = False
    """Load a checkpoint saved with another split, placement or number of stages or ranks."""
    allow_numerics_change: bool = False
    """Also load one saved with another schedule, micro-batch count, loss reduction or seed:
    the state loads bitwise, but later losses differ (summation order, dropout streams)."""
    timeout_s: float = 300.0
    """Longest wait for the other ranks inside a checkpoint save or load."""

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be >= 1 step, got {self.every}")
        if self.keep < 0:
            raise ValueError(f"keep must be >= 0 (0 keeps every checkpoint), got {self.keep}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
