"""A Hugging Face causal LM, unedited, on 2 ranks: `conveyor run -n 2 examples/huggingface.py`.

The model is built from a small config on the meta device (each rank allocates and initializes
only its own stages), split through torch.export before one of its decoder layers, trained with
its own loss on Python's own source text, saved back in the format ``from_pretrained`` reads,
and read back.
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

import conveyor
from conveyor.models import text_batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save", default="llama-pipelined", help="directory to save into")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dist.init_process_group("gloo")

    config = LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                         max_position_embeddings=64)  # fmt: skip
    with torch.device("meta"):  # nothing is allocated until each rank builds its own stage
        model = AutoModelForCausalLM.from_config(config)
    batches = text_batches(16, 32, args.steps)

    def batch_of(ids: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    ids, targets = batches[0]
    pipe = conveyor.Pipeline(model, split_points=["model.layers.2"], num_microbatches=4,
                             example_inputs=batch_of(ids, targets))  # fmt: skip
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    for step, (ids, targets) in enumerate(batches, start=1):
        loss = pipe.step(batch_of(ids, targets))  # the model's own loss: labels in the batch
        optimizer.step()
        optimizer.zero_grad()
        if loss is not None and step % 5 == 0:
            logging.info("step %d | loss %.4f", step, loss.item())

    pipe.save_pretrained(args.save)  # collective: a shard per rank, the index, config.json
    if dist.get_rank() == 0:
        plain = AutoModelForCausalLM.from_pretrained(args.save)
        with torch.no_grad():
            logging.info(
                "reloaded with from_pretrained: loss %.4f", plain(**batch_of(ids, ids)).loss
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
