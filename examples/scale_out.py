"""Scaling out: 2 data-parallel replicas of a 2-rank pipeline, on 4 ranks.

    conveyor run -n 4 --dp 2 examples/scale_out.py --steps 20

Each replica trains on its half of every global batch (the loader shards it), the stages'
gradients are reduced over the replicas once per step (FSDP2; --fsdp also shards parameters
and optimizer state), gradients are clipped by their global norm, the loss of the whole
global batch is known on every rank, and one checkpoint per step covers the whole mesh
(run it again and it resumes; with --dp 1 -n 2 it resumes on one replica). Add
--trace DIR before the script to record every (replica, stage) and `conveyor trace DIR`.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import conveyor
from conveyor.checkpoint import Checkpointer
from conveyor.models import char_ids, gpt, gpt_loss
from conveyor.pipeline.training import Throughput

SEQ_LEN = 32


def char_windows(seq_len: int) -> TensorDataset:
    """Non-overlapping windows of the character corpus: (inputs, next-character targets)."""
    ids = char_ids()
    count = (len(ids) - 1) // seq_len
    inputs = ids[: count * seq_len].view(count, seq_len)
    targets = ids[1 : count * seq_len + 1].view(count, seq_len)
    return TensorDataset(inputs, targets)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--fsdp", action="store_true", help="shard over the replicas")
    parser.add_argument("--every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument(
        "--checkpoint-dir",
        default=os.environ.get("CONVEYOR_CHECKPOINT_DIR", "scale_out_checkpoints"),
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dist.init_process_group("gloo")  # conveyor run --dp 2: Pipelines make a dp x pp mesh

    torch.manual_seed(0)  # every replica builds the same model (replica 0's is broadcast too)
    model = gpt(seq_len=SEQ_LEN, num_layers=4, tie_embeddings=True)  # a weight on 2 stages
    pipe = conveyor.Pipeline(
        model,
        num_microbatches=4,
        schedule=args.schedule,
        fsdp=args.fsdp,
        broadcast_loss=True,
        loss_fn=gpt_loss,
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    loader = conveyor.ResumableLoader(
        char_windows(SEQ_LEN), batch_size=32, num_replicas=pipe.num_replicas, replica=pipe.replica
    )
    meter = Throughput(num_replicas=pipe.num_replicas, tokens_per_sample=SEQ_LEN)
    with Checkpointer(
        pipe,
        optimizer,
        data=loader,
        directory=args.checkpoint_dir,
        every=args.every,
        allow_reshard=True,
        allow_numerics_change=True,
    ) as ckpt:
        start = ckpt.resume_latest()
        batches = loader.forever()
        for step in range(start + 1, args.steps + 1):
            inputs, targets = next(batches)  # this replica's half of the global batch
            loss = pipe.step(inputs, targets)  # the global batch's loss, on every rank
            norm = pipe.clip_grad_norm_(1.0)  # over every stage, replica and shard
            optimizer.step()
            optimizer.zero_grad()
            rates = meter.update(loader.batch_size)
            ckpt.maybe_save(step)
            if dist.get_rank() == 0 and step % 5 == 0:
                logging.info("step %d | loss %.4f | grad norm %.2f | %s", step, loss, norm, rates)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
