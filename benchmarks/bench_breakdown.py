"""Where a step's time goes: conveyor vs torch.distributed.pipelining, side by side.

    python benchmarks/bench_breakdown.py                 # 1f1b and zb-v, m 8
    python benchmarks/bench_breakdown.py --schedules gpipe --microbatches 4 --no-write

Each system runs out of the box in its own processes (benchmarks/ootb.py) and, after its timed
steps, profiles more steps with cProfile on every rank: the same instrument for both. Every
function's own time (cProfile's tottime) is put in a bucket by where its code lives, per rank
per step: compute (torch operators and the autograd engine, called from C), waiting on gloo
(``Work.wait``), posting transfers, the pipeline library's own Python (conveyor's, or
torch.distributed.pipelining's), the model's own Python, torch's other Python (nn.Module
calls, the optimizer, autograd's Python), and the rest. conveyor also records its Timeline
over the same steps, which splits its step by action kind. Results go to the `breakdown` section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ootb import RANKS, Spec, load_average, run_round, shared
from report import write_section

BUCKETS = [
    "compute (torch operators, autograd engine)",
    "waiting on gloo (Work.wait)",
    "posting gloo sends/receives",
    "pipeline library's own Python",
    "the model's Python (gpt.py forward)",
    "torch's other Python (nn.Module, optimizer, autograd, c10d)",
    "other (Python builtins, pickling, ...)",
]


def bucket(key: tuple[str, int, str], library: str) -> int:
    """Which of BUCKETS a profiled function's own time belongs to."""
    file, _, name = key
    if file == "~":  # a builtin: a C function called from Python
        if "wait" in name and ("Work" in name or "_distributed_c10d" in name):
            return 1
        if "_distributed_c10d.send" in name or "_distributed_c10d.recv" in name:
            return 2
        if "torch" in name or ("method" in name and ("Tensor" in name or "_C" in name)):
            return 0
        return 6
    if file.endswith("models/gpt.py"):
        return 4
    if library in file:
        return 3
    if "/torch/" in file:
        return 5
    return 6


def buckets(paths: list[Path], library: str, steps: int) -> list[float]:
    """Seconds per step in each of BUCKETS, averaged over ranks."""
    totals = [0.0] * len(BUCKETS)
    for path in paths:
        for key, (_, _, own, _, _) in pstats.Stats(str(path)).stats.items():  # type: ignore[attr-defined]
            totals[bucket(key, library)] += own
    return [t / steps / len(paths) for t in totals]


def timeline_breakdown(path: Path) -> dict[str, float]:
    """conveyor's Timeline, seconds per step per rank by event kind, and the untracked rest."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from conveyor.trace import Timeline

    per_kind: dict[str, list[float]] = defaultdict(list)
    for data in json.loads(path.read_text()):
        timeline = Timeline.from_dict(data)
        step = timeline.step_time
        for rank in range(timeline.num_ranks):
            kinds: dict[str, float] = defaultdict(float)
            for event in timeline.on(rank):
                name = "wait for sends" if event.action == "wait sends" else event.kind
                kinds[name] += event.duration
            kinds["untracked (between actions)"] = step - sum(kinds.values())
            for name, value in kinds.items():
                per_kind[name].append(value / timeline.num_ranks)
    steps = len(json.loads(path.read_text()))
    return {name: sum(values) / steps for name, values in per_kind.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="1f1b,zb-v")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    configs = [(s, args.microbatches) for s in args.schedules.split(",")]
    started, loads = time.perf_counter(), [load_average()]
    sections = []
    with tempfile.TemporaryDirectory() as directory:
        outs = {}
        for system in ("conveyor", "torch"):
            out = str(Path(directory, system))
            extra = {"trace": True} if system == "conveyor" else {}
            spec = Spec(system, configs, warmup=1, steps=args.steps, profile=True, out=out)
            spec.extra = extra
            result = run_round(spec)
            if "error" in result:
                raise SystemExit(f"{system} failed: {result['error']}")
            outs[system] = (out, result)
            loads.append(load_average())
        for schedule, m in configs:
            sections.append(render_config(schedule, m, outs, args.steps))
    text = header(args, loads, time.perf_counter() - started) + "\n\n".join(sections)
    print(text)
    if not args.no_write:
        write_section("breakdown", text)


def render_config(schedule: str, m: int, outs: dict[str, Any], steps: int) -> str:
    label = f"{schedule}.{m}"
    figures = {}
    for system, library in (
        ("conveyor", "/conveyor/"),
        ("torch", "/torch/distributed/pipelining/"),
    ):
        out, result = outs[system]
        paths = [Path(f"{out}.{label}.rank{r}.prof") for r in range(RANKS)]
        step = statistics.median(result["results"][f"{schedule}/{m}"]["times"])
        figures[system] = (step, buckets(paths, library, steps))
    lines = [
        f"### {schedule}, {m} micro-batches",
        "",
        f"Timed step (no profiler): conveyor {figures['conveyor'][0] * 1e3:.0f} ms, torch "
        f"{figures['torch'][0] * 1e3:.0f} ms. Profiled (cProfile, which slows Python): own "
        "time per step, mean of the 2 ranks, ms:",
        "",
        "| where | conveyor | torch.distributed.pipelining |",
        "|---|---|---|",
    ]
    for index, name in enumerate(BUCKETS):
        ours, theirs = figures["conveyor"][1][index], figures["torch"][1][index]
        lines.append(f"| {name} | {ours * 1e3:.1f} | {theirs * 1e3:.1f} |")
    ours_total, theirs_total = sum(figures["conveyor"][1]), sum(figures["torch"][1])
    lines.append(f"| total | {ours_total * 1e3:.1f} | {theirs_total * 1e3:.1f} |")
    timeline = Path(f"{outs['conveyor'][0]}.{label}.timeline.json")
    if timeline.exists():
        kinds = timeline_breakdown(timeline)
        lines += [
            "",
            "conveyor's Timeline over the same steps (ms per step, mean of the 2 ranks): "
            + ", ".join(
                f"{k} {v * 1e3:.1f}" for k, v in sorted(kinds.items(), key=lambda i: -i[1])
            ),
        ]
    return "\n".join(lines)


def header(args: argparse.Namespace, loads: list[float], seconds: float) -> str:
    return "\n".join(
        [
            "## Breakdown: where a step goes, conveyor vs torch.distributed.pipelining",
            "",
            f"Command: `python benchmarks/bench_breakdown.py` ({seconds / 60:.1f} min); load "
            f"average {min(loads):.1f} to {max(loads):.1f}"
            + (" (CPU shared with other work)" if shared(loads) else "")
            + f". Same model and batch as the schedules table; each system in its own "
            f"processes, {args.steps} profiled steps after the timed ones. Buckets: each "
            "function's own time (cProfile tottime) by where its code lives.",
            "",
            "",
        ]
    )


if __name__ == "__main__":
    main()
