"""A causal language model as conveyor generates with it: units with KV caches, run in ranges.

    lm = as_causal_lm(model)                        # conveyor.pipeline.decode
    cache = lm.new_cache(range(0, 3), rows=4, capacity=160, device=cpu)
    hidden = lm.run(range(0, 3), token_ids, cache, context)    # a stage: units 0, 1, 2

A model's *units* are, in order, its token embedding (unit 0), its transformer blocks (units
1..n) and its final norm with the LM head (unit n + 1); a stage runs a contiguous range of
them. Every rank knows every item's ``Context`` (where its tokens sit), so only hidden states
travel between stages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from conveyor.parallel.context_parallel import AttentionSpec

__all__ = ["Attend", "CausalLM", "Context", "CpPlace"]

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, AttentionSpec], torch.Tensor]
"""Attention in place of a block's own: (layer index, queries, the new keys, the new values,
what the layer computes) -> its output, (rows, heads, tokens, head size); context
parallelism's (conveyor.inference.context)."""


@dataclass(frozen=True)
class CpPlace:
    """Where a context-parallel rank's tokens of one item sit (conveyor.inference.context)."""

    rank: int
    """This rank's index in its cp group."""
    shards: tuple[tuple[range, ...], ...]
    """Each cp rank's prompt positions (conveyor.parallel.context_parallel.zigzag)."""
    decoding: bool
    """A new token (every rank runs it alike) rather than the prompt (each rank its chunks)."""
    start: int
    """The cache position of the item's first token."""

    @property
    def owner_of_last(self) -> int:
        """The cp rank that holds the prompt's last position."""
        last = max(r.stop for ranges in self.shards for r in ranges) - 1
        return next(i for i, ranges in enumerate(self.shards) if any(last in r for r in ranges))

    @property
    def mine(self) -> list[int]:
        """The cache positions of this rank's tokens of the item, in order."""
        if self.decoding:
            return [self.start]
        return [p for r in self.shards[self.rank] for p in r]


@dataclass(frozen=True)
class Context:
    """Where one item's tokens sit in their sequences: what a stage needs besides its input."""

    positions: torch.Tensor
    """(rows, length) position of each token: its count of earlier real (unpadded) tokens."""
    key_mask: torch.Tensor
    """(rows, start + length) bool, True at real tokens: left padding is False."""
    start: int
    """Tokens before this item's (cache indices start, start + 1, ...)."""
    cp: CpPlace | None = None
    """Under context parallelism, where this rank's tokens of the item sit; ``positions``
    then holds those tokens only."""

    @property
    def length(self) -> int:
        return int(self.positions.shape[1])

    def blocked(self) -> torch.Tensor:
        """(rows, 1, length, start + length) bool, True where a query may not look: padding
        and later positions. A query always sees itself, so a padding query's row is never
        empty (its softmax would be NaN, and NaN times a zero weight is still NaN)."""
        device = self.key_mask.device
        query = torch.arange(self.start, self.start + self.length, device=device)[:, None]
        key = torch.arange(self.start + self.length, device=device)[None, :]
        visible = self.key_mask[:, None, :] & (key <= query)
        return ~(visible | (key == query))[:, None]


class CausalLM(ABC):
    """A model conveyor can generate with: units (embedding, blocks, head) and their caches.

    Subclasses adapt one family of models (conveyor's GPT, Hugging Face Llama and GPT-2);
    ``conveyor.pipeline.decode.as_causal_lm`` picks one.
    """

    num_units: int
    """Embedding, blocks, head: ``num_blocks + 2``."""
    hidden_size: int
    vocab_size: int
    context_length: int | None
    """Most positions the model can take (prompt plus new tokens); None if unbounded."""
    dtype: torch.dtype
    """Dtype of the hidden states that travel between stages."""
    default_cache: str = "static"
    """Cache kind used when the generation config does not name one."""

    @property
    def generation_config(self) -> Any:
        """The model's own generation settings (a Hugging Face model's), whose stop and pad
        tokens ``generate`` starts from; None."""
        return None

    @property
    def num_blocks(self) -> int:
        return self.num_units - 2

    def blocks(self, units: range) -> list[int]:
        """The block units among ``units`` (their layer index is the unit index - 1)."""
        return [u for u in units if 0 < u < self.num_units - 1]

    @abstractmethod
    def unit_modules(self, units: range) -> list[nn.Module]:
        """The modules that compute ``units`` (a stage's parameters)."""

    @abstractmethod
    def new_cache(
        self, units: range, rows: int, capacity: int, device: torch.device, kind: str
    ) -> Any:
        """An empty cache of ``units``'s blocks for ``rows`` sequences of at most ``capacity``
        positions (``kind``: 'static' or 'dynamic', as the model supports)."""

    @abstractmethod
    def cache_bytes_per_position(self, units: range) -> int:
        """Bytes of keys and values that ``units``'s blocks keep per sequence and position."""

    @abstractmethod
    def run(self, units: range, x: torch.Tensor, cache: Any, context: Context) -> torch.Tensor:
        """Run ``units`` on ``x``: token ids (rows, length) if unit 0 is among them, else hidden
        states (rows, length, hidden). Returns hidden states, or the logits of each sequence's
        last position (rows, vocab) if the head is among them. Extends ``cache``."""

    supports_context_parallel: bool = False
    """Whether ``run_attending`` can replace this model's attention (context parallelism)."""

    def attention_heads(self) -> tuple[int, int, int]:
        """(query heads, key/value heads, head size) of the blocks' attention."""
        raise TypeError(f"{type(self).__name__} does not say its attention's heads")

    def run_attending(
        self, units: range, x: torch.Tensor, context: Context, attend: Attend
    ) -> torch.Tensor:
        """The embedding and blocks among ``units`` on ``x`` with ``attend`` in place of each
        block's attention over a cache (it keeps keys and values itself); no head."""
        raise TypeError(
            f"{type(self).__name__} cannot have its attention replaced (context parallelism)"
        )

    def check_cache_kind(self, kind: str, supported: tuple[str, ...]) -> None:
        if kind not in supported:
            raise ValueError(
                f"{type(self).__name__} keeps a {' or '.join(map(repr, supported))} KV cache, "
                f"got cache={kind!r}"
            )
