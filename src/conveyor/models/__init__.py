"""Models that ship with conveyor, for the demo, examples, tests and benchmarks."""

from conveyor.models.gpt import (
    Block,
    Embedding,
    Head,
    char_corpus,
    char_ids,
    gpt,
    gpt_loss,
    text_batches,
    unigram_entropy,
)

__all__ = [
    "Block", "Embedding", "Head", "char_corpus", "char_ids", "gpt", "gpt_loss", "text_batches",
    "unigram_entropy",
]
