"""A small U-Net as an nn.Sequential whose long skips are stash/pop layers (conveyor.split.skip).

    model = unet(depth=3)          # Down, Down, Down, Bottom, Up, Up, Up, Head: 8 layers
    model(images)                  # plain PyTorch: the skips pass through conveyor.split.skip
    Pipeline(model, balance=[2, 2, 2, 2], loss_fn=segmentation_loss)
Each ``Down`` stashes its features before pooling and the ``Up`` at the same level pops
them, so in a pipeline every skip goes straight from the encoder's rank to the decoder's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from conveyor.split.skip import pop, rename, skippable, stash

__all__ = [
    "Bottom",
    "Down",
    "SegmentationHead",
    "Up",
    "segmentation_batches",
    "segmentation_loss",
    "unet",
]


def _convolutions(in_channels: int, out_channels: int) -> nn.Sequential:
    """Two 3x3 convolutions, each followed by group norm and ReLU."""
    groups = 4 if out_channels % 4 == 0 else 1
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1),
        nn.GroupNorm(groups, out_channels),
        nn.ReLU(),
        nn.Conv2d(out_channels, out_channels, 3, padding=1),
        nn.GroupNorm(groups, out_channels),
        nn.ReLU(),
    )


@skippable(stash=["skip"])
class Down(nn.Module):
    """Encoder level: convolutions at this resolution, stashed for the decoder, then pooled."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = _convolutions(in_channels, out_channels)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.conv(x)
        stash("skip", features)
        pooled: torch.Tensor = self.pool(features)
        return pooled


class Bottom(nn.Module):
    """The lowest resolution: convolutions only."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = _convolutions(in_channels, out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.conv(x)
        return out


@skippable(pop=["skip"])
class Up(nn.Module):
    """Decoder level: upsample, concatenate the encoder's features of this level, convolve."""

    def __init__(self, in_channels: int, skip_channels: int, out_channels: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(in_channels, in_channels // 2, 2, stride=2)
        self.conv = _convolutions(in_channels // 2 + skip_channels, out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.conv(torch.cat([self.up(x), pop("skip")], dim=1))
        return out


class SegmentationHead(nn.Module):
    """1x1 convolution to per-pixel class logits."""

    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.out = nn.Conv2d(in_channels, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.out(x)
        return logits


def unet(
    in_channels: int = 3, num_classes: int = 2, width: int = 8, depth: int = 3
) -> nn.Sequential:
    """A U-Net with ``depth`` levels: ``2 * depth + 2`` layers, widths ``width * 2**level``.

    Images need sides divisible by ``2**depth``. Level i's skip is named ``skip{i}``.
    """
    if depth < 1 or width < 1:
        raise ValueError(f"depth and width must be >= 1, got depth={depth}, width={width}")
    widths = [width * 2**level for level in range(depth + 1)]
    downs = [
        rename(Down(in_channels if i == 0 else widths[i - 1], widths[i]), skip=f"skip{i}")
        for i in range(depth)
    ]
    bottom = Bottom(widths[depth - 1], widths[depth])
    ups = [
        rename(Up(widths[i + 1], widths[i], widths[i]), skip=f"skip{i}")
        for i in reversed(range(depth))
    ]
    return nn.Sequential(*downs, bottom, *ups, SegmentationHead(widths[0], num_classes))


def segmentation_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean per-pixel cross-entropy; ``targets`` holds class indices (batch, height, width)."""
    return F.cross_entropy(logits, targets)


def segmentation_batches(
    batch_size: int,
    size: int,
    num_batches: int,
    in_channels: int = 3,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(images, masks): noisy images with one brighter rectangle each; the mask marks it (1)
    against the background (0). The same arguments give the same batches."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_batches):
        images = torch.randn(batch_size, in_channels, size, size, generator=generator) * 0.5
        masks = torch.zeros(batch_size, size, size, dtype=torch.long)
        corners = torch.randint(0, size // 2, (batch_size, 2), generator=generator)
        sides = torch.randint(size // 4, size // 2 + 1, (batch_size, 2), generator=generator)
        for b in range(batch_size):
            (top, left), (height, width) = corners[b].tolist(), sides[b].tolist()
            masks[b, top : top + height, left : left + width] = 1
        images += masks[:, None].to(images.dtype)
        batches.append((images.to(dtype), masks))
    return batches
