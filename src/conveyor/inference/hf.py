"""Hugging Face causal LMs as CausalLMs: a hand split that runs the model's own modules per
stage, with Hugging Face's own cache objects (DynamicCache or StaticCache) on each stage.

    lm = hf_causal_lm(LlamaForCausalLM(config))     # or GPT2LMHeadModel
    lm.run(range(0, 3), input_ids, lm.new_cache(...), context)

Each stage builds its attention mask with ``transformers.masking_utils.create_causal_mask``
sized against its own first layer's cache (a stage's cache holds only its own layers), and
Llama's rotary embeddings from the positions every rank knows, so only hidden states travel
between stages. Only architectures whose forward is known to be reproduced exactly are
accepted (``SUPPORTED``).

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

from typing import Any

import torch
from torch import nn

from conveyor.inference.lm import CausalLM, Context

__all__ = ["SUPPORTED", "HfGpt2", "HfLlama", "hf_causal_lm", "is_hf_model"]

SUPPORTED = ("gpt2", "llama")
"""Hugging Face ``config.model_type``s the hand split reproduces."""


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` looks like a Hugging Face model (it has a config with a model type)."""
    return isinstance(getattr(getattr(model, "config", None), "model_type", None), str)


def hf_causal_lm(model: nn.Module) -> CausalLM:
    """The adapter for a Hugging Face causal LM.

    Raises:
        TypeError: the model has no causal LM head, or its architecture is not supported.
    """
    config: Any = getattr(model, "config", None)
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if head is None:
        raise TypeError(
            f"{type(model).__name__} has no causal LM head (get_output_embeddings() is None); "
            "generation needs the *ForCausalLM / *LMHeadModel class, e.g. LlamaForCausalLM "
            "rather than LlamaModel"
        )
    if config.model_type not in SUPPORTED:
        raise TypeError(
            f"generation with a hand split supports Hugging Face model types {list(SUPPORTED)}, "
            f"got {config.model_type!r} ({type(model).__name__}); adapt it as a "
            "conveyor.inference.lm.CausalLM (see conveyor.inference.hf for what it runs)"
        )
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        raise TypeError(
            f"{type(model).__name__} has layer types {sorted(set(config.layer_types))}; the hand "
            "split supports full attention only"
        )
    return HfLlama(model) if config.model_type == "llama" else HfGpt2(model)


class _HfLM(CausalLM):
    """What both Hugging Face adapters share: the config, caches, the mask and the head."""

    default_cache = "dynamic"

    @property
    def generation_config(self) -> Any:
        return getattr(self.model, "generation_config", None)

    def __init__(self, model: Any, body: Any, blocks: Any) -> None:
        # Any: transformers is optional, and its modules are reached by attribute
        self.model: Any = model
        self.config: Any = model.config
        self.body: Any = body
        self.layers: Any = blocks
        self.num_units = len(blocks) + 2
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.config.vocab_size)
        self.context_length = int(self.config.max_position_embeddings)
        self.dtype = next(model.parameters()).dtype

    def new_cache(
        self, units: range, rows: int, capacity: int, device: torch.device, kind: str
    ) -> Any:
        """Hugging Face's own cache for the whole model; only ``units``'s layers fill (the
        others are never updated and allocate nothing)."""
        from transformers import DynamicCache, StaticCache

        self.check_cache_kind(kind, ("dynamic", "static"))
        if kind == "static":
            return StaticCache(config=self.config, max_cache_len=capacity)
        return DynamicCache(config=self.config)

    def _mask(self, x: torch.Tensor, cache: Any, context: Context, layer: int) -> Any:
        """The causal mask of ``layer``'s attention, as the model's own forward makes it."""
        from transformers.masking_utils import create_causal_mask

        key_mask = context.key_mask
        return create_causal_mask(
            config=self.config,
            inputs_embeds=x,
            # generate drops an all-ones mask, which lets sdpa use its causal kernel
            attention_mask=None if bool(key_mask.all()) else key_mask,
            past_key_values=cache,
            position_ids=context.positions,
            layer_idx=layer,
        )

    def _head(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        head = self.model.get_output_embeddings()
        logits: torch.Tensor = head(norm(x[:, -1:]))[:, -1]
        return logits


class HfLlama(_HfLM):
    """``LlamaForCausalLM``: embed_tokens | decoder layers | norm and lm_head."""

    def __init__(self, model: nn.Module) -> None:
        body: Any = model.model
        super().__init__(model, body, body.layers)

    def unit_modules(self, units: range) -> list[nn.Module]:
        found: list[nn.Module] = []
        for u in units:
            if u == 0:
                found.append(self.body.embed_tokens)
            elif u == self.num_units - 1:
                found += [self.body.norm, self.model.get_output_embeddings()]
            else:
                found.append(self.layers[u - 1])
        if self.blocks(units):
            found.append(self.body.rotary_emb)
        return found

    def cache_bytes_per_position(self, units: range) -> int:
        config = self.config
        head_dim = (
            getattr(config, "head_dim", None) or self.hidden_size // config.num_attention_heads
        )
        per_layer = 2 * config.num_key_value_heads * head_dim * self.dtype.itemsize
        return int(per_layer * len(self.blocks(units)))

    def run(self, units: range, x: torch.Tensor, cache: Any, context: Context) -> torch.Tensor:
        if 0 in units:
            x = self.body.embed_tokens(x)
        blocks = self.blocks(units)
        if blocks:
            rotary = self.body.rotary_emb(x, position_ids=context.positions)
            mask = self._mask(x, cache, context, blocks[0] - 1)
            for u in blocks:
                x = self.layers[u - 1](
                    x,
                    attention_mask=mask,
                    position_embeddings=rotary,
                    position_ids=context.positions,
                    past_key_values=cache,
                    use_cache=True,
                )
        if self.num_units - 1 in units:
            x = self._head(x, self.body.norm)
        return x


class HfGpt2(_HfLM):
    """``GPT2LMHeadModel``: wte + wpe (and dropout) | blocks h | ln_f and lm_head."""

    def __init__(self, model: nn.Module) -> None:
        body: Any = model.transformer
        super().__init__(model, body, body.h)
        self.context_length = int(self.config.n_positions)

    def unit_modules(self, units: range) -> list[nn.Module]:
        found: list[nn.Module] = []
        for u in units:
            if u == 0:
                found += [self.body.wte, self.body.wpe, self.body.drop]
            elif u == self.num_units - 1:
                found += [self.body.ln_f, self.model.get_output_embeddings()]
            else:
                found.append(self.layers[u - 1])
        return found

    def cache_bytes_per_position(self, units: range) -> int:
        return 2 * self.hidden_size * self.dtype.itemsize * len(self.blocks(units))

    def run(self, units: range, x: torch.Tensor, cache: Any, context: Context) -> torch.Tensor:
        if 0 in units:
            x = self.body.drop(self.body.wte(x) + self.body.wpe(context.positions))
        blocks = self.blocks(units)
        if blocks:
            mask = self._mask(x, cache, context, blocks[0] - 1)
            for u in blocks:
                x = self.layers[u - 1](
                    x, cache, mask, use_cache=True, position_ids=context.positions
                )
        if self.num_units - 1 in units:
            x = self._head(x, self.body.ln_f)
        return x
