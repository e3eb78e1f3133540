"""conveyor's own GPT (conveyor.models.gpt) as a CausalLM, with a static KV cache per block."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from conveyor.inference.cache import StaticKV
from conveyor.inference.lm import Attend, CausalLM, Context
from conveyor.models.gpt import Block, Embedding, Head
from conveyor.parallel.context_parallel import AttentionSpec

__all__ = ["GptLM", "is_gpt"]


def is_gpt(layers: Sequence[nn.Module]) -> bool:
    """Whether ``layers`` are conveyor's GPT: Embedding, Blocks, Head (``gpt()``'s Sequential)."""
    return (
        len(layers) >= 2
        and isinstance(layers[0], Embedding)
        and isinstance(layers[-1], Head)
        and all(isinstance(layer, Block) for layer in layers[1:-1])
    )


class GptLM(CausalLM):
    """``conveyor.models.gpt``'s layers (an Embedding, Blocks, a Head) as units: the units are
    the Sequential's own layers, so a Pipeline's balance splits both the same way."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        if not is_gpt(layers):
            raise TypeError(
                "GptLM takes conveyor.models.gpt's layers: an Embedding, Blocks and a Head"
            )
        self.layers = list(layers)
        embedding, head = self.layers[0], self.layers[-1]
        assert isinstance(embedding, Embedding) and isinstance(head, Head)
        self.num_units = len(self.layers)
        self.hidden_size = embedding.tokens.embedding_dim
        self.vocab_size = head.out.out_features
        self.context_length = embedding.positions.num_embeddings
        self.dtype = embedding.tokens.weight.dtype
        self.num_heads = self._block(1).num_heads if self.num_blocks else 1

    def _block(self, unit: int) -> Block:
        block = self.layers[unit]
        assert isinstance(block, Block)
        return block

    def unit_modules(self, units: range) -> list[nn.Module]:
        return [self.layers[u] for u in units]

    def new_cache(
        self, units: range, rows: int, capacity: int, device: torch.device, kind: str
    ) -> dict[int, StaticKV]:
        self.check_cache_kind(kind, ("static",))
        head_dim = self.hidden_size // self.num_heads
        return {
            u: StaticKV(rows, self.num_heads, capacity, head_dim, self.dtype, device)
            for u in self.blocks(units)
        }

    def cache_bytes_per_position(self, units: range) -> int:
        return 2 * self.hidden_size * self.dtype.itemsize * len(self.blocks(units))

    def run(self, units: range, x: torch.Tensor, cache: Any, context: Context) -> torch.Tensor:
        blocked = context.blocked() if self.blocks(units) else None
        for u in units:
            if u == 0:
                embedding = self.layers[0]
                assert isinstance(embedding, Embedding)
                x = embedding.embed(x, context.positions)
            elif u == self.num_units - 1:
                x = self.layers[u](x[:, -1:])[:, -1]
            else:
                x = self._block(u).attend(x, blocked, cache[u])
        return x

    supports_context_parallel = True

    def attention_heads(self) -> tuple[int, int, int]:
        return self.num_heads, self.num_heads, self.hidden_size // self.num_heads

    def run_attending(
        self, units: range, x: torch.Tensor, context: Context, attend: Attend
    ) -> torch.Tensor:
        for u in units:
            if u == 0:
                embedding = self.layers[0]
                assert isinstance(embedding, Embedding)
                x = embedding.embed(x, context.positions)
            elif u < self.num_units - 1:
                x = self._block(u).attend(x, None, _Attending(u - 1, attend))
        return x


class _Attending:
    """What a Block asks its cache to do, as ``attend`` does it (conveyor.models.gpt's
    ``Attention``): the block's attention, keys and values kept elsewhere."""

    def __init__(self, layer: int, attend: Attend) -> None:
        self.layer, self.function = layer, attend

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        spec = AttentionSpec(q.shape[-1] ** -0.5, q.shape[1], k.shape[1])
        return self.function(self.layer, q, k, v, spec)
