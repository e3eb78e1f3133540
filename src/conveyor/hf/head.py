"""A transformers causal LM with its head and loss in vocabulary chunks (conveyor.split.vocab).

    model = ChunkedCausalLM(AutoModelForCausalLM.from_pretrained(path), chunks=8)
    pipe = Pipeline(model, num_stages=2, example_inputs={"input_ids": ids, "labels": next_ids})

The families below compute their logits as the output projection of the base model's last
hidden state and nothing more (no soft-capping, scaling or bias), so the chunks give exactly
the model's loss.
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.split.vocab import ChunkedHeadLoss

__all__ = ["CHUNKABLE", "ChunkedCausalLM"]

CHUNKABLE = ("llama", "mistral", "qwen2", "qwen3")
"""The ``model_type`` of the causal LMs whose head ``ChunkedCausalLM`` may cut."""


class ChunkedCausalLM(nn.Module):
    """A causal LM of a ``CHUNKABLE`` family whose output projection and loss run in
    ``chunks`` vocabulary chunks a pipeline stage may start between (``head.chunks.i``).

    ``forward(input_ids, labels, attention_mask=None)`` returns ``{"loss": ...}``: the mean
    cross-entropy of ``labels`` read in place, each the token that follows its position (-100
    where none counts). That is the model's own loss with ``labels=input_ids`` when
    ``labels`` is ``input_ids`` shifted left by one, -100 last. The base model keeps its
    parameter names (``model.layers.0...``); the head's are ``head.chunks.i.weight``, read
    from the rows of the model's ``lm_head.weight`` by ``Pipeline(..., weights=DIR)``.
    """

    def __init__(self, model: nn.Module, chunks: int) -> None:
        super().__init__()
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        if model_type not in CHUNKABLE:
            raise ValueError(
                f"cannot cut the head of {type(model).__name__} (model_type {model_type!r}) "
                f"into vocabulary chunks; conveyor cuts those of {list(CHUNKABLE)}, whose "
                "logits are the output projection and nothing more"
            )
        head = model.get_output_embeddings()  # type: ignore[operator]
        if head.weight is model.get_input_embeddings().weight:  # type: ignore[operator]
            raise ValueError(
                f"{type(model).__name__}'s head is tied to its token embedding "
                "(tie_word_embeddings=True), and chunks of the head would be copies that "
                "untie it; chunk a model with an untied head"
            )
        self.model = getattr(model, str(model.base_model_prefix))
        source = next(name for name, module in model.named_modules() if module is head)
        self.head = ChunkedHeadLoss.from_linear(head, chunks, source)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        hidden = self.model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
        return {"loss": self.head(hidden, labels)}
