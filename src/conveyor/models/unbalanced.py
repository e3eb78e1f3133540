"""An MLP whose layers cost very different amounts: an even split of it is a poor split."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

__all__ = ["MLPBlock", "mse", "regression_batch", "unbalanced_mlp"]


class MLPBlock(nn.Module):
    """Pre-norm residual MLP block: ``x + fc2(gelu(fc1(norm(x))))`` with ``hidden`` units."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.fc2(self.act(self.fc1(self.norm(x))))
        return out


def unbalanced_mlp(
    dim: int = 256,
    widths: Sequence[int] = (16, 16, 16, 1, 1, 1, 1, 1),
) -> nn.Sequential:
    """An nn.Sequential of residual MLP blocks, block i with ``widths[i] * dim`` hidden units.

    The default puts three blocks 16 times wider than the others first, so three of eight
    layers hold nearly all the work: an even split over two ranks gives rank 0 all three
    heavy blocks, where [2, 6] would share them.
    """
    if not widths or any(w < 1 for w in widths):
        raise ValueError(f"widths must be positive multiples of dim, got {list(widths)}")
    return nn.Sequential(*(MLPBlock(dim, w * dim) for w in widths))


def regression_batch(
    batch_size: int, dim: int = 256, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of a fixed random regression task, the same for the same arguments."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch_size, dim, generator=generator)
    return inputs, torch.sin(inputs)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error (the loss for ``regression_batch``)."""
    return F.mse_loss(output, target)
