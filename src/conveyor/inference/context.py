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

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.inference.gpt import GptLM
from conveyor.inference.hf import HfCausalLM, HfDecoder
from conveyor.inference.lm import CausalLM, Context, CpPlace
from conveyor.models.gpt import Block, Embedding
from conveyor.parallel.context_parallel import (
    AttentionSpec,
    KVShard,
    ring_attention,
    shard_attention,
)

__all__ = ["SUPPORTED", "ContextParallelLM", "check_supported", "context_parallel_lm"]

SUPPORTED = ("conveyor GPT", "llama", "qwen2", "mistral")
"""Models whose attention context parallelism replaces (Hugging Face model types by name)."""

_HF_TYPES = ("llama", "qwen2", "mistral")
_ATTENTION = "conveyor_context_parallel"
"""The name conveyor's attention is registered under in transformers' AttentionInterface."""


# Note [context parallel decode]:
# Only attention needs the whole sequence; embeddings, norms, MLPs and the head work token by
# token. So a cp rank runs every module as usual on the tokens it holds, and its attention is
# replaced: for a prompt, ring attention over every rank's chunks, after which the rank keeps
# its chunks' keys and values (its shard); for a new token, which every rank of the group
# runs alike, attention over every shard merged by one all-gather, the token's key and value
# joining the shard of ``owner_of`` its position. A Hugging Face model's attention modules are
# its own (projections, rotary embeddings, grouped heads); only the function they call for
# attention is conveyor's, registered in transformers' AttentionInterface and selected while
# a context-parallel run is in progress.
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


@dataclass(frozen=True)
class _Call:
    """One run of a stage's blocks: where this rank's tokens sit, and the group."""

    place: CpPlace
    context: Context
    group: dist.ProcessGroup | None
    layers: Mapping[int, _Layer]
    """By layer index."""


_current: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("cp_call", default=None)


def context_parallel_lm(lm: CausalLM, group: dist.ProcessGroup | None) -> ContextParallelLM:
    """``lm`` with its attention split over the cp ``group``; See ``check_supported``."""
    check_supported(lm)
    return ContextParallelLM(lm, group)


def check_supported(lm: CausalLM) -> None:
    """Refuse, before any communication, a model whose attention conveyor cannot shard.

    Raises:
        TypeError: naming the model's attention classes and those conveyor supports.
    """
    model = getattr(lm, "model", None)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not isinstance(lm, GptLM) and not (isinstance(lm, HfDecoder) and model_type in _HF_TYPES):
        where = type(model).__name__ if model is not None else type(lm).__name__
        attention = _attention_classes(model)
        raise TypeError(
            f"context parallelism replaces the attention of {list(SUPPORTED)}, but {where}'s "
            f"attention ({', '.join(attention) or 'unknown'}) is not one conveyor can shard; "
            "decode it with cp=1 (a pipeline over the ranks), or adapt its attention"
        )


def _attention_classes(model: Any) -> list[str]:
    if not isinstance(model, nn.Module):
        return []
    return sorted(
        {type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Attention")}
    )


class ContextParallelLM(CausalLM):
    """A CausalLM run by every rank of a cp group, its KV cache split along the sequence."""

    def __init__(self, inner: CausalLM, group: dist.ProcessGroup | None) -> None:
        self.inner = inner
        self.group = group
        self.size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.num_units = inner.num_units
        self.hidden_size = inner.hidden_size
        self.vocab_size = inner.vocab_size
        self.context_length = inner.context_length
        self.dtype = inner.dtype
        self.default_cache = "static"
        self.heads, self.kv_heads, self.head_dim = _head_sizes(inner)
        if isinstance(inner, HfCausalLM):
            _register_attention()

    @property
    def generation_config(self) -> Any:
        return self.inner.generation_config

    def unit_modules(self, units: range) -> list[nn.Module]:
        return self.inner.unit_modules(units)

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
        call = _Call(place, context, self.group, cache)
        token = _current.set(call)
        try:
            with _selected(self.inner):
                out = self._run(units, x, cache, context)
        finally:
            _current.reset(token)
        return out

    def _run(self, units: range, x: torch.Tensor, cache: Any, context: Context) -> torch.Tensor:
        head = self.num_units - 1
        body = range(units.start, min(units.stop, head))
        if len(body) and x.shape[1] == 0:
            x = self._idle(body, x)
        elif len(body):
            x = _body(self.inner, body, x, cache, context)
        if head in units:
            x = self._logits(x, context.cp)
        return x

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
            _attend(u - 1, query, empty, empty, spec)
        return x.new_zeros((rows, 0, self.hidden_size)) if 0 in units else x

    def _logits(self, x: torch.Tensor, place: CpPlace | None) -> torch.Tensor:
        """Each sequence's last-position logits on every rank of the group: a prompt's last
        position is on one rank, which computes and broadcasts them."""
        assert place is not None
        last = self.num_units - 1
        if place.decoding or self.size == 1:
            return self.inner.run(range(last, last + 1), x, None, _NO_CONTEXT)
        owner = place.owner_of_last
        rows = x.shape[0]
        if owner == self.rank:
            logits = self.inner.run(range(last, last + 1), x, None, _NO_CONTEXT)
        else:
            logits = x.new_empty((rows, self.vocab_size))
        source = dist.get_global_rank(self.group, owner) if self.group is not None else owner
        dist.broadcast(logits, source, group=self.group)
        return logits


def _head_sizes(lm: CausalLM) -> tuple[int, int, int]:
    """(query heads, key/value heads, head size) of the model's attention."""
    if isinstance(lm, GptLM):
        return lm.num_heads, lm.num_heads, lm.hidden_size // lm.num_heads
    config: Any = getattr(lm, "config", None)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or lm.hidden_size // heads)
    return heads, kv_heads, head_dim


_NO_CONTEXT = Context(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool), 0)
"""The head reads no context."""


def _body(
    lm: CausalLM, units: range, x: torch.Tensor, cache: Mapping[int, _Layer], context: Context
) -> torch.Tensor:
    """Embedding and blocks of ``units`` with conveyor's attention (See Note [context parallel
    decode])."""
    if isinstance(lm, GptLM):
        for u in units:
            layer = lm.layers[u]
            if isinstance(layer, Embedding):
                x = layer.embed(x, context.positions)
            else:
                assert isinstance(layer, Block)
                x = layer.attend(x, None, _GptAttention(u - 1))
        return x
    assert isinstance(lm, HfCausalLM)
    if 0 in units:
        x = lm.embed(x, context)
    blocks = lm.blocks(units)
    rotary = {t: lm.position_embeddings(x, context, t) for t in set(lm.layer_types)}
    for u in blocks:
        x = lm.block(u - 1, x, None, rotary[lm.layer_types[u - 1]], None, context)
    return x


class _GptAttention:
    """conveyor's GPT Block asks its cache to attend: this one attends over the cp shards."""

    def __init__(self, layer: int) -> None:
        self.layer = layer

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        heads, dim = q.shape[1], q.shape[-1]
        spec = AttentionSpec(dim**-0.5, heads, k.shape[1])
        return _attend(self.layer, q, k, v, spec)


def _attend(
    layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
) -> torch.Tensor:
    """This rank's tokens' attention over the whole sequence; the keys and values of its
    prompt tokens, or of a new token it owns, join its shard."""
    call = _current.get()
    assert call is not None, "context-parallel attention outside a context-parallel run"
    entry = call.layers[layer]
    if entry.shard is None:
        entry.shard = KVShard(
            entry.rows, k.shape[1], entry.capacity, k.shape[-1], k.dtype, k.device
        )
    place, key_real = call.place, call.context.key_mask
    if place.decoding:
        index = torch.tensor([place.start], device=q.device)
        return shard_attention(q, k, v, index, key_real, entry.shard, spec, call.group)
    out = ring_attention(q, k, v, place.shards, key_real, spec, call.group)
    mine = torch.cat([torch.arange(r.start, r.stop) for r in place.shards[place.rank]])
    entry.shard.append(k, v, mine.to(k.device))
    return out


def _hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function signature, computing context-parallel attention."""
    layer = int(getattr(module, "layer_idx", 0))
    window = kwargs.get("sliding_window")
    spec = AttentionSpec(
        float(scaling if scaling is not None else query.shape[-1] ** -0.5),
        query.shape[1],
        key.shape[1],
        int(window) if window else None,
    )
    out = _attend(layer, query, key, value, spec)
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    """Make conveyor's attention selectable by name in transformers (once per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if _ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(_ATTENTION, _hf_attention)
        AttentionMaskInterface.register(_ATTENTION, lambda *args, **kwargs: None)


@contextlib.contextmanager
def _selected(lm: CausalLM) -> Iterator[None]:
    """A Hugging Face model's attention set to conveyor's while the body runs."""
    config = getattr(getattr(lm, "model", None), "config", None)
    if config is None or not isinstance(lm, HfCausalLM):
        yield
        return
    before = config._attn_implementation
    config._attn_implementation = _ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before
