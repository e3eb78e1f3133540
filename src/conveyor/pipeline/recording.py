"""A Pipeline's timelines: this rank's Recorder hooked into its runtime and transport, a file
per rank for ``trace_dir`` (``conveyor trace DIR``), and the whole step gathered on demand.

    recorder = start(rank, config, p2p, runtime, file_name, meta)   # trace=True or trace_dir
    timeline = gather(recorder, num_ranks, step, group, meta)       # collective
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

import torch.distributed as dist

from conveyor.config import PipelineConfig
from conveyor.runtime.comm import P2P
from conveyor.runtime.core import Interpreter
from conveyor.trace import Recorder, Timeline, merge

__all__ = ["gather", "recorded", "start"]

logger = logging.getLogger(__name__)


def start(
    rank: int,
    config: PipelineConfig,
    p2p: P2P,
    runtime: Interpreter,
    file_name: str,
    header: dict[str, Any],
    announce: bool,
) -> tuple[Recorder, TextIO | None]:
    """This rank's recorder, set on the runtime and the transport, and its trace file (line
    buffered: each step is on disk when step() returns, even if the run dies) when the
    config names a directory; ``announce`` logs where."""
    recorder = Recorder(rank)
    runtime.recorder = recorder
    p2p.recorder = recorder
    if not config.trace_dir:
        return recorder, None
    directory = os.path.abspath(config.trace_dir)
    os.makedirs(directory, exist_ok=True)
    sink = open(os.path.join(directory, file_name), "w", buffering=1)  # noqa: SIM115
    sink.write(json.dumps({**recorder.header(), **header}) + "\n")
    recorder.sink = sink
    if announce:
        logger.info("tracing to %s; render with `conveyor trace %s`", directory, config.trace_dir)
    return recorder, sink


def gather(
    recorder: Recorder | None,
    num_ranks: int,
    step: int,
    group: dist.ProcessGroup | None,
    meta: dict[str, Any],
) -> Timeline:
    """Every rank's events of one recorded step (collective over the group).

    Raises:
        RuntimeError: the Pipeline records no timeline.
    """
    if recorder is None:
        raise RuntimeError(
            "this Pipeline records no timeline; create it with trace=True "
            "(or trace_dir=DIR, or run under `conveyor run --trace DIR`)"
        )
    part = recorder.timeline(num_ranks, step)
    parts: list[Any] = [None] * num_ranks
    dist.all_gather_object(parts, part, group=group)
    return merge(parts, meta)


@contextmanager
def recorded(recorder: Recorder | None, action: str) -> Iterator[None]:
    """Record what runs inside as ``action`` when tracing."""
    start_time = 0.0 if recorder is None else recorder.now()
    yield
    if recorder is not None:
        recorder.add(action, start_time, recorder.now())
