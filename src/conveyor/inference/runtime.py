"""Interpret one rank's decode Program: forwards with KV caches, sampling at the last stage,
sends and receives of hidden states and fed-back tokens; no schedule logic.

Every message is ``{"value": tensor, "done": bool}``: hidden states (rows, length, hidden)
between stages, or sampled tokens (rows,) from the last stage to the first. ``done`` says
that every sequence of the item's group has stopped: the stages then skip its remaining
items (still sending the same messages, so the static Program holds) and the last stage
records padding for them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from conveyor.graph import StageGraph
from conveyor.inference.config import GenerationConfig
from conveyor.inference.lm import CausalLM, Context, CpPlace
from conveyor.inference.sampling import Sampler
from conveyor.inference.schedule import Item
from conveyor.parallel.context_parallel import zigzag
from conveyor.program import Action, Kind
from conveyor.runtime.comm import P2P, Meta, Receive
from conveyor.runtime.core import Interpreter

__all__ = ["Batch", "DecodeRuntime"]

logger = logging.getLogger(__name__)

_Message = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Batch:
    """What every rank knows about one generation: prompts, groups, items and settings."""

    input_ids: torch.Tensor
    """(batch, prompt length) token ids, left-padded."""
    key_mask: torch.Tensor
    """(batch, prompt length + new tokens) bool: the prompt's attention mask, then True."""
    positions: torch.Tensor
    """(batch, prompt length + new tokens) position of every token (0 at padding)."""
    groups: tuple[range, ...]
    """Rows of the batch in each group."""
    items: tuple[Item, ...]
    config: GenerationConfig
    cache_kind: str
    cp_rank: int = 0
    """This rank's index in its context-parallel group (conveyor.inference.context)."""
    cp_size: int = 1

    @cached_property
    def shards(self) -> tuple[tuple[range, ...], ...]:
        """Each cp rank's prompt positions: zigzag chunks of the prompt."""
        prompt = int(self.input_ids.shape[1])
        return tuple(tuple(ranges) for ranges in zigzag(prompt, self.cp_size))

    def place(self, k: int) -> CpPlace | None:
        """Where this cp rank's tokens of item ``k`` sit (None without context parallelism):
        a prompt's zigzag chunks, or a new token that every rank of the group runs."""
        if self.cp_size == 1:
            return None
        item = self.items[k]
        return CpPlace(self.cp_rank, self.shards, item.source is not None, item.start)

    def columns(self, k: int) -> list[int]:
        """The cache positions of the tokens of item ``k`` that this rank runs."""
        place = self.place(k)
        if place is not None:
            return place.mine
        item = self.items[k]
        return list(range(item.start, item.start + item.length))

    def context(self, k: int) -> Context:
        item = self.items[k]
        rows = self.groups[item.group]
        end = item.start + item.length
        return Context(
            self.positions[rows.start : rows.stop, self.columns(k)],
            self.key_mask[rows.start : rows.stop, :end],
            item.start,
            self.place(k),
        )


@dataclass
class _State:
    """What one generation keeps between actions on this rank."""

    caches: dict[tuple[int, int], Any]
    """(stage, group) -> that stage's KV cache of the group."""
    samplers: dict[int, Sampler]
    """Per group, on the rank that holds the last stage."""
    outputs: dict[tuple[int, int], _Message] = field(default_factory=dict)
    """(stage, item) -> its message, until sent or taken by a local stage."""
    receives: dict[Action, Receive] = field(default_factory=dict)
    tokens: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Per group, the tokens sampled so far (one (rows,) tensor per new token)."""
    first_token: float | None = None
    """``time.perf_counter()`` when the last group sampled its first token (last stage)."""


class DecodeRuntime(Interpreter):
    """Runs one rank's decode actions over its stages (``units`` of ``lm`` each)."""

    def __init__(
        self,
        lm: CausalLM,
        graph: StageGraph,
        units: Mapping[int, range],
        rank: int,
        p2p: P2P | None,
        device: torch.device,
    ) -> None:
        self.lm = lm
        self.graph = graph
        self.units = units
        """Units of each stage (every stage, so message shapes are known on every rank)."""
        self.rank = rank
        self.p2p = p2p
        self.device = device
        self.local = graph.stages_on(rank)
        self.first_token: float | None = None
        """When the last run's every sequence had its first token (on the last stage's
        rank, else None), ``time.perf_counter()`` seconds."""
        self.final_cache_bytes = 0
        """Bytes of keys and values the last run's caches held at its end."""
        self.handlers = {
            Kind.F: self._forward,
            Kind.SEND_F: self._send,
            Kind.RECV_F: self._recv,
        }

    def run(self, actions: Sequence[Action], batch: Batch) -> dict[int, list[torch.Tensor]]:
        """Execute ``actions``; returns each group's sampled tokens (on the last stage's rank,
        empty elsewhere)."""
        self._batch = batch
        self._fed = frozenset(i.source for i in batch.items if i.source is not None)
        self._state = _State(self._new_caches(batch), self._new_samplers(batch))
        with torch.no_grad():
            self.execute(actions)
            if self.p2p is not None:
                self.p2p.wait_sends()
        self.final_cache_bytes = self.cache_bytes
        state, self._state = self._state, _State({}, {})
        self.first_token = state.first_token
        return state.tokens

    def held_bytes(self) -> int:
        return self.cache_bytes

    @property
    def cache_bytes(self) -> int:
        """Bytes of keys and values this rank's caches hold now."""
        total = 0
        for cache in self._state.caches.values():
            tensors = cache.values() if isinstance(cache, dict) else [cache]
            total += sum(_nbytes(t) for t in tensors)
        return total

    def _new_caches(self, batch: Batch) -> dict[tuple[int, int], Any]:
        capacity = int(batch.key_mask.shape[1])
        return {
            (s, g): self.lm.new_cache(
                self.units[s], len(rows), capacity, self.device, batch.cache_kind
            )
            for s in self.local
            for g, rows in enumerate(batch.groups)
        }

    def _new_samplers(self, batch: Batch) -> dict[int, Sampler]:
        if self.graph.sink not in self.local:
            return {}
        return {g: Sampler(batch.config, rows, self.device) for g, rows in enumerate(batch.groups)}

    # -- compute -------------------------------------------------------------------------

    def _forward(self, action: Action) -> None:
        s, k = action.stage, action.microbatch
        item = self._batch.items[k]
        message = self._input(s, k, item)
        done = bool(message["done"])
        if done:
            value = None
        else:
            cache = self._state.caches[(s, item.group)]
            value = self.lm.run(self.units[s], message["value"], cache, self._batch.context(k))
        if s != self.graph.sink:
            if value is None:
                rows = len(self._batch.groups[item.group])
                shape = (rows, len(self._batch.columns(k)), self.lm.hidden_size)
                value = torch.zeros(shape, dtype=self.lm.dtype, device=self.device)
            self._state.outputs[(s, k)] = {"value": value, "done": message["done"]}
        elif item.samples:
            self._sample(k, item, value)

    def _sample(self, k: int, item: Item, logits: torch.Tensor | None) -> None:
        """The last stage: the group's next tokens, kept, and fed back if an item takes them."""
        sampler = self._state.samplers[item.group]
        tokens = sampler.pad() if logits is None else sampler(logits)
        sampled = self._state.tokens.setdefault(item.group, [])
        sampled.append(tokens)
        if len(sampled) == 1 and len(self._state.tokens) == len(self._batch.groups):
            self._state.first_token = time.perf_counter()
        if k in self._fed:
            done = torch.tensor(sampler.done, device=self.device)
            self._state.outputs[(self.graph.sink, k)] = {"value": tokens, "done": done}

    def _input(self, s: int, k: int, item: Item) -> _Message:
        """Stage ``s``'s input for item ``k``: prompt tokens, a fed-back token or hidden states,
        from this rank's own stages or from a peer."""
        if s == 0 and item.source is None:
            rows = self._batch.groups[item.group]
            ids = self._batch.input_ids[rows.start : rows.stop, self._batch.columns(k)]
            return {"value": ids, "done": torch.tensor(False, device=self.device)}
        if s == 0:
            assert item.source is not None
            producer, k_sent = self.graph.sink, item.source
        else:
            producer, k_sent = s - 1, k
        if self.graph.rank_of(producer) == self.rank:
            message = self._state.outputs.pop((producer, k_sent))
        else:
            assert self.p2p is not None
            receive = self._state.receives.pop(Action(s, Kind.RECV_F, k_sent, producer))
            message = self.p2p.wait(receive)
        if s == 0:  # a fed-back token per sequence: the (rows, 1) ids of the next position
            return {"value": message["value"][:, None], "done": message["done"]}
        return message

    # -- communication -------------------------------------------------------------------

    def _send(self, action: Action) -> None:
        s, k, d = action.stage, action.microbatch, action.peer
        assert d is not None and self.p2p is not None
        message = self._state.outputs.pop((s, k))
        self.p2p.send(message, self.graph.rank_of(d), str(action))

    def _recv(self, action: Action) -> None:
        s, k, u = action.stage, action.microbatch, action.peer
        assert u is not None and self.p2p is not None
        item = self._batch.items[k]
        rows = len(self._batch.groups[item.group])
        if u == self.graph.sink and s == 0:  # a fed-back token
            value = torch.empty(rows, dtype=torch.long, device="meta")
        else:
            shape = (rows, len(self._batch.columns(k)), self.lm.hidden_size)
            value = torch.empty(shape, dtype=self.lm.dtype, device="meta")
        meta = Meta.of({"value": value, "done": torch.empty((), dtype=torch.bool, device="meta")})
        self._state.receives[action] = self.p2p.post(self.graph.rank_of(u), meta, str(action))


def _nbytes(cache: Any) -> int:
    """Bytes a cache object holds: conveyor's StaticKV, or Hugging Face's layers."""
    nbytes = getattr(cache, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    total = 0
    for layer in getattr(cache, "layers", []):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total
