"""Train a two-tower model as a graph pipeline: `conveyor run -n 3 examples/multimodal.py`.

Rank 0 runs the text tower, rank 1 the image tower and rank 2 the head that fuses them. The
towers do not feed each other, so they work side by side: a step takes m + 1 stage slots
instead of the m + 2 of a chain text -> image -> head. Pass --auto to let conveyor trace the
model and choose the split itself.
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.distributed as dist

import conveyor
from conveyor.models import classification_loss, multimodal_batches, two_tower


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--auto", action="store_true", help="split with auto_split")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dist.init_process_group("gloo")  # torchrun (conveyor run) provides rank and world size

    torch.manual_seed(0)
    model = two_tower()  # text: 4 blocks over 16 tokens; image: 2 blocks over 32 patches
    batches = multimodal_batches(batch_size=32, num_batches=args.steps)
    if args.auto:
        pipe = conveyor.Pipeline(
            model,
            auto_split=True,
            example_inputs=batches[0][0],
            num_microbatches=4,
            schedule=args.schedule,
            loss_fn=classification_loss,
            measure_memory=True,
        )
    else:
        pipe = conveyor.Pipeline(
            model,
            stage_modules=("text", "image", "head"),
            num_microbatches=4,
            schedule=args.schedule,
            loss_fn=classification_loss,
            measure_memory=True,
        )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    for step, (inputs, labels) in enumerate(batches, start=1):
        loss = pipe.step(inputs, labels)  # inputs: {"tokens", "patches", "mask"}
        optimizer.step()
        optimizer.zero_grad()
        if loss is not None and (step == 1 or step % 10 == 0):
            logging.info("step %d | loss %.4f", step, loss.item())
    edges = [(s.index, c) for s in pipe.graph.stages for c in pipe.graph.consumers(s.index)]
    logging.info(
        "rank %d: stage graph edges %s, depth %d, peak activations %.0f KiB",
        pipe.rank,
        edges,
        pipe.graph.depth,
        pipe.memory().peak_bytes / 1024,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
