"""Pipeline vs tensor vs context parallelism for long-sequence inference, on paper: one long
request on P devices, from per-layer costs (measured and fitted, conveyor.inference.cost) and
link models (point-to-point for the pipeline's and the ring's messages and CP's decode
exchanges, collective for TP's all-reduces), each strategy run through the simulator as a
decode Program.

    costs = LayerCosts(embed=..., block=..., head=..., hidden_size=1024, ...)
    rows = compare(costs, num_layers=32, link=link, devices=[2, 8, 64], prompts=[1024, 2**20])

- **pipeline** (PP): the layers in P stages, one per device; the prompt in 4P chunks that
  flow through the stages; a new token passes every stage in turn (one request: P - 1 devices
  idle at each token).
- **tensor** (TP, Megatron-style): every layer's heads and MLP split over the P devices, two
  all-reduces of the layer's activations per layer (ring: 2(P - 1) steps) and the
  framework's dispatch of the split layer (``LayerCosts.tensor_overhead``); at most one
  device per head.
- **context** (CP): the sequence split over the P devices. Prefill as ring attention: each
  device runs its P-th of the tokens through every layer and passes key-value blocks around
  the ring (P - 1 transfers per layer, overlapped with the attention); decode with the KV
  cache sharded along the sequence: every device runs the new token's projections and MLP
  (weights replicated), attends over its shard, and the partial results are combined after
  each device sends its partial output (about one hidden vector) to every other device, once
  a layer, as conveyor.inference.context runs it (as messages, or through shared memory where
  the group is on one host: ``estimate``'s ``exchange`` link), plus what the split costs
  beyond its share and the exchange (``LayerCosts.context_overhead``: the shard's mask,
  packing the partial results and merging them).
- **pipeline x context**: the layers in P/2 stages, each served by a cp group of 2 devices
  (DecodePipeline(cp=2) on P ranks), each stage's work divided as context parallelism
  divides it.

Compute that a strategy splits is divided by P with its fixed per-call cost kept whole; KV
caches take 2 x layers x positions x hidden values in all of them, divided by P (TP while
P <= heads). Weights: PP and TP hold 1/P of them, CP all of them, PP x CP 2/P. Each device
is taken to have memory bandwidth of its own, as GPUs do; CPU ranks that share one memory bus
share its speed too, which this model does not see (on 2 cores, two ranks read their halves of
a long cache 1.3-1.9 times as fast as one rank reads all of it, not twice: benchmarks.md,
"Reading the KV cache at decode").
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from conveyor.graph import chain
from conveyor.inference.cost import DecodeCost, Fit, StageFit
from conveyor.inference.schedule import Item, decode_items, decode_program
from conveyor.program import Action, Kind
from conveyor.simulator import Link, simulate

__all__ = [
    "STRATEGIES",
    "Estimate",
    "LayerCosts",
    "Strategy",
    "compare",
    "estimate",
    "measured_overhead",
    "pipeline_chunk",
]

Strategy = Literal["pipeline", "tensor", "context", "pipeline x context"]
STRATEGIES: tuple[Strategy, ...] = ("pipeline", "tensor", "context", "pipeline x context")


@dataclass(frozen=True)
class LayerCosts:
    """One request's per-unit costs (fits at one row) and the model's sizes."""

    embed: StageFit
    block: StageFit
    head: StageFit
    """The final norm, LM head and sampling (last position only)."""
    hidden_size: int
    num_heads: int
    dtype_bytes: int
    block_params: int
    head_params: int
    """Parameters of the LM head and the embedding together."""
    tensor_overhead: float = 0.0
    """Seconds a layer split by tensor parallelism spends per call beyond its share of the
    work and its two all-reduces: the framework's dispatch of sharded weights (torch's
    DTensor, some milliseconds a layer on CPU); ``measured_overhead`` finds it."""
    context_overhead: float = 0.0
    """Seconds a layer under context parallelism spends per new token beyond its share of the
    attention and its exchange: masking the shard, packing the partial results and merging
    them (some tenths of a millisecond a layer on CPU); ``measured_overhead`` finds it."""

    @property
    def hidden_bytes(self) -> int:
        return self.hidden_size * self.dtype_bytes


@dataclass(frozen=True)
class Estimate:
    """One strategy on ``devices`` devices for a prompt of ``prompt`` tokens."""

    strategy: Strategy
    devices: int
    prompt: int
    time_to_first_token: float
    """Seconds from the prompt to the first new token."""
    decode_tokens_per_s: float
    """New tokens per second after the first."""
    kv_bytes_per_device: float
    weight_bytes_per_device: float


def estimate(
    strategy: Strategy,
    costs: LayerCosts,
    num_layers: int,
    link: Link,
    devices: int,
    prompt: int,
    new_tokens: int = 16,
    *,
    collective: Link | None = None,
    exchange: Link | None = None,
) -> Estimate | None:
    """``strategy``'s estimate, or None where it does not apply (TP beyond one device per
    head, PP beyond one device per layer). ``link`` carries point-to-point messages (the
    pipeline's, the ring's, CP's decode exchanges); ``collective``, TP's all-reduces
    (``conveyor.planner.calibrate.measure_allreduce``; default ``link``); ``exchange``, CP's
    decode exchanges where they do not travel as messages (default ``link``; a cp group on one
    host exchanges through shared memory: ``measure_between_work("shared")``). For decode,
    measure them between work (``conveyor.planner.calibrate.measure_between_work``)."""
    staged = strategy == "pipeline x context"
    if (
        (strategy == "tensor" and devices > costs.num_heads)
        or (strategy == "pipeline" and devices > num_layers)
        or (staged and (devices < 4 or devices % 2 or devices > 2 * num_layers))
    ):
        return None
    links = (link, collective or link, exchange or link)
    first = _simulated(strategy, costs, num_layers, links, devices, prompt, 1)
    total = _simulated(strategy, costs, num_layers, links, devices, prompt, new_tokens)
    kv = 2 * num_layers * (prompt + new_tokens) * costs.hidden_bytes / devices
    weights = num_layers * costs.block_params + costs.head_params
    replicas = {"context": devices, "pipeline x context": 2}.get(strategy, 1)
    return Estimate(
        strategy,
        devices,
        prompt,
        first,
        (new_tokens - 1) / (total - first),
        kv,
        weights * costs.dtype_bytes * replicas / devices,
    )


def compare(
    costs: LayerCosts,
    num_layers: int,
    link: Link,
    devices: Sequence[int],
    prompts: Sequence[int],
    new_tokens: int = 16,
    *,
    collective: Link | None = None,
    exchange: Link | None = None,
) -> list[Estimate]:
    """Every strategy that applies, for every device count and prompt length (``link``,
    ``collective`` and ``exchange`` as ``estimate`` takes them)."""
    found = []
    for prompt in prompts:
        for count in devices:
            for strategy in STRATEGIES:
                result = estimate(
                    strategy, costs, num_layers, link, count, prompt, new_tokens,
                    collective=collective, exchange=exchange,
                )  # fmt: skip
                if result is not None:
                    found.append(result)
    return found


def pipeline_chunk(prompt: int, stages: int) -> int | None:
    """The prompt chunk a pipeline of ``stages`` stages prefills in: 4 chunks a stage, so that
    the stages work on the prompt at once instead of in turn; None (the whole prompt) for one
    stage, which has nothing to overlap."""
    return None if stages == 1 else math.ceil(prompt / (4 * stages))


def measured_overhead(
    strategy: Literal["tensor", "context"],
    costs: LayerCosts,
    split: Fit,
    link: Link,
    devices: int,
    starts: Sequence[int],
) -> float:
    """The ``tensor_overhead`` or ``context_overhead`` that brings a layer's modelled decode
    time to ``split``'s: the decode fit of one layer profiled as ``strategy`` splits it over
    ``devices`` (all ranks at once; its all-reduces, or its exchange, over ``link``
    included); the median over ``starts`` (cached tokens) of the difference, at least 0."""
    plain = replace(costs, tensor_overhead=0.0, context_overhead=0.0)
    if strategy == "tensor":
        modelled = [_tensor_layer(plain, link, devices, 1, s) for s in starts]
    else:
        decode = _context_fit(plain.block, link, plain, devices).decode
        modelled = [decode.time(1, 1, s) for s in starts]
    gaps = [split.time(1, 1, s) - m for s, m in zip(starts, modelled, strict=True)]
    return max(statistics.median(gaps), 0.0)


def _simulated(
    strategy: Strategy,
    costs: LayerCosts,
    num_layers: int,
    links: tuple[Link, Link, Link],
    devices: int,
    prompt: int,
    new_tokens: int,
) -> float:
    """Seconds for ``strategy`` to prefill ``prompt`` tokens and generate ``new_tokens``, over
    ``links`` (point-to-point, collective, cp's decode exchange)."""
    link = links[0]
    if strategy in ("pipeline", "pipeline x context"):
        cp = 2 if strategy == "pipeline x context" else 1
        stages = devices // cp
        graph = chain(stages)
        chunk = None if cp > 1 else pipeline_chunk(prompt, stages)  # cp splits the prompt
        items = decode_items(1, prompt, new_tokens, chunk)
        layers = [len(range(s, num_layers, stages)) for s in range(stages)]
        fits = [_context_fit(costs.block, links[2], costs, cp) * n for n in layers]
        fits[0] = fits[0] + costs.embed
        fits[-1] = fits[-1] + costs.head
        cost = DecodeCost(
            fits, graph, items, [range(1)], costs.hidden_bytes, link=link,
            capacity=prompt + new_tokens,
        )  # fmt: skip
        return simulate(decode_program(graph, items), graph, cost).step_time
    graph = chain(1)
    items = decode_items(1, prompt, new_tokens)
    split = _TensorCost if strategy == "tensor" else _ContextCost
    return simulate(
        decode_program(graph, items), graph, split(costs, num_layers, links, devices, items)
    ).step_time


def _context_fit(block: StageFit, link: Link, costs: LayerCosts, cp: int) -> StageFit:
    """A block's fits when a cp group of ``cp`` ranks serves it: a prompt's tokens and pairs
    split over the group (ring transfers overlapped), a new token's pairs split and one
    exchange of its attention output over ``link`` and the split's overhead added."""
    if cp == 1:
        return block
    added = _exchange(link, costs.hidden_bytes, cp) + costs.context_overhead
    decode = _attention_divided(block.decode, cp)
    return StageFit(replace(decode, fixed=decode.fixed + added), _divided(block.prefill, cp))


def _divided(fit: Fit, devices: int) -> Fit:
    """A fit whose token and attention work is split over ``devices``; the fixed cost is
    not."""
    return replace(_attention_divided(fit, devices), per_token=fit.per_token / devices)


def _attention_divided(fit: Fit, devices: int) -> Fit:
    """A fit whose attention (over the cache's pairs or slots) is split over ``devices``:
    a new token's, with the cache sharded along the sequence."""
    return replace(fit, per_pair=fit.per_pair / devices, per_slot=fit.per_slot / devices)


def _tensor_layer(
    costs: LayerCosts, collective: Link, devices: int, length: int, start: int
) -> float:
    """One layer split over ``devices`` by tensor parallelism: its share of the work, its two
    all-reduces and the framework's overhead."""
    work = _divided(_fit(costs.block, length), devices).time(1, length, start)
    reduce = _all_reduce(collective, length * costs.hidden_bytes, devices)
    return work + 2 * reduce + costs.tensor_overhead


def _exchange(link: Link, num_bytes: int, devices: int) -> float:
    """Every device sends ``num_bytes`` to every other, all messages in flight at once, each
    device's sends one after another."""
    return (devices - 1) * link.transfer(num_bytes)


def _all_reduce(link: Link, num_bytes: float, devices: int) -> float:
    """A ring all-reduce: 2(P - 1) steps, each a latency and 1/P of the bytes."""
    steps = 2 * (devices - 1)
    return steps * (link.latency + num_bytes / devices / link.bandwidth)


class _TensorCost:
    """Each item on P devices with every layer split (see the module docstring), over
    ``links`` (point-to-point, collective, cp's decode exchange)."""

    def __init__(
        self,
        costs: LayerCosts,
        num_layers: int,
        links: tuple[Link, Link, Link],
        devices: int,
        items: Sequence[Item],
    ) -> None:
        self.costs, self.num_layers = costs, num_layers
        self.link, self.collective, self.exchange = links
        self.devices, self.items = devices, items

    def compute(self, action: Action) -> float:
        item = self.items[action.microbatch]
        length, start, p = item.length, item.start, self.devices
        layer = _tensor_layer(self.costs, self.collective, p, length, start)
        reduce = _all_reduce(self.collective, length * self.costs.hidden_bytes, p)
        head = _divided(_fit(self.costs.head, length), p).time(1, length, start)
        embed = _fit(self.costs.embed, length).time(1, length, start)
        return embed + self.num_layers * layer + head + reduce

    def transfer(self, action: Action) -> float:
        return 0.0


class _ContextCost(_TensorCost):
    """Each item with the sequence split over P devices (see the module docstring)."""

    def compute(self, action: Action) -> float:
        assert action.kind is Kind.F
        item = self.items[action.microbatch]
        length, start, p = item.length, item.start, self.devices
        fit = _fit(self.costs.block, length)
        if length > 1:  # prefill: a P-th of the tokens and of the pairs, ring passes overlap
            compute = _divided(fit, p).time(1, length, start)
            kv_block = 2 * math.ceil(length / p) * self.costs.hidden_bytes
            ring = (p - 1) * self.link.transfer(kv_block)
            layer = max(compute, ring + fit.fixed)
        else:  # decode: the token everywhere, its attention over a P-th of the cache each
            split = _context_fit(self.costs.block, self.exchange, self.costs, p)
            layer = split.decode.time(1, length, start)
        head = _fit(self.costs.head, length).time(1, length, start)
        embed = _fit(self.costs.embed, length).time(1, length, start)
        return embed + self.num_layers * layer + head


def _fit(stage: StageFit, length: int) -> Fit:
    return stage.decode if length == 1 else stage.prefill
