"""How micro-batch losses add up to the step's loss: weights by samples, by counted tokens, or 1.

    weights = loss_weights("token_mean", [counted_tokens(t) for t in targets])
    step_loss = sum(w * loss_k for w, loss_k in zip(weights, microbatch_losses))

A loss that is a mean over its micro-batch (samples, or tokens not marked ``IGNORE_INDEX``)
weighted by the micro-batch's share of the step's count gives exactly the full batch's mean,
and so the full batch's gradients, however the padding falls between micro-batches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

__all__ = ["IGNORE_INDEX", "LossReduction", "counted_tokens", "loss_weights"]

LossReduction = Literal["mean", "token_mean", "sum"]

IGNORE_INDEX = -100
"""Targets equal to this are not counted (torch's cross-entropy default, and transformers')."""


def counted_tokens(targets: Any, shift: bool = False) -> int:
    """Targets that a token-level loss counts: those not ``IGNORE_INDEX`` in a tensor of
    targets, or in the ``labels`` of a dict of them; with ``shift`` (a causal language model's
    own loss), all but each sequence's first, which nothing predicts.

    Raises:
        TypeError: the targets are neither a tensor nor a dict with a ``labels`` tensor.
    """
    if isinstance(targets, Mapping) and isinstance(targets.get("labels"), torch.Tensor):
        targets = targets["labels"]
    if not isinstance(targets, torch.Tensor):
        raise TypeError(
            "loss_reduction='token_mean' weighs micro-batches by the targets not equal to "
            f"{IGNORE_INDEX} in a tensor of targets, or in the 'labels' of a dict; got "
            f"{type(targets).__name__}. Pass the labels as the targets (with {IGNORE_INDEX} "
            "where the loss ignores a token), or as {'labels': labels, ...} with the rest"
        )
    if shift:
        targets = targets[..., 1:]
    return int((targets != IGNORE_INDEX).sum())


def loss_weights(reduction: LossReduction, counts: Sequence[int]) -> list[float]:
    """Each micro-batch's weight: its share of ``counts``' total for the means, 1 for 'sum'.

    A step whose every count is 0 (every token ignored) weighs each micro-batch 0, as the
    full batch's loss would have nothing to average.
    """
    if reduction == "sum":
        return [1.0] * len(counts)
    total = sum(counts)
    return [count / total if total else 0.0 for count in counts]
