"""A small GPT and character data from Python's own source, for the demo, tests and benchmarks."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = [
    "Block",
    "Embedding",
    "Head",
    "KeyValueCache",
    "char_corpus",
    "char_ids",
    "gpt",
    "gpt_loss",
    "gpt_tp_plan",
    "text_batches",
    "unigram_entropy",
]


class Embedding(nn.Module):
    """Token plus learned position embeddings, then dropout."""

    def __init__(self, vocab_size: int, seq_len: int, dim: int, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(seq_len, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids, torch.arange(ids.shape[1], device=ids.device))

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Tokens ``ids`` at ``positions`` (broadcast to ``ids``): generation with left padding
        and a KV cache places tokens at positions other than 0, 1, 2, ..."""
        embedded: torch.Tensor = self.dropout(self.tokens(ids) + self.positions(positions))
        return embedded


class KeyValueCache(Protocol):
    """One block's keys and values of earlier positions (conveyor.inference.cache.StaticKV)."""

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``keys`` and ``values`` (batch, heads, new positions, head dim); return the
        keys and values of every position so far."""
        ...


class Attention(Protocol):
    """A cache that computes the attention itself: context parallelism's, whose keys and
    values are spread over ranks (conveyor.inference.context)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention of queries ``q`` given the new keys and values ``k``, ``v`` (batch,
        heads, new positions, head dim); returns (batch, heads, new positions, head dim)."""
        ...


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, each residual."""

    def __init__(self, dim: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        return self.attend(x, torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1))

    def attend(
        self,
        x: torch.Tensor,
        blocked: torch.Tensor | None,
        cache: KeyValueCache | Attention | None = None,
    ) -> torch.Tensor:
        """The block on ``x``, no attention where ``blocked`` (broadcast to the scores) is
        true. With a ``cache``, ``x`` holds the newest positions only: their keys and values
        join the cache and they attend to every position in it (``blocked`` then has one
        column per cached position). A cache that attends itself (``Attention``) is given
        the queries, keys and values, and ``blocked`` is not used."""
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=-1)
        q, k, v = (t.view(batch, seq, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        attend = getattr(cache, "attend", None)
        if attend is not None:
            y = attend(q, k, v)
        else:
            extend = getattr(cache, "extend", None)
            if extend is not None:
                k, v = extend(k, v)
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            if blocked is not None:
                scores = scores.masked_fill(blocked, float("-inf"))
            y = scores.softmax(-1) @ v
        y = y.transpose(1, 2).reshape(batch, seq, dim)
        x = x + self.dropout(self.proj(y))
        out: torch.Tensor = x + self.dropout(self.mlp(self.norm2(x)))
        return out


class Head(nn.Module):
    """Final layer norm and the projection to vocabulary logits."""

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.out(self.norm(x))
        return logits


def gpt(
    vocab_size: int = 96,
    seq_len: int = 64,
    dim: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    dropout: float = 0.1,
    tie_embeddings: bool = False,
) -> nn.Sequential:
    """A GPT as an nn.Sequential: embedding, ``num_layers`` blocks, head (``num_layers + 2``
    layers), so ``balance`` can split it anywhere."""
    embedding = Embedding(vocab_size, seq_len, dim, dropout)
    blocks = [Block(dim, num_heads, dropout) for _ in range(num_layers)]
    head = Head(dim, vocab_size)
    if tie_embeddings:  # one Parameter object: the output projection is the token table
        head.out.weight = embedding.tokens.weight
        # N(0, 1) rows would make logits of size sqrt(dim); keep them of order one
        nn.init.normal_(embedding.tokens.weight, std=dim**-0.5)
    return nn.Sequential(embedding, *blocks, head)


def gpt_tp_plan() -> dict[str, ParallelStyle]:
    """A tensor-parallel plan for ``gpt`` (``Pipeline(..., tp=N, tp_plan=gpt_tp_plan())``):
    each block's MLP split Megatron-style, its first Linear by output columns and the second
    by input rows, so the activations between them stay sharded and one all-reduce joins the
    output. Attention stays whole on every rank: its fused qkv projection would need a
    head-aware split (separate q, k and v projections) to be split by columns."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"*.mlp.0": ColwiseParallel(), "*.mlp.2": RowwiseParallel()}


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def char_corpus() -> str:
    """Text that ships with Python: the source of a few standard-library modules."""
    root = Path(logging.__file__).parent.parent
    names = ["textwrap.py", "string.py", "heapq.py", "bisect.py", "fnmatch.py", "colorsys.py"]
    return "\n".join((root / name).read_text(encoding="utf-8") for name in names)


def char_ids(vocab_size: int = 96) -> torch.Tensor:
    """``char_corpus`` as token ids: ``ord(c) - 32`` clipped to the vocabulary."""
    return torch.tensor([min(max(ord(c) - 32, 0), vocab_size - 1) for c in char_corpus()])


def unigram_entropy(vocab_size: int = 96) -> float:
    """Entropy (nats) of the corpus's character frequencies: the loss of a model that
    ignores context. A language model that learns anything goes well below it."""
    counts = torch.bincount(char_ids(vocab_size), minlength=vocab_size).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def text_batches(
    batch_size: int, seq_len: int, num_batches: int, vocab_size: int = 96, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, next-token targets) batches of printable characters from ``char_corpus``.

    Characters map to ``ord(c) - 32`` clipped to the vocabulary; windows start at random
    offsets drawn from ``seed``, so the same arguments give the same batches.
    """
    ids = char_ids(vocab_size)
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_batches):
        starts = torch.randint(0, len(ids) - seq_len - 1, (batch_size,), generator=generator)
        windows = torch.stack([ids[s : s + seq_len + 1] for s in starts.tolist()])
        batches.append((windows[:, :-1], windows[:, 1:]))
    return batches
