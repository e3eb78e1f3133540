"""Activation recomputation (``recompute`` in the configuration): its modes and its one rule.

    is_recomputed("except_last", microbatch=2, num_microbatches=4)   # True: not the last one

A recomputed stage keeps only its inputs and outputs after its forward and runs the forward
again in backward (torch.utils.checkpoint). The runtime, the simulator's cost model and the
planner all decide which (stage, micro-batch) recomputes with ``is_recomputed``.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["RECOMPUTE_MODES", "RecomputeMode", "is_recomputed", "recomputed_share"]

RecomputeMode = Literal["never", "except_last", "always"]
RECOMPUTE_MODES: tuple[RecomputeMode, ...] = ("never", "except_last", "always")
"""From the fastest to the least memory: ``never`` keeps every activation, ``except_last``
recomputes all but the last micro-batch (whose backward follows at once; torchgpipe's
default), ``always`` recomputes every micro-batch."""


def is_recomputed(mode: RecomputeMode, microbatch: int, num_microbatches: int) -> bool:
    """Whether micro-batch ``microbatch`` of a stage in ``mode`` recomputes its forward."""
    return mode == "always" or (mode == "except_last" and microbatch < num_microbatches - 1)


def recomputed_share(mode: RecomputeMode, num_microbatches: int) -> float:
    """Share of a step's micro-batches that recompute in ``mode``."""
    redone = sum(is_recomputed(mode, k, num_microbatches) for k in range(num_microbatches))
    return redone / num_microbatches
