"""A static cache that scores every slot against one that scores the written ones: time to first
token and decode speed of a Hugging Face model on one process (See Note [filled slots]).

    python benchmarks/bench_static_cache.py          # the 'static-cache' section of benchmarks.md
    python benchmarks/bench_static_cache.py --quick  # one round, a 2k prompt, nothing written

Hugging Face's StaticCache hands attention all of its preallocated slots, masked; conveyor's
hands it the slots written so far. The model is bench_long_context's (4 layers, width 256,
float32, one thread); each prompt is prefilled whole (the unsplit model) and in the chunks a
two-stage pipeline prefills it in (4 a stage), then decodes 16 tokens, with each cache in
turn, alternating which goes first, on one process: the chunked prefill is the work a
pipeline's stages share, without its messages.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_long_context import build
from report import publishable, write_section

import conveyor.hf.decode
from conveyor.pipeline.decode import DecodePipeline
from conveyor.planner.parallelism import pipeline_chunk

CACHES = ("every slot", "written slots")
NEW_TOKENS = 16


@contextmanager
def scoring(cache: str) -> Iterator[None]:
    """Generation with Hugging Face's StaticCache as it is (``every slot``) or conveyor's."""
    filled = conveyor.hf.decode.filled_slots
    if cache == "every slot":
        conveyor.hf.decode.filled_slots = lambda c: c  # type: ignore[assignment]
    try:
        yield
    finally:
        conveyor.hf.decode.filled_slots = filled  # type: ignore[assignment]


def run(model: Any, prompt: int, chunk: int | None) -> tuple[float, float]:
    """(time to first token, decode tokens/s) of one generation."""
    ids = torch.randint(1, 1024, (1, prompt), generator=torch.Generator().manual_seed(prompt))
    decoder = DecodePipeline(model, local=True)
    decoder.generate(ids, max_new_tokens=NEW_TOKENS, cache="static", prefill_chunk=chunk)
    stats = decoder.stats
    assert stats is not None and stats.time_to_first_token and stats.decode_tokens_per_s
    return stats.time_to_first_token, stats.decode_tokens_per_s


def measure(
    prompts: list[int], rounds: int
) -> dict[tuple[int, str, str], list[tuple[float, float]]]:
    """(prompt, prefill, cache) -> each round's (time to first token, decode tokens/s)."""
    torch.set_num_threads(1)
    model = build(max(prompts) + NEW_TOKENS)
    found: dict[tuple[int, str, str], list[tuple[float, float]]] = {}
    for r in range(rounds):
        for prompt in prompts:
            for prefill, chunk in (("whole", None), ("chunked", pipeline_chunk(prompt, 2))):
                for cache in CACHES if r % 2 == 0 else CACHES[::-1]:
                    with scoring(cache):
                        found.setdefault((prompt, prefill, cache), []).append(
                            run(model, prompt, chunk)
                        )
        print(f"round {r + 1}/{rounds} done", flush=True)
    return found


def render(
    found: dict[tuple[int, str, str], list[tuple[float, float]]], prompts: list[int], note: str
) -> str:
    """The section: ``note``, then each prompt's and prefill's figures with each cache."""
    rows = [
        "| prompt | prefill | time to first token, every slot (s) | written slots (s) | "
        "speed-up | decode tokens/s, every slot | written slots | speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for prompt in prompts:
        for prefill in ("whole", "chunked"):
            runs = [found[(prompt, prefill, cache)] for cache in CACHES]
            ttft, speed = ([[r[i] for r in rounds] for rounds in runs] for i in (0, 1))
            t0, t1 = (statistics.median(v) for v in ttft)
            s0, s1 = (statistics.median(v) for v in speed)
            rows.append(
                f"| {prompt} | {prefill} | {_spread(ttft[0])} | {_spread(ttft[1])} | "
                f"**{t0 / t1:.2f}x** | {_spread(speed[0])} | {_spread(speed[1])} | "
                f"{s1 / s0:.2f}x |"
            )
    return f"{note}\n\n" + "\n".join(rows)


def _spread(values: list[float]) -> str:
    """Median (min-max)."""
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a 2k prompt, one round")
    parser.add_argument("--no-write", action="store_true", help="print, do not publish")
    parser.add_argument("--force", action="store_true", help="publish even on a busy machine")
    args = parser.parse_args()
    prompts, rounds = ([2048], 1) if args.quick else (args.prompts, args.rounds)
    before = os.getloadavg()[0]
    found = measure(prompts, rounds)
    after = os.getloadavg()[0]
    note = (
        f"`python benchmarks/bench_static_cache.py` ({rounds} rounds, the caches alternating "
        f"which goes first; load average {before:.2f} before, {after:.2f} after; 2 CPU cores, "
        f"torch {torch.__version__}). bench_long_context's Llama-style model (4 layers, width "
        f"256, float32) on one process of one thread; {NEW_TOKENS} new tokens; chunked: the "
        "chunks a two-stage pipeline prefills in (4 a stage). Median (min-max) over rounds; "
        "*every slot*: Hugging Face's StaticCache, whose attention scores all preallocated "
        "slots, masked; *written slots*: conveyor's, which hands attention the slots written "
        "so far (Note [filled slots] in conveyor.hf.decode)."
    )
    text = render(found, prompts, note)
    print(text)
    if not (args.quick or args.no_write) and publishable([before, after], args.force, own=1.5):
        write_section("static-cache", "## A static cache that scores its written slots\n\n" + text)


if __name__ == "__main__":
    main()
