"""Context parallelism's attention (conveyor.parallel.context_parallel): attention over shards
of the keys, merged, equals attention over all of them; ring prefill and sharded decode on
gloo ranks equal one process's attention, with padding, grouped heads and a sliding window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conveyor.parallel.context_parallel import (
    AttentionSpec,
    KVShard,
    merge,
    owner_of,
    partial_attention,
    ring_attention,
    shard_attention,
    visible,
    zigzag,
)
from dist import run_ranks


def reference(q, k, v, key_real, spec, start=0):  # type: ignore[no-untyped-def]
    """Plain attention of queries at positions start.. over every key before them."""
    n = k.shape[2]
    index = torch.arange(start, start + q.shape[2])
    allowed = visible(index, torch.arange(n), key_real, spec.window)
    k = k.repeat_interleave(spec.groups, dim=1)
    v = v.repeat_interleave(spec.groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) * spec.scale
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def inputs(rows=2, heads=4, kv_heads=2, n=13, d=8, seed=0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(rows, kv_heads, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(rows, kv_heads, n, d, generator=g, dtype=torch.float64)
    real = torch.ones(rows, n, dtype=torch.bool)
    real[1, :4] = False  # left padding
    return q, k, v, real


@pytest.mark.parametrize("window", [None, 3])
def test_merged_shards_equal_attention_over_all_keys(window: int | None) -> None:
    q, k, v, real = inputs()
    spec = AttentionSpec(scale=0.3, num_heads=4, num_kv_heads=2, window=window)
    query = torch.arange(13)
    parts = []
    for keys in (
        torch.tensor([0, 3, 4, 9]),
        torch.tensor([1, 2, 12]),
        torch.tensor([5, 6, 7, 8, 10, 11]),
    ):
        allowed = visible(query, keys, real[:, keys], window)
        parts.append(partial_attention(q, k[:, :, keys], v[:, :, keys], spec, allowed))
    expected = reference(q, k, v, real, spec)
    torch.testing.assert_close(merge(parts).out, expected, rtol=0, atol=1e-12)


def test_zigzag_gives_every_rank_two_chunks_covering_the_prompt() -> None:
    shards = zigzag(10, 2)
    assert shards == [[range(0, 2), range(7, 10)], [range(2, 5), range(5, 7)]]
    covered = sorted(p for ranges in zigzag(1001, 3) for r in ranges for p in r)
    assert covered == list(range(1001))
    assert [owner_of(i, 3) for i in range(5)] == [0, 1, 2, 0, 1]


def _prefill_then_decode(rank: int, world_size: int, window: int | None) -> None:
    torch.manual_seed(0)
    spec = AttentionSpec(scale=0.3, num_heads=4, num_kv_heads=2, window=window)
    n, new = 23, 5
    q, k, v, real = inputs(n=n + new)
    real_prompt = real[:, :n]
    shards = zigzag(n, world_size)
    mine = shards[rank]
    positions = torch.cat([torch.arange(r.start, r.stop) for r in mine])
    out = ring_attention(
        q[:, :, positions], k[:, :, positions], v[:, :, positions], shards, real_prompt,
        spec, None,
    )  # fmt: skip
    expected = reference(q[:, :, :n], k[:, :, :n], v[:, :, :n], real_prompt, spec)
    torch.testing.assert_close(out, expected[:, :, positions], rtol=0, atol=1e-12)
    # the rank keeps its prompt positions as its shard, then every P-th new token
    shard = KVShard(2, 2, n + new, 8, torch.float64, torch.device("cpu"))
    shard.append(k[:, :, positions], v[:, :, positions], positions)
    for t in range(n, n + new):
        index = torch.tensor([t])
        got = shard_attention(
            q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], index,
            real[:, : t + 1], shard, spec, None,
        )  # fmt: skip
        want = reference(
            q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], real[:, : t + 1], spec, t
        )
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    mine_total = sum(len(r) for r in mine) + len(
        [t for t in range(n, n + new) if t % world_size == rank]
    )
    assert shard.length == mine_total


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_prefill_and_sharded_decode_equal_one_process(tmp_path: Path, world_size: int) -> None:
    for window in (None, 4):
        run_ranks(_prefill_then_decode, tmp_path, world_size, timeout_s=120, window=window)
