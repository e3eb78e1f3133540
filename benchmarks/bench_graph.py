"""Graph pipeline vs the chain pipeline of the same stages, side by side in one run.

    python benchmarks/bench_graph.py                 # both parts; writes the `graph` section
    python benchmarks/bench_graph.py --repeats 3     # quicker

Part 1: a two-tower model (text and image towers of similar cost, a light fusion head) on 3
ranks, split text | image | head. As a graph pipeline the towers run side by side (depth 2);
as a chain the image stage also receives the text tower's output and relays it to the head
(text -> image -> head, depth 3), which is what chain-only pipelines must do. For m = 2, 4, 8
micro-batches of a fixed size: step time and peak activation memory per rank, against the
bubble formula's gain (m + d_chain - 1) / (m + d_graph - 1).
Part 2: a U-Net on 4 ranks (2 layers each): every skip sent straight from the encoder's rank
to the decoder's vs relayed through the ranks in between; peak activation memory per rank.

Every configuration runs in the same gloo processes (1 thread each), repetitions interleaved,
medians reported; results go to the `graph` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_section

import conveyor
from conveyor.models import (
    classification_loss,
    multimodal_batches,
    segmentation_batches,
    segmentation_loss,
    two_tower,
    unet,
)
from conveyor.split import balance_to_split_points, split_by_modules, split_model

STAGES = [["text"], ["image"], ["head"]]


def _step_time(pipe: conveyor.Pipeline, inputs: Any, targets: Any) -> float:
    """Seconds from a common start until the last rank finishes the step."""
    dist.barrier()
    start = time.perf_counter()
    pipe.step(inputs, targets)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _peaks(pipe: conveyor.Pipeline) -> list[int]:
    """Every rank's peak activation bytes since the last reset."""
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, pipe.memory().peak_bytes)
    return [int(p) for p in peaks]


def _measure(
    pipes: dict[Any, conveyor.Pipeline],
    batches: dict[Any, tuple[Any, Any]],
    repeats: int,
    warmup: int,
) -> dict[Any, dict[str, Any]]:
    """Interleaved repetitions of one step of every pipeline (the order reversed every other
    round, so neither side always runs first): all step times, and peak memory per rank."""
    for key, pipe in pipes.items():
        for _ in range(warmup):
            _step_time(pipe, *batches[key])
        pipe.reset_memory()
    times: dict[Any, list[float]] = {key: [] for key in pipes}
    keys = list(pipes)
    for round_index in range(repeats):
        for key in keys if round_index % 2 == 0 else keys[::-1]:
            times[key].append(_step_time(pipes[key], *batches[key]))
    return {
        key: {
            "times": times[key],
            "time": statistics.median(times[key]),
            "peaks": _peaks(pipes[key]),
        }
        for key in pipes
    }


def towers_worker(rank: int, args: argparse.Namespace) -> None:
    """Part 1 on 3 ranks."""
    torch.manual_seed(0)
    model = two_tower(
        vocab_size=256,
        seq_len=args.text_len,
        num_patches=args.patches,
        patch_dim=args.patch_dim,
        dim=args.dim,
        text_layers=4,
        image_layers=2,
        num_heads=4,
    )
    pipes: dict[Any, conveyor.Pipeline] = {}
    batches: dict[Any, tuple[Any, Any]] = {}
    for m in args.microbatches:
        ((inputs, labels),) = multimodal_batches(
            m * args.microbatch_size,
            1,
            vocab_size=256,
            seq_len=args.text_len,
            num_patches=args.patches,
            patch_dim=args.patch_dim,
        )
        for kind in ("graph", "chain"):
            graph = split_by_modules(copy.deepcopy(model), STAGES, relay_skips=kind == "chain")
            pipes[(m, kind)] = conveyor.Pipeline(
                graph,
                num_microbatches=m,
                schedule=args.schedule,
                loss_fn=classification_loss,
                measure_memory=True,
            )
            batches[(m, kind)] = (inputs, labels)
    results = _measure(pipes, batches, args.repeats, args.warmup)
    if rank == 0:
        _report_towers(results, args)


def unet_worker(rank: int, args: argparse.Namespace) -> None:
    """Part 2 on 4 ranks."""
    torch.manual_seed(0)
    model = unet(width=args.unet_width, depth=3)
    points = balance_to_split_points(model, [2, 2, 2, 2])
    m = args.unet_microbatches
    ((images, masks),) = segmentation_batches(m * args.unet_microbatch_size, args.unet_size, 1)
    pipes = {
        kind: conveyor.Pipeline(
            split_model(copy.deepcopy(model), points, relay_skips=kind == "relayed"),
            num_microbatches=m,
            schedule=args.schedule,
            loss_fn=segmentation_loss,
            measure_memory=True,
        )
        for kind in ("direct", "relayed")
    }
    results = _measure(pipes, dict.fromkeys(pipes, (images, masks)), args.unet_repeats, args.warmup)
    if rank == 0:
        _report_unet(results, args)


def _report_towers(results: dict[Any, dict[str, Any]], args: argparse.Namespace) -> None:
    rows = []
    for m in args.microbatches:
        graph, chain = results[(m, "graph")], results[(m, "chain")]
        # steps measured next to each other share the machine's state: compare them in pairs
        measured = statistics.median(
            c / g for g, c in zip(graph["times"], chain["times"], strict=True)
        )
        predicted = (m + 3 - 1) / (m + 2 - 1)
        mib = " / ".join(
            f"{g / 2**20:.2f} vs {c / 2**20:.2f}"
            for g, c in zip(graph["peaks"], chain["peaks"], strict=True)
        )
        rows.append(
            f"| {m} | {graph['time'] * 1e3:.0f} | {chain['time'] * 1e3:.0f} | "
            f"{measured:.3f} | {predicted:.3f} | {measured / predicted:.1%} | "
            f"{(measured - 1) / (predicted - 1):.0%} | {mib} |"
        )
    Path(args.out, "towers.md").write_text("\n".join(rows))


def _report_unet(results: dict[Any, dict[str, Any]], args: argparse.Namespace) -> None:
    direct, relayed = results["direct"], results["relayed"]
    cells = " | ".join(
        f"{d / 2**20:.2f} vs {r / 2**20:.2f} ({1 - d / r:.0%} less)"
        for d, r in zip(direct["peaks"], relayed["peaks"], strict=True)
    )
    row = f"| {direct['time'] * 1e3:.0f} | {relayed['time'] * 1e3:.0f} | {cells} |"
    Path(args.out, "unet.md").write_text(row)


def _launch(
    fn: Callable[[int, argparse.Namespace], None],
    world_size: int,
    args: argparse.Namespace,
    timeout_s: float = 1800.0,
) -> None:
    store = Path(tempfile.mkdtemp(prefix="bench-graph-")) / "store"
    ctx = mp.spawn(_entry, args=(fn, world_size, str(store), args), nprocs=world_size, join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{fn.__name__} did not finish in {timeout_s:.0f}s")
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()


def _entry(
    rank: int,
    fn: Callable[[int, argparse.Namespace], None],
    world_size: int,
    store: str,
    args: argparse.Namespace,
) -> None:
    torch.set_num_threads(1)  # several ranks on 2 cores
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=300),
    )
    try:
        fn(rank, args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--microbatch-size", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--text-len", type=int, default=32)
    parser.add_argument("--patches", type=int, default=64)
    parser.add_argument("--patch-dim", type=int, default=48)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--unet-width", type=int, default=16)
    parser.add_argument("--unet-size", type=int, default=64)
    parser.add_argument("--unet-microbatches", type=int, default=4)
    parser.add_argument("--unet-microbatch-size", type=int, default=4)
    parser.add_argument("--unet-repeats", type=int, default=3)
    parser.add_argument("--skip-unet", action="store_true")
    parser.add_argument("--no-write", action="store_true", help="print, do not touch docs/")
    args = parser.parse_args()
    args.out = tempfile.mkdtemp(prefix="bench-graph-out-")
    _launch(towers_worker, 3, args)
    towers = Path(args.out, "towers.md").read_text()
    unet_row = ""
    if not args.skip_unet:
        _launch(unet_worker, 4, args)
        unet_row = Path(args.out, "unet.md").read_text()
    markdown = _markdown(args, towers, unet_row)
    print(markdown)
    if not args.no_write:
        write_section("graph", markdown)


def _table(header: list[str], rows: str) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header), rows])


def _markdown(args: argparse.Namespace, towers: str, unet_row: str) -> str:
    command = " ".join(["python benchmarks/bench_graph.py", *sys.argv[1:]])
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        "gloo, 1 thread per rank"
    )
    text = f"""## Graph pipeline vs chain pipeline (GraphPipe)

Two-tower model: text tower 4 blocks over {args.text_len} tokens, image tower 2 blocks over
{args.patches} patches (similar cost), width {args.dim}, a light fusion head; 3 ranks split
text | image | head. *Graph*: the towers run side by side (depth 2). *Chain*: the same stages
as text -> image -> head, the image stage relaying the text tower's output (depth 3), as
chain-only pipelines must. Schedule {args.schedule}, micro-batches of {args.microbatch_size}
samples, {args.repeats} rounds after {args.warmup} warm-up steps, every cell once per round,
all in one run; step times are medians. Measured gain: median over rounds of chain step /
graph step of the same round. Predicted gain: (m + 3 - 1) / (m + 2 - 1), the bubble formula
for equal stages (with a head much lighter than a tower the ideal is higher, up to
(m + 1) / m). Peak activation memory per rank (ActivationMeter: stage inputs, outputs and
tensors saved for backward), graph vs chain, ranks 0 / 1 / 2.

Command: `{command}` on {machine}. Other work may have been running on the machine.

"""
    text += _table(
        [
            "m",
            "graph step (ms)",
            "chain step (ms)",
            "measured gain",
            "predicted gain",
            "measured / predicted",
            "same, for gain - 1",
            "peak activations per rank, graph vs chain (MiB)",
        ],
        towers,
    )
    if unet_row:
        text += f"""

U-Net (3 levels, width {args.unet_width}, {args.unet_size}x{args.unet_size} images) on 4
ranks, 2 layers each; skips sent directly from encoder rank to decoder rank vs relayed through
every rank in between. {args.unet_microbatches} micro-batches of {args.unet_microbatch_size},
schedule {args.schedule}, median of {args.unet_repeats} steps. Ranks 1 and 2 are the
intermediate ones.

"""
        text += _table(
            [
                "direct step (ms)",
                "relayed step (ms)",
                "rank 0 peak, direct vs relayed (MiB)",
                "rank 1",
                "rank 2",
                "rank 3",
            ],
            unet_row,
        )
    return text + "\n"


if __name__ == "__main__":
    main()
