"""The demo: train the shipped GPT on Python's own source text, pipelined over local ranks.

    conveyor demo                      # 2 ranks, 1F1B, 8 micro-batches
    conveyor demo --schedule gpipe --recompute always
    conveyor demo --ranks 4 --dp 2     # 2 data-parallel replicas of a 2-rank pipeline
Each rank runs ``python -m conveyor.demo`` under torchrun.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn, TextIO

import torch
import torch.distributed as dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from conveyor.config import PipelineConfig
from conveyor.models import gpt, gpt_loss, text_batches, unigram_entropy
from conveyor.pipeline import Pipeline
from conveyor.pipeline.training import Throughput
from conveyor.trace import load_run, write_chrome, write_png

__all__ = ["DemoConfig", "progress_bar", "train"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoConfig:
    """What the demo trains and for how long."""

    ranks: int = 2
    """Processes to start: pipeline ranks x data-parallel replicas (--dp)."""
    steps: int = 300
    """Optimizer steps."""
    batch_size: int = 32
    """Sequences per step."""
    seq_len: int = 64
    """Characters per sequence."""
    dim: int = 64
    """Model width."""
    num_layers: int = 4
    """Transformer blocks (the model has two more layers: embedding and head)."""
    tie_embeddings: bool = True
    """The output projection is the token embedding (one weight on two ranks, kept equal)."""
    lr: float = 3e-3
    """AdamW learning rate."""
    log_every: int = 50
    """Steps between progress log lines. On a terminal, a progress bar also updates every
    step; in a log file or CI output these lines are the only progress."""

    def __post_init__(self) -> None:
        for name in ("ranks", "steps", "batch_size", "seq_len", "dim", "num_layers", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def train(demo: DemoConfig, pipeline: PipelineConfig) -> list[float]:
    """Train on this rank (torch.distributed must be initialized); returns every step's loss
    (over every replica), on every rank."""
    torch.manual_seed(0)
    model = gpt(
        seq_len=demo.seq_len,
        dim=demo.dim,
        num_layers=demo.num_layers,
        tie_embeddings=demo.tie_embeddings,
    )
    pipe = Pipeline(model, pipeline.replace(broadcast_loss=True), loss_fn=gpt_loss)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=demo.lr)
    if demo.batch_size % pipe.num_replicas:
        raise ValueError(
            f"batch_size {demo.batch_size} does not split over {pipe.num_replicas} replicas; "
            "pass a multiple of --dp"
        )
    share = demo.batch_size // pipe.num_replicas
    mine = slice(pipe.replica * share, (pipe.replica + 1) * share)
    meter = Throughput(num_replicas=pipe.num_replicas, tokens_per_sample=demo.seq_len)
    losses: list[float] = []
    start = time.perf_counter()
    shown = dist.get_rank() == 0
    batches = text_batches(demo.batch_size, demo.seq_len, demo.steps)
    bar = progress_bar(demo.steps, shown)
    with bar, logging_redirect_tqdm() if not bar.disable else contextlib.nullcontext():
        for step, (inputs, targets) in enumerate(batches, start=1):
            loss = pipe.step(inputs[mine], targets[mine])
            optimizer.step()
            optimizer.zero_grad()
            assert loss is not None  # broadcast_loss: on every rank
            losses.append(loss.item())
            rates = meter.update(demo.batch_size)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rates.tokens_per_s:,.0f}")
            bar.update()
            if shown and step % demo.log_every == 0:
                logger.info("step %d/%d | loss %.4f | %s", step, demo.steps, losses[-1], rates)
    if shown:
        _summary(demo, pipe, losses, time.perf_counter() - start)
    if pipeline.trace_dir:
        _render_trace(pipeline.trace_dir)
    return losses


def progress_bar(total: int, is_shown: bool, stream: TextIO | None = None) -> tqdm[NoReturn]:
    """A progress bar over ``total`` steps on ``stream`` (standard error), updated every step;
    disabled unless ``is_shown`` and ``stream`` is a terminal.

    A bar redraws itself with a carriage return on every update: on a terminal that is one
    line, but in a log file or CI output it is ~300 bytes per step. There the log line every
    ``log_every`` steps reports progress instead.
    """
    stream = sys.stderr if stream is None else stream
    return tqdm(
        total=total,
        file=stream,
        disable=not (is_shown and stream.isatty()),
        unit="step",
        dynamic_ncols=True,
    )


def _render_trace(directory: str) -> None:
    """Draw the last recorded step once every rank has written it (conveyor trace DIR)."""
    dist.barrier()
    if dist.get_rank() == 0:
        timeline = load_run(directory)
        png = write_png(f"{directory}/timeline.png", timeline)
        chrome = write_chrome(f"{directory}/trace.json", timeline)
        logger.info(
            "%s\nwrote %s and %s; `conveyor trace %s` renders any recorded step",
            timeline.summary_text(),
            png,
            chrome,
            directory,
        )


def _summary(demo: DemoConfig, pipe: Pipeline, losses: list[float], seconds: float) -> None:
    tail = losses[-min(10, len(losses)) :]
    logger.info(
        "done: %d steps in %.1f s (%.0f tokens/s) | loss %.3f -> %.3f (mean of last %d) | "
        "unigram entropy of the text %.3f nats, uniform %.3f | %s",
        demo.steps,
        seconds,
        demo.steps * demo.batch_size * demo.seq_len / seconds,
        losses[0],
        sum(tail) / len(tail),
        len(tail),
        unigram_entropy(),
        math.log(96),
        pipe.describe(),
    )


def main(argv: list[str] | None = None) -> int:
    """Worker entry point: ``python -m conveyor.demo --demo JSON --pipeline JSON``."""
    parser = argparse.ArgumentParser(prog="python -m conveyor.demo")
    parser.add_argument("--demo", default="{}", help="DemoConfig fields as JSON")
    parser.add_argument("--pipeline", default="{}", help="PipelineConfig fields as JSON")
    args = parser.parse_args(argv)
    demo = DemoConfig(**json.loads(args.demo))
    pipeline = PipelineConfig.from_dict(json.loads(args.pipeline), "--pipeline")
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # an entry point, like cli
    # its barrier waits as long as the pipeline does, no longer
    dist.init_process_group("gloo", timeout=timedelta(seconds=pipeline.timeout_s))
    try:
        train(demo, pipeline)
    finally:
        dist.destroy_process_group()
    return 0


def worker_args(demo: DemoConfig, pipeline: PipelineConfig) -> list[str]:
    """The command-line arguments of ``main`` for these configs."""
    return [
        "--demo",
        json.dumps(dataclasses.asdict(demo)),
        "--pipeline",
        json.dumps(pipeline.to_dict()),
    ]


if __name__ == "__main__":
    from conveyor.runtime.peers import leave

    leave(main())  # See Note [threads at exit]
