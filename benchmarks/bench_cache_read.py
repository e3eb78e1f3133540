"""How fast decode reads a KV cache on one rank alone and on two ranks at once: the most that
context parallelism (cp = 2) can gain at decode on this machine, whatever its messages cost.

    python benchmarks/bench_cache_read.py          # the 'cache-read' section of benchmarks.md
    python benchmarks/bench_cache_read.py --quick  # one round, short caches, nothing written

A decode token at long context is the new token's attention over every cached key and value of
every layer, so it runs at the speed the cache is read. cp = 2 gives each of two ranks half of
the cache, which halves the time only if the two ranks read twice as fast as one. Here the
attention cp runs at decode (``conveyor.parallel.context_parallel.partial_attention``, one query
over a shard, float32, the shapes of bench_long_context's model: 4 layers of 4 heads of 64) is
timed per token over caches of 4k, 16k and 64k positions in three ways, alternating within each
round: one rank over the whole cache while the other waits (what the unsplit model and a
pipeline's one busy stage read), the same with two threads, and both ranks at once over half of
it each (cp = 2 without its exchanges). The time of the whole over that of the halves is cp's
ceiling at decode: its speed-up over one rank if its exchanges cost nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import publishable, two_ranks, write_section

from conveyor.parallel.context_parallel import AttentionSpec, partial_attention

LAYERS, HEADS, HEAD_DIM = 4, 4, 64
MODES = ("one rank, whole cache", "one rank, 2 threads, whole cache", "two ranks, half each")
SPEC = AttentionSpec(scale=HEAD_DIM**-0.5, num_heads=HEADS, num_kv_heads=HEADS)


def cache(length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's keys and values over ``length`` positions (their own memory, as a model's
    layers have: together they do not fit the processor's caches at 16k and beyond)."""
    generator = torch.Generator().manual_seed(length)
    shape = (1, HEADS, length, HEAD_DIM)
    return [
        (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
        for _ in range(LAYERS)
    ]


def token_seconds(layers: list[tuple[torch.Tensor, torch.Tensor]], tokens: int) -> float:
    """Median seconds of one token's attention over every layer's cache."""
    q = torch.randn(1, HEADS, 1, HEAD_DIM)
    allowed = torch.ones(1, 1, 1, layers[0][0].shape[2], dtype=torch.bool)
    times = []
    for _ in range(tokens):
        start = time.perf_counter()
        for keys, values in layers:
            partial_attention(q, keys, values, SPEC, allowed)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(0, 3600)
    )
    with torch.no_grad():
        results = {length: _measure(rank, args, length) for length in args.lengths}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def _measure(rank: int, args: argparse.Namespace, length: int) -> dict[str, list[float]]:
    """Every mode's seconds a token over a cache of ``length`` positions, round by round."""
    whole, half = cache(length), cache(length // 2)
    runs = {
        MODES[0]: lambda: _alone(rank, whole, args.tokens, 1),
        MODES[1]: lambda: _alone(rank, whole, args.tokens, 2),
        MODES[2]: lambda: token_seconds(half, args.tokens),
    }
    measured: dict[str, list[float]] = {m: [] for m in MODES}
    for round_index in range(args.rounds):
        for mode in MODES if round_index % 2 == 0 else MODES[::-1]:
            dist.barrier()
            measured[mode].append(_slowest(runs[mode]()))
    return measured


def _alone(
    rank: int, layers: list[tuple[torch.Tensor, torch.Tensor]], tokens: int, threads: int
) -> float:
    """Rank 0 reads ``layers`` with ``threads`` threads; rank 1 waits (0 s)."""
    if rank != 0:
        return 0.0
    torch.set_num_threads(threads)
    try:
        return token_seconds(layers, tokens)
    finally:
        torch.set_num_threads(1)


def _slowest(seconds: float) -> float:
    """The slower rank's time: a token is done when both ranks are."""
    gathered = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(gathered, op=dist.ReduceOp.MAX)
    return float(gathered)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--tokens", type=int, default=20, help="tokens timed per run")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="short caches, one round")
    parser.add_argument("--no-write", action="store_true", help="print, do not publish")
    parser.add_argument("--force", action="store_true", help="publish even on a busy machine")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.rounds, args.tokens, args.no_write = [1024, 4096], 1, 4, True
    loads = [os.getloadavg()[0]]
    print(f"load average before: {loads[0]:.2f}", flush=True)
    results = two_ranks(worker, args)
    loads.append(os.getloadavg()[0])
    text = render(args, results, loads)
    print(text)
    if not args.no_write and publishable(loads, args.force):
        write_section("cache-read", text)


def render(args: argparse.Namespace, results: dict[int, dict[str, list[float]]],
           loads: list[float]) -> str:  # fmt: skip
    lines = [
        "## Reading the KV cache at decode: one rank against two (cp's ceiling)",
        "",
        f"`python benchmarks/bench_cache_read.py` ({args.rounds} rounds, modes alternating; "
        f"load average {loads[0]:.2f} before, {loads[1]:.2f} after, the benchmark's own ranks "
        f"included; {os.cpu_count()} CPU cores, torch {torch.__version__}). One token's "
        f"attention over the cache of {LAYERS} layers (4 heads of 64, float32), as cp's decode "
        f"computes it; median seconds a token over {args.tokens} tokens, then the median over "
        "rounds (min-max). *GB/s*: the cache's bytes over the time. *ceiling*: the whole "
        "cache on one rank over the halves on two ranks at once, the most cp = 2 can gain at "
        "decode over one rank's reading (the median of the rounds' ratios, min-max).",
        "",
        "| cache | one rank, whole (ms) | GB/s | one rank, 2 threads, whole (ms) | GB/s | "
        "two ranks, half each (ms) | GB/s | ceiling |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for length, measured in results.items():
        nbytes = 2 * LAYERS * HEADS * length * HEAD_DIM * 4
        cells = []
        for mode in MODES:
            values = measured[mode]
            median = statistics.median(values)
            cells.append(
                f"{median * 1e3:.2f} ({min(values) * 1e3:.2f}-{max(values) * 1e3:.2f}) | "
                f"{nbytes / median / 1e9:.1f}"
            )
        ratios = [w / h for w, h in zip(measured[MODES[0]], measured[MODES[2]], strict=True)]
        ceiling = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
        lines.append(f"| {length} | {' | '.join(cells)} | {ceiling} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
