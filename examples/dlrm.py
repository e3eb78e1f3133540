"""Train a DLRM-style recommender as a graph pipeline: `conveyor run -n 3 examples/dlrm.py`.

The dense MLP (rank 0) and the embedding tables (rank 1) are independent branches; the
interaction and the top MLP (rank 2) join them. The interaction is not inside any named
module: conveyor places such code where its inputs meet.
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.distributed as dist

import conveyor
from conveyor.models import click_batches, click_loss, dlrm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--schedule", default="1f1b")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dist.init_process_group("gloo")  # torchrun (conveyor run) provides rank and world size

    torch.manual_seed(0)
    model = dlrm(table_size=100)  # 13 dense features, 8 tables of 100 rows, bags of 4
    pipe = conveyor.Pipeline(
        model,
        stage_modules=("bottom", "embeddings", "top"),
        num_microbatches=4,
        schedule=args.schedule,
        loss_fn=click_loss,
    )
    optimizer = torch.optim.Adagrad(pipe.parameters(), lr=0.05)
    batches = click_batches(batch_size=128, num_batches=args.steps, table_size=100)
    for step, (inputs, clicks) in enumerate(batches, start=1):
        loss = pipe.step(inputs, clicks)  # inputs: (dense, sparse)
        optimizer.step()
        optimizer.zero_grad()
        if loss is not None and (step == 1 or step % 10 == 0):
            logging.info("step %d | loss %.4f", step, loss.item())
    logging.info(
        "rank %d holds %s", pipe.rank, sorted({n.split(".")[0] for n, _ in pipe.named_parameters()})
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
