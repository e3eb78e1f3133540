"""Pipelined generation: train the demo GPT briefly, then generate with a KV cache on every
stage; then a Hugging Face Llama (a small random one, built here) split the same way.

    conveyor run -n 2 examples/generate.py

Every rank gets the tokens. The batch is split into groups of sequences that are in flight at
once, so while rank 1 runs one group's token, rank 0 runs another's.
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.distributed as dist

import conveyor
from conveyor.models import gpt, gpt_loss, text_batches
from conveyor.pipeline.decode import DecodePipeline


def text(ids: torch.Tensor) -> str:
    return "".join(chr(32 + int(i)) for i in ids)


def ids_of(prompt: str) -> torch.Tensor:
    return torch.tensor([min(max(ord(c) - 32, 0), 95) for c in prompt])


def demo_gpt(steps: int) -> None:
    torch.manual_seed(0)
    model = gpt(num_layers=4, seq_len=128)
    pipe = conveyor.Pipeline(model, balance=[3, 3], num_microbatches=4, loss_fn=gpt_loss)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    for inputs, targets in text_batches(16, 64, steps):
        pipe.step(inputs, targets)
        optimizer.step()
        optimizer.zero_grad()

    prompts = [ids_of("def "), ids_of("import "), ids_of("    return "), ids_of("class ")]
    tokens = pipe.generate(prompts, max_new_tokens=40, do_sample=True, top_k=10, seed=0)
    for prompt, row in zip(prompts, tokens, strict=True):  # every rank has them
        logging.info("%r -> %r", text(prompt), text(row[-40:]))


def demo_llama() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    decoder = DecodePipeline(model)  # embedding + 2 layers | 2 layers + norm + lm_head
    input_ids = torch.randint(1, 128, (4, 8))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # left padding
    tokens = decoder.generate(input_ids, attention_mask=attention_mask, max_new_tokens=16)
    reference = model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=16, do_sample=False
    )
    if not torch.equal(tokens, reference):
        raise AssertionError("the pipelined Llama generated other tokens than its own generate")
    logging.info("Llama over %d ranks: the tokens of its own generate", dist.get_world_size())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30, help="training steps before generating")
    args = parser.parse_args()
    dist.init_process_group("gloo")  # torchrun (conveyor run) provides rank and world size
    level = logging.INFO if dist.get_rank() == 0 else logging.WARNING  # one rank prints
    logging.basicConfig(level=level, format="%(message)s")
    try:
        demo_gpt(args.steps)
        demo_llama()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
