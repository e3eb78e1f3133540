"""A DLRM-style recommender: a dense MLP branch and an embedding branch meet in a dot-product
interaction that feeds a top MLP.

    model = dlrm()                                  # 13 dense features, 8 tables of bags of 4
    logits = model(dense, sparse)                   # sparse: (batch, tables, bag) indices
    Pipeline(model, stage_modules=("bottom", "embeddings", "top"), loss_fn=click_loss)
The branches are independent until the interaction, so a graph pipeline runs them on
different ranks at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

__all__ = ["DLRM", "Embeddings", "click_batches", "click_loss", "dlrm", "mlp"]


def mlp(widths: Sequence[int], last_activation: bool = True) -> nn.Sequential:
    """Linear layers between consecutive ``widths``, ReLU after each (but the last, unless
    ``last_activation``)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if last_activation or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class Embeddings(nn.Module):
    """One summed embedding bag per sparse feature: (batch, tables, bag) -> (batch, tables, dim)."""

    def __init__(self, table_sizes: Sequence[int], dim: int) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(size, dim, mode="sum") for size in table_sizes)

    def forward(self, sparse: torch.Tensor) -> torch.Tensor:
        return torch.stack([table(sparse[:, t]) for t, table in enumerate(self.tables)], dim=1)


class DLRM(nn.Module):
    """``top(interact(bottom(dense), embeddings(sparse)))``.

    The interaction takes the dot product of every pair among the dense vector and the
    embedded features (the pairs are a buffer) and appends the dense vector.
    """

    def __init__(
        self,
        num_dense: int,
        table_sizes: Sequence[int],
        dim: int,
        bottom: Sequence[int],
        top: Sequence[int],
    ) -> None:
        super().__init__()
        self.bottom = mlp([num_dense, *bottom, dim])
        self.embeddings = Embeddings(table_sizes, dim)
        num_features = len(table_sizes) + 1
        pairs = torch.triu_indices(num_features, num_features, offset=1)
        self.pairs: torch.Tensor
        self.register_buffer("pairs", pairs, persistent=False)
        num_pairs = num_features * (num_features - 1) // 2
        self.top = mlp([dim + num_pairs, *top, 1], last_activation=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        features = torch.cat([x[:, None], self.embeddings(sparse)], dim=1)
        products = features @ features.transpose(1, 2)
        interactions = products[:, self.pairs[0], self.pairs[1]]
        logits: torch.Tensor = self.top(torch.cat([x, interactions], dim=1))
        return logits.squeeze(-1)


def dlrm(
    num_dense: int = 13,
    num_tables: int = 8,
    table_size: int = 1000,
    dim: int = 16,
    bottom: Sequence[int] = (64, 32),
    top: Sequence[int] = (64, 32),
) -> DLRM:
    """A small DLRM: ``num_tables`` tables of ``table_size`` rows, width ``dim``."""
    return DLRM(num_dense, [table_size] * num_tables, dim, bottom, top)


def click_loss(logits: torch.Tensor, clicks: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy of click logits against 0/1 labels."""
    return F.binary_cross_entropy_with_logits(logits, clicks)


def click_batches(
    batch_size: int,
    num_batches: int,
    num_dense: int = 13,
    num_tables: int = 8,
    table_size: int = 1000,
    bag: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> list[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """((dense, sparse), clicks) batches from a hidden logistic model of both kinds of input,
    so the model can learn them; the same arguments give the same batches."""
    generator = torch.Generator().manual_seed(seed)
    dense_weights = torch.randn(num_dense, generator=generator)
    row_weights = torch.randn(num_tables, table_size, generator=generator) * 0.5
    batches = []
    for _ in range(num_batches):
        dense = torch.randn(batch_size, num_dense, generator=generator)
        sparse = torch.randint(0, table_size, (batch_size, num_tables, bag), generator=generator)
        score = dense @ dense_weights / num_dense**0.5
        score += row_weights[torch.arange(num_tables)[None, :, None], sparse].sum((1, 2)) / bag
        clicks = torch.rand(batch_size, generator=generator) < torch.sigmoid(score)
        batches.append(((dense.to(dtype), sparse), clicks.to(dtype)))
    return batches
