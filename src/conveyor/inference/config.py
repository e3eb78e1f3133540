"""GenerationConfig: what a generation computes and how it is split, validated up front."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["GenerationConfig", "model_defaults"]


@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """Settings of ``generate``: decoding (greedy or sampled), stops, groups, chunks, budget.

    Sampling draws each sequence's tokens from its own generator, seeded by ``seed`` and the
    sequence's row in the batch, so the tokens depend on neither the split, nor the groups,
    nor the rank that samples them.
    """

    max_new_tokens: int = 32
    """Tokens to generate per sequence (fewer if every sequence stops first)."""
    do_sample: bool = False
    """Sample from the (filtered) distribution; otherwise pick the most likely token (greedy)."""
    temperature: float = 1.0
    """Divide the logits by this before sampling."""
    top_k: int | None = None
    """Sample among the k most likely tokens only (Hugging Face's generate defaults to 50;
    pass top_k=50 to match it)."""
    top_p: float | None = None
    """Sample among the most likely tokens whose probabilities sum to top_p (nucleus)."""
    seed: int = 0
    """Seed of every sequence's sampling generator."""
    eos_token_id: tuple[int, ...] | int = ()
    """Stop tokens (one id or several; kept as a tuple): a sequence that samples one is
    finished and gets pad_token_id after it; generation ends when every sequence is finished.
    DecodePipeline's default: the model's own (``generation_config.eos_token_id``)."""
    pad_token_id: int = 0
    """Token after a finished sequence's stop token, and left padding of ragged prompts.
    DecodePipeline's default: the model's own, else its first stop token, as Hugging Face's
    generate does."""
    num_groups: int | None = None
    """Groups of sequences decoded in flight, each on another rank at a time (the decode
    analogue of micro-batches); default: on 2 or more ranks without context parallelism,
    the count from 1 to two per rank that the stages' measured costs predict fastest (more
    than one only if predicted 5% faster than one; said in the log), else one per rank; at
    most one per sequence. 1 is the naive pipeline, where p - 1 of p ranks idle at every
    token."""
    prefill_chunk: int | None = None
    """Prompt tokens per prefill item: a long prompt then flows through the stages in chunks,
    overlapping other groups' work; default: the whole prompt in one item."""
    cache: Literal["static", "dynamic"] | None = None
    """KV cache kind: 'static' (preallocated for prompt + new tokens) or 'dynamic' (Hugging Face
    DynamicCache, grows); default: the model's (static for conveyor's GPT, dynamic for Hugging
    Face models, as their generate does)."""
    memory_budget: int | None = None
    """Bytes each rank may spend on KV caches; a generation that needs more fails before it
    starts, saying how much it needs."""
    dst: int | None = None
    """Rank (in the pipeline's group) that gets the tokens; default: every rank."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_id", _token_ids(self.eos_token_id))
        self._check_types()
        if not _is_int(self.pad_token_id) or self.pad_token_id < 0:
            raise ValueError(
                f"pad_token_id must be a token id (an int >= 0), got {self.pad_token_id!r}; for "
                "a tokenizer without a pad token, pass its eos_token_id, as Hugging Face does"
            )
        for name in ("max_new_tokens", "num_groups", "prefill_chunk", "top_k", "memory_budget"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not self.temperature > 0:  # NaN too: it would fail in sampling, mid-generation
            raise ValueError(
                f"temperature must be > 0, got {self.temperature}; use do_sample=False for greedy"
            )
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.cache not in (None, "static", "dynamic"):
            raise ValueError(f"cache must be 'static' or 'dynamic', got {self.cache!r}")
        if self.dst is not None and self.dst < 0:
            raise ValueError(f"dst must be a rank >= 0, got {self.dst}")

    def _check_types(self) -> None:
        for name, (kind, check) in _TYPES.items():
            value = getattr(self, name)
            if not check(value):
                raise TypeError(f"{name} must be {kind}, got {value!r}")

    @property
    def stop_tokens(self) -> tuple[int, ...]:
        """``eos_token_id`` as the tuple it is once validated."""
        stops = self.eos_token_id
        return stops if isinstance(stops, tuple) else (stops,)

    def replace(self, **changes: Any) -> GenerationConfig:
        """This config with ``changes`` (field names) applied and validated."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise TypeError(
                f"unknown generation settings {unknown}; expected GenerationConfig fields "
                f"{sorted(names)}"
            )
        return dataclasses.replace(self, **changes)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _or_none(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


_TYPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "max_new_tokens": ("an int", _is_int),
    "do_sample": ("a bool", lambda value: isinstance(value, bool)),
    "temperature": ("a number", _is_number),
    "top_k": ("an int or None", _or_none(_is_int)),
    "top_p": ("a number or None", _or_none(_is_number)),
    "seed": ("an int", _is_int),
    "num_groups": ("an int or None", _or_none(_is_int)),
    "prefill_chunk": ("an int or None", _or_none(_is_int)),
    "memory_budget": ("an int (bytes) or None", _or_none(_is_int)),
    "dst": ("an int (a rank) or None", _or_none(_is_int)),
}
"""What the fields of GenerationConfig must hold, checked before their values."""


def _token_ids(stops: Any) -> tuple[int, ...]:
    """``eos_token_id`` as a tuple: one id, a sequence of ids or a tensor of them."""
    if isinstance(stops, torch.Tensor):
        stops = stops.tolist()
    if stops is None:
        stops = ()
    elif _is_int(stops):
        stops = (stops,)
    elif isinstance(stops, list | tuple):
        stops = tuple(stops)
    if not isinstance(stops, tuple) or not all(_is_int(t) and t >= 0 for t in stops):
        raise ValueError(
            f"eos_token_id must be a token id or a sequence of them (ints >= 0), got {stops!r}"
        )
    return stops


def model_defaults(own: Any, **options: Any) -> GenerationConfig:
    """GenerationConfig with the stop and pad tokens of a model's own generation settings
    (a Hugging Face ``generation_config``, or None) changed by ``options`` (GenerationConfig
    fields): the tokens its own generate would use. A model without a pad token pads with
    the first stop token, the one given in ``options`` if any, as Hugging Face's does."""
    stops = options.get("eos_token_id", getattr(own, "eos_token_id", None))
    config = GenerationConfig(eos_token_id=() if stops is None else stops)  # validates, tuples
    pad = getattr(own, "pad_token_id", None)
    pad = pad if pad is not None else (config.stop_tokens or (0,))[0]
    return config.replace(**{"pad_token_id": pad, **options})
