"""conveyor's GPT with its head and loss over vocabulary chunks, for large vocabularies.

    model = ChunkedGPT(gpt(vocab_size=131072, ...), chunks=8)   # the same weights and loss
    pipe = Pipeline(model, num_stages=2, example_inputs={"input_ids": x, "labels": y})

The split by measured cost may then start a stage inside the head (docs/models.md).
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.models.gpt import Embedding, Head
from conveyor.split.vocab import ChunkedHeadLoss

__all__ = ["ChunkedGPT"]


class ChunkedGPT(nn.Module):
    """A ``gpt()`` model computing its own mean next-token loss from ``labels``, the head
    cut along the vocabulary (conveyor.split.vocab) so that a split by measured cost can
    spread a large vocabulary's head over stages.

    ``forward(input_ids, labels)`` returns ``{"loss": gpt_loss(gpt(input_ids), labels)}``
    (tokens labelled -100 aside); the stages may start at ``layers.i`` and ``head.chunks.i``.
    """

    def __init__(self, gpt: nn.Sequential, chunks: int) -> None:
        super().__init__()
        embedding, *blocks, head = gpt
        if not isinstance(embedding, Embedding) or not isinstance(head, Head):
            raise TypeError(
                "ChunkedGPT takes a model made by conveyor.models.gpt() (embedding, blocks, "
                f"head), got layers {type(embedding).__name__} ... {type(head).__name__}"
            )
        if head.out.weight is embedding.tokens.weight:
            raise ValueError(
                "the GPT's head is tied to its token embedding, and chunks of the head would "
                "be copies that untie it; build it with gpt(..., tie_embeddings=False)"
            )
        self.embedding = embedding
        self.layers = nn.ModuleList(blocks)
        self.norm = head.norm
        self.head = ChunkedHeadLoss.from_linear(head.out, chunks)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embedding(input_ids)
        for layer in self.layers:
            x = layer(x)
        return {"loss": self.head(self.norm(x), labels)}
