"""Which CausalLM adapter a model gets: conveyor's GPT, a Hugging Face causal LM, or its own."""

from __future__ import annotations

from typing import Any

from torch import nn

from conveyor.inference.gpt import GptLM, is_gpt
from conveyor.inference.hf import hf_causal_lm, is_hf_model
from conveyor.inference.lm import CausalLM

__all__ = ["as_causal_lm"]


def as_causal_lm(model: Any) -> CausalLM:
    """``model`` as a CausalLM: a CausalLM itself, conveyor's GPT (``conveyor.models.gpt``'s
    Sequential), or a Hugging Face causal LM of a family ``conveyor.inference.hf.ADAPTERS``
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
        "Hugging Face causal LM of a family in conveyor.inference.hf.ADAPTERS "
        "(LlamaForCausalLM, Qwen2ForCausalLM, GPT2LMHeadModel, ...) or a "
        "conveyor.inference.lm.CausalLM"
    )
