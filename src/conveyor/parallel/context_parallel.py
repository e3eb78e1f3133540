"""Context parallelism: one sequence's attention computed by ranks that each hold a part of it.

    shards = zigzag(length, cp_size)                    # prompt positions of each cp rank
    out = ring_attention(q, k, v, mine, spec, group)     # prefill: KV blocks around the ring
    cache = KVShard(rows, kv_heads, capacity, head_dim, dtype, device)
    out = shard_attention(q, k_new, v_new, index, cache, spec, group)   # decode: one merge

Every rank of a cp group runs the same layers on its own positions. Keys and values never
gather in one place: prefill passes each rank's block around the ring (overlapped with the
attention over the block in hand), and decode attends over each rank's shard and merges the
partial results. See Note [merging attention over shards].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from conveyor.torch_compat import attention_with_lse

__all__ = [
    "AttentionSpec",
    "Exchanger",
    "KVShard",
    "Partial",
    "cp_groups",
    "exchange",
    "merge",
    "owner_of",
    "partial_attention",
    "ring_attention",
    "shard_attention",
    "zigzag",
]


# Note [merging attention over shards]:
# Attention of a query over keys K is softmax(s) V with s the scaled scores. Split K into
# shards K_1..K_P: shard i gives o_i = softmax(s_i) V_i and l_i = logsumexp(s_i). The whole
# is exact from the parts: l = logsumexp_i(l_i) and o = sum_i exp(l_i - l) o_i. A shard with
# no key the query may see has l_i = -inf and weight 0 (never NaN: its weight is set to 0,
# not computed from -inf - -inf). Decode merges once per layer: every rank sends every other the
# (o_i, l_i) of the new tokens, so every rank holds the same merged output, the same next
# hidden state and samples the same token. Prefill merges as the ring turns, block by block.
@dataclass(frozen=True)
class Partial:
    """Attention of some queries over some of the keys: the output normalised over those keys
    and the log-sum-exp of their scores (-inf where the queries see none of them)."""

    out: torch.Tensor
    """(rows, heads, queries, head_dim)."""
    lse: torch.Tensor
    """(rows, heads, queries), float32 or wider."""


@dataclass(frozen=True)
class AttentionSpec:
    """What attention a layer computes: scale, grouped key/value heads, sliding window."""

    scale: float
    num_heads: int
    num_kv_heads: int
    window: int | None = None
    """Keys at most ``window - 1`` cache positions before the query are seen (None: all)."""

    @property
    def groups(self) -> int:
        return self.num_heads // self.num_kv_heads


def zigzag(length: int, num_ranks: int) -> list[list[range]]:
    """Each rank's prompt positions: the prompt cut in 2P chunks, rank i taking chunks i and
    2P - 1 - i, so that under causal masking every rank has about the same work (the first
    chunks see few keys, the last ones many)."""
    bounds = [length * c // (2 * num_ranks) for c in range(2 * num_ranks + 1)]
    chunks = [range(bounds[c], bounds[c + 1]) for c in range(2 * num_ranks)]
    return [[chunks[r], chunks[2 * num_ranks - 1 - r]] for r in range(num_ranks)]


def owner_of(index: int, num_ranks: int) -> int:
    """The cp rank whose shard keeps the key and value of cache position ``index`` after the
    prompt: round robin, so shards stay within one position of each other."""
    return index % num_ranks


def visible(
    query_index: torch.Tensor,
    key_index: torch.Tensor,
    key_real: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """(rows, 1, queries, keys) bool: a query sees a real key at or before its position (and
    within the window); it always sees itself, so a padding query's row is never empty."""
    before = key_index[None, :] <= query_index[:, None]
    if window is not None:
        before = before & (key_index[None, :] > query_index[:, None] - window)
    seen = before[None] & key_real[:, None, :]
    itself = key_index[None, :] == query_index[:, None]
    return (seen | itself[None])[:, None]


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
    allowed: torch.Tensor | None = None,
    causal: bool = False,
) -> Partial:
    """Attention of ``q`` (rows, heads, queries, d) over ``k`` and ``v`` (rows, kv heads, keys,
    d): where ``allowed`` (rows, 1, queries, keys) is true, else over every key (``causal``:
    query i over keys 0..i, for a block against itself). See Note [attention kernels]."""
    rows, heads, queries, _ = q.shape
    if queries == 0 or k.shape[2] == 0:  # nothing to attend (kernels divide by these sizes)
        lse = torch.full((rows, heads, queries), float("-inf"), device=q.device)
        return Partial(q.new_zeros(q.shape), lse.to(torch.promote_types(q.dtype, torch.float32)))
    if allowed is not None and queries * spec.groups <= _GROUPED_QUERIES:
        return _grouped(q, k, v, allowed, spec)
    k, v = (t.repeat_interleave(spec.groups, dim=1) for t in (k, v))
    if allowed is None:
        out, lse = attention_with_lse(q, k, v, None, spec.scale, causal)
        return Partial(out, lse)
    tiles = [
        _masked(q[:, :, i : i + _TILE], k, v, allowed[:, :, i : i + _TILE], spec)
        for i in range(0, queries, _TILE)
    ]
    return Partial(torch.cat([t.out for t in tiles], 2), torch.cat([t.lse for t in tiles], 2))


# Note [attention kernels]:
# Attention runs in a fused kernel that returns the log-sum-exp with the output and never
# holds the score matrix (conveyor.torch_compat.attention_with_lse), so a 16k x 16k block of a
# long prompt costs no more memory than its inputs. A block that every query sees whole (all
# its keys earlier, no padding, no window) needs no mask, a block against itself a causal
# one, and only the rest a boolean mask turned into a bias, computed a tile of queries at a
# time. A new token (one query per head) attends without copying keys, in plain products:
# the query heads that share a key head are stacked along the queries.
_TILE = 1024
"""Queries per masked tile: the bias of a tile over a 64k-key block is 1024 x 64k values."""
_GROUPED_QUERIES = 64
"""Up to this many (query heads x queries) per key head, grouped heads share their keys."""


def _grouped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, spec: AttentionSpec
) -> Partial:
    """Masked attention of a few queries, the query heads of one key head stacked, as plain
    products: for a handful of queries they beat the fused kernel, which needs a bias as
    large as the scores (a new token over 512 keys: 72 against 117 us; over 32k: 3.6 against
    4.3 ms, 1 thread). A query that sees no key gets -inf and no output."""
    rows, heads, queries, dim = q.shape
    grouped = q.reshape(rows, spec.num_kv_heads, spec.groups * queries, dim)
    mask = allowed.expand(rows, 1, queries, allowed.shape[-1]).repeat(1, 1, spec.groups, 1)
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(grouped, k.transpose(-2, -1)).to(wide).mul_(spec.scale)
    scores.masked_fill_(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.where(torch.isfinite(lse), 0.0)[..., None])
    out = torch.matmul(weights.to(v.dtype), v)
    return Partial(out.reshape(rows, heads, queries, dim), lse.reshape(rows, heads, queries))


def _masked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, spec: AttentionSpec
) -> Partial:
    """Attention where ``allowed``; a query that sees no key gets -inf and no output."""
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
    bias.masked_fill_(~allowed, float("-inf"))
    out, lse = attention_with_lse(q, k, v, bias, spec.scale)
    seen = allowed.any(-1).expand_as(lse)
    lse = torch.where(seen, lse, torch.full_like(lse, float("-inf")))
    return Partial(out.masked_fill(~seen[..., None], 0.0), lse)


def merge(parts: Sequence[Partial]) -> Partial:
    """The attention over every part's keys, exactly; See Note [merging attention over
    shards]."""
    lses = torch.stack([p.lse for p in parts])
    total = torch.logsumexp(lses, dim=0)
    finite = torch.isfinite(lses)
    weights = torch.where(finite, torch.exp(lses - total.where(torch.isfinite(total), 0.0)), 0.0)
    out = sum(w[..., None].to(p.out.dtype) * p.out for w, p in zip(weights, parts, strict=True))
    assert isinstance(out, torch.Tensor)
    return Partial(out, total)


Exchanger = Callable[[torch.Tensor], list[torch.Tensor]]
"""Gives every cp rank's tensor, in rank order (conveyor.parallel.shared_exchange)."""


def _gather_merge(
    part: Partial, group: dist.ProcessGroup | None, exchanger: Exchanger | None = None
) -> torch.Tensor:
    """Merge every cp rank's ``part`` of the same queries (one exchange: through
    ``exchanger`` if given, else messages over ``group``)."""
    size = dist.get_world_size(group)
    if size == 1:
        return part.out
    packed = torch.cat([part.out.flatten(), part.lse.to(part.out.dtype).flatten()])
    split = part.out.numel()
    gathered = exchanger(packed) if exchanger is not None else exchange(packed, group)
    parts = [Partial(g[:split].view_as(part.out), g[split:].view_as(part.lse)) for g in gathered]
    return merge(parts).out


# Note [exchanging, not all-gathering]:
# A decode step merges every layer's partial attention: each cp rank needs each other rank's
# few hundred values, right after computing its own. Sent to each peer and received from each
# in one batch of point-to-point messages, this costs half of what an all-gather does between
# computing ranks on gloo (2 CPU ranks, 1 KB after 2 ms of work: mean 0.6-0.7 ms against
# 1.2-1.4 ms), whose collectives pass through a worker thread of the process group. A batch
# (``batch_isend_irecv``) also keeps NCCL from blocking on a send whose receive is not posted.
# CPU ranks of one host skip messages altogether: conveyor.parallel.shared_exchange.
def exchange(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Every rank of ``group``'s ``tensor`` (same shape everywhere), in rank order; See Note
    [exchanging, not all-gathering]."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    gathered = [tensor if r == rank else torch.empty_like(tensor) for r in range(size)]
    ops = []
    for peer in range(size):
        if peer != rank:
            ops.append(dist.P2POp(dist.isend, tensor, group=group, group_peer=peer))
            ops.append(dist.P2POp(dist.irecv, gathered[peer], group=group, group_peer=peer))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return gathered


class KVShard:
    """One layer's keys and values at this cp rank's cache positions, preallocated: the
    rank's prompt chunks, then every P-th new token (``owner_of``)."""

    def __init__(
        self,
        rows: int,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (rows, kv_heads, capacity, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.index = torch.empty(capacity, dtype=torch.long, device=device)
        """Cache position of each slot."""
        self.length = 0

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def append(self, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor) -> None:
        """Keep ``keys`` and ``values`` (rows, kv heads, n, d) of cache positions ``index``."""
        end = self.length + keys.shape[2]
        if end > self.keys.shape[2]:
            raise RuntimeError(
                f"KV shard of {self.keys.shape[2]} positions cannot take {keys.shape[2]} more "
                f"after {self.length}; size it for this rank's share of prompt and new tokens"
            )
        self.keys[:, :, self.length : end] = keys
        self.values[:, :, self.length : end] = values
        self.index[self.length : end] = index
        self.length = end

    def held(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values and cache positions of the filled slots."""
        n = self.length
        return self.keys[:, :, :n], self.values[:, :, :n], self.index[:n]


def shard_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    index: torch.Tensor,
    key_real: torch.Tensor,
    shard: KVShard,
    spec: AttentionSpec,
    group: dist.ProcessGroup | None,
    exchanger: Exchanger | None = None,
) -> torch.Tensor:
    """Decode: the new tokens' attention over every rank's shard. Their keys and values join
    the shard of ``owner_of`` their position (all new tokens of a call share it); each rank
    attends over its own shard and one exchange merges the parts (through ``exchanger`` if
    given, else messages over ``group``).

    ``index`` holds the new tokens' cache positions; ``key_real`` (rows, positions so far) is
    true at real (unpadded) tokens."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if owner_of(int(index[0]), size) == rank:
        shard.append(k_new, v_new, index)
    keys, values, held = shard.held()
    allowed = visible(index, held, key_real[:, held], spec.window)
    return _gather_merge(partial_attention(q, keys, values, spec, allowed), group, exchanger)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    shards: Sequence[Sequence[range]],
    key_real: torch.Tensor,
    spec: AttentionSpec,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Prefill: the attention of this rank's prompt tokens (``q``, ``k``, ``v`` at the
    positions ``shards[rank]``, in order) over every earlier position of the prompt. Each
    rank's key-value block travels once around the ring; the next block is in flight while
    the one in hand is attended to. Pairs of chunks that causal masking (or the window)
    hides entirely are skipped. ``key_real``: (rows, prompt length), true at real tokens."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    mine = list(shards[rank])
    queries = _chunks(q, mine)
    results: list[Partial | None] = [None] * len(mine)
    block = torch.stack([k, v])
    for step in range(size):
        source = (rank - step) % size
        pending = _pass_on(block, shards, rank, step, group) if step < size - 1 else None
        keys = _chunks(block, list(shards[source]))
        for i, (query_range, query) in enumerate(zip(mine, queries, strict=True)):
            for key_range, kv in zip(shards[source], keys, strict=True):
                part = _pair(query, query_range, kv, key_range, key_real, spec)
                if part is None:
                    continue
                found = results[i]
                results[i] = part if found is None else merge([found, part])
        if pending is not None:
            block = pending()
    outs = [r.out for r in results if r is not None]
    return torch.cat(outs, dim=2) if outs else q.new_zeros(q.shape)


def _pair(
    query: torch.Tensor,
    queries: range,
    kv: torch.Tensor,
    keys: range,
    key_real: torch.Tensor,
    spec: AttentionSpec,
) -> Partial | None:
    """One chunk of queries over one chunk of keys: None if none sees any, else without a
    mask, causally, or masked (See Note [attention kernels])."""
    if _hidden(queries, keys, spec.window):
        return None
    padded = not bool(key_real[:, keys.start : keys.stop].all())
    in_window = spec.window is None or queries.stop - 1 - keys.start < spec.window
    if not padded and in_window and keys.stop <= queries.start:
        return partial_attention(query, kv[0], kv[1], spec)
    if not padded and in_window and keys == queries:
        return partial_attention(query, kv[0], kv[1], spec, causal=True)
    allowed = visible(
        _positions(queries, query.device),
        _positions(keys, query.device),
        key_real[:, keys.start : keys.stop],
        spec.window,
    )
    return partial_attention(query, kv[0], kv[1], spec, allowed)


def _chunks(tensor: torch.Tensor, ranges: Sequence[range]) -> list[torch.Tensor]:
    """``tensor``'s positions (dim -2) cut into the lengths of ``ranges``."""
    return list(torch.split(tensor, [len(r) for r in ranges], dim=-2))


def _positions(where: range, device: torch.device) -> torch.Tensor:
    return torch.arange(where.start, where.stop, device=device)


def _hidden(queries: range, keys: range, window: int | None) -> bool:
    """Whether no query of ``queries`` sees any key of ``keys`` (all later, or out of the
    window), so the pair needs no work."""
    if not len(queries) or not len(keys):
        return True
    if keys.start > queries.stop - 1:
        return True
    return window is not None and keys.stop - 1 <= queries.start - window


def _pass_on(
    block: torch.Tensor,
    shards: Sequence[Sequence[range]],
    rank: int,
    step: int,
    group: dist.ProcessGroup | None,
) -> _Pending:
    """Send ``block`` to the next rank and receive the previous rank's (both in flight)."""
    size = dist.get_world_size(group)
    coming = (rank - step - 1) % size
    length = sum(len(r) for r in shards[coming])
    incoming = block.new_empty((*block.shape[:3], length, block.shape[-1]))
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, block.contiguous(), group=group, group_peer=(rank + 1) % size),
            dist.P2POp(dist.irecv, incoming, group=group, group_peer=(rank - 1) % size),
        ]
    )
    return _Pending(works, incoming)


class _Pending:
    """A block in flight around the ring; calling it waits and returns it."""

    def __init__(self, works: list[dist.Work], block: torch.Tensor) -> None:
        self.works = works
        self.block = block

    def __call__(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.block


def cp_groups(
    num_cp: int, timeout: timedelta, mesh: DeviceMesh | None = None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's pipeline group, its cp group) over the world: ``num_cp`` consecutive ranks
    per cp group (one machine's ranks, whose link is fastest), the pipeline across them; or
    the ``pp`` and ``cp`` dimensions of ``mesh``. Collective: every rank calls it.

    Raises:
        ValueError: the world is not a multiple of ``num_cp``, or ``mesh`` has no ``cp``
            dimension.
    """
    if mesh is not None:
        names = list(mesh.mesh_dim_names or ())
        if "cp" not in names or not set(names) <= {"pp", "cp"}:
            raise ValueError(
                f"a decode mesh has dimensions ('pp', 'cp') or ('cp',), got {tuple(names)}; "
                "build it with init_device_mesh(device, (pp, cp), mesh_dim_names=('pp', 'cp'))"
            )
        cp_group = mesh.get_group("cp")
        pp_group = mesh.get_group("pp") if "pp" in names else dist.new_group([dist.get_rank()])
        return pp_group, cp_group
    world, rank = dist.get_world_size(), dist.get_rank()
    if num_cp < 1 or world % num_cp:
        raise ValueError(
            f"cp={num_cp} does not divide the {world} ranks; launch a multiple of cp ranks "
            f"(pipeline stages x cp), e.g. `conveyor run -n {num_cp * max(1, world // num_cp)}`"
        )
    num_pp = world // num_cp
    pp_index, cp_index = divmod(rank, num_cp)
    pipelines = [
        dist.new_group([p * num_cp + c for p in range(num_pp)], timeout=timeout)
        for c in range(num_cp)
    ]
    groups = [
        dist.new_group([p * num_cp + c for c in range(num_cp)], timeout=timeout)
        for p in range(num_pp)
    ]
    return pipelines[cp_index], groups[pp_index]
