"""Soak: resident memory of each rank over thousands of training steps, per configuration.

    python benchmarks/bench_soak.py     # 500 warm-up steps, then the demo 5000, the others 1000
    python benchmarks/bench_soak.py --sweep-steps 5000               # every configuration 5000
    python benchmarks/bench_soak.py --steps 500 --configs demo,1f1b-untied --no-write  # quicker
    # the code before a fix, for comparison: run it there, then pass its samples here
    PYTHONPATH=old/src python benchmarks/bench_soak.py --configs demo --steps 1000 \
        --no-write --samples before.json
    python benchmarks/bench_soak.py --before before.json --samples after.json
    python benchmarks/bench_soak.py --from-samples after.json --before before.json  # report again

Every configuration trains the demo's GPT (`conveyor demo` defaults: 2 ranks, batch 32,
sequence 64, width 64, 4 blocks, AdamW) in two fresh gloo processes, one torch thread each,
cycling 64 batches drawn once. Each rank samples its resident set (/proc/self/statm) and
glibc's heap (mallinfo2) every --every steps. The slope is the least-squares line through the
samples after warm-up, in KB per step; its value over each half of that window, and the
demo's slope over each --sweep-steps window of its longer run, show whether a shorter window
estimates it as well. Results go to the `soak` section of docs/benchmarks.md and to
docs/soak_rss.png.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import platform
import re
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import DOC, write_section

import conveyor
from conveyor.demo import DemoConfig
from conveyor.models import gpt, gpt_loss, text_batches

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"]


@dataclass(frozen=True)
class Soak:
    """One configuration: the demo's, or one of its settings changed."""

    name: str
    schedule: str = "1f1b"
    tied: bool = True
    options: dict[str, Any] = field(default_factory=dict)
    """PipelineConfig fields that differ from the defaults."""


def configurations() -> list[Soak]:
    soaks = [
        Soak("demo"),
        Soak("demo, keep_host_memory=False", options={"keep_host_memory": False}),
        Soak("demo, recompute=always", options={"recompute": "always"}),
        Soak("demo, trace=True", options={"trace": True}),
    ]
    for schedule in SCHEDULES:
        for tied in (True, False):
            if (schedule, tied) != ("1f1b", True):  # that one is the demo
                soaks.append(Soak(f"{schedule}-{'tied' if tied else 'untied'}", schedule, tied))
    return soaks


_MALLINFO2 = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2.split()]


def sample(step: int) -> list[int]:
    """[step, resident bytes, heap bytes in use, heap bytes held] (heap: 0 without glibc)."""
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    if platform.libc_ver()[0] != "glibc":
        return [step, rss, 0, 0]
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return [step, rss, info.uordblks + info.hblkhd, info.arena + info.hblkhd]


def worker(
    rank: int, soak: Soak, warmup: int, steps: int, every: int, store: str, out: str
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(300)
    )
    demo = DemoConfig()
    torch.manual_seed(0)
    model = gpt(
        seq_len=demo.seq_len, dim=demo.dim, num_layers=demo.num_layers, tie_embeddings=soak.tied
    )
    pipe = conveyor.Pipeline(model, schedule=soak.schedule, loss_fn=gpt_loss, **soak.options)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=demo.lr)
    batches = text_batches(demo.batch_size, demo.seq_len, 64)
    samples = [sample(0)]
    start = time.perf_counter()
    for step in range(1, warmup + steps + 1):
        inputs, targets = batches[step % len(batches)]
        pipe.step(inputs, targets)
        optimizer.step()
        optimizer.zero_grad()
        if step % every == 0:
            samples.append(sample(step))
    seconds = time.perf_counter() - start
    Path(f"{out}.{rank}").write_text(json.dumps({"samples": samples, "seconds": seconds}))
    dist.destroy_process_group()


@dataclass(frozen=True)
class RankResult:
    """One rank's memory over one configuration's run."""

    samples: list[list[int]]
    seconds: float
    warmup: int
    steps: int
    """Steps measured after warm-up."""

    def after_warmup(self) -> list[list[int]]:
        return [s for s in self.samples if s[0] >= self.warmup]

    def slope(
        self, column: int = 1, part: slice = slice(None), since: int = 0, until: int | None = None
    ) -> float:
        """Least-squares growth of a sampled column after warm-up (between steps ``since``
        and ``until``), in KB per step."""
        rows = [
            r for r in self.after_warmup() if since <= r[0] and (until is None or r[0] <= until)
        ][part]
        fit = statistics.linear_regression([r[0] for r in rows], [r[column] for r in rows])
        return fit.slope / 1e3

    def halves(self) -> tuple[float, float]:
        middle = len(self.after_warmup()) // 2
        return self.slope(part=slice(None, middle + 1)), self.slope(part=slice(middle, None))

    def settled_step(self, tolerance: int = 1 << 20) -> int:
        """The first sampled step with resident memory within ``tolerance`` of the run's
        maximum: where the peak was (all but) reached."""
        peak = max(s[1] for s in self.samples)
        return next(s[0] for s in self.samples if s[1] >= peak - tolerance)

    def rss(self, step: int) -> float:
        """Resident MiB at the sample nearest ``step``."""
        return min(self.samples, key=lambda s: abs(s[0] - step))[1] / 2**20


def run(soak: Soak, steps: int, args: argparse.Namespace) -> list[RankResult]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "samples")
        store = os.path.join(tmp, "store")
        mp.spawn(worker, args=(soak, args.warmup, steps, args.every, store, out), nprocs=2)
        parts = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]
    return [RankResult(p["samples"], p["seconds"], args.warmup, steps) for p in parts]


def table(results: dict[str, list[RankResult]]) -> list[str]:
    lines = [
        "| configuration | rank | steps | ms/step | RSS after warm-up MiB | RSS at end MiB "
        "| slope KB/step | first half / second half | within 1 MiB of peak by step "
        "| heap in use B/step | heap held B/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, ranks in results.items():
        for rank, r in enumerate(ranks):
            first, second = r.halves()
            lines.append(
                f"| {name} | {rank} | {r.warmup} + {r.steps} "
                f"| {r.seconds / (r.warmup + r.steps) * 1e3:.0f} "
                f"| {r.rss(r.warmup):.1f} | {r.rss(r.warmup + r.steps):.1f} "
                f"| {r.slope():+.3f} | {first:+.3f} / {second:+.3f} | {r.settled_step()} "
                f"| {r.slope(column=2) * 1e3:+.1f} | {r.slope(column=3) * 1e3:+.1f} |"
            )
    return lines


def stability(results: dict[str, list[RankResult]]) -> list[str]:
    """The demo's slope over each window as long as the shorter runs of the other
    configurations, against its whole run: how well the shorter window estimates it."""
    demo = results.get("demo")
    window = min((r[0].steps for name, r in results.items() if name != "demo"), default=None)
    if demo is None or window is None or demo[0].steps < 2 * window:
        return []
    lines = [
        f"The demo ran {demo[0].steps} steps after warm-up, the other configurations "
        f"{window} or more. The demo's slope over each consecutive {window}-step window, "
        "against its slope over the whole run, shows how well such a window estimates it "
        "(KB/step):",
        "",
    ]
    for rank, r in enumerate(demo):
        starts = range(r.warmup, r.warmup + r.steps - window + 1, window)
        slopes = [r.slope(since=start, until=start + window) for start in starts]
        lines.append(
            f"- rank {rank}: whole run {r.slope():+.3f}; windows "
            f"{', '.join(f'{x:+.2f}' for x in slopes)} (largest {max(map(abs, slopes)):.2f})"
        )
    return [*lines, ""]


def caveats(results: dict[str, list[RankResult]]) -> list[str]:
    """What to read a configuration's slope with."""
    if "demo, keep_host_memory=False" not in results:
        return []
    return [
        "With keep_host_memory=False glibc gives large freed blocks back to the system and "
        "maps them again, so resident memory moves both ways from step to step: over a short "
        "window its slope is mostly that noise, and heap in use is the steadier measure.",
        "",
    ]


def missing(results: dict[str, list[RankResult]]) -> list[str]:
    """The configurations this report lacks, said plainly."""
    names = [s.name for s in configurations() if s.name not in results]
    if not names:
        return []
    return [f"Not measured in this run: {'; '.join(names)}.", ""]


def plot(results: dict[str, list[RankResult]], path: Path) -> None:
    """Resident memory per rank, a color per configuration (up to 20), the legend below."""
    figure, axes = plt.subplots(1, 2, figsize=(13, 6), sharex=True)
    colors = plt.get_cmap("tab20").colors
    for rank, axis in enumerate(axes):
        for (name, ranks), color in zip(results.items(), colors, strict=False):
            steps = [s[0] for s in ranks[rank].samples]
            rss = [s[1] / 2**20 for s in ranks[rank].samples]
            axis.plot(steps, rss, label=name, lw=1, color=color)
        axis.set_title(f"rank {rank}")
        axis.set_xlabel("step")
        axis.set_ylabel("resident memory (MiB)")
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, fontsize=8, loc="lower center", ncol=5)
    figure.tight_layout(rect=(0, 0.12, 1, 1))
    figure.savefig(path, dpi=90)
    plt.close(figure)


COMMAND = shlex.join(["python", "benchmarks/bench_soak.py", *sys.argv[1:]])
"""This run's command line, as the report gives it."""


def save(results: dict[str, list[RankResult]], path: Path) -> None:
    """Every rank's samples and the command that measured them (``--before``,
    ``--from-samples``)."""
    raw = {name: [dataclasses.asdict(r) for r in ranks] for name, ranks in results.items()}
    path.write_text(json.dumps({"command": COMMAND, "results": raw}))


def load(path: Path) -> tuple[str, dict[str, list[RankResult]]]:
    """The command and results ``save`` wrote."""
    raw = json.loads(path.read_text())
    results = {name: [RankResult(**r) for r in ranks] for name, ranks in raw["results"].items()}
    return raw["command"], results


def before(path: Path | None) -> list[str]:
    """The same measurement of other code (``--before``: the code before the fix)."""
    if path is None:
        return []
    command, results = load(path)
    return [
        "Before the fix (tied gradients summed by an all_reduce per step, Note [no collective "
        "per step]), measured by this benchmark with that code's src/ first on PYTHONPATH "
        f"(`{command}`):",
        "",
        *table(results),
        "",
        "After the fix:",
        "",
    ]


def render(
    commands: list[str], results: dict[str, list[RankResult]], args: argparse.Namespace
) -> str:
    minutes = sum(max(r.seconds for r in ranks) for ranks in results.values()) / 60
    first = next(iter(results.values()))[0]
    worst = max(abs(r.slope()) for ranks in results.values() for r in ranks)
    latest = max(r.settled_step() for ranks in results.values() for r in ranks)
    return "\n".join(
        [
            "## Soak: resident memory over long runs",
            "",
            f"Command{'s' if len(commands) > 1 else ''}: "
            + "; ".join(f"`{command}`" for command in commands)
            + " "
            f"({minutes:.0f} min) on "
            f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
            "2 gloo ranks with one torch thread each; other work may have been running. "
            "Each configuration is the demo (`conveyor demo` defaults: GPT with tied embeddings, "
            "1F1B, 4 micro-batches, batch 32, AdamW) with one setting changed, in fresh "
            f"processes: {first.warmup} warm-up steps, then the steps the table gives, "
            f"resident memory sampled every {first.samples[1][0]} steps. Slope: "
            "least-squares line through the samples after warm-up (and through each half "
            "of them); heap in use: glibc's bytes allocated and not freed (mallinfo2), the "
            "same fit; heap held: the bytes glibc holds from the system for its heaps, in use "
            "or free. Resident memory that rises in steps while heap in use stays flat and heap "
            "held rises with it is glibc placing the same allocations in a more fragmented "
            "heap, not memory kept by the program.",
            "",
            f"**Largest slope {worst:.3f} KB/step (target: below 1); every rank within 1 MiB "
            f"of its peak by step {latest}.**",
            "",
            *before(args.before),
            *missing(results),
            *caveats(results),
            *stability(results),
            *table(results),
            "",
            "![resident memory per rank over the run](soak_rss.png)",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5000, help="steps measured after warm-up")
    parser.add_argument(
        "--sweep-steps", type=int, default=1000, help="the same for the other configurations"
    )
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--every", type=int, default=25, help="steps between samples")
    parser.add_argument(
        "--configs",
        default=None,
        help='comma-separated names, e.g. "demo,gpipe-tied,demo, trace=True" (default: all)',
    )
    parser.add_argument("--no-write", action="store_true", help="print, leave docs alone")
    parser.add_argument("--samples", type=Path, help="also write every sample to this JSON file")
    parser.add_argument(
        "--before", type=Path, help="a --samples file of other code, shown for comparison"
    )
    parser.add_argument(
        "--from-samples",
        type=Path,
        nargs="+",
        help="report --samples files (of several runs: their configurations together) "
        "instead of running",
    )
    args = parser.parse_args()
    if args.from_samples is not None:
        loaded = [load(path) for path in args.from_samples]
        commands = [command for command, _ in loaded]
        results = {name: ranks for _, part in loaded for name, ranks in part.items()}
    else:
        commands, results = [COMMAND], measure(parser, args)
    markdown = render(commands, results, args)
    print(markdown)
    if not args.no_write:
        plot(results, DOC.parent / "soak_rss.png")
        write_section("soak", markdown)


def measure(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> dict[str, list[RankResult]]:
    """Run the chosen configurations one after another, printing each one's rows."""
    soaks = configurations()
    if args.configs is not None:
        wanted = re.split(r",(?=\S)", args.configs)  # names hold ", " themselves
        unknown = sorted(set(wanted) - {s.name for s in soaks})
        if unknown:
            parser.error(
                f"unknown configurations {unknown}; expected some of {[s.name for s in soaks]}"
            )
        soaks = [s for s in soaks if s.name in wanted]
    results: dict[str, list[RankResult]] = {}
    for soak in soaks:
        steps = args.steps if soak.name == "demo" else args.sweep_steps
        results[soak.name] = run(soak, steps, args)
        print("\n".join(table({soak.name: results[soak.name]})[2:]), flush=True)
        if args.samples is not None:  # after each configuration: an interrupted run keeps them
            save(results, args.samples)
    return results


if __name__ == "__main__":
    main()
