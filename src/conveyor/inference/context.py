"""Context-parallel decoding: a CausalLM whose blocks attend over a sequence held by a cp group.

    lm = ContextParallelLM(as_causal_lm(model), cp_group)   # every rank of the group
    cache = lm.new_cache(units, rows, capacity, device, "static")   # this rank's KV shards
    hidden = lm.run(units, my_prompt_ids, cache, context)   # context.cp: where my tokens sit

The ranks of a cp group hold the same layers. A prompt is cut in zigzag chunks over them
(conveyor.parallel.context_parallel.zigzag): each runs its chunks through its layers with ring
attention and keeps their keys and values as its shard of the cache; each new token then runs
on every rank of the group, attends over every shard, and joins one shard, round robin. The
logits of a prompt's last position are computed where that position is and broadcast, so every
rank of the group samples the same token. See Note [context parallel decode].
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.inference.lm import CausalLM, Context, CpPlace
from conveyor.parallel.context_parallel import (
    AttentionSpec,
    Exchanger,
    KVShard,
    ring_attention,
    shard_attention,
)

__all__ = ["ContextParallelLM", "check_supported", "context_parallel_lm"]


# Note [context parallel decode]:
# Only attention needs the whole sequence; embeddings, norms, MLPs and the head work token by
# token. So a cp rank runs every module as usual on the tokens it holds, and only attention is
# replaced (CausalLM.run_attending): for a prompt, ring attention over every rank's chunks,
# after which the rank keeps its chunks' keys and values (its shard); for a new token, which
# every rank of the group runs alike, attention over every shard merged after one exchange
# of the partial results, the token's key and value joining the shard of ``owner_of`` its
# position. The model's own modules compute everything else: projections, rotary positions,
# grouped heads.
@dataclass
class _Layer:
    """One block's shard of the cache, for one group of sequences."""

    shard: KVShard | None
    """Allocated on first use: the key/value heads and head size come from the model."""
    rows: int
    capacity: int

    @property
    def nbytes(self) -> int:
        return 0 if self.shard is None else self.shard.nbytes


def context_parallel_lm(lm: CausalLM, group: dist.ProcessGroup | None) -> ContextParallelLM:
    """``lm`` with its attention split over the cp ``group``; See ``check_supported``."""
    check_supported(lm)
    return ContextParallelLM(lm, group)


def check_supported(lm: CausalLM) -> None:
    """Refuse, before any communication, a model whose attention conveyor cannot shard.

    Raises:
        TypeError: naming the model's attention classes.
    """
    if lm.supports_context_parallel:
        return
    model = getattr(lm, "model", None)
    where = type(model).__name__ if model is not None else type(lm).__name__
    attention = _attention_classes(model)
    raise TypeError(
        f"context parallelism replaces the attention of conveyor's GPT and of Hugging Face "
        f"Llama, Qwen2 and Mistral models, but {where}'s attention "
        f"({', '.join(attention) or 'unknown'}) is not one conveyor can shard; decode it with "
        "cp=1 (a pipeline over the ranks), or adapt its attention "
        "(CausalLM.run_attending)"
    )


def _attention_classes(model: Any) -> list[str]:
    if not isinstance(model, nn.Module):
        return []
    names = {type(m).__name__ for m in model.modules()}
    return sorted(name for name in names if name.endswith("Attention"))


class ContextParallelLM(CausalLM):
    """A CausalLM run by every rank of a cp group, its KV cache split along the sequence."""

    default_cache = "static"
    supports_context_parallel = True

    def __init__(self, inner: CausalLM, group: dist.ProcessGroup | None) -> None:
        self.inner = inner
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_units = inner.num_units
        self.hidden_size = inner.hidden_size
        self.vocab_size = inner.vocab_size
        self.context_length = inner.context_length
        self.dtype = inner.dtype
        self.heads, self.kv_heads, self.head_dim = inner.attention_heads()
        self.exchanger: Exchanger | None = None
        """How decode's partial attentions reach the other ranks (None: messages over the
        group); set by DecodePipeline once it knows where the ranks run."""
        self._run_state: tuple[CpPlace, Context, Mapping[int, _Layer]] | None = None
        """The run in progress: where this rank's tokens sit, their context, the shards."""

    @property
    def generation_config(self) -> Any:
        return self.inner.generation_config

    def unit_modules(self, units: range) -> list[nn.Module]:
        return self.inner.unit_modules(units)

    def attention_heads(self) -> tuple[int, int, int]:
        return self.heads, self.kv_heads, self.head_dim

    def new_cache(
        self, units: range, rows: int, capacity: int, device: torch.device, kind: str
    ) -> dict[int, _Layer]:
        """This rank's shard of every block's cache: its share of ``capacity`` positions."""
        self.check_cache_kind(kind, ("static",))
        # the prompt's zigzag chunks and the new tokens round robin: at most 2 over 1/P
        share = -(-capacity // self.size) + 2
        return {u - 1: _Layer(None, rows, share) for u in self.blocks(units)}

    def cache_bytes_per_position(self, units: range) -> int:
        """Bytes per position of the whole sequence that this rank keeps: 1/P of them."""
        return -(-self.inner.cache_bytes_per_position(units) // self.size)

    def run(self, units: range, x: torch.Tensor, cache: Any, context: Context) -> torch.Tensor:
        place = context.cp
        assert place is not None, "a context-parallel run needs the item's cp place"
        head = self.num_units - 1
        body = range(units.start, min(units.stop, head))
        self._run_state = (place, context, cache)
        try:
            if len(body) and x.shape[1] == 0:
                x = self._idle(body, x)
            elif len(body):
                x = self.inner.run_attending(body, x, context, self._attend)
        finally:
            self._run_state = None
        if head in units:
            x = self._logits(x, place)
        return x

    def _attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
    ) -> torch.Tensor:
        """This rank's tokens' attention over the whole sequence; the keys and values of its
        prompt tokens, or of a new token it owns, join its shard."""
        assert self._run_state is not None, "context-parallel attention outside a run"
        place, context, layers = self._run_state
        entry = layers[layer]
        if entry.shard is None:
            entry.shard = KVShard(
                entry.rows, k.shape[1], entry.capacity, k.shape[-1], k.dtype, k.device
            )
        if place.decoding:
            index = torch.tensor([place.start], device=q.device)
            return shard_attention(
                q, k, v, index, context.key_mask, entry.shard, spec, self.group, self.exchanger
            )
        out = ring_attention(q, k, v, place.shards, context.key_mask, spec, self.group)
        mine = torch.tensor(place.mine, device=k.device)
        entry.shard.append(k, v, mine)
        return out

    def _idle(self, units: range, x: torch.Tensor) -> torch.Tensor:
        """A rank that holds none of a short prompt's tokens: its blocks still pass the
        others' keys and values around the ring; its output is as empty as its input."""
        rows = x.shape[0]
        empty = torch.zeros(
            (rows, self.kv_heads, 0, self.head_dim), dtype=self.dtype, device=x.device
        )
        query = empty.new_zeros((rows, self.heads, 0, self.head_dim))
        spec = AttentionSpec(self.head_dim**-0.5, self.heads, self.kv_heads)
        for u in self.blocks(units):
            self._attend(u - 1, query, empty, empty, spec)
        return x.new_zeros((rows, 0, self.hidden_size)) if 0 in units else x

    def _logits(self, x: torch.Tensor, place: CpPlace) -> torch.Tensor:
        """Each sequence's last-position logits on every rank of the group: a prompt's last
        position is on one rank, which computes and broadcasts them."""
        last = range(self.num_units - 1, self.num_units)
        if place.decoding or self.size == 1:
            return self.inner.run(last, x, None, _NO_CONTEXT)
        owner = place.owner_of_last
        if owner == self.rank:
            logits = self.inner.run(last, x, None, _NO_CONTEXT)
        else:
            logits = x.new_empty((x.shape[0], self.vocab_size))
        source = dist.get_global_rank(self.group, owner) if self.group is not None else owner
        dist.broadcast(logits, source, group=self.group)
        return logits


_NO_CONTEXT = Context(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool), 0)
"""The head reads no context."""
