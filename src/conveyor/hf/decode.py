"""Hugging Face causal LMs as CausalLMs: a hand split that runs the model's own modules per
stage, with Hugging Face's own cache objects (DynamicCache or StaticCache) on each stage.

    lm = hf_causal_lm(Qwen2ForCausalLM(config))     # the adapter ADAPTERS names for qwen2
    lm.run(range(0, 3), input_ids, lm.new_cache(...), context)

``ADAPTERS`` maps a ``config.model_type`` to its adapter, one per layout of modules: the
Llama layout (``HfDecoder``: Llama, Qwen2, Mistral, Phi-3, Gemma 2; ``HfGemma3`` for Gemma 3's
rotary tables per layer type), GPT-NeoX, OPT and GPT-2. Each stage builds, for each layer type
among its blocks (full or sliding-window attention), the mask the model's own forward builds
(``transformers.masking_utils``), sized against its own first layer of that type (a stage's
cache fills only its own layers), and rotary embeddings from the positions every rank knows,
so only hidden states travel between stages. Only families whose forward is known to be
reproduced exactly are accepted; a new one is an adapter class and one entry.

Why not the export front end (conveyor.split.export), which splits any Hugging Face model
unedited: it traces the forward with ``use_cache=False``, so its stage graphs hold no cache
and compute the attention mask and positions once, in the first stage, for the whole
sequence. Generation needs each stage to keep its layers' keys and values between calls and
to run both a prompt and a single token against them: a stage graph exported with a static
cache as mutable buffers (as transformers.integrations.executorch does for a whole model),
``cache_position`` and the attention mask as inputs of every stage, and logits of the last
position only. Until the front end exports stages that way, this hand split is the path.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from abc import abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from conveyor.inference.lm import Attend, CausalLM, Context
from conveyor.parallel.context_parallel import AttentionSpec

__all__ = [
    "ADAPTERS",
    "HfCausalLM",
    "HfDecoder",
    "HfGemma3",
    "HfGpt2",
    "HfGptNeoX",
    "HfOpt",
    "hf_causal_lm",
    "is_hf_model",
]

_MASKS = {
    "full_attention": "create_causal_mask",
    "sliding_attention": "create_sliding_window_causal_mask",
}
"""Layer type -> the ``transformers.masking_utils`` function that makes its mask."""


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` looks like a Hugging Face model (it has a config with a model type)."""
    return isinstance(getattr(getattr(model, "config", None), "model_type", None), str)


def hf_causal_lm(model: nn.Module) -> CausalLM:
    """The adapter ``ADAPTERS`` names for a Hugging Face causal LM's model type.

    Raises:
        TypeError: the model has no causal LM head, or its model type has no adapter.
    """
    config: Any = getattr(model, "config", None)
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if head is None:
        raise TypeError(
            f"{type(model).__name__} has no causal LM head (get_output_embeddings() is None); "
            "generation needs the *ForCausalLM / *LMHeadModel class, e.g. LlamaForCausalLM "
            "rather than LlamaModel"
        )
    adapter = ADAPTERS.get(config.model_type)
    if adapter is None:
        raise TypeError(_unsupported(model, config.model_type))
    return adapter(model)


def _unsupported(model: nn.Module, model_type: str) -> str:
    """Why ``model`` has no adapter, and how to write one: from the adapter whose module
    layout it shares most, or from CausalLM itself."""
    nearest = max(ADAPTERS.values(), key=lambda adapter: len(_shared_paths(model, adapter)))
    shared = _shared_paths(model, nearest)
    if shared:
        how = (
            f"subclass the nearest adapter, conveyor.hf.decode.{nearest.__name__} (the "
            f"model shares its {', '.join(shared)}): set its *_paths, override embed and block "
            "to run them as the model's own forward does, and register it: "
            f"ADAPTERS[{model_type!r}] = YourAdapter (or adapt it as a "
            "conveyor.inference.lm.CausalLM and pass that to DecodePipeline)"
        )
    else:
        how = (
            "adapt it as a conveyor.inference.lm.CausalLM (see conveyor.hf.decode's "
            "adapters) and pass that to DecodePipeline"
        )
    return (
        f"generation splits Hugging Face model types {sorted(ADAPTERS)} "
        f"(conveyor.hf.decode.ADAPTERS), got {model_type!r} ({type(model).__name__}); "
        f"to generate with it, {how}"
    )


def _shared_paths(model: nn.Module, adapter: type[HfCausalLM]) -> list[str]:
    """The module paths of ``adapter``'s layout that ``model`` has too."""
    return [path for path in adapter.layout() if _submodule(model, path) is not None]


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    """The module at dotted ``path``, or None where the model has none (OPT without a
    projection holds None there)."""
    found: Any = model
    for name in path.split("."):
        found = getattr(found, name, None)
    return found if isinstance(found, nn.Module) else None


def _layer_types(config: Any) -> list[str]:
    """Each layer's attention type, read as the model's own forward and cache read it: the
    config's ``layer_types``, else sliding-window attention everywhere if the config sets a
    ``sliding_window`` (Mistral, Phi-3), else full attention."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    sliding = getattr(config, "sliding_window", None) is not None
    kind = "sliding_attention" if sliding else "full_attention"
    return [kind] * int(config.num_hidden_layers)


class HfCausalLM(CausalLM):
    """What every Hugging Face adapter shares: units of the model's own modules (found by
    path), its caches, a mask per layer type, the final modules and the LM head.

    A family's adapter says where its modules sit (the ``*_paths``) and how to run its
    embedding (``embed``) and one block (``block``).
    """

    default_cache = "dynamic"
    embedding_paths: ClassVar[tuple[str, ...]] = ()
    """Paths of unit 0's modules (token and position embeddings) in the model."""
    layers_path: ClassVar[str] = ""
    """Path of the ModuleList of blocks."""
    final_paths: ClassVar[tuple[str, ...]] = ()
    """Paths of the modules run in order before the LM head (final norm, projection)."""
    shared_paths: ClassVar[tuple[str, ...]] = ()
    """Paths of modules every stage with blocks runs (rotary embeddings)."""

    def __init__(self, model: Any) -> None:
        # Any: transformers is optional, and its modules are reached by attribute
        self.model: Any = model
        self.config: Any = model.config
        self.layers: Any = _submodule(model, self.layers_path)
        if not isinstance(self.layers, nn.ModuleList):
            raise TypeError(
                f"{type(self).__name__} reads the blocks at {self.layers_path!r}, but "
                f"{type(model).__name__} has no ModuleList there; use the adapter of its "
                "family (conveyor.hf.decode.ADAPTERS) or set layers_path"
            )
        self.num_units = len(self.layers) + 2
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.config.vocab_size)
        self.context_length = _rope_context(self.config, int(self.config.max_position_embeddings))
        self.dtype = next(model.parameters()).dtype
        self.layer_types = _layer_types(self.config)
        self._check_layer_types()

    @classmethod
    def layout(cls) -> tuple[str, ...]:
        """Every module path this adapter reads."""
        return (*cls.embedding_paths, cls.layers_path, *cls.final_paths, *cls.shared_paths)

    @property
    def generation_config(self) -> Any:
        return getattr(self.model, "generation_config", None)

    def _check_layer_types(self) -> None:
        unknown = sorted(set(self.layer_types) - set(_MASKS))
        if unknown:
            raise TypeError(
                f"{type(self.model).__name__} has layer types {unknown}; "
                f"{type(self).__name__} builds masks for {sorted(_MASKS)} only; subclass it "
                "and build those layers' masks as the model's own forward does"
            )

    def _at(self, paths: tuple[str, ...]) -> list[nn.Module]:
        return [m for m in (_submodule(self.model, p) for p in paths) if m is not None]

    def unit_modules(self, units: range) -> list[nn.Module]:
        found: list[nn.Module] = []
        for u in units:
            if u == 0:
                found += self._at(self.embedding_paths)
            elif u == self.num_units - 1:
                found += [*self._at(self.final_paths), self.model.get_output_embeddings()]
            else:
                found.append(self.layers[u - 1])
        if self.blocks(units):
            found += self._at(self.shared_paths)
        return found

    def new_cache(
        self, units: range, rows: int, capacity: int, device: torch.device, kind: str
    ) -> Any:
        """Hugging Face's own cache for the whole model, sliding layers as the model keeps
        them; only ``units``'s layers fill (the others are never updated and allocate
        nothing)."""
        from transformers import DynamicCache, StaticCache

        self.check_cache_kind(kind, ("dynamic", "static"))
        if kind == "static":
            return filled_slots(StaticCache(config=self.config, max_cache_len=capacity))
        return DynamicCache(config=self.config)

    def cache_bytes_per_position(self, units: range) -> int:
        """Keys and values of every block (at most: a sliding layer keeps its window only)."""
        config = self.config
        heads = int(config.num_attention_heads)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or self.hidden_size // heads
        per_layer = 2 * kv_heads * head_dim * self.dtype.itemsize
        return int(per_layer * len(self.blocks(units)))

    def run(self, units: range, x: torch.Tensor, cache: Any, context: Context) -> torch.Tensor:
        if 0 in units:
            x = self.embed(x, context)
        blocks = self.blocks(units)
        if blocks:
            types = self._first_layers(blocks)
            masks = {t: self._mask(x, cache, context, t, layer) for t, layer in types.items()}
            rotary = {t: self.position_embeddings(x, context, t) for t in types}
            for u in blocks:
                kind = self.layer_types[u - 1]
                x = self.block(u - 1, x, masks[kind], rotary[kind], cache, context)
        if self.num_units - 1 in units:
            x = self._logits(x[:, -1:])[:, -1]
        return x

    @abstractmethod
    def embed(self, ids: torch.Tensor, context: Context) -> torch.Tensor:
        """Unit 0: hidden states of token ``ids``, as the model's own forward embeds them."""

    @abstractmethod
    def block(
        self, index: int, x: torch.Tensor, mask: Any, rotary: Any, cache: Any, context: Context
    ) -> torch.Tensor:
        """Layer ``index`` on ``x`` with its type's ``mask`` and position embeddings
        (``rotary``), called as the model's own forward calls it."""

    def _first_layers(self, blocks: list[int]) -> dict[str, int]:
        """Layer type -> the index of this stage's first layer of it, whose cache sizes that
        type's mask (every layer of a type in a stage has seen the same tokens)."""
        first: dict[str, int] = {}
        for u in blocks:
            first.setdefault(self.layer_types[u - 1], u - 1)
        return first

    def position_embeddings(self, x: torch.Tensor, context: Context, layer_type: str) -> Any:
        """What the blocks of ``layer_type`` take as position embeddings (None: none)."""
        return None

    def _mask(
        self, x: torch.Tensor, cache: Any, context: Context, layer_type: str, layer: int
    ) -> Any:
        """The mask of ``layer_type``'s attention as the model's own forward makes it, sized
        against ``layer``, this stage's first layer of that type."""
        from transformers import masking_utils

        key_mask = context.key_mask
        make = getattr(masking_utils, _MASKS[layer_type])
        return make(
            config=self.config,
            inputs_embeds=x,
            # generate drops an all-ones mask, which lets sdpa use its causal kernel
            attention_mask=None if bool(key_mask.all()) else key_mask,
            past_key_values=cache,
            position_ids=context.positions,
            layer_idx=layer,
        )

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final modules, the LM head and the logits' soft cap (Gemma 2), as the model's
        ``*ForCausalLM.forward`` applies them."""
        for module in self._at(self.final_paths):
            x = module(x)
        logits: torch.Tensor = self.model.get_output_embeddings()(x)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


# Note [filled slots]:
# Hugging Face's StaticCache hands attention every slot it preallocated, masked, so a prompt
# chunk after cached ones scores all of them, its tokens x the cache's capacity wherever it
# starts: the eight chunks a two-stage pipeline prefills a 16k prompt in took 20.3 s on one
# process, against 10.4 s for the prompt whole. Handed only the slots written so far, as
# conveyor's own StaticKV does, attention is the same (a masked slot weighs exactly 0; the
# mask is cut as the keys are) and the chunks take 12.8 s (bench_static_cache). A prompt sent
# whole, and decode, cost what they did.
def filled_slots(cache: Any) -> Any:
    """``cache`` (a StaticCache) with each full-attention layer handing attention its written
    slots only, not every preallocated one (See Note [filled slots]); sliding-window layers,
    which keep their window only, are left as they are."""
    from transformers.cache_utils import StaticLayer

    filled = _filled_layer_class()
    cache.layers = [
        filled(layer.max_cache_len) if type(layer) is StaticLayer else layer
        for layer in cache.layers
    ]
    return cache


@functools.cache
def _filled_layer_class() -> type:
    """StaticLayer with attention over the written slots, made on first use (transformers is
    imported only where a Hugging Face model is)."""
    from transformers.cache_utils import StaticLayer

    class FilledLayer(StaticLayer):  # type: ignore[no-untyped-call]  # transformers is untyped
        """A StaticLayer whose ``update`` returns its keys and values up to the last written
        position, and whose masks are as long; positions are written in order, as the
        StaticLayer writes them."""

        is_compileable = False  # its shapes grow; and sdpa may take its causal kernel

        def __init__(self, max_cache_len: int) -> None:
            super().__init__(max_cache_len=max_cache_len)
            self.filled = 0  # cumulative_length as a Python int: slicing never waits on a GPU

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            self.filled += key_states.shape[-2]
            return keys[:, :, : self.filled], values[:, :, : self.filled]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.filled + query_length, 0

        def reset(self) -> None:
            super().reset()
            self.filled = 0

    return FilledLayer


class HfDecoder(HfCausalLM):
    """The Llama layout: ``model.embed_tokens`` | ``model.layers`` | ``model.norm`` and
    ``lm_head``, with ``model.rotary_emb`` (Llama, Qwen2, Mistral, Phi-3, Gemma 2); each
    layer's mask by its type (full or sliding window)."""

    embedding_paths = ("model.embed_tokens",)
    layers_path = "model.layers"
    final_paths = ("model.norm",)
    shared_paths = ("model.rotary_emb",)

    def embed(self, ids: torch.Tensor, context: Context) -> torch.Tensor:
        embedded: torch.Tensor = self.model.model.embed_tokens(ids)
        return embedded

    def position_embeddings(self, x: torch.Tensor, context: Context, layer_type: str) -> Any:
        return self.model.model.rotary_emb(x, position_ids=context.positions)

    def block(
        self, index: int, x: torch.Tensor, mask: Any, rotary: Any, cache: Any, context: Context
    ) -> torch.Tensor:
        out: torch.Tensor = self.layers[index](
            x,
            attention_mask=mask,
            position_embeddings=rotary,
            position_ids=context.positions,
            past_key_values=cache,
            use_cache=True,
        )
        return out

    @property
    def supports_context_parallel(self) -> bool:  # type: ignore[override]  # per model type
        return self.config.model_type in CONTEXT_PARALLEL

    def attention_heads(self) -> tuple[int, int, int]:
        heads = int(self.config.num_attention_heads)
        kv_heads = int(getattr(self.config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(self.config, "head_dim", None) or self.hidden_size // heads)
        return heads, kv_heads, head_dim

    def run_attending(
        self, units: range, x: torch.Tensor, context: Context, attend: Attend
    ) -> torch.Tensor:
        """The model's own modules, each attention module calling ``attend`` through
        transformers' attention interface (See Note [replaced attention])."""
        if 0 in units:
            x = self.embed(x, context)
        blocks = self.blocks(units)
        rotary = {t: self.position_embeddings(x, context, t) for t in set(self.layer_types)}
        with _attention_replaced(self, attend):
            for u in blocks:
                x = self.block(u - 1, x, None, rotary[self.layer_types[u - 1]], None, context)
        return x


CONTEXT_PARALLEL = ("llama", "qwen2", "mistral")
"""Model types whose attention ``run_attending`` replaces, tested against their own."""

_REPLACED = "conveyor_replaced"
"""The name conveyor's attention is registered under in transformers' AttentionInterface."""

_attend: contextvars.ContextVar[Attend | None] = contextvars.ContextVar("attend", default=None)


# Note [replaced attention]:
# A Hugging Face attention module runs its own projections, rotary embeddings and grouped
# heads, then calls the function its config's ``_attn_implementation`` names in transformers'
# AttentionInterface. conveyor registers one there that hands the queries and the new keys and
# values to the ``attend`` of the run in progress (a context variable) and selects it on the
# model's config only while the run lasts; no cache is passed, so the keys and values are the
# new tokens' only, and no mask is built (the attend function masks for itself).
def _replaced_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function signature, computing ``attend``'s attention."""
    attend = _attend.get()
    assert attend is not None, "conveyor's attention selected outside run_attending"
    window = kwargs.get("sliding_window")
    spec = AttentionSpec(
        float(scaling if scaling is not None else query.shape[-1] ** -0.5),
        query.shape[1],
        key.shape[1],
        int(window) if window else None,
    )
    out = attend(int(getattr(module, "layer_idx", 0)), query, key, value, spec)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _attention_replaced(lm: HfCausalLM, attend: Attend) -> Iterator[None]:
    """The model's attention modules calling ``attend`` while the body runs."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if _REPLACED not in AttentionInterface._global_mapping:  # once per process
        AttentionInterface.register(_REPLACED, _replaced_attention)
        AttentionMaskInterface.register(_REPLACED, lambda *args, **kwargs: None)
    config = lm.config
    before = config._attn_implementation
    token = _attend.set(attend)
    config._attn_implementation = _REPLACED
    try:
        yield
    finally:
        config._attn_implementation = before
        _attend.reset(token)


class HfGemma3(HfDecoder):
    """Gemma 3's text model (``Gemma3ForCausalLM``): the Llama layout with rotary tables per
    layer type (local for sliding layers, global for full ones)."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        if getattr(self.config, "use_bidirectional_attention", False):
            raise TypeError(
                f"{type(model).__name__} has use_bidirectional_attention=True: it attends to "
                "later tokens, so it cannot generate token by token; load it with "
                "use_bidirectional_attention=False"
            )

    def position_embeddings(self, x: torch.Tensor, context: Context, layer_type: str) -> Any:
        return self.model.model.rotary_emb(x, context.positions, layer_type)


class HfGptNeoX(HfCausalLM):
    """``GPTNeoXForCausalLM``: ``gpt_neox.embed_in`` (and its dropout) | ``gpt_neox.layers`` |
    ``gpt_neox.final_layer_norm`` and ``embed_out``, with ``gpt_neox.rotary_emb``."""

    embedding_paths = ("gpt_neox.embed_in", "gpt_neox.emb_dropout")
    layers_path = "gpt_neox.layers"
    final_paths = ("gpt_neox.final_layer_norm",)
    shared_paths = ("gpt_neox.rotary_emb",)

    def embed(self, ids: torch.Tensor, context: Context) -> torch.Tensor:
        body = self.model.gpt_neox
        embedded: torch.Tensor = body.emb_dropout(body.embed_in(ids))
        return embedded

    def position_embeddings(self, x: torch.Tensor, context: Context, layer_type: str) -> Any:
        return self.model.gpt_neox.rotary_emb(x, position_ids=context.positions)

    def block(
        self, index: int, x: torch.Tensor, mask: Any, rotary: Any, cache: Any, context: Context
    ) -> torch.Tensor:
        out: torch.Tensor = self.layers[index](
            x,
            attention_mask=mask,
            position_ids=context.positions,
            layer_past=cache,
            use_cache=True,
            position_embeddings=rotary,
        )
        return out


class HfOpt(HfCausalLM):
    """``OPTForCausalLM``: ``embed_tokens`` (and ``project_in``) plus ``embed_positions`` |
    ``layers`` | ``final_layer_norm`` (and ``project_out``) and ``lm_head``, all under
    ``model.decoder``; positions are learned, offset by 2 in the position table."""

    embedding_paths = (
        "model.decoder.embed_tokens",
        "model.decoder.project_in",
        "model.decoder.embed_positions",
    )
    layers_path = "model.decoder.layers"
    final_paths = ("model.decoder.final_layer_norm", "model.decoder.project_out")

    def embed(self, ids: torch.Tensor, context: Context) -> torch.Tensor:
        decoder = self.model.model.decoder
        x = decoder.embed_tokens(ids)
        if decoder.project_in is not None:
            x = decoder.project_in(x)
        # the table's own offset applies to the positions given, as generate gives them
        positions = decoder.embed_positions(
            context.key_mask.long(), context.start, position_ids=context.positions
        )
        embedded: torch.Tensor = x + positions
        return embedded

    def block(
        self, index: int, x: torch.Tensor, mask: Any, rotary: Any, cache: Any, context: Context
    ) -> torch.Tensor:
        out: torch.Tensor = self.layers[index](
            x,
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
            position_ids=context.positions,
        )
        return out


class HfGpt2(HfCausalLM):
    """``GPT2LMHeadModel``: ``transformer.wte`` + ``wpe`` (and dropout) | blocks ``h`` |
    ``ln_f`` and ``lm_head``."""

    embedding_paths = ("transformer.wte", "transformer.wpe", "transformer.drop")
    layers_path = "transformer.h"
    final_paths = ("transformer.ln_f",)

    def embed(self, ids: torch.Tensor, context: Context) -> torch.Tensor:
        body = self.model.transformer
        embedded: torch.Tensor = body.drop(body.wte(ids) + body.wpe(context.positions))
        return embedded

    def block(
        self, index: int, x: torch.Tensor, mask: Any, rotary: Any, cache: Any, context: Context
    ) -> torch.Tensor:
        out: torch.Tensor = self.layers[index](
            x, cache, mask, use_cache=True, position_ids=context.positions
        )
        return out


def _rope_context(config: Any, context: int) -> int:
    """Positions a rotary model generates exactly: with LongRoPE, up to the original context
    only, beyond which the model switches its rotary factors and its generate recomputes
    the cache (a pipeline's cache, kept per stage, cannot be)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    per_type = all(isinstance(table, dict) for table in parameters.values())  # Gemma 3
    for table in list(parameters.values()) if per_type and parameters else [parameters]:
        if table.get("rope_type") == "longrope":
            original = table.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None
            )
            context = min(context, int(original or context))
    return context


ADAPTERS: dict[str, type[HfCausalLM]] = {
    "llama": HfDecoder,
    "qwen2": HfDecoder,
    "mistral": HfDecoder,
    "phi3": HfDecoder,
    "gemma2": HfDecoder,
    "gemma3_text": HfGemma3,
    "gpt_neox": HfGptNeoX,
    "opt": HfOpt,
    "gpt2": HfGpt2,
}
"""Hugging Face ``config.model_type`` -> the adapter that reproduces its forward per stage;
the one place that says which families generate (add an entry to add a family)."""
