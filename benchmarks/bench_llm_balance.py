"""A large-vocabulary LLM split by measured cost: conveyor's cost-balanced split against its even
split, and torch.distributed.pipelining on the even split and on the best split by hand.

    python benchmarks/bench_llm_balance.py              # 1f1b and zb-v, m = 8, 5 rounds
    python benchmarks/bench_llm_balance.py --quick      # one short round, docs left alone
    python benchmarks/bench_llm_balance.py --vocab 131072 --schedules 1f1b   # a 128k vocabulary
    python benchmarks/bench_llm_balance.py --ranks 4 --schedules 1f1b        # 4 ranks
    python benchmarks/bench_llm_balance.py --vocab 131072 --head-chunks 8     # + its head in 8

The model is conveyor's benchmark GPT (benchmarks/ootb.py) with a Llama-sized vocabulary
(32,768 tokens unless --vocab): embedding, 8 blocks of width 256, head; its head and loss cost
many blocks.
Before the rounds, ``conveyor.split.balance.balance_by_cost`` measures its layers in this
process (one thread, freed host memory kept, as a conveyor rank runs) and chooses the
balance per schedule, as a Pipeline given the number of stages and ``example_inputs`` does by
itself (here with the loss timed too); that balance is passed as ``balance=`` so that every
round runs the same split. Each system then runs in fresh processes of its own (2 gloo ranks
unless --ranks, 1 thread each; torch's never import conveyor), the four rows alternating round
by round. With ``--head-chunks K`` a fifth row runs the same GPT as a
``conveyor.models.ChunkedGPT``: its head and loss in K vocabulary chunks that a stage may
start inside, cut by ``split_points_by_cost`` in the same way. Results go to the
`llm-balance` section of docs/benchmarks.md (other vocabularies
and rank counts to a section named after them).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ootb import (
    RANKS,
    SCHEDULES,
    Spec,
    batch,
    chunked_model,
    gpt_module,
    load_average,
    medians,
    model,
    placement,
    run_round,
    shared,
)
from report import bootstrap_interval, publishable, write_section

VOCAB = 32768
HAND = {"1f1b": [9, 1]}
"""The best split by hand on 2 ranks, measured from outside: the embedding and 8 blocks, then
the head alone; other schedules and rank counts take the cost-balanced split by hand."""
ROWS = ("conveyor cost-balanced", "conveyor even", "torch even", "torch by hand")
CHUNKED = "conveyor head in chunks"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="1f1b,zb-v")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=VOCAB, help="tokens in the vocabulary")
    parser.add_argument("--ranks", type=int, default=RANKS, help="pipeline ranks (processes)")
    parser.add_argument(
        "--head-chunks", type=int, default=0, help="add a row with the head in K vocabulary chunks"
    )
    parser.add_argument("--quick", action="store_true", help="1 round of 2 steps, no writing")
    parser.add_argument("--section", help="docs section (default: named after the run)")
    parser.add_argument("--no-write", action="store_true", help="print, leave the docs alone")
    parser.add_argument(
        "--force", action="store_true", help="publish even if other work shared the machine"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.no_write = 1, 2, 1, True
    if args.section is None:
        default = args.vocab == VOCAB and args.ranks == RANKS
        args.section = "llm-balance" + ("" if default else f"-v{args.vocab}-r{args.ranks}")
        args.section += f"-chunks{args.head_chunks}" if args.head_chunks else ""
    return args


def hand_split(schedule: str, ranks: int, cost_balanced: list[int]) -> list[int]:
    """The split by hand: HAND's on 2 ranks, else the cost-balanced one."""
    return HAND[schedule] if ranks == RANKS and schedule in HAND else cost_balanced


def choose(schedules: list[str], args: argparse.Namespace) -> tuple[dict[str, Any], float]:
    """The cost-balanced split of each schedule (and of the chunked head's, under CHUNKED),
    chosen in this process as a rank would; and the seconds the measurement took."""
    from conveyor.hf.loss import model_loss
    from conveyor.runtime.host_memory import keep_freed_memory
    from conveyor.split.balance import balance_by_cost, split_points_by_cost

    torch.set_num_threads(1)
    keep_freed_memory()  # as a conveyor rank runs by default
    spec = Spec("conveyor", [], vocab=args.vocab, ranks=args.ranks, head_chunks=args.head_chunks)
    gpt = gpt_module()
    x, y = batch(spec)
    net = model(spec, gpt)
    began = time.perf_counter()
    choices: dict[str, Any] = {}
    for schedule in schedules:
        ranks = placement(schedule, args.ranks)
        options = {"num_microbatches": args.microbatches, "placement": ranks}
        choices[schedule] = balance_by_cost(
            net, len(ranks), x, loss_fn=gpt.gpt_loss, targets=y, **options
        )
        print(f"{schedule}: {choices[schedule]}", flush=True)
        if args.head_chunks:
            choices[f"{schedule}, {CHUNKED}"] = chosen = split_points_by_cost(
                chunked_model(spec), len(ranks), {"input_ids": x, "labels": y},
                loss_fn=model_loss, **options,
            )  # fmt: skip
            print(f"{schedule}, {CHUNKED}: {chosen}", flush=True)
    return choices, time.perf_counter() - began


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    command = shlex.join(["python", "benchmarks/bench_llm_balance.py", *(argv or sys.argv[1:])])
    schedules = args.schedules.split(",")
    unknown = sorted(set(schedules) - set(SCHEDULES))
    if unknown:
        raise SystemExit(f"unknown schedules {unknown}; expected some of {sorted(SCHEDULES)}")
    from conveyor.split import even_balance

    started, loads = time.perf_counter(), [load_average()]
    print(f"load average before: {loads[0]:.2f}", flush=True)
    choices, profile_s = choose(schedules, args)
    layers = Spec("", []).layers + 2
    splits = {
        "conveyor cost-balanced": {s: list(choices[s].balance) for s in schedules},
        "conveyor even": {
            s: even_balance(layers, len(placement(s, args.ranks))) for s in schedules
        },
    }
    splits["torch even"] = splits["conveyor even"]
    splits["torch by hand"] = {
        s: hand_split(s, args.ranks, list(choices[s].balance)) for s in schedules
    }
    rows = ROWS + ((CHUNKED,) if args.head_chunks else ())
    points = {
        s: list(choices[f"{s}, {CHUNKED}"].split_points) for s in schedules if args.head_chunks
    }
    splits[CHUNKED] = points  # where its stages start: vocabulary chunks have no layer count
    configs = [(s, args.microbatches) for s in schedules]
    rounds: dict[str, list[dict[str, Any]]] = {row: [] for row in rows}
    for index in range(args.rounds):
        order = rows[index % len(rows) :] + rows[: index % len(rows)]
        for row in order:  # alternate, so drift in the machine hits every row
            system = row.split()[0]
            chunks = args.head_chunks if row == CHUNKED else 0
            spec = Spec(
                system, configs, vocab=args.vocab, warmup=args.warmup, steps=args.steps,
                balances=splits[row], ranks=args.ranks, head_chunks=chunks, split_points=points,
            )  # fmt: skip
            result = run_round(spec)
            if "error" in result:
                raise SystemExit(f"{row} failed: {result['error']}")
            if system == "torch":
                assert not result["conveyor_imported"], "the peer's processes imported conveyor"
            rounds[row].append(result)
            loads.append(load_average())
            print(f"round {index} {row}: load {loads[-1]:.1f}", flush=True)
    loads.append(load_average())
    print(f"load average after: {loads[-1]:.2f}", flush=True)
    seconds = time.perf_counter() - started
    text = render(args, command, configs, splits, choices, profile_s, rounds, loads, seconds)
    print(text)
    if not args.no_write and publishable(loads, args.force, own=args.ranks + 0.5):
        write_section(args.section, text)


def render(
    args: argparse.Namespace,
    command: str,
    configs: list[tuple[str, int]],
    splits: dict[str, dict[str, list[Any]]],
    choices: dict[str, Any],
    profile_s: float,
    rounds: dict[str, list[dict[str, Any]]],
    loads: list[float],
    seconds: float,
) -> str:
    spec = Spec("", [], vocab=args.vocab, ranks=args.ranks)
    load_note = (
        f" — the CPU was shared with other work (load above the benchmark's {args.ranks} "
        "ranks), so step times are noisier and slower than on an idle machine; ratios come "
        "from alternating rounds."
        if shared(loads, args.ranks)
        else "."
    )
    cores = os.cpu_count() or 1
    oversubscribed = (
        f" **{args.ranks} ranks share {cores} cores**: each rank gets part of a core, so a "
        "stage's time includes waiting for the CPU and the balance matters less than on one "
        "device per rank."
        if args.ranks > cores
        else ""
    )
    lines = [
        "## A large-vocabulary LLM: the split by measured cost, conveyor and "
        "torch.distributed.pipelining",
        "",
        f"Command: `{command}` ({seconds / 60:.1f} min) on {platform.machine()}, "
        f"{os.cpu_count()} CPU cores, torch {torch.__version__}. Load average (1 min) during "
        f"the run: {min(loads):.1f} to {max(loads):.1f}{load_note}",
        "",
        f"GPT: embedding, {spec.layers} blocks (d_model {spec.dim}, {spec.heads} heads), head; "
        f"sequence {spec.seq_len}, vocabulary {args.vocab}, no dropout; batch {spec.batch}; "
        f"SGD. {args.ranks} gloo ranks of 1 thread each, one stage per rank for 1f1b, two (V) "
        f"for zb-v.{oversubscribed} "
        "Cost-balanced: `conveyor.split.balance.balance_by_cost` on one micro-batch, in one "
        f"process before the rounds ({profile_s:.1f} s for every schedule), passed as "
        "`balance=`; even: `balance='even'` (what conveyor picks without example inputs); by hand: "
        f"{HAND if args.ranks == RANKS else {}} (other schedules and rank counts: the "
        "cost-balanced split). Each row in fresh processes, "
        f"alternating, {len(rounds[ROWS[0]])} rounds of {args.steps} steps after "
        f"{args.warmup} warm-up; step = slowest rank's zero_grad + step + optimizer.step "
        "between barriers; figures are medians over rounds of each round's median.",
        "",
        *(f"- {schedule}: {choice}" for schedule, choice in choices.items()),
        "",
        "| schedule | m | row | layers per stage (head in chunks: where stages 1.. start) "
        "| ms per step | speed-up of conveyor "
        "cost-balanced = row ms / its ms [95% bootstrap interval of the median] (per round) "
        "| first loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for schedule, m in configs:
        key = f"{schedule}/{m}"
        ours = medians(rounds[ROWS[0]], key)
        for row in rounds:
            times = medians(rounds[row], key)
            ratios = [t / o for o, t in zip(ours, times, strict=False)]
            low, high = bootstrap_interval(ratios) if ratios else (float("nan"),) * 2
            per_round = ", ".join(f"{r:.2f}" for r in ratios)
            speedup = (
                "-"
                if row == ROWS[0] or not ratios
                else f"**{statistics.median(times) / statistics.median(ours):.2f}** "
                f"[{low:.2f}, {high:.2f}] ({per_round})"
            )
            found = [r["results"][key]["loss"] for r in rounds[row]]
            loss = f"{found[0]:.4f}" if found and found[0] is not None else "-"
            ms = f"{statistics.median(times) * 1e3:.0f}" if times else "-"
            lines.append(
                f"| {schedule} | {m} | {row} | {splits[row][schedule]} | {ms} | {speedup} | "
                f"{loss} |"
            )
    crashes = {
        row: sum(r.get("teardown_crashes", 0) for r in found) for row, found in rounds.items()
    }
    if any(crashes.values()):
        lines.append("")
        lines.append(
            "Processes that exited non-zero after their last step and their report (figures "
            f"complete): {', '.join(f'{row} {n}' for row, n in crashes.items() if n)}."
        )
    if CHUNKED in rounds:
        lines.append("")
        lines += [f"- {schedule}: {versus(rounds, f'{schedule}/{m}')}" for schedule, m in configs]
    return "\n".join(lines) + "\n"


def versus(rounds: dict[str, list[dict[str, Any]]], key: str) -> str:
    """The chunked head's speed-up over conveyor's even split and cost-balanced split."""
    chunked = medians(rounds[CHUNKED], key)
    found = []
    for row in ("conveyor even", ROWS[0]):
        ratios = [t / c for c, t in zip(chunked, medians(rounds[row], key), strict=False)]
        low, high = bootstrap_interval(ratios)
        ratio = statistics.median(medians(rounds[row], key)) / statistics.median(chunked)
        found.append(f"**{ratio:.2f}x** [{low:.2f}, {high:.2f}] over {row}")
    return f"{CHUNKED}: " + ", ".join(found)


if __name__ == "__main__":
    main()
