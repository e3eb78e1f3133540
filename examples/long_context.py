"""One long prompt served by two ranks at once: context parallelism splits the KV cache along
the sequence, so each rank holds half of it and attends over its half for every new token.

    conveyor run -n 2 examples/long_context.py

A small Llama (built here, random weights) reads a prompt of 3,000 tokens. With cp=2 both
ranks run every layer: the prompt in zigzag chunks with ring attention, then each new token
on both, its attention merged across them. The tokens equal the unsplit model's; each rank's
cache is half the unsplit one's.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from conveyor.pipeline.decode import DecodePipeline


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    dist.init_process_group("gloo")
    logging.basicConfig(level=logging.INFO, format=f"[rank {dist.get_rank()}] %(message)s")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        pad_token_id=0,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    prompt = torch.randint(1, 256, (1, 3000), generator=torch.Generator().manual_seed(1))

    decoder = DecodePipeline(model, cp=2)  # both ranks serve the one stage
    tokens = decoder.generate(prompt, max_new_tokens=16)
    alone = DecodePipeline(model, local=True)  # the unsplit model, for comparison
    expected = alone.generate(prompt, max_new_tokens=16, cache="static")

    assert tokens is not None and expected is not None and torch.equal(tokens, expected)
    assert decoder.stats is not None and alone.stats is not None
    logging.info(
        "16 new tokens after 3000: %s; this rank's KV cache %.1f MiB (unsplit %.1f MiB)",
        tokens[0, -16:].tolist(),
        decoder.stats.cache_bytes / 2**20,
        alone.stats.cache_bytes / 2**20,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
