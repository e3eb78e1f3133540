"""Train a U-Net whose long skips jump over ranks: `conveyor run -n 4 examples/unet.py`.

The model is a plain nn.Sequential: its Down layers stash their features and its Up layers
pop them (conveyor.split.skip), so it also runs unchanged without conveyor. Split 2-2-2-2 over
four ranks, each skip goes from the rank that stashes it straight to the rank that pops it;
the ranks in between neither relay nor store it (--relay shows the difference in memory).
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.distributed as dist

import conveyor
from conveyor.models import segmentation_batches, segmentation_loss, unet
from conveyor.split import balance_to_split_points, split_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument(
        "--relay",
        action="store_true",
        help="pass skips through every rank in between, as a chain must",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dist.init_process_group("gloo")  # torchrun (conveyor run) provides rank and world size

    torch.manual_seed(0)
    model = unet(width=8, depth=3)  # Down x3, Bottom, Up x3, Head: 8 layers
    if args.relay:  # a prebuilt StageGraph works too
        graph = split_model(model, balance_to_split_points(model, [2, 2, 2, 2]), relay_skips=True)
        pipe = conveyor.Pipeline(
            graph,
            num_microbatches=4,
            schedule=args.schedule,
            loss_fn=segmentation_loss,
            measure_memory=True,
        )
    else:
        pipe = conveyor.Pipeline(
            model,
            balance=[2, 2, 2, 2],
            num_microbatches=4,
            schedule=args.schedule,
            loss_fn=segmentation_loss,
            measure_memory=True,
        )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    for step, (images, masks) in enumerate(segmentation_batches(16, 32, args.steps), start=1):
        loss = pipe.step(images, masks)
        optimizer.step()
        optimizer.zero_grad()
        if loss is not None and (step == 1 or step % 5 == 0):
            logging.info("step %d | loss %.4f", step, loss.item())
    stage = pipe.graph.stages_on(pipe.rank)[0]
    logging.info(
        "rank %d: stage %d sends to stages %s, peak activations %.0f KiB",
        pipe.rank,
        stage,
        pipe.graph.consumers(stage),
        pipe.memory().peak_bytes / 1024,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
