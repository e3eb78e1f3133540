"""Pipeline configuration: one frozen dataclass, validated before any process starts."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

__all__ = ["CHECKPOINT_MODES", "PipelineConfig"]

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
    """Schedule name (see conveyor.schedule.SCHEDULES) or a schedule file."""
    checkpoint: Literal["always", "except_last", "never"] = "never"
    """Activation checkpointing: recompute forwards in backward (torchgpipe semantics;
    'except_last' keeps the last micro-batch's activations, which are used at once)."""
    loss_reduction: Literal["mean", "sum"] = "mean"
    """'mean': the loss is a per-sample mean, so micro-batch losses are weighted by their share
    of the batch and the step's loss equals the full batch's. 'sum': they are added."""
    seed: int = 0
    """Seed of the per-micro-batch random streams (dropout); Note [micro-batch randomness]."""
    timeout_s: float = 120.0
    """Longest wait for a peer before the rank fails, naming the peer."""
    placement: tuple[int, ...] | None = None
    """Rank of each stage; default: stage i on rank i."""

    def __post_init__(self) -> None:
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.balance is not None and self.split_points is not None:
            raise ValueError("pass balance or split_points, not both: balance counts layers of "
                             "an nn.Sequential, split_points name submodules of any module")
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

    @property
    def num_stages(self) -> int | None:
        """Stages implied by balance or split points; None when neither is given."""
        if self.balance is not None:
            return len(self.balance)
        if self.split_points is not None:
            return len(self.split_points) + 1
        return None
