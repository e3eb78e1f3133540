"""Pipelined generation on 2 ranks vs the unsplit model and vs the naive pipeline, measured and
predicted; then pipeline vs tensor vs context parallelism for long sequences, on paper.

    python benchmarks/bench_generate.py              # 'generate' and 'parallelism' sections of
                                                     # docs/benchmarks.md, docs/parallelism.png
    python benchmarks/bench_generate.py --repeats 1 --new-tokens 32 --skip-paper   # quicker
    python benchmarks/bench_generate.py --paper-only   # the links and the paper section alone

Measured: a GPT (8 blocks, width 256, 8 heads, context 1152) generating 128 new tokens after
prompts of 128 and 1024 tokens, batch 1 and 8: the unsplit model on one process (1 and 2
threads), and split in two stages on 2 gloo ranks (1 thread each) with one group of sequences
in flight (the naive pipeline), with 2 groups, and with the default (as many groups as the
stages' measured costs predict fastest, chosen at the first call: conveyor.inference.groups),
all in the same processes, alternating, one
generation at a time (the unsplit ones on rank 0 while rank 1 waits). Time to first token and
decode throughput come from the same run (``DecodePipeline.stats``); medians of the repeats.
Predicted: each stage profiled on both ranks at once
(``conveyor.inference.cost.profile_stage``), the link and the runtime's per-message costs
measured between the two ranks
(``conveyor.planner.calibrate``), and the decode Program simulated.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import DOC, publishable, two_ranks, write_section

from conveyor.graph import chain
from conveyor.inference import decode_program
from conveyor.inference.cost import DecodeCost, StageFit, profile_stage
from conveyor.inference.prompts import groups_of
from conveyor.inference.schedule import decode_items
from conveyor.models import gpt
from conveyor.pipeline.decode import DecodePipeline, GenerationStats, as_causal_lm
from conveyor.planner.calibrate import measure_allreduce, measure_link, measure_overheads
from conveyor.planner.parallelism import STRATEGIES, Estimate, LayerCosts, compare
from conveyor.simulator import Link, Overheads, simulate

FIGURE = DOC.parent / "parallelism.png"
CASES = [(1, 128), (8, 128), (1, 1024), (8, 1024)]
"""(batch, prompt length)."""


def model(args: argparse.Namespace) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return gpt(
        seq_len=1024 + args.new_tokens, dim=args.dim, num_layers=args.layers, num_heads=8
    ).eval()


def prompts(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, 96, (batch, length), generator=torch.Generator().manual_seed(length))


DEFAULT = "default (groups chosen)"


def modes(batch: int, prompt: int) -> dict[str, dict[str, Any]]:
    """Pipelined configurations of a case: generate options by name."""
    found: dict[str, dict[str, Any]] = {"naive pipeline (1 group)": {"num_groups": 1}}
    if batch > 1:
        found["2 groups in flight"] = {"num_groups": 2}
    if prompt >= 1024:
        groups = min(2, batch)
        found[f"{groups} group{'s' if groups > 1 else ''}, prefill in chunks of 256"] = {
            "num_groups": groups,
            "prefill_chunk": 256,
        }
    found[DEFAULT] = {}  # num_groups chosen by the measured costs (conveyor.inference.groups)
    return found


def worker(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(0, 900)
    )
    link = measure_link()
    collective = measure_allreduce(sizes=(1 << 10, 1 << 22, 1 << 16, 1 << 20))
    if args.paper_only:  # the links are all the paper section measures on two ranks
        if rank == 0:
            torch.save({"link": link, "collective": collective}, out)
        dist.destroy_process_group()
        return
    overheads = measure_overheads()
    plain = model(args)
    decoder = DecodePipeline(model(args), timeout_s=900)
    results: dict[str, Any] = {
        "link": link, "collective": collective, "overheads": overheads, "runs": {},
    }  # fmt: skip
    for batch, prompt in CASES:
        ids = prompts(batch, prompt)
        runs: dict[str, Callable[[], GenerationStats | None]] = {}
        for threads in (1, 2):
            runs[f"unsplit, {threads} thread{'s' if threads > 1 else ''}"] = _unsplit(
                rank, plain, ids, args.new_tokens, threads
            )
        for name, options in modes(batch, prompt).items():
            runs[name] = _pipelined(decoder, ids, args.new_tokens, options)
        measured: dict[str, list[GenerationStats]] = {name: [] for name in runs}
        for run in runs.values():  # warm-up
            dist.barrier()
            run()
        for _ in range(args.repeats):
            for name, run in runs.items():
                dist.barrier()
                stats = run()
                if stats is not None and stats.time_to_first_token is not None:
                    measured[name].append(stats)
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, measured)
        results["runs"][(batch, prompt)] = {
            name: gathered[0][name] or gathered[1][name] for name in runs
        }
        chosen = results["runs"][(batch, prompt)][DEFAULT][-1].num_groups
        results.setdefault("chosen", {})[(batch, prompt)] = chosen
        print(f"rank {rank}: batch {batch}, prompt {prompt} done", flush=True)
    dist.barrier()
    fits = _profile(decoder, args)  # on both ranks at once: See _profile
    gathered_fits: list[Any] = [None, None]
    dist.all_gather_object(gathered_fits, fits)
    if rank == 0:
        results["fits"] = [(a + b) * 0.5 for a, b in zip(*gathered_fits, strict=True)]
        torch.save(results, out)
    dist.destroy_process_group()


def _unsplit(
    rank: int, plain: torch.nn.Module, ids: torch.Tensor, new_tokens: int, threads: int
) -> Callable[[], GenerationStats | None]:
    def run() -> GenerationStats | None:
        if rank != 0:
            return None
        torch.set_num_threads(threads)
        decoder = DecodePipeline(plain, balance=[len(plain)], local=True)
        decoder.generate(ids, max_new_tokens=new_tokens)
        torch.set_num_threads(1)
        return decoder.stats

    return run


def _pipelined(
    decoder: DecodePipeline, ids: torch.Tensor, new_tokens: int, options: dict[str, Any]
) -> Callable[[], GenerationStats | None]:
    def run() -> GenerationStats | None:
        decoder.generate(ids, max_new_tokens=new_tokens, **options)
        return decoder.stats

    return run


def _profile(decoder: DecodePipeline, args: argparse.Namespace) -> list[StageFit]:
    """Each stage's fit at the shapes the runs have. Every rank profiles every stage at the
    same time (the caller averages the ranks' fits): decode streams the weights from memory
    at every token, so a stage runs slower while the other rank computes too, as it does in
    the pipeline, than on an otherwise idle machine (measured: 6.3 against 5.0 ms a token
    for a stage of 4 blocks, batch 8)."""
    start = time.perf_counter()
    fits = [
        profile_stage(
            decoder.lm,
            decoder.units[s],
            rows=[1, 4, 8],
            starts=[128, 640, 1024],
            chunks=[128, 256, 1024],
            steps=6,
            repeats=2,
        )
        for s in range(decoder.graph.num_stages)
    ]
    print(f"profiled both stages in {time.perf_counter() - start:.0f} s", flush=True)
    return fits


def predicted(
    fits: list[StageFit],
    args: argparse.Namespace,
    batch: int,
    prompt: int,
    options: dict[str, Any],
    link: Link,
    overheads: Overheads,
) -> tuple[float, float]:
    """(time to first token, decode tokens/s) the simulator predicts for a pipelined run."""
    graph = chain(2)
    num_groups = min(options.get("num_groups") or 1, batch)
    groups = groups_of(batch, num_groups)
    times = []
    for new_tokens in (1, args.new_tokens):
        items = decode_items(num_groups, prompt, new_tokens, options.get("prefill_chunk"))
        cost = DecodeCost(fits, graph, items, groups, args.dim * 4, link=link, overheads=overheads)
        times.append(simulate(decode_program(graph, items), graph, cost).step_time)
    first, total = times
    return first, batch * (args.new_tokens - 1) / (total - first)


# -- on paper -------------------------------------------------------------------------------

PAPER_DEVICES = [2, 4, 8, 16, 32, 64]
PAPER_PROMPTS = [1024, 4096, 32768, 131072, 1048576]
PAPER_LAYERS = 32


def paper_costs() -> LayerCosts:
    """Per-unit fits of a GPT of width 1024 (16 heads, vocabulary 32000), one sequence,
    measured here on one thread."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    wide = gpt(vocab_size=32000, seq_len=4096, dim=1024, num_layers=1, num_heads=16).eval()
    lm = as_causal_lm(wide)
    fit = {
        name: profile_stage(
            lm, units, rows=[1], starts=[256, 1024, 2048], chunks=[256, 512, 1024], repeats=2
        )
        for name, units in [("embed", range(0, 1)), ("block", range(1, 2)), ("head", range(2, 3))]
    }
    return LayerCosts(
        fit["embed"],
        fit["block"],
        fit["head"],
        hidden_size=1024,
        num_heads=16,
        dtype_bytes=4,
        block_params=sum(p.numel() for p in wide[1].parameters()),
        head_params=sum(p.numel() for p in [*wide[0].parameters(), *wide[2].parameters()]),
    )


FAST = Link(latency=5e-6, bandwidth=100e9)
"""An assumed fast interconnect (NVLink-class: 5 us, 100 GB/s), for contrast."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-paper", action="store_true", help="measure only")
    parser.add_argument(
        "--paper-only", action="store_true", help="measure the links, write the paper section"
    )
    parser.add_argument("--no-write", action="store_true", help="print, leave the docs alone")
    parser.add_argument("--force", action="store_true", help="publish even on a shared machine")
    args = parser.parse_args()
    if args.paper_only and args.skip_paper:
        parser.error("--paper-only and --skip-paper leave nothing to do; pass one of them")
    loads = [os.getloadavg()[0]]
    print(f"load average before: {loads[0]:.2f}", flush=True)
    results = two_ranks(worker, args)
    loads.append(os.getloadavg()[0])
    results["loads"] = loads
    text = None if args.paper_only else render(args, results)
    if text is not None:
        print(text)
    if args.no_write or not publishable(loads, args.force):
        return
    if text is not None:
        write_section("generate", text)
    if not args.skip_paper:
        costs = paper_costs()
        link, collective = results["link"], results["collective"]
        measured = compare(
            costs, PAPER_LAYERS, link, PAPER_DEVICES, PAPER_PROMPTS, collective=collective
        )
        fast = compare(costs, PAPER_LAYERS, FAST, PAPER_DEVICES, PAPER_PROMPTS)
        draw(measured, fast)
        write_section("parallelism", render_paper(costs, (link, collective), measured, fast))


# -- reporting ------------------------------------------------------------------------------


def _median(stats: list[GenerationStats], field: str) -> float:
    values = [getattr(s, field) for s in stats]
    return statistics.median(v for v in values if v is not None)


def render(args: argparse.Namespace, results: dict[str, Any]) -> str:
    link, overheads = results["link"], results["overheads"]
    lines = [
        "## Generation: pipelined decode with groups in flight (measured and predicted)",
        "",
        f"GPT with {args.layers} blocks, width {args.dim}, 8 heads, float32, {args.new_tokens} "
        "new tokens (greedy) after prompts of 128 and 1024 tokens; split in two stages "
        f"(embedding + {args.layers // 2} blocks | {args.layers // 2} blocks + head) on 2 gloo "
        "ranks with 1 thread each, or unsplit on one process. Time to first token (TTFT) and "
        "decode throughput (new tokens after the first, over the batch, per second of decoding) "
        f"are medians of {args.repeats} generations per row, the rows alternating in one run. "
        "Predicted: the decode Program simulated with each stage profiled on both ranks at once "
        "(the ranks' fits averaged), the link "
        f"measured between the ranks ({link.latency * 1e6:.0f} us + "
        f"{link.bandwidth / 1e9:.2f} GB/s) and the runtime's per-message costs (send "
        f"{overheads.send * 1e6:.0f} us, receive {overheads.recv * 1e6:.0f} us).",
        "",
        f"Command: `python benchmarks/bench_generate.py` on {platform.machine()}, "
        f"{os.cpu_count()} CPU cores, torch {torch.__version__}, {args.repeats} rounds; load "
        f"average {results['loads'][0]:.2f} before and {results['loads'][-1]:.2f} at the end "
        "(the benchmark's own two ranks included).",
        "",
        "| batch | prompt | run | TTFT (ms) | decode tokens/s | vs naive pipeline | "
        "vs unsplit 1 thread | predicted TTFT (ms) | predicted tokens/s | predicted / measured |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (batch, prompt), runs in results["runs"].items():
        naive = _median(runs["naive pipeline (1 group)"], "decode_tokens_per_s")
        alone = _median(runs["unsplit, 1 thread"], "decode_tokens_per_s")
        pipelined = modes(batch, prompt)
        for name, stats in runs.items():
            ttft = _median(stats, "time_to_first_token")
            rate = _median(stats, "decode_tokens_per_s")
            cells = ["", "", ""]
            if name in pipelined:
                options = pipelined[name]
                if name == DEFAULT:
                    chosen = results["chosen"][(batch, prompt)]
                    options = {"num_groups": chosen}
                    name = f"{name}: {chosen}"
                first, guess = predicted(
                    results["fits"], args, batch, prompt, options, link, overheads
                )
                cells = [f"{first * 1e3:.0f}", f"{guess:.1f}", f"{guess / rate:.2f}"]
            lines.append(
                f"| {batch} | {prompt} | {name} | {ttft * 1e3:.0f} | {rate:.1f} | "
                f"{rate / naive:.2f} | {rate / alone:.2f} | {' | '.join(cells)} |"
            )
    return "\n".join([*lines, "", *ceiling(results["fits"], args)])


def ceiling(fits: list[StageFit], args: argparse.Namespace) -> list[str]:
    """What 2 groups in flight can gain over the naive pipeline at batch 8, from the profiled
    forward costs alone: one token of the naive pipeline runs both stages on 8 rows one after
    the other; with 2 groups each rank runs its stage twice on 4 rows, and the ranks overlap.
    Twice only if a forward's time is proportional to its rows."""
    lines = []
    for prompt in (128, 1024):
        start = prompt + args.new_tokens // 2
        eight = [f.time(8, 1, start) for f in fits]
        four = [f.time(4, 1, start) for f in fits]
        bound = sum(eight) / max(2 * t for t in four)
        lines.append(
            f"- prompt {prompt}: a decode forward of 8 rows takes "
            f"{' and '.join(f'{t * 1e3:.2f}' for t in eight)} ms (stage 0 and 1), of 4 rows "
            f"{' and '.join(f'{t * 1e3:.2f}' for t in four)} ms; so 2 groups in flight can "
            f"reach at most {bound:.2f}x the naive pipeline's decode throughput here (2x if "
            "halving the rows halved the time)."
        )
    return [
        "The ceiling of groups in flight, from the profiled costs (batch 8, the runtime's "
        "overheads left out):",
        "",
        *lines,
    ]


def draw(measured: list[Estimate], fast: list[Estimate]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from conveyor.files import atomic_path

    prompt = 131072
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    styles = {
        "pipeline": "tab:blue",
        "tensor": "tab:red",
        "context": "tab:green",
        "pipeline x context": "tab:purple",
    }
    for estimates, dashes, label in [(measured, "-", "measured link"), (fast, "--", "fast link")]:
        for strategy in STRATEGIES:
            rows = [e for e in estimates if e.strategy == strategy and e.prompt == prompt]
            devices = [e.devices for e in rows]
            color = styles[strategy]
            name = f"{strategy}, {label}"
            axes[0].plot(
                devices, [e.time_to_first_token for e in rows], dashes, color=color, label=name
            )
            axes[1].plot(devices, [e.decode_tokens_per_s for e in rows], dashes, color=color)
            if label == "measured link":
                memory = [(e.kv_bytes_per_device + e.weight_bytes_per_device) / 2**30 for e in rows]
                axes[2].plot(devices, memory, "-", color=color, label=strategy)
    titles = [
        "time to first token (s)",
        "decode tokens/s (one sequence)",
        "KV cache + weights per device (GiB)",
    ]
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("devices")
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    fig.suptitle(f"one request, prompt of {prompt} tokens, {PAPER_LAYERS} blocks of width 1024")
    fig.tight_layout()
    with atomic_path(FIGURE) as temporary:
        fig.savefig(temporary, dpi=110, format="png")
    plt.close(fig)


def render_paper(
    costs: LayerCosts, links: tuple[Link, Link], measured: list[Estimate], fast: list[Estimate]
) -> str:
    block, (link, collective) = costs.block, links
    lines = [
        "## Parallelisms for long-sequence inference, on paper",
        "",
        f"One request on 2-64 devices, {PAPER_LAYERS} blocks of width {costs.hidden_size} "
        f"({costs.num_heads} heads, float32, vocabulary 32000): each strategy's prefill and "
        "decode run as a decode Program through the simulator (conveyor.planner.parallelism; "
        "its docstring states the model of each strategy). Per-layer costs measured here on one "
        f"thread and fitted (block, per sequence: decode {block.decode.fixed * 1e3:.2f} ms + "
        f"{block.decode.per_pair * 1e9:.2f} ns per cached position; prefill "
        f"{block.prefill.per_token * 1e6:.1f} us per token + {block.prefill.per_pair * 1e9:.3f} "
        "ns per query-key pair); links measured between two local gloo ranks (point to point "
        f"{link.latency * 1e6:.0f} us + {link.bandwidth / 1e9:.2f} GB/s; all-reduce "
        f"{collective.latency * 1e6:.0f} us a step + {collective.bandwidth / 1e9:.2f} GB/s, "
        "for tensor parallelism's all-reduces; point to point for the pipeline's messages, "
        "the ring and context parallelism's decode exchanges), "
        "and an assumed fast link (5 us + 100 GB/s, both) for contrast. Assumptions: costs "
        "measured at up to 2048 positions and extrapolated linearly in tokens and query-key "
        "pairs; collectives are rings "
        "(2(P - 1) steps of latency + 1/P of the bytes); ring-attention transfers overlap the "
        "attention; tensor and context parallelism without their costs beyond the model "
        "(tensor_overhead and context_overhead 0: both measured on this CPU in the section "
        "below); no position-table "
        "or memory limits; 16 decode tokens; prefill of the "
        "pipeline in 4P chunks. A dash: the strategy cannot use that many devices "
        f"({PAPER_LAYERS} blocks, {costs.num_heads} heads). Figure: [parallelism.png]"
        "(parallelism.png) (prompt of 131072).",
        "",
        "| prompt | devices | TTFT pipeline / tensor / context / pipeline x context (s) | "
        "decode tokens/s, same order | same, fast link: TTFT (s) | decode tokens/s | "
        "KV cache per device "
        "(GiB) | weights per device pipeline, tensor / context (GiB) |",
        "|---:|---:|---|---|---|---|---:|---|",
    ]
    table = {(e.strategy, e.devices, e.prompt): e for e in measured}
    quick = {(e.strategy, e.devices, e.prompt): e for e in fast}
    for prompt in [4096, 131072, 1048576]:
        for devices in [2, 8, 64]:
            row = [table.get((s, devices, prompt)) for s in STRATEGIES]
            fast_row = [quick.get((s, devices, prompt)) for s in STRATEGIES]
            known = next(e for e in row if e is not None)
            lines.append(
                f"| {prompt} | {devices} | {_triple(row, 'time_to_first_token', '{:.3g}')} | "
                f"{_triple(row, 'decode_tokens_per_s', '{:.3g}')} | "
                f"{_triple(fast_row, 'time_to_first_token', '{:.3g}')} | "
                f"{_triple(fast_row, 'decode_tokens_per_s', '{:.3g}')} | "
                f"{known.kv_bytes_per_device / 2**30:.3g} | "
                f"{_weights(row[0])} / {_weights(row[2])} |"
            )
    return "\n".join(lines)


def _weights(estimate: Estimate | None) -> str:
    return "-" if estimate is None else f"{estimate.weight_bytes_per_device / 2**30:.3g}"


def _triple(row: list[Estimate | None], field: str, form: str) -> str:
    return " / ".join("-" if e is None else form.format(getattr(e, field)) for e in row)


if __name__ == "__main__":
    main()
