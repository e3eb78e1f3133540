"""Train the shipped GPT pipelined over 2 ranks: `conveyor run -n 2 examples/train_gpt.py`."""

from __future__ import annotations

import argparse
import logging

import torch
import torch.distributed as dist

import conveyor
from conveyor.models import gpt, gpt_loss, text_batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--schedule", default="1f1b")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dist.init_process_group("gloo")  # torchrun (conveyor run) provides rank and world size

    torch.manual_seed(0)
    with torch.device("meta"):  # nothing is allocated until each rank builds its own stage
        model = gpt(num_layers=4)
    pipe = conveyor.Pipeline(
        model,
        balance=[3, 3],
        num_microbatches=8,
        schedule=args.schedule,
        recompute="except_last",
        loss_fn=gpt_loss,
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    for step, (inputs, targets) in enumerate(text_batches(32, 64, args.steps), start=1):
        loss = pipe.step(inputs, targets)  # every rank passes the same batch
        optimizer.step()
        optimizer.zero_grad()
        if loss is not None and step % 10 == 0:  # the loss lives on the last stage's rank
            logging.info("step %d | loss %.4f", step, loss.item())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
