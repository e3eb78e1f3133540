"""A language model's head and loss over chunks of its vocabulary, so a pipeline can split them.

    head = ChunkedHeadLoss.from_linear(lm_head, chunks=8)   # the same loss, 8 submodules
    loss = head(hidden, labels)                             # == cross_entropy(lm_head(hidden))

With a vocabulary of 128k tokens the output projection and its cross-entropy cost more than
every transformer block together, so no cut between layers balances a pipeline: the stage
holding the head is the bottleneck. Cut into chunks along the vocabulary, the head becomes a
run of layers like the blocks, and a split by measured cost puts some of its chunks on the
stage before (See Note [loss over vocabulary chunks]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

__all__ = ["ChunkedHeadLoss", "VocabChunk", "vocab_chunks"]

IGNORE_INDEX = -100
"""The label of a token the loss skips, as torch's cross_entropy and transformers use it."""


# Note [loss over vocabulary chunks]:
# Cross-entropy is lse(z) - z[label] per token, z the logits over the whole vocabulary. Chunk
# c sees only its logits z_c, so each chunk carries two per-token numbers to the next: the
# running log-sum-exp (lse = logaddexp(lse, logsumexp(z_c))), and the label's logit, added by
# the one chunk whose range holds the label. Both are exact (logaddexp is the stable merge of
# two log-sum-exps), and what crosses a stage boundary inside the head is the hidden state and
# these two numbers per token, never a logit. Autograd does the rest: the backward of the merge
# hands each chunk its share of softmax - one-hot, as the whole head's backward would.
class VocabChunk(nn.Module):
    """Rows ``[start, start + len(weight))`` of the output projection, and their part of the
    cross-entropy (See Note [loss over vocabulary chunks])."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, start: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.start = start

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        lse: torch.Tensor | None = None,
        picked: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The running log-sum-exp and label logit, this chunk added (None: the first)."""
        logits = F.linear(hidden, self.weight, self.bias)
        if logits.dtype in (torch.float16, torch.bfloat16):  # a log-sum-exp needs float32's range
            logits = logits.float()
        size = self.weight.shape[0]
        local = labels - self.start
        inside = (local >= 0) & (local < size)
        mine = logits.gather(-1, local.clamp(0, size - 1).unsqueeze(-1)).squeeze(-1)
        mine = torch.where(inside, mine, torch.zeros_like(mine))
        chunk_lse = logits.logsumexp(-1)
        if lse is None or picked is None:
            return chunk_lse, mine
        return torch.logaddexp(lse, chunk_lse), picked + mine

    def extra_repr(self) -> str:
        rows = self.weight.shape[0]
        return f"vocabulary [{self.start}, {self.start + rows}), bias={self.bias is not None}"


class ChunkedHeadLoss(nn.Module):
    """An output projection and its mean cross-entropy, the vocabulary cut into ``chunks``
    submodules (``chunks.0``, ``chunks.1``, ...) a pipeline may split between.

    ``forward(hidden, labels)`` equals ``cross_entropy(linear(hidden).flatten(0, -2),
    labels.flatten(), ignore_index=-100)``: the mean over tokens whose label is not -100.
    Half-precision logits are taken to float32 first, as transformers' losses take them.
    """

    def __init__(self, chunks: list[VocabChunk], source: str | None = None) -> None:
        super().__init__()
        self.source = source
        """Qualified name of the projection the chunks were cut from, whose tensors a weights
        file holds whole (``lm_head``): ``Pipeline(..., weights=DIR)`` reads their rows."""
        if not chunks:
            raise ValueError("a chunked head needs at least one chunk")
        expected = 0
        for index, chunk in enumerate(chunks):
            if chunk.start != expected:
                raise ValueError(
                    f"chunk {index} starts at token {chunk.start}, expected {expected}: the "
                    "chunks must cover the vocabulary in order, each starting where the last "
                    "ended (ChunkedHeadLoss.from_linear cuts a projection so)"
                )
            expected += chunk.weight.shape[0]
        self.chunks = nn.ModuleList(chunks)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, chunks: int, source: str | None = None
    ) -> ChunkedHeadLoss:
        """The head of ``linear`` (its weights copied, rows cut as evenly as they go);
        ``source`` names ``linear`` in weights files (see ``ChunkedHeadLoss.source``).

        The copy is a new parameter: a projection tied to the token embedding would come
        untied, so the model that builds the head refuses one (as ``ChunkedGPT`` does)."""
        vocab = linear.out_features
        if not 1 <= chunks <= vocab:
            raise ValueError(
                f"cannot cut a vocabulary of {vocab} tokens into {chunks} chunks; "
                f"use 1 to {vocab} chunks"
            )
        size, extra = divmod(vocab, chunks)
        parts, last = [], 0
        for index in range(chunks):  # as tensor_split cuts: the first `extra` a row longer
            first, last = last, last + size + (index < extra)
            bias = None if linear.bias is None else linear.bias.detach()[first:last].clone()
            parts.append(VocabChunk(linear.weight.detach()[first:last].clone(), bias, first))
        return cls(parts, source)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        lse, picked = None, None
        for chunk in self.chunks:
            lse, picked = chunk(hidden, labels, lse, picked)
        assert lse is not None and picked is not None
        counted = labels != IGNORE_INDEX
        losses = torch.where(counted, lse - picked, torch.zeros_like(lse))
        return losses.sum() / counted.sum()

    @property
    def parts(self) -> list[VocabChunk]:
        """The chunks, in vocabulary order."""
        return list(self.chunks)  # type: ignore[arg-type]

    def rows(self) -> list[tuple[int, int]]:
        """The vocabulary range ``[first, last)`` of each chunk."""
        return [(c.start, c.start + c.weight.shape[0]) for c in self.parts]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits (for evaluation, not the loss)."""
        return torch.cat([F.linear(hidden, c.weight, c.bias) for c in self.parts], dim=-1)


def vocab_chunks(model: nn.Module) -> list[str]:
    """Qualified names of the vocabulary chunks of ``model``'s chunked heads, in order: the
    places inside a head that a stage may start at."""
    return [
        f"{name}.chunks.{index}"
        for name, module in model.named_modules()
        if isinstance(module, ChunkedHeadLoss)
        for index in range(len(module.chunks))
    ]
