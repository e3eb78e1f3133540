"""DecodePipeline: a causal LM cut into stages over ranks, generating with a KV cache per stage;
the generation facade, beside Pipeline.

    decoder = DecodePipeline(model, balance=[3, 3])           # on every rank, like Pipeline
    tokens = decoder.generate(input_ids, max_new_tokens=32)    # (batch, prompt + new), every rank
    tokens = generate(model, input_ids, max_new_tokens=32)     # the unsplit model, one process

Each rank keeps the KV caches of its own stages; the batch is split into groups of sequences
that are in flight at once (the decode analogue of micro-batches), as many as the stages'
measured costs predict fastest unless ``num_groups`` is given (See Note [choosing groups at
run time]), and the run is a decode Program (conveyor.inference.schedule), validated,
simulated and traced like training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from conveyor.graph import StageGraph, chain
from conveyor.hf.decode import hf_causal_lm, is_hf_model
from conveyor.inference.config import GenerationConfig, model_defaults
from conveyor.inference.context import ContextParallelLM, check_supported, context_parallel_lm
from conveyor.inference.gpt import GptLM, is_gpt
from conveyor.inference.groups import GroupChoice
from conveyor.inference.lm import CausalLM
from conveyor.inference.prompts import (
    generated_length,
    groups_of,
    inferred_mask,
    positions_of,
    prepare_prompts,
)
from conveyor.inference.runtime import Batch, DecodeRuntime
from conveyor.inference.schedule import decode_items, decode_program
from conveyor.parallel.context_parallel import cp_groups
from conveyor.parallel.shared_exchange import SharedExchange, shared_memory_possible
from conveyor.pipeline.decode_groups import GroupChooser
from conveyor.program import Program
from conveyor.runtime.comm import P2P, Meta
from conveyor.runtime.fingerprint import CannotRunError, agree, fingerprint
from conveyor.split import even_balance
from conveyor.text import format_bytes
from conveyor.trace import Recorder, Timeline, merge

__all__ = ["DecodePipeline", "GenerationStats", "as_causal_lm", "generate"]

logger = logging.getLogger(__name__)

_EXCHANGES = ("auto", "shared", "group")


@dataclass(frozen=True)
class GenerationStats:
    """How long one generate call took on this rank."""

    seconds: float
    """From the call until the tokens were shared."""
    time_to_first_token: float | None
    """From the call until every sequence had its first new token; known on the rank that
    holds the last stage (None elsewhere)."""
    num_sequences: int
    new_tokens: int
    """New tokens per sequence (fewer than max_new_tokens if every sequence stopped), as the
    last stage's rank and the ranks that get the tokens count them; max_new_tokens on others."""
    cache_bytes: int = 0
    """Bytes of keys and values this rank's caches held at the end (with context
    parallelism, its shards: about 1/cp of its stages' whole cache)."""
    num_groups: int = 1
    """Groups of sequences in flight: ``num_groups`` if given, else chosen (See Note
    [choosing groups at run time])."""
    choosing_seconds: float = 0.0
    """Of ``seconds``, the time spent choosing ``num_groups``: measuring the stages, on the
    first generation of a batch size and length only."""

    @property
    def decode_tokens_per_s(self) -> float | None:
        """New tokens after the first, per second of decoding, over the batch."""
        if self.time_to_first_token is None or self.new_tokens < 2:
            return None
        decoding = self.seconds - self.time_to_first_token
        return self.num_sequences * (self.new_tokens - 1) / decoding if decoding > 0 else None


class DecodePipeline:
    """A causal LM split into stages, one rank's part of which runs here; generates tokens.

    Every rank constructs it with the same model and calls ``generate`` with the same
    prompts (as ``Pipeline.step`` takes the same batch): every rank knows every item's shape,
    so stages exchange hidden states and sampled tokens without a round of headers.
    """

    def __init__(
        self,
        model: Any,
        *,
        balance: Sequence[int] | None = None,
        placement: Sequence[int] | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        timeout_s: float = 60.0,
        trace: bool = False,
        local: bool = False,
        cp: int = 1,
        mesh: DeviceMesh | None = None,
        cp_exchange: Literal["auto", "shared", "group"] = "auto",
    ) -> None:
        """
        Args:
            model: conveyor's GPT, a Hugging Face causal LM, or a CausalLM.
            balance: units per stage (embedding, blocks, head: ``num_blocks + 2`` units);
                default: the blocks evenly, the embedding with the first stage and the head
                with the last, one stage per rank (or per ``placement`` entry).
            placement: rank of each stage; default: stage i on rank i.
            group: the pipeline's process group (default: the world).
            device: where this rank's stages run (default: where their parameters are).
            local: run every stage in this process, without torch.distributed.
            cp: ranks per context-parallel group: each pipeline stage is served by ``cp``
                ranks that split every sequence's KV cache along its length (consecutive
                ranks; the world is stages x cp). See conveyor.inference.context.
            mesh: a DeviceMesh with dimensions ('pp', 'cp') (or ('cp',)), instead of ``cp``.
            cp_exchange: how a cp group's ranks exchange each layer's attention at decode:
                "shared" (shared memory: CPU ranks of one x86-64 host), "group" (messages
                over the process group) or "auto" (shared where possible). See
                conveyor.parallel.shared_exchange.
        """
        if cp_exchange not in _EXCHANGES:
            raise ValueError(
                f"cp_exchange must be one of {', '.join(map(repr, _EXCHANGES))}, got "
                f"{cp_exchange!r}"
            )
        self.lm = as_causal_lm(model)
        self.cp_group: dist.ProcessGroup | None = None
        """The ranks that serve this rank's stages with it (None without cp)."""
        if cp != 1 or mesh is not None:
            group = self._context_parallel(cp, mesh, group, local, timeout_s)
        self.group = group
        self.rank, self.num_ranks = (0, 1) if local else _group_size(group)
        num_stages = len(balance or placement or range(self.num_ranks))
        self.balance = tuple(balance or default_balance(self.lm.num_units, num_stages))
        self.units = _stage_units(self.lm, self.balance)
        placement = tuple(placement or range(num_stages))
        if len(placement) != num_stages:
            raise ValueError(
                f"placement {list(placement)} has {len(placement)} ranks for "
                f"{num_stages} stages; give one rank per stage"
            )
        self.graph = chain(num_stages, placement=placement)
        if self.graph.num_ranks != self.num_ranks:
            raise ValueError(
                f"the split places {num_stages} stages on {self.graph.num_ranks} ranks but the "
                f"process group has {self.num_ranks}; launch with `conveyor run -n "
                f"{self.graph.num_ranks}` or change balance/placement"
            )
        self._check_materialized()
        self.device = torch.device(device) if device is not None else self._model_device()
        for module in self._local_modules():
            module.to(self.device)
        p2p = (
            None
            if local or self.num_ranks == 1
            else P2P(group, self.device, timedelta(seconds=timeout_s))
        )
        self._runtime = DecodeRuntime(self.lm, self.graph, self.units, self.rank, p2p, self.device)
        self.cp_exchange = self._cp_exchange(cp_exchange, timeout_s)
        """How this rank's cp group exchanges at decode: "shared", "group" (None without
        cp)."""
        self._chooser = (
            None
            if p2p is None or self.cp_group is not None
            else GroupChooser(
                self.lm, self.graph, self.units, self.rank, self.group, p2p, self.device
            )
        )
        """Chooses the number of groups when ``num_groups`` is not given; None on one rank
        and with context parallelism, which run one group per rank."""
        self.choice: GroupChoice | None = None
        """How the last generate chose its number of groups (None if it did not choose)."""
        self._programs: dict[tuple[int, int, int, int | None], Program] = {}
        self.num_generations = 0
        self.stats: GenerationStats | None = None
        """Timings of the last generate call."""

        self.recorder: Recorder | None = None
        """This rank's recorder when tracing: one recorded step per generate call."""
        if trace:
            self.recorder = self._runtime.recorder = Recorder(self.rank)
            if p2p is not None:
                p2p.recorder = self.recorder

    @property
    def cp_size(self) -> int:
        """Ranks per context-parallel group (1 without cp)."""
        return 1 if self.cp_group is None else dist.get_world_size(self.cp_group)

    @property
    def cp_rank(self) -> int:
        return 0 if self.cp_group is None else dist.get_rank(self.cp_group)

    def _context_parallel(
        self,
        cp: int,
        mesh: DeviceMesh | None,
        group: dist.ProcessGroup | None,
        local: bool,
        timeout_s: float,
    ) -> dist.ProcessGroup:
        """Lay the world out as pipelines of cp groups; returns this rank's pipeline group.
        Everything that can be refused is refused before the groups are made."""
        if local or group is not None:
            raise ValueError(
                "cp= and mesh= lay the ranks out themselves; pass neither group= nor local=True "
                "with them"
            )
        if cp < 1:
            raise ValueError(f"cp must be >= 1, got {cp}")
        check_supported(self.lm)
        _group_size(None)  # torch.distributed must be initialized
        pipeline, self.cp_group = cp_groups(cp, timedelta(seconds=timeout_s), mesh)
        self.lm = context_parallel_lm(self.lm, self.cp_group)
        return pipeline

    def _cp_exchange(self, choice: str, timeout_s: float) -> str | None:
        """Choose how the cp group exchanges at decode (collective over it), and warn when it
        spans hosts: every layer of every token waits for the exchange."""
        if self.cp_group is None:
            return None
        hosts: list[Any] = [None] * self.cp_size
        dist.all_gather_object(hosts, socket.gethostname(), group=self.cp_group)
        if len(set(hosts)) > 1:
            logger.warning(
                "the cp group of rank %d spans hosts %s: context parallelism exchanges every "
                "layer's attention for every token within the group, so a slow link between "
                "machines bounds its speed; put a cp group's ranks on one machine (consecutive "
                "ranks) and the pipeline across machines",
                dist.get_rank(),
                sorted(set(hosts)),
            )
        why_not = shared_memory_possible(self.device, hosts)
        if choice == "shared" and why_not is not None:
            raise ValueError(
                f"cp_exchange='shared' needs the cp group in one host's memory, but {why_not}; "
                "pass cp_exchange='group' (or 'auto')"
            )
        if choice == "group" or why_not is not None:
            return "group"
        assert isinstance(self.lm, ContextParallelLM)
        self.lm.exchanger = SharedExchange(self.cp_group, timedelta(seconds=timeout_s))
        return "shared"

    @classmethod
    def from_split(
        cls,
        model: Any,
        graph: StageGraph,
        stages: Mapping[int, nn.Module],
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        timeout_s: float = 60.0,
        trace: bool = False,
    ) -> DecodePipeline:
        """The generator of a ``Pipeline``'s split of conveyor's GPT: its stages (``graph``),
        placement and this rank's materialized ``stages``, sharing their parameters.

        Raises:
            TypeError: the model is not conveyor's GPT, or its stages are not layer ranges.
        """
        if not isinstance(model, nn.Sequential) or not is_gpt(list(model)):
            raise TypeError(
                f"Pipeline.generate runs conveyor's GPT (conveyor.models.gpt), got a "
                f"{type(model).__name__}; for a Hugging Face causal LM use "
                "conveyor.DecodePipeline(model, balance=...)"
            )
        layers: list[nn.Module] = list(model)
        balance = []
        for stage in graph.stages:
            assert stage.module is not None
            names = [name for name, _ in stage.module.named_children()]
            units = [int(n) for n in names if n.isdigit()]
            if not units or units != list(range(units[0], units[0] + len(units))):
                raise TypeError(
                    f"stage {stage.index} holds layers {names}; Pipeline.generate needs a chain "
                    "split of the GPT into ranges of layers (balance or split_points)"
                )
            if stage.index in stages:
                layers[units[0] : units[-1] + 1] = [
                    stages[stage.index].get_submodule(n) for n in names
                ]
            balance.append(len(units))
        return cls(
            GptLM(layers),
            balance=balance,
            placement=[s.rank for s in graph.stages],
            group=group,
            device=device,
            timeout_s=timeout_s,
            trace=trace,
        )

    # -- generating ------------------------------------------------------------------------

    def generate(
        self,
        input_ids: torch.Tensor | Sequence[torch.Tensor],
        config: GenerationConfig | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        **options: Any,
    ) -> torch.Tensor | None:
        """Generate after each prompt; returns (batch, prompt length + new tokens) ids (the
        left-padded prompts, then the new tokens) on every rank, or on ``dst`` only.

        ``options`` are GenerationConfig fields (``max_new_tokens``, ``do_sample``, ...),
        overriding ``config``. Bad input fails on every rank before any message is sent.

        Raises:
            ValueError: a prompt longer than the model's context, caches over the memory
                budget, or malformed prompts or settings.
        """
        start = time.perf_counter()
        self._check_usable()
        read, problem = None, None
        try:  # a problem of one rank's input is told to all in _agree: they stay in step
            read = self._read(input_ids, attention_mask, config, options)
        except (ValueError, TypeError) as error:
            problem = error
        with self._refused_as(problem), self._abandoning(f"generation {self.num_generations}"):
            self._agree(read, problem)
        assert read is not None  # else raised above
        ids, mask, config = read
        choosing = time.perf_counter()
        with (
            self._abandoning(f"choosing the groups of generation {self.num_generations}"),
            _eval_mode(self._local_modules()),
        ):
            num_groups = self._groups(int(ids.shape[0]), int(ids.shape[1]), config)
        choosing = time.perf_counter() - choosing
        batch = self._batch(ids, mask, config, num_groups)
        program = self.program(num_groups, ids.shape[1], config)
        if self.recorder is not None:
            self.recorder.begin_step(self.num_generations)
        with self._abandoning(f"generation {self.num_generations}"):
            with _eval_mode(self._local_modules()):
                tokens = self._runtime.run(program[self.rank], batch)
            new = self._share(tokens, batch, config.dst)
        if self.recorder is not None:
            self.recorder.end_step()
        self.num_generations += 1
        length = config.max_new_tokens
        if tokens or new is not None:  # the last stage's rank, or one that got the tokens
            mine = new if new is not None else _stacked(tokens)
            length = generated_length(mine, config.stop_tokens)
        first = self._runtime.first_token
        self.stats = GenerationStats(
            time.perf_counter() - start,
            None if first is None else first - start,
            int(ids.shape[0]),
            length,
            self._runtime.final_cache_bytes,
            num_groups,
            choosing,
        )
        return None if new is None else torch.cat([ids.to(new.device), new[:, :length]], 1)

    @property
    def defaults(self) -> GenerationConfig:
        """The settings ``generate`` starts from when given no config: the model's own stop
        and pad tokens (a Hugging Face model's ``generation_config``), as its generate uses."""
        return self.settings()

    def settings(self, config: GenerationConfig | None = None, **options: Any) -> GenerationConfig:
        """What ``generate(config, **options)`` runs with: ``config`` (default: the model's own
        stop and pad tokens) changed by ``options``. Without a config, a stop token given in
        ``options`` also pads for a model without a pad token, as in Hugging Face's generate."""
        if config is None:
            return model_defaults(self.lm.generation_config, **options)
        return config.replace(**options)

    def program(self, num_groups: int, prompt_length: int, config: GenerationConfig) -> Program:
        """The decode Program of ``num_groups`` groups and prompts of ``prompt_length`` tokens."""
        key = (num_groups, prompt_length, config.max_new_tokens, config.prefill_chunk)
        if key not in self._programs:
            items = decode_items(
                num_groups, prompt_length, config.max_new_tokens, config.prefill_chunk
            )
            self._programs[key] = decode_program(self.graph.topology(), items)
        return self._programs[key]

    def _groups(self, batch_size: int, prompt_length: int, config: GenerationConfig) -> int:
        """Groups in flight, at most one per sequence: ``num_groups`` if given; else the
        fastest predicted from the stages' measured costs (See Note [choosing groups at run
        time]); on one rank or with context parallelism, one per rank (as before there was
        a choice: cp ranks' attention exchanges are not in the cost model)."""
        self.choice = None
        if config.num_groups is not None:
            return min(config.num_groups, batch_size)
        if self._chooser is None or batch_size == 1:
            return min(self.num_ranks, batch_size)
        self.choice = self._chooser.choose(batch_size, prompt_length, config)
        return self.choice.num_groups

    def cache_bytes(self, batch_size: int, positions: int) -> list[int]:
        """KV-cache bytes each rank needs for ``batch_size`` sequences of ``positions``."""
        per_rank = [0] * self.num_ranks
        for stage in self.graph.stages:
            per_rank[stage.rank] += (
                batch_size * positions * self.lm.cache_bytes_per_position(self.units[stage.index])
            )
        return per_rank

    def _check(self, ids: torch.Tensor, config: GenerationConfig) -> None:
        """What can be wrong with a generation, found before any message: context, memory,
        ``dst``."""
        length, context = int(ids.shape[1]), self.lm.context_length
        if context is not None and length > context:
            raise ValueError(
                f"the prompt is {length} tokens (with left padding) but the model's context is "
                f"{context} positions; shorten the prompts"
            )
        if context is not None and length + config.max_new_tokens > context:
            raise ValueError(
                f"a prompt of {length} tokens plus max_new_tokens={config.max_new_tokens} needs "
                f"{length + config.max_new_tokens} positions but the model's context is "
                f"{context}; generate at most {context - length} new tokens or shorten the prompts"
            )
        self._check_tokens(ids, config)
        if self.cp_group is not None:
            self._check_context_parallel(config)
        if config.dst is not None and config.dst >= self.num_ranks:
            raise ValueError(f"dst={config.dst} is not a rank of the {self.num_ranks}-rank group")
        if config.memory_budget is not None:
            self._check_budget(ids.shape[0], length + config.max_new_tokens, config.memory_budget)

    def _check_context_parallel(self, config: GenerationConfig) -> None:
        """What context parallelism does not take: a prompt in chunks (it splits the prompt
        along its length over the cp ranks instead), a cache other than its own shards."""
        if config.prefill_chunk is not None:
            raise ValueError(
                f"prefill_chunk={config.prefill_chunk} with cp={self.cp_size}: context "
                "parallelism already splits each prompt along its length over the cp ranks; "
                "leave prefill_chunk out"
            )
        if config.cache not in (None, "static"):
            raise ValueError(
                f"cache={config.cache!r} with cp={self.cp_size}: context parallelism keeps "
                "each rank's part of the cache in its own preallocated shards; leave cache out"
            )

    def _check_tokens(self, ids: torch.Tensor, config: GenerationConfig) -> None:
        """Refuse ids the embedding has no row for: in the prompts (padding included), and the
        pad token once a stop token can end a sequence (its pad then feeds the model)."""
        vocab = self.lm.vocab_size
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(
                f"input_ids hold token {low if low < 0 else high}, outside the model's "
                f"vocabulary of {vocab} (ids 0 to {vocab - 1}); check the tokenizer, and "
                "pad_token_id if the prompts were padded"
            )
        if config.pad_token_id >= vocab and any(t < vocab for t in config.stop_tokens):
            raise ValueError(
                f"pad_token_id={config.pad_token_id} is outside the model's vocabulary of "
                f"{vocab}, and it feeds the model after a stop token; pass a pad_token_id "
                "below the vocabulary size (e.g. the first stop token)"
            )

    def _check_budget(self, batch_size: int, positions: int, budget: int) -> None:
        for rank, need in enumerate(self.cache_bytes(batch_size, positions)):
            if need > budget:
                stages = self.graph.stages_on(rank)
                blocks = sum(len(self.lm.blocks(self.units[s])) for s in stages)
                raise ValueError(
                    f"rank {rank} (stages {stages}) needs {format_bytes(need)} of KV cache "
                    f"({blocks} blocks x {batch_size} sequences x {positions} positions), over "
                    f"memory_budget={format_bytes(budget)}; generate fewer tokens, use a smaller "
                    "batch or split the model over more ranks"
                )

    def _batch(
        self, ids: torch.Tensor, mask: torch.Tensor, config: GenerationConfig, num_groups: int
    ) -> Batch:
        new = torch.ones((ids.shape[0], config.max_new_tokens), dtype=torch.bool)
        key_mask = torch.cat([mask, new], dim=1)
        return Batch(
            ids.to(self.device),
            key_mask.to(self.device),
            positions_of(key_mask).to(self.device),
            groups_of(ids.shape[0], num_groups),
            decode_items(num_groups, ids.shape[1], config.max_new_tokens, config.prefill_chunk),
            config,
            config.cache or self.lm.default_cache,
            self.cp_rank,
            self.cp_size,
        )

    def _share(
        self, tokens: dict[int, list[torch.Tensor]], batch: Batch, dst: int | None
    ) -> torch.Tensor | None:
        """The (batch, max new tokens) tokens, from the last stage's rank to every rank (or
        to ``dst``), over the pipeline's own messages: every wait is bounded, a lost peer named."""
        p2p, sink = self._runtime.p2p, self.graph.rank_of(self.graph.sink)
        if p2p is None:
            return _stacked(tokens)
        receivers = [r for r in range(self.num_ranks) if r != sink and dst in (None, r)]
        if self.rank == sink:
            new = _stacked(tokens)
            for rank in receivers:
                p2p.send(new, rank, "the generated tokens")
            p2p.wait_sends()
        elif self.rank in receivers:
            shape = (batch.input_ids.shape[0], batch.config.max_new_tokens)
            meta = Meta.of(torch.empty(shape, dtype=torch.long, device="meta"))
            new = p2p.wait(p2p.post(sink, meta, "the generated tokens"))
        return new if dst in (None, self.rank) else None

    def _read(
        self,
        input_ids: Any,
        attention_mask: torch.Tensor | None,
        config: GenerationConfig | None,
        options: Mapping[str, Any],
    ) -> _Read:
        """(ids, mask, settings) of a generation, checked. Prompts padded without a mask get
        one from the pad token, as Hugging Face's generate makes it: the model's own pad
        token, or the one ``options`` give.

        Raises:
            ValueError, TypeError: malformed prompts or settings, or more than the model's
                context or the memory budget holds.
        """
        settings = self.settings(config, **options)
        if attention_mask is None:
            pad = options.get("pad_token_id", self._own_pad if config is None else None)
            attention_mask = inferred_mask(input_ids, pad, settings.stop_tokens)
        ids, mask = prepare_prompts(input_ids, attention_mask, settings.pad_token_id)
        self._check(ids, settings)
        return ids, mask, settings

    def _agree(self, read: _Read | None, problem: Exception | None = None) -> None:
        """Every rank must generate from the same prompts and settings: compared before the
        first message (Note [batch fingerprint]). A rank with a ``problem`` of its own takes
        part too, so that every rank raises and the next generation pairs up again.

        Raises:
            the ``problem`` itself, on a single rank (no exchange).
        """
        if self._runtime.p2p is None:
            if problem is not None:
                raise problem
            return
        ids, mask, config = read or _NOTHING
        prompts = {"input_ids": ids, "attention_mask": mask, "settings": repr(config)}
        mine = fingerprint(
            prompts,
            None,
            False,
            self.device,
            int(ids.shape[0]),
            "" if problem is None else f"rank {self.rank}: {problem}",
        )
        agree(self._runtime.p2p, mine, f"generation {self.num_generations}", _named(config))
        if self.cp_group is not None:
            self._agree_within_cp(mine.tensor())

    def _agree_within_cp(self, mine: torch.Tensor) -> None:
        """The ranks of a cp group must run the same prompts and settings too: their shards
        are parts of one cache (each pipeline has agreed within itself already).

        Raises:
            ValueError: on every rank of the group, naming the ranks that differ.
        """
        group = self.cp_group
        assert group is not None
        gathered = [torch.empty_like(mine) for _ in range(self.cp_size)]
        dist.all_gather(gathered, mine, group=group)
        differ = [i for i, theirs in enumerate(gathered) if not torch.equal(theirs, gathered[0])]
        if differ:
            ranks = [dist.get_global_rank(group, i) for i in [0, *differ]]
            raise ValueError(
                f"the ranks {ranks} of one cp group were given other prompts or settings for "
                f"generation {self.num_generations}; every rank passes the same prompts and "
                "settings to generate"
            )

    @contextlib.contextmanager
    def _refused_as(self, problem: Exception | None) -> Iterator[None]:
        """This rank's own ``problem`` as it was raised, rather than as the refusal the
        agreement makes of it (every other rank says which rank could not run)."""
        try:
            yield
        except CannotRunError:
            if problem is not None:
                raise problem from None
            raise

    @property
    def _own_pad(self) -> int | None:
        """The model's own pad token, if it has one (None for conveyor's GPT)."""
        pad = getattr(self.lm.generation_config, "pad_token_id", None)
        return pad if isinstance(pad, int) else None

    def _abandoning(self, doing: str) -> contextlib.AbstractContextManager[None]:
        """On an error once messages may move, close this rank's connections so that every
        peer fails at once naming it, and refuse to generate again (Note [abandoned step])."""
        if self._runtime.p2p is None:
            return contextlib.nullcontext()
        return self._runtime.p2p.abandoning(doing)

    def _check_usable(self) -> None:
        if self._runtime.p2p is not None:
            self._runtime.p2p.check_usable("DecodePipeline")

    def _check_materialized(self) -> None:
        """Refuse this rank's modules if they hold meta tensors: they have no values to run."""
        for s in self.graph.stages_on(self.rank):
            for module in self.lm.unit_modules(self.units[s]):
                for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
                    if tensor.is_meta:
                        raise ValueError(
                            f"stage {s}'s {type(module).__name__} has {name!r} on the meta "
                            "device, without values; load the weights first (e.g. "
                            "model.load_state_dict(state, assign=True) or from_pretrained) "
                            "or build the model on a real device"
                        )

    def _model_device(self) -> torch.device:
        """The device of this rank's parameters (CPU for a model without any)."""
        for module in self._local_modules():
            for parameter in module.parameters():
                return parameter.device
        return torch.device("cpu")

    def _local_modules(self) -> list[nn.Module]:
        return [
            module
            for s in self.graph.stages_on(self.rank)
            for module in self.lm.unit_modules(self.units[s])
        ]

    # -- timelines -------------------------------------------------------------------------

    def timeline(self, generation: int = -1) -> Timeline:
        """Every rank's events of one traced generate call: ``generation`` is its index (0:
        the first call), or counts back from the last (-1, the default).

        Collective over the group; needs ``trace=True``.
        """
        if self.recorder is None:
            raise RuntimeError("this DecodePipeline records no timeline; create it with trace=True")
        part = self.recorder.timeline(self.num_ranks, generation)
        parts: list[Any] = [part]
        if self.num_ranks > 1:
            parts = [None] * self.num_ranks
            dist.all_gather_object(parts, part, group=self.group)
        return merge(
            parts, {"schedule": "decode", "ranks": self.num_ranks, "balance": list(self.balance)}
        )


def generate(
    model: Any,
    input_ids: torch.Tensor | Sequence[torch.Tensor],
    config: GenerationConfig | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    **options: Any,
) -> torch.Tensor:
    """Generate with the unsplit model on this process: the same KV caches, groups and
    sampling as a DecodePipeline, without torch.distributed.

        tokens = generate(model, input_ids, max_new_tokens=32, do_sample=True, seed=1)
    """
    lm = as_causal_lm(model)
    decoder = DecodePipeline(lm, balance=[lm.num_units], device=device, local=True)
    tokens = decoder.generate(input_ids, config, attention_mask=attention_mask, **options)
    assert tokens is not None
    return tokens


def as_causal_lm(model: Any) -> CausalLM:
    """``model`` as a CausalLM: a CausalLM itself, conveyor's GPT (``conveyor.models.gpt``'s
    Sequential), or a Hugging Face causal LM of a family ``conveyor.hf.decode.ADAPTERS``
    names (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``GPT2LMHeadModel``, ...).

    Raises:
        TypeError: ``model`` is none of these, has no causal LM head, or is of a Hugging Face
            family without an adapter.
    """
    if isinstance(model, CausalLM):
        return model
    if isinstance(model, nn.Sequential) and is_gpt(list(model)):
        return GptLM(list(model))
    if isinstance(model, nn.Module) and is_hf_model(model):
        return hf_causal_lm(model)
    raise TypeError(
        f"cannot generate with a {type(model).__name__}: it has no causal LM head conveyor "
        "knows; expected conveyor.models.gpt (an nn.Sequential of Embedding, Blocks, Head), a "
        "Hugging Face causal LM of a family in conveyor.hf.decode.ADAPTERS "
        "(LlamaForCausalLM, Qwen2ForCausalLM, GPT2LMHeadModel, ...) or a "
        "conveyor.inference.lm.CausalLM"
    )


def default_balance(num_units: int, num_stages: int) -> list[int]:
    """Units per stage: the blocks evenly (larger stages first), the embedding with the first
    stage and the head with the last."""
    num_blocks = num_units - 2
    if num_stages == 1:
        return [num_units]
    if num_blocks < num_stages:
        return even_balance(num_units, num_stages)
    balance = even_balance(num_blocks, num_stages)
    balance[0] += 1
    balance[-1] += 1
    return balance


def _stage_units(lm: CausalLM, balance: Sequence[int]) -> dict[int, range]:
    if any(b < 1 for b in balance):
        raise ValueError(
            f"balance {list(balance)} gives a stage {min(balance)} units; every stage needs "
            "at least one (the embedding, a block or the head)"
        )
    if sum(balance) != lm.num_units:
        raise ValueError(
            f"balance {list(balance)} covers {sum(balance)} units but the model has "
            f"{lm.num_units} (the embedding, {lm.num_blocks} blocks and the head); pass "
            f"positive counts that sum to {lm.num_units}, or omit balance to split evenly"
        )
    starts = [sum(balance[:i]) for i in range(len(balance))]
    return {
        s: range(start, start + b) for s, (start, b) in enumerate(zip(starts, balance, strict=True))
    }


_Read = tuple[torch.Tensor, torch.Tensor, GenerationConfig]
"""A generation's prompts, attention mask and settings, checked."""

_NOTHING = (torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.bool), None)
"""What a rank whose prompts could not be read puts in its fingerprint."""


def _named(config: GenerationConfig | None) -> dict[str, str]:
    """Each setting of ``config`` by name, as a rank's error shows it to the others (none for
    a rank that could not read its own)."""
    if config is None:
        return {}
    return {f.name: repr(getattr(config, f.name)) for f in dataclasses.fields(config)}


def _stacked(tokens: dict[int, list[torch.Tensor]]) -> torch.Tensor:
    """(batch, new tokens): each group's sampled tokens side by side, the groups in order."""
    return torch.cat([torch.stack(tokens[g], dim=1) for g in sorted(tokens)])


def _group_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; launch with `conveyor run -n N script.py` "
            "and call torch.distributed.init_process_group() first, or use "
            "conveyor.generate(model, ...) on one process"
        )
    return dist.get_rank(group), dist.get_world_size(group)


@contextlib.contextmanager
def _eval_mode(modules: list[nn.Module]) -> Iterator[None]:
    """Modules in eval mode (no dropout) for the body, then back to their own modes."""
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(modules, modes, strict=True):
            m.train(mode)
