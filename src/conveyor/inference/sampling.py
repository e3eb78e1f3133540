"""Next tokens from logits: greedy or sampled with temperature, top-k and top-p, per-sequence
generators, stop tokens.

    sampler = Sampler(config, rows=range(4, 8), device=cpu)   # sequences 4..7 of the batch
    tokens = sampler(logits)                                   # (4,); pad after a stop token
"""

from __future__ import annotations

import hashlib

import torch

from conveyor.inference.config import GenerationConfig

__all__ = ["Sampler", "filter_logits", "sequence_seed"]


def sequence_seed(seed: int, row: int) -> int:
    """The seed of the sampling generator of the batch's sequence ``row``."""
    digest = hashlib.blake2b(f"{seed}:sequence:{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def filter_logits(scores: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p, as Hugging Face's logits warpers apply them
    (``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``): removed tokens
    get -inf, and top-p keeps at least the most likely token."""
    if config.temperature != 1.0:
        scores = scores / config.temperature
    if config.top_k is not None:
        kth = torch.topk(scores, min(config.top_k, scores.shape[-1]))[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if config.top_p is not None and config.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        removed = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - config.top_p
        removed[..., -1:] = False
        scores = scores.masked_fill(removed.scatter(1, order, removed), float("-inf"))
    return scores


class Sampler:
    """Picks the next token of a group's sequences and tracks which have stopped.

    Scores are float32, as in Hugging Face's generate. A finished sequence gets
    ``pad_token_id``; ``done`` once every sequence of the group is finished.
    """

    def __init__(self, config: GenerationConfig, rows: range, device: torch.device) -> None:
        self.config = config
        self.generators = [
            torch.Generator(device).manual_seed(sequence_seed(config.seed, row)) for row in rows
        ]
        self.unfinished = torch.ones(len(rows), dtype=torch.bool, device=device)
        self.stops = torch.tensor(config.stop_tokens, dtype=torch.long, device=device)

    @property
    def done(self) -> bool:
        return not bool(self.unfinished.any())

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Tokens (rows,) for ``logits`` (rows, vocab) of each sequence's last position."""
        scores = logits.to(torch.float32)
        if self.config.do_sample:
            probs = filter_logits(scores, self.config).softmax(dim=-1)
            tokens = torch.cat(
                [
                    torch.multinomial(row, 1, generator=generator)
                    for row, generator in zip(probs, self.generators, strict=True)
                ]
            )
        else:
            tokens = scores.argmax(dim=-1)
        tokens = torch.where(self.unfinished, tokens, self.config.pad_token_id)
        if self.stops.numel():
            self.unfinished &= ~torch.isin(tokens, self.stops)
        return tokens

    def pad(self) -> torch.Tensor:
        """The tokens of a step the group no longer runs (every sequence finished)."""
        return torch.full_like(self.unfinished, self.config.pad_token_id, dtype=torch.long)
