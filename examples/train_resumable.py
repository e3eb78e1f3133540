"""A training run that survives a lost process: checkpoints, and resume after a restart.

    conveyor run -n 2 --max-restarts 3 --checkpoint-dir ckpt examples/train_resumable.py

Kill any rank at any moment (or arm a fault: CONVEYOR_FAULTS="backward:rank=1:step=7");
torchrun restarts every rank, which resume from the newest valid checkpoint in ckpt/, and the
loss of every step equals an uninterrupted run's, bit for bit. Run without torchrun, it trains
on one process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import conveyor
from conveyor.checkpoint import Checkpointer
from conveyor.data import ResumableLoader
from conveyor.models import char_ids, gpt, gpt_loss
from conveyor.pipeline.faults import attempt


class CharWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of the character corpus: (inputs, next-character targets)."""

    def __init__(self, seq_len: int) -> None:
        self.ids = char_ids()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.ids[index * self.seq_len : (index + 1) * self.seq_len + 1]
        return window[:-1], window[1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5, help="steps between checkpoints")
    parser.add_argument(
        "--checkpoint-dir",
        help="default: $CONVEYOR_CHECKPOINT_DIR "
        "(conveyor run --checkpoint-dir), else a new temporary directory",
    )
    parser.add_argument("--loss-log", type=Path, help="append every step's loss (JSON lines)")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--sync", action="store_true", help="save synchronously")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    _init_process_group()
    directory = (
        args.checkpoint_dir
        or os.environ.get("CONVEYOR_CHECKPOINT_DIR")
        or tempfile.mkdtemp(prefix="conveyor-ckpt-")
    )

    _seed_everything(0)  # a deterministic run; resumes restore these generators' states
    model = gpt(seq_len=32, dim=32, num_layers=2)  # dropout 0.1: resumes reproduce it too
    pipe = conveyor.Pipeline(
        model, num_microbatches=args.microbatches, schedule=args.schedule, loss_fn=gpt_loss
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    loader = ResumableLoader(CharWindows(seq_len=32), batch_size=16, seed=0)
    with Checkpointer(
        pipe,
        optimizer,
        scheduler=scheduler,
        data=loader,
        directory=directory,
        every=args.every,
        async_save=not args.sync,
    ) as ckpt:
        start = ckpt.resume_latest()  # 0 on the first attempt
        batches = loader.forever()
        for step in range(start + 1, args.steps + 1):
            inputs, targets = next(batches)
            loss = pipe.step(inputs, targets)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if loss is not None:  # the rank holding the last stage
                _log(args.loss_log, step, loss.item())
            ckpt.maybe_save(step)
        if start < args.steps and args.steps % args.every:
            ckpt.save(args.steps)  # the final state, for comparison
    dist.destroy_process_group()


def _log(path: Path | None, step: int, loss: float) -> None:
    logging.info("step %d | loss %.4f", step, loss)
    if path is not None:
        with path.open("a") as log:  # one write per line: a killed run leaves whole lines
            log.write(json.dumps({"step": step, "loss": loss.hex(), "attempt": attempt()}) + "\n")


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    numpy = sys.modules.get("numpy")  # loaded by torch when installed
    if numpy is not None:
        numpy.random.seed(seed)


def _init_process_group() -> None:
    if "RANK" not in os.environ:  # plain `python train_resumable.py`: one rank
        store = Path(tempfile.mkdtemp(prefix="conveyor-store-")) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    else:
        dist.init_process_group("gloo")


if __name__ == "__main__":
    main()
