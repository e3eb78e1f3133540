"""Hugging Face conventions in one place: the model's own loss, what it counts, its config.

    pipe = Pipeline(model, split_points=["model.layers.2"], example_inputs=batch)
    pipe.step(batch)          # batch["labels"] given, no loss_fn: the model's own loss

conveyor does not import transformers; it recognises its conventions. A model whose forward
takes ``labels`` and returns an output with a ``loss`` (a ``ModelOutput``) computes its own
loss; a token-level loss (labels with a sequence dimension) is a mean over the tokens not
marked -100, shifted by one for a causal language model, so the step weighs micro-batches by
those counts (conveyor.runtime.loss). ``shifts_labels`` says which counting a model's loss uses.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from conveyor.runtime.loss import counted_tokens

__all__ = [
    "LABELS",
    "is_transformers_model",
    "label_counts",
    "model_loss",
    "takes_labels",
]

LABELS = "labels"
"""The input by which a model that computes its own loss receives its targets."""


def is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (without importing it)."""
    return any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__)


def takes_labels(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes labels, and so may compute its own loss."""
    return LABELS in inspect.signature(model.forward).parameters


def model_loss(output: Any, targets: Any = None) -> torch.Tensor:
    """The loss the model computed itself (``output.loss``): the loss function of a Pipeline
    built without ``loss_fn``."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise RuntimeError(
            f"the model returned {type(output).__name__} without a loss; pass labels in the "
            "batch (a model that computes its own loss needs them) or a loss_fn to Pipeline"
        )
    return loss


_SHIFTED_LOSSES = ("ForCausalLM", "ForConditionalGeneration")
"""transformers' loss types whose ``loss_function`` is its causal loss (labels shifted by
one): ``ForConditionalGeneration`` is, for the vision-language models that call it;
encoder-decoders compute theirs in their forward, on unshifted decoder labels."""


def shifts_labels(model: nn.Module) -> bool | None:
    """Whether the model's own token-level loss predicts labels shifted by one (True), reads
    them in place (False), or None when its code does not say.

    transformers gives a model a ``loss_type`` from its class name, and its ``loss_function``
    is the causal loss when there is none; but many models compute their loss in their own
    forward instead, whatever ``loss_type`` says (``BartForCausalLM`` reads its labels in
    place, ``BlipTextLMHeadModel`` shifts them by hand). So the forward's own code decides:
    ``loss_function`` by its loss type, else a slice of the labels from position 1 or a cross
    entropy on them as they are."""
    if not is_transformers_model(model):
        return False
    source = _code_of(type(model).forward)
    if source is None:
        return None
    if "self.loss_function(" in source:
        return (getattr(model, "loss_type", None) or "ForCausalLM") in _SHIFTED_LOSSES
    if _SHIFTED.search(source):
        return True
    if "CrossEntropyLoss(" in source or "cross_entropy(" in source:
        return False
    return None


def _code_of(function: Callable[..., Any]) -> str | None:
    """``function``'s code without its docstring and comments (their examples slice labels
    too: ProphetNet's shows ``labels[:, 1:]``), or None where it has no source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):  # built at run time: nothing to read
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, ast.FunctionDef) and body and _is_docstring(body[0]):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def _is_docstring(statement: ast.stmt) -> bool:
    value = getattr(statement, "value", None)
    return isinstance(statement, ast.Expr) and isinstance(getattr(value, "value", None), str)


_SHIFTED = re.compile(r"labels\s*\[\s*(?:\.\.\.|:)\s*,\s*1\s*:|shift_labels")
"""A forward that shifts its labels by hand: ``labels[:, 1:]``, ``labels[..., 1:]`` or a
``shift_labels`` variable (``shift_tokens_right``, which makes decoder inputs, is not one)."""


def _added_losses(model: nn.Module, inputs: Mapping[str, Any]) -> list[str]:
    """What a forward adds to the loss of ``labels``: the losses of other labels the batch
    gives (BERT's ``next_sentence_label``, GPT-2 double heads' ``mc_labels``), and a mixture
    of experts' load-balancing loss, which is over the whole batch."""
    added = [
        name
        for name, value in inputs.items()
        if name != LABELS and name.endswith(("_label", "_labels")) and value is not None
    ]
    config = getattr(model, "config", None)
    router = inputs.get("output_router_logits")
    if router is None:
        router = getattr(config, "output_router_logits", False)
    if router and getattr(config, "router_aux_loss_coef", 1.0):
        added.append("the router's load-balancing loss (output_router_logits=True)")
    return added


def label_counts(
    model: nn.Module, labels: list[Any], inputs: Mapping[str, Any] | None = None
) -> list[int]:
    """What the model's own loss averages over in each micro-batch: counted tokens for
    token-level labels, samples whose class label is not -100 for one label per sample (every
    sample for a regression). ``inputs`` is a micro-batch's
    inputs by name: what they ask the forward to add to the loss is refused.

    Raises:
        ValueError: the loss is not one mean the counts describe; the message asks for a
            ``loss_fn``.
    """
    shift = shifts_labels(model)
    added = _added_losses(model, inputs or {}) if is_transformers_model(model) else []
    if added:
        raise ValueError(
            f"{type(model).__name__} adds {added} to the loss of labels: a sum of means over "
            "different counts, which micro-batch weights cannot make the full batch's. Pass "
            "loss_fn=(outputs, targets) -> loss computing what you train on, with the labels "
            "as targets (or turn the router's loss off: output_router_logits=False)"
        )
    counts = []
    for chunk in labels:
        if not isinstance(chunk, torch.Tensor):
            raise ValueError(
                f"labels must be a tensor for the model's own loss, got {type(chunk).__name__}"
            )
        token_level = chunk.dim() >= 2 and not chunk.is_floating_point()
        if token_level and shift is None:
            raise ValueError(
                f"{type(model).__name__} computes its loss in code conveyor cannot read "
                "(not transformers' loss_function, nor a cross entropy in its forward), so "
                "nothing says whether it shifts its labels. The micro-batches could not be "
                "weighted to make the step's loss the full batch's. Pass loss_fn=(outputs, "
                "targets) -> loss and the labels as targets, with loss_reduction='token_mean' "
                "for a mean over the tokens whose label is not -100"
            )
        if token_level:
            counts.append(counted_tokens(chunk, bool(shift)))
        else:
            counts.append(_counted_samples(model, chunk))
    return counts


def _counted_samples(model: nn.Module, labels: torch.Tensor) -> int:
    """What a loss with one label per sample averages over: the samples whose class label is
    not -100 (a cross entropy ignores them), or every sample of a regression or of
    multi-label targets (floats, or one output: a mean of squared errors counts them all)."""
    config = getattr(model, "config", None)
    regression = getattr(config, "problem_type", None) == "regression"
    if labels.is_floating_point() or regression or getattr(config, "num_labels", None) == 1:
        return int(labels.shape[0])
    return counted_tokens(labels)
