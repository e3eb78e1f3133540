"""Every schedule, conveyor vs torch.distributed.pipelining, each out of the box.

    python benchmarks/bench_schedules.py   # gpipe, 1f1b, interleaved-1f1b, zb-v, dualpipev; m 8, 4
    python benchmarks/bench_schedules.py --rounds 1 --steps 3 --no-write    # a quick look
    python benchmarks/bench_schedules.py --plan plan.json     # that plan as the planned row

Each system runs in fresh processes of its own (benchmarks/ootb.py: 2 gloo ranks, 1 thread
each; torch's processes never import conveyor), the systems alternating round by round, each
round running every (schedule, micro-batches) configuration: the same GPT, batch, loss and SGD
step. A step is the slowest rank's zero_grad + step + optimizer.step between barriers; a
round's figure is the median of its steps, the table's the median over rounds. conveyor runs
twice, with its defaults and with ``keep_host_memory=False``, which measures that setting
alone. Plain training (one process, 1 thread, the batch in the same micro-batches) gives the
ideal pipeline throughput. Before the rounds, ``conveyor plan`` chooses a configuration for
the batch (schedule, micro-batches, split); conveyor runs it as one more row. Results go to
the `schedules` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ootb import (
    PLANNED,
    RANKS,
    ROOT,
    SCHEDULES,
    SYSTEMS,
    Spec,
    load_average,
    medians,
    run_round,
    shared,
)
from report import bootstrap_interval, publishable, write_section

PEER_NAMES = {name: cls for name, (_, _, cls) in SCHEDULES.items()}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--microbatches", default="8,4")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--section", default="schedules")
    parser.add_argument("--no-write", action="store_true", help="print, leave the docs alone")
    parser.add_argument(
        "--force", action="store_true", help="publish even if other work shared the machine"
    )
    parser.add_argument("--save", help="write the raw results here (JSON) after every run")
    parser.add_argument("--render", help="report the results --save wrote instead of running")
    parser.add_argument("--plan", help="run this plan file as the planned row (default: plan now)")
    parser.add_argument("--no-plan", action="store_true", help="leave out the planned row")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    command = shlex.join(["python", "benchmarks/bench_schedules.py", *(argv or sys.argv[1:])])
    counts = [int(m) for m in args.microbatches.split(",")]
    configs = [(s, m) for m in counts for s in args.schedules.split(",")]
    systems = args.systems.split(",")
    started, loads = time.perf_counter(), [load_average()]
    print(f"load average before: {loads[0]:.2f}", flush=True)
    rounds: dict[str, list[dict[str, Any]]] = {s: [] for s in [*systems, "plain"]}
    plan = None if args.no_plan or args.render else json.loads(make_plan(args.plan).read_text())
    if args.render:  # a saved run (--save), perhaps cut short: its finished rounds
        saved = json.loads(Path(args.render).read_text())
        rounds, loads, args.rounds, plan = saved["rounds"], saved["loads"], 0, saved["plan"]
        command = saved.get("command", command)
        started -= saved["seconds"]
    planned = [] if plan is None else [(PLANNED, plan["pipeline"]["num_microbatches"])]
    if plan is not None:  # every system also runs the plan's (schedule, m), split evenly
        chosen = (plan["pipeline"]["schedule"], plan["pipeline"]["num_microbatches"])
        if chosen[0] in SCHEDULES and chosen not in configs:
            configs.append(chosen)
    plain = [("plain", m) for m in sorted({*counts, *(m for _, m in planned)}, reverse=True)]
    plan_file = "" if plan is None else str(write_plan(plan))
    for index in range(args.rounds):
        order = systems[index % len(systems) :] + systems[: index % len(systems)]
        for system in [*order, "plain"]:  # alternate, so drift in the machine hits all
            todo = {"plain": plain, "conveyor": configs + planned}.get(system, configs)
            spec = Spec(system, todo, warmup=args.warmup, steps=args.steps, plan=plan_file)
            result = run_round(spec)
            if "error" in result:
                raise SystemExit(f"{system} failed: {result['error']}")
            if system != "plain" and not system.startswith("conveyor"):
                assert not result["conveyor_imported"], "the peer's processes imported conveyor"
            rounds[system].append(result)
            loads.append(load_average())
            print(f"round {index} {system}: load {loads[-1]:.1f}", flush=True)
            if args.save:  # every finished run, so a long run cut short still has its figures
                elapsed = time.perf_counter() - started
                raw = {
                    "rounds": rounds, "loads": loads, "seconds": elapsed, "plan": plan,
                    "command": command,
                }  # fmt: skip
                Path(args.save).write_text(json.dumps(raw))
    loads.append(load_average())
    print(f"load average after: {loads[-1]:.2f}", flush=True)
    text = render(args, command, configs, rounds, loads, time.perf_counter() - started, plan)
    print(text)
    if not args.no_write and publishable(loads, args.force):
        write_section(args.section, text)


def render(
    args: argparse.Namespace,
    command: str,
    configs: list[tuple[str, int]],
    rounds: dict[str, list[dict[str, Any]]],
    loads: list[float],
    seconds: float,
    plan: dict[str, Any] | None,
) -> str:
    batch = Spec("", []).batch
    lines = [
        "## Schedules: conveyor vs torch.distributed.pipelining, each out of the box",
        "",
        f"Command: `{command}` "
        f"({seconds / 60:.1f} min) on "
        f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}. "
        f"Load average (1 min) during the run: {min(loads):.1f} to {max(loads):.1f}"
        + (
            f" — the CPU was shared with other work (load above the benchmark's {RANKS} "
            "ranks), so step times are "
            "noisier and slower than on an idle machine; ratios come from alternating rounds."
            if shared(loads)
            else "."
        ),
        "",
        f"GPT: embedding, 8 blocks (d_model 256, 4 heads), head; sequence 128, vocabulary "
        f"2048, no dropout; batch {batch}; SGD. {RANKS} gloo ranks of 1 thread each; 2 stages "
        "(1 per rank) for gpipe and 1f1b, 4 (2 per rank, loop placement for interleaved-1f1b, "
        "V for zb-v and dualpipev), layers spread evenly. Each system in its own fresh processes "
        "(torch's never import conveyor), alternating, "
        f"{len(rounds['plain'])} rounds of {args.steps} steps after {args.warmup} warm-up; step = "
        "slowest rank's zero_grad + step + optimizer.step between barriers; figures are "
        "medians over rounds of each round's median. Ideal = 2 x plain 1-thread throughput "
        "on the same micro-batches x m / (m + 1). Losses: first step, conveyor vs torch.",
        "",
        "| schedule | m | conveyor ms | torch ms (class) | conveyor speed-up = torch ms / "
        "conveyor ms [95% bootstrap interval of the median] (per round) | conveyor % of "
        "ideal | keep_host_memory=False ms | "
        "keep_host_memory speed-up = off ms / on ms | first loss conveyor / torch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for schedule, m in configs:
        lines.append(row(schedule, m, rounds, batch))
    lines += planned_lines(plan, configs, rounds)
    usage = [usage_row(schedule, m, rounds) for schedule, m in configs]
    if any(usage):
        lines += [
            "",
            "CPU seconds and page faults per step and rank (median over rounds, mean of the "
            "ranks): unlike wall time they hardly depend on the machine's load.",
            "",
            "| schedule | m | conveyor CPU ms / faults | keep_host_memory=False | torch |",
            "|---|---|---|---|---|",
            *filter(None, usage),
        ]
    crashes = {s: sum(r.get("teardown_crashes", 0) for r in rs) for s, rs in rounds.items()}
    if any(crashes.values()):
        lines += [
            "",
            "Processes that crashed after their last step and report (at exit; the figures "
            "of their rounds are complete): "
            + ", ".join(f"{system} {n}" for system, n in crashes.items() if n)
            + ".",
        ]
    return "\n".join(lines) + "\n"


def make_plan(given: str | None) -> Path:
    """The plan file to run: ``given``, or the one ``conveyor plan`` writes now for the
    benchmark's GPT and batch, in processes of its own, as a user would plan it."""
    if given:
        return Path(given)
    out = Path(tempfile.mkdtemp(), "plan.json")
    paths = [str(ROOT / "src"), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")]
    command = [*PLAN_COMMAND, "--out", str(out)]
    print("planning:", " ".join(command), flush=True)
    subprocess.run(
        [sys.executable, "-m", "conveyor.cli", *command[1:]],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
        check=True,
    )
    return out


def write_plan(plan: dict[str, Any]) -> Path:
    """``plan`` as a file the ranks read (a saved run's plan, or the one just made)."""
    path = Path(tempfile.mkdtemp(), "plan.json")
    path.write_text(json.dumps(plan))
    return path


PLAN_COMMAND = [
    "conveyor", "plan", "--model", "ootb:workload", "--ranks", str(RANKS), "--memory", "4GiB",
    "--batch-size", str(Spec("", []).batch),
]  # fmt: skip


def planned_lines(
    plan: dict[str, Any] | None,
    configs: list[tuple[str, int]],
    rounds: dict[str, list[dict[str, Any]]],
) -> list[str]:
    """The row of the configuration ``conveyor plan`` chose for this batch, against the
    fastest like-for-like configuration of each system (item 4 of issue 16)."""
    if plan is None:
        return []
    chosen, m = plan["pipeline"], plan["pipeline"]["num_microbatches"]
    ours = medians(rounds.get("conveyor", []), f"{PLANNED}/{m}")
    if not ours:
        return []

    def fastest(system: str) -> tuple[float, str]:
        found = [
            (statistics.median(times), f"{s}, m = {k}")
            for s, k in configs
            if (times := medians(rounds.get(system, []), f"{s}/{k}"))
        ]
        return min(found) if found else (float("nan"), "-")

    measured, predicted = statistics.median(ours), plan["prediction"]["step_time_s"]
    (theirs, their_config), (like, our_config) = fastest("torch"), fastest("conveyor")
    same = medians(rounds.get("torch", []), f"{chosen['schedule']}/{m}")
    torch_same = f"{statistics.median(same) * 1e3:.0f}" if same else "-"
    plain = medians(rounds["plain"], f"plain/{m}")
    ideal = statistics.median(plain) / RANKS * (m + RANKS - 1) / m if plain else float("nan")
    split = ", ".join(f"{k}={v}" for k, v in chosen.items() if k != "schedule")
    return [
        "",
        f"Planned: `{' '.join(PLAN_COMMAND)}` (in processes of its own, before the rounds) "
        "chose the configuration below for this batch; conveyor runs it in every one of its "
        "rounds, next to the like-for-like configurations above. Ideal as above, at the "
        "plan's m.",
        "",
        "| plan | predicted ms | conveyor ms | predicted / measured | conveyor's fastest "
        "above | torch's fastest above | speed-up over torch's fastest | torch ms at the "
        "plan's schedule and m (split evenly) | % of ideal |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {chosen['schedule']} ({split}) | {predicted * 1e3:.0f} | {measured * 1e3:.0f} | "
        f"{predicted / measured:.2f} | {like * 1e3:.0f} ({our_config}) | {theirs * 1e3:.0f} "
        f"({their_config}) | **{theirs / measured:.2f}** | {torch_same} | "
        f"{ideal / measured:.0%} |",
    ]


def usage_row(schedule: str, m: int, rounds: dict[str, list[dict[str, Any]]]) -> str:
    key, cells = f"{schedule}/{m}", []
    for system in SYSTEMS:
        found = [r["results"][key] for r in rounds.get(system, []) if "cpu_s" in r["results"][key]]
        if not found:
            cells.append("-")
            continue
        cpu = statistics.median(statistics.mean(r["cpu_s"]) for r in found)
        faults = statistics.median(statistics.mean(r["faults"]) for r in found)
        cells.append(f"{cpu * 1e3:.0f} / {faults:,.0f}")
    return f"| {schedule} | {m} | {' | '.join(cells)} |" if cells.count("-") < 3 else ""


def row(schedule: str, m: int, rounds: dict[str, list[dict[str, Any]]], batch: int) -> str:
    key = f"{schedule}/{m}"
    ours = medians(rounds.get("conveyor", []), key)
    theirs = medians(rounds.get("torch", []), key)
    off = medians(rounds.get("conveyor-keep-off", []), key)
    plain = medians(rounds["plain"], f"plain/{m}")

    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e3:.0f}" if values else "-"

    def ratio(a: list[float], b: list[float]) -> str:
        return f"{statistics.median(a) / statistics.median(b):.2f}" if a and b else "-"

    ratios = [t / o for o, t in zip(ours, theirs, strict=False)]
    per_round = ", ".join(f"{r:.2f}" for r in ratios)
    low, high = bootstrap_interval(ratios) if ratios else (float("nan"), float("nan"))
    ideal = statistics.median(plain) / RANKS * (m + RANKS - 1) / m if plain else None
    share = f"{ideal / statistics.median(ours):.0%}" if ideal and ours else "-"

    def loss(system: str) -> str:
        found = [r["results"][key]["loss"] for r in rounds.get(system, [])]
        return f"{found[0]:.4f}" if found and found[0] is not None else "-"

    return (
        f"| {schedule} | {m} | {ms(ours)} | {ms(theirs)} ({PEER_NAMES[schedule]}) | "
        f"**{ratio(theirs, ours)}** [{low:.2f}, {high:.2f}] ({per_round}) | {share} | "
        f"{ms(off)} | {ratio(off, ours)} | "
        f"{loss('conveyor')} / {loss('torch')} |"
    )


if __name__ == "__main__":
    main()
