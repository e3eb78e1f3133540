"""A two-tower multi-modal classifier: a text tower and an image tower fused by a head.

    model = two_tower()                     # text: 4 blocks over 16 tokens; image: 2 over 32
    logits = model(tokens, patches, mask)   # mask: True for real tokens, False for padding
    Pipeline(model, stage_modules=("text", "image", "head"), loss_fn=classification_loss)
The towers differ in depth but cost about the same (twice the blocks over half the
positions), and the head is light: split as text | image | head, the towers run side by side.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from conveyor.models.gpt import Block

__all__ = [
    "EncoderBlock",
    "FusionHead",
    "ImageTower",
    "TextTower",
    "TwoTower",
    "classification_loss",
    "multimodal_batches",
    "two_tower",
]


class EncoderBlock(Block):
    """Pre-norm transformer encoder block; ``mask`` (batch, seq) marks the real positions."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        # padding keys get no attention
        return self.attend(x, None if mask is None else ~mask[:, None, None, :])


def _pool(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean over the real positions."""
    if mask is None:
        return x.mean(1)
    weights = mask.to(x.dtype)[..., None]
    return (x * weights).sum(1) / weights.sum(1).clamp(min=1.0)


class TextTower(nn.Module):
    """Token and position embeddings, encoder blocks, masked mean pooling."""

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        dim: int,
        num_layers: int,
        num_heads: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        self.blocks = nn.ModuleList(
            EncoderBlock(dim, num_heads, dropout) for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, mask)
        return _pool(self.norm(x), mask)


class ImageTower(nn.Module):
    """Patch projection and position embeddings, encoder blocks, mean pooling."""

    def __init__(
        self,
        patch_dim: int,
        num_patches: int,
        dim: int,
        num_layers: int,
        num_heads: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.patches = nn.Linear(patch_dim, dim)
        self.positions = nn.Parameter(torch.randn(num_patches, dim) * 0.02)
        self.blocks = nn.ModuleList(
            EncoderBlock(dim, num_heads, dropout) for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.patches(patches) + self.positions
        for block in self.blocks:
            x = block(x)
        return _pool(self.norm(x), None)


class FusionHead(nn.Module):
    """Joins the two pooled embeddings: concatenation, a small MLP, class logits."""

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2 * dim, dim), nn.GELU(), nn.Linear(dim, num_classes))

    def forward(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.mlp(torch.cat([text, image], dim=-1))
        return logits


class TwoTower(nn.Module):
    """``head(text(tokens, mask), image(patches))``: two independent towers, one join."""

    def __init__(self, text: TextTower, image: ImageTower, head: FusionHead) -> None:
        super().__init__()
        self.text = text
        self.image = image
        self.head = head

    def forward(
        self, tokens: torch.Tensor, patches: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.text(tokens, mask), self.image(patches))
        return logits


def two_tower(
    vocab_size: int = 64,
    seq_len: int = 16,
    num_patches: int = 32,
    patch_dim: int = 48,
    dim: int = 64,
    text_layers: int = 4,
    image_layers: int = 2,
    num_heads: int = 4,
    num_classes: int = 4,
    dropout: float = 0.0,
) -> TwoTower:
    """The default towers cost about the same: 4 blocks x 16 tokens, 2 blocks x 32 patches."""
    return TwoTower(
        TextTower(vocab_size, seq_len, dim, text_layers, num_heads, dropout),
        ImageTower(patch_dim, num_patches, dim, image_layers, num_heads, dropout),
        FusionHead(dim, num_classes),
    )


def classification_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the batch."""
    return F.cross_entropy(logits, targets)


def multimodal_batches(
    batch_size: int,
    num_batches: int,
    vocab_size: int = 64,
    seq_len: int = 16,
    num_patches: int = 32,
    patch_dim: int = 48,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """({"tokens", "patches", "mask"}, labels) batches of a task that needs both towers.

    Texts have random lengths (padding after them is masked). The label's low bit says
    whether token 1 occurs more often than token 2 in the text, its high bit whether the
    patches' mean is positive: 4 classes.
    """
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_batches):
        tokens = torch.randint(3, vocab_size, (batch_size, seq_len), generator=generator)
        special = torch.randint(0, 3, (batch_size, seq_len), generator=generator)
        tokens = torch.where(special > 0, special, tokens)
        lengths = torch.randint(seq_len // 2, seq_len + 1, (batch_size,), generator=generator)
        mask = torch.arange(seq_len)[None, :] < lengths[:, None]
        tokens = tokens.masked_fill(~mask, 0)
        patches = torch.randn(batch_size, num_patches, patch_dim, generator=generator)
        patches += torch.randn(batch_size, 1, 1, generator=generator) * 0.3
        text_bit = ((tokens == 1).sum(1) > (tokens == 2).sum(1)).long()
        image_bit = (patches.mean((1, 2)) > 0).long()
        inputs = {"tokens": tokens, "patches": patches.to(dtype), "mask": mask}
        batches.append((inputs, text_bit + 2 * image_bit))
    return batches
