"""Prompts as a generation takes them: left-padded ids, attention masks, positions, groups.

ids, mask = prepare_prompts([torch.tensor([5, 6, 7]), torch.tensor([8])], None, pad=0)
# ids = [[5, 6, 7], [0, 0, 8]], mask = [[1, 1, 1], [0, 0, 1]] (bool)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["generated_length", "groups_of", "inferred_mask", "positions_of", "prepare_prompts"]


def prepare_prompts(
    prompts: torch.Tensor | Sequence[torch.Tensor],
    attention_mask: torch.Tensor | None,
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask): a (batch, length) long tensor and its bool attention mask.

    ``prompts`` is a (batch, length) tensor (left-padded where ``attention_mask`` is 0; all
    real without one), or a list of 1-D tensors of any lengths, left-padded here.

    Raises:
        ValueError: no prompt, an empty one, a mask of another shape, or padding that is not
            on the left.
        TypeError: the prompts are not integer tensors.
    """
    if not isinstance(prompts, torch.Tensor):
        prompts = list(prompts)
        if attention_mask is not None:
            raise ValueError(
                "pass attention_mask with a (batch, length) tensor of prompts only; a list of "
                "prompts is padded here, which makes its mask"
            )
        if not prompts or any(not isinstance(p, torch.Tensor) or p.dim() != 1 for p in prompts):
            raise ValueError(
                "prompts must be a non-empty list of non-empty 1-D tensors of token ids, or a "
                "(batch, length) tensor"
            )
        empty = [row for row, p in enumerate(prompts) if p.numel() == 0]
        if empty:
            raise ValueError(
                f"prompts {empty[:5]} of the list are empty (length 0); every prompt needs at "
                "least one token: drop them, or start each with a token (e.g. the "
                "tokenizer's BOS token)"
            )
        for p in prompts:
            _check_ids_dtype(p)
        width = max(p.numel() for p in prompts)
        ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            ids[row, width - prompt.numel() :] = prompt
            mask[row, width - prompt.numel() :] = True
        prompts, attention_mask = ids, mask
    _check_ids_dtype(prompts)
    if prompts.dim() != 2 or prompts.shape[0] == 0:
        raise ValueError(
            f"input_ids must be a (batch, length) tensor of token ids with at least one "
            f"prompt, got shape {tuple(prompts.shape)}"
        )
    mask = (
        torch.ones(prompts.shape, dtype=torch.bool)
        if attention_mask is None
        else attention_mask.to(torch.bool).cpu()
    )
    _check_mask(prompts, mask)
    return prompts.to(torch.long).cpu(), mask


def inferred_mask(
    ids: Any, pad_token_id: int | None, stop_tokens: Sequence[int]
) -> torch.Tensor | None:
    """The attention mask of a (batch, length) tensor of prompts given without one, read from
    its pad tokens as Hugging Face's generate reads it: only for a known pad token that is no
    stop token and that the prompts hold; None where every token counts as real.

    Raises:
        ValueError: a prompt is all pad tokens (it would have no token).
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or pad_token_id is None:
        return None
    if pad_token_id in stop_tokens or not bool((ids == pad_token_id).any()):
        return None
    mask = ids != pad_token_id
    empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"input_ids rows {empty[:5]} hold only the pad token {pad_token_id}, which marks "
            "padding when no attention_mask is given (as Hugging Face's generate reads it), "
            "so those prompts have no token; pass an attention_mask with a 1 at each of their "
            "tokens, or drop those rows"
        )
    return mask


def _check_ids_dtype(ids: torch.Tensor) -> None:
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(
            f"token ids must be an integer tensor, got {ids.dtype}; convert with .long() if "
            "the values are whole token ids"
        )


def _check_mask(ids: torch.Tensor, mask: torch.Tensor) -> None:
    if mask.shape != ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)} but input_ids {tuple(ids.shape)}; "
            "give one entry per token (1: a token, 0: left padding)"
        )
    if ids.shape[1] == 0:
        raise ValueError(
            f"input_ids has shape {tuple(ids.shape)}: every prompt is empty (length 0); every "
            "prompt needs at least one token: pass (batch, length) ids with length >= 1 (e.g. "
            "the tokenizer's BOS token)"
        )
    empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"attention_mask rows {empty[:5]} are all zeros: those prompts are only padding, "
            "without a token; every prompt needs at least one token (a 1 in its row of "
            "attention_mask, after its left padding): drop those rows or mark their tokens"
        )
    right_padded = (mask[:, :-1] & ~mask[:, 1:]).any(dim=1)
    if bool(right_padded.any()):
        rows = right_padded.nonzero().flatten().tolist()
        raise ValueError(
            f"attention_mask rows {rows[:5]} have padding after tokens (right padding); "
            "generation needs left padding: put the zeros of each row before its tokens"
        )


def positions_of(mask: torch.Tensor) -> torch.Tensor:
    """Each token's position: its count of earlier real tokens (0 at padding), as Hugging
    Face's generate computes position ids from the attention mask."""
    positions = mask.long().cumsum(-1) - 1
    return positions.masked_fill(~mask, 0)


def groups_of(batch_size: int, num_groups: int) -> tuple[range, ...]:
    """Rows of each group: ``num_groups`` contiguous groups whose sizes differ by at most
    one (the first ones larger), as micro-batches split a batch."""
    base, extra = divmod(batch_size, num_groups)
    starts = [0]
    for g in range(num_groups):
        starts.append(starts[-1] + base + (1 if g < extra else 0))
    return tuple(range(a, b) for a, b in itertools.pairwise(starts))


def generated_length(tokens: torch.Tensor, eos_token_id: Sequence[int]) -> int:
    """New tokens to keep of (batch, max new tokens) ``tokens``: up to the step at which
    every sequence has sampled a stop token, where Hugging Face's generate stops too."""
    if not eos_token_id:
        return int(tokens.shape[1])
    stopped = torch.isin(tokens, torch.tensor(list(eos_token_id), device=tokens.device))
    if not bool(stopped.any(dim=1).all()):
        return int(tokens.shape[1])
    return int(stopped.int().argmax(dim=1).max()) + 1
