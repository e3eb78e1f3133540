"""How accurate is the simulator? Predicted vs measured step time and peak activation memory
on 2 gloo ranks, for every schedule and three models (a GPT, an unbalanced MLP, a two-tower
graph model).

    python benchmarks/bench_accuracy.py             # writes the 'accuracy' section of docs
    python benchmarks/bench_accuracy.py --rounds 2  # quicker, noisier
    python benchmarks/bench_accuracy.py --no-write --save a.json   # a rerun, to compare with

Protocol: both ranks profile the model at the same time (so each core is as busy as in the
run), the profiles are averaged, and the runtime's overheads and the link are measured; then
every configuration runs, interleaved round by round, each step started after a barrier and
timed from the first rank's start to the last rank's end on the shared monotonic clock. The
measured step time is the median of all rounds, with each round's median spread beside it, and
the error is reported for the first and the second half of the rounds apart, so that a table
shows whether its own figures reproduce; with activation accounting off (the default); the peak
activation memory is the runtime meter's (``Pipeline.memory()``), in untimed steps of a
metered pipeline of the same configuration. Predictions come from
``conveyor.planner.cost.predict`` with the averaged profile, fitted to the traced 1F1B steps of
the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import DOC, publishable, write_section

from conveyor import Pipeline
from conveyor.graph import place
from conveyor.planner import (
    Profile,
    ProfileCost,
    Workload,
    fit,
    layout,
    measure_link,
    measure_overheads,
    predict,
    profile_together,
)
from conveyor.schedule import SCHEDULES, build_program, spec_of
from conveyor.split import even_balance
from conveyor.trace import write_png


@dataclass(frozen=True)
class Model:
    """A model of the benchmark: how to build it and its batches, and its stage layouts."""

    name: str
    workload: Callable[[], Workload]
    batch_size: int
    layouts: Callable[[str, int], list[tuple[list[list[int]], list[int]]]]
    """(schedule, number of units) -> [(units of each stage, rank of each stage), ...]."""


def _gpt() -> Workload:
    from conveyor.models import gpt, gpt_loss, text_batches

    torch.manual_seed(0)
    return Workload(
        "gpt",
        gpt(seq_len=64, dim=128, num_layers=6, dropout=0.0),
        lambda n: text_batches(n, 64, 1)[0],
        gpt_loss,
    )


def _unbalanced() -> Workload:
    from conveyor.models.unbalanced import mse, regression_batch, unbalanced_mlp

    torch.manual_seed(0)
    return Workload("unbalanced", unbalanced_mlp(), regression_batch, mse)


def _two_tower() -> Workload:
    from conveyor.models import classification_loss, multimodal_batches, two_tower

    torch.manual_seed(0)
    return Workload(
        "two-tower",
        two_tower(dim=128, text_layers=4, image_layers=4),
        lambda n: multimodal_batches(n, 1)[0],
        classification_loss,
    )


def _chain_layouts(schedule: str, num_units: int) -> list[tuple[list[list[int]], list[int]]]:
    """The schedule's layout on 2 ranks with the Pipeline's default even split."""
    wanted = spec_of(schedule)
    num_stages = 2 * wanted.virtual_stages
    balance = even_balance(num_units, num_stages)
    starts = [sum(balance[:i]) for i in range(num_stages)]
    units = [list(range(a, a + b)) for a, b in zip(starts, balance, strict=True)]
    return [(units, place(num_stages, 2, wanted.placement))]


def _tower_layouts(schedule: str, num_units: int) -> list[tuple[list[list[int]], list[int]]]:
    """Text | image + head on two ranks (the towers run side by side); for the graph schedules
    also text | image | head with the head beside the image tower."""
    if spec_of(schedule).virtual_stages > 1:
        return []  # 3 layers cannot make 2 stages per rank
    found = [([[0], [1, 2]], [0, 1])]
    if schedule.startswith("graph-"):
        found.append(([[0], [1], [2]], [0, 1, 1]))
    return found


MODELS = [
    Model("gpt", _gpt, 32, _chain_layouts),
    Model("unbalanced", _unbalanced, 64, _chain_layouts),
    Model("two-tower", _two_tower, 32, _tower_layouts),
]
MICROBATCHES = (4, 8)
FIT_SCHEDULE = "1f1b"
"""The schedule whose traced runs the profile is fitted to (conveyor plan's default too)."""


# -- the two ranks -----------------------------------------------------------------------------


def join_two_ranks(rank: int, store: str) -> tuple[Any, Any]:
    """Join the two-rank gloo group (one torch thread each); the runtime's measured
    overheads and link."""
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=120),
    )
    return measure_overheads(), measure_link()


PICTURE = DOC.parent / "accuracy_timeline.png"


def spawn_two_ranks(worker: Callable[..., None], rounds: int, steps: int) -> Any:
    """Run ``worker(rank, store, out, rounds, steps)`` on two local processes; return the
    JSON that rank 0 wrote to ``out``, and the PICTURE it drew beside it, if any."""
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory, "results.json")
        mp.spawn(
            worker,
            args=(str(Path(directory, "store")), str(out), rounds, steps),
            nprocs=2,
            join=True,
        )
        picture = out.with_name(PICTURE.name)
        return json.loads(out.read_text()), picture.read_bytes() if picture.exists() else None


def _worker(rank: int, store: str, out: str, rounds: int, steps: int) -> None:
    overheads, link = join_two_ranks(rank, store)
    try:
        results, profiles = [], {}
        for model in MODELS:
            found, profiles[model.name] = _measure_model(
                model, rank, rounds, steps, overheads, link
            )
            results += found
        tracing = _trace_overhead(
            rounds * steps * 4, profiles[MODELS[0].name], rank, Path(out).with_name(PICTURE.name)
        )
        if rank == 0:
            Path(out).write_text(json.dumps({"results": results, "tracing": tracing}))
    finally:
        dist.destroy_process_group()


def _measure_model(
    model: Model, rank: int, rounds: int, steps: int, overheads: Any, link: Any
) -> tuple[list[dict[str, Any]], Profile]:
    workload = model.workload()
    sizes = sorted({model.batch_size // m for m in MICROBATCHES})
    profile = profile_together(workload, sizes)
    profile = replace(profile, overheads=overheads, link=link)
    configs = []
    for name in SCHEDULES:
        for units, placement in model.layouts(name, profile.num_units):
            for m in MICROBATCHES:
                try:  # the configurations the profile is fitted to are traced
                    pipe = _pipeline(
                        model, workload, name, units, placement, m, trace=name == FIT_SCHEDULE
                    )
                except ValueError as error:  # the schedule cannot run this layout
                    if rank == 0:
                        print(f"skip {model.name} {name} {len(units)} stages: {error}", flush=True)
                    continue
                configs.append((name, units, placement, m, pipe))
    inputs, targets = workload.batch(model.batch_size)
    times = step_times([c[-1] for c in configs], inputs, targets, rounds, steps)
    fitted, fitted_on = _fitted(model, profile, configs, rounds * steps)
    results = []
    for (name, units, placement, m, _), measured in zip(configs, times, strict=True):
        peaks = _peak_memory(
            _pipeline(model, workload, name, units, placement, m, measure_memory=True),
            inputs,
            targets,
        )
        graph, stage_units = layout(profile, units, placement)
        program = build_program(name, graph, m)
        raw, prediction = (
            predict(
                program,
                graph,
                ProfileCost(chosen, graph, stage_units, model.batch_size / m, m),
                record=False,
            )
            for chosen in (profile, fitted)
        )
        results.append(
            {
                "model": model.name,
                "schedule": name,
                "stages": len(units),
                "microbatches": m,
                "measured_s": statistics.median(measured),
                "rounds_s": [
                    statistics.median(measured[i : i + steps])
                    for i in range(0, len(measured), steps)
                ],
                "predicted_s": prediction.step_time,
                "unfitted_s": raw.step_time,
                "fitted_on": fitted_on,
                "is_fit": (name, len(units), m) in fitted_on,
                "measured_peak": peaks,
                "predicted_peak": list(prediction.peak_activation),
            }
        )
        if rank == 0:
            print(
                f"{model.name:<11}{name:<17}{len(units)} stages m={m}: measured "
                f"{results[-1]['measured_s'] * 1e3:7.2f} ms, predicted "
                f"{prediction.step_time * 1e3:7.2f} ms (profile alone "
                f"{raw.step_time * 1e3:7.2f} ms)",
                flush=True,
            )
    return results, fitted


def _peak_memory(pipe: Pipeline, inputs: Any, targets: Any) -> list[int]:
    """Each rank's peak activation bytes in a step after a warm-up step, as the runtime's
    meter counts them (a pipeline of its own: the timed ones run without the meter, as
    pipelines do by default). Collective."""
    pipe.step(inputs, targets)
    pipe.reset_memory()
    pipe.step(inputs, targets)
    peaks: list[Any] = [None, None]
    dist.all_gather_object(peaks, pipe.memory().peak_bytes)
    return peaks


def step_times(
    pipes: list[Pipeline], inputs: Any, targets: Any, rounds: int, steps: int
) -> list[list[float]]:
    """Each pipeline's step times, from the first rank's start to the last rank's end, the
    pipelines taking turns round by round after a warm-up round. Collective."""
    times: list[list[float]] = [[] for _ in pipes]
    for round_index in range(rounds + 1):  # round 0 warms up
        for index, pipe in enumerate(pipes):
            for _ in range(steps if round_index else 2):
                dist.barrier()
                start = time.perf_counter()
                pipe.step(inputs, targets)
                spans: list[Any] = [None, None]
                dist.all_gather_object(spans, (start, time.perf_counter()))
                if round_index:
                    times[index].append(max(e for _, e in spans) - min(s for s, _ in spans))
    return times


def _fitted(
    model: Model, profile: Profile, configs: list[Any], num_steps: int
) -> tuple[Profile, list[tuple[str, int, int]]]:
    """The profile fitted to the traced timed steps of FIT_SCHEDULE at each micro-batch count
    (the first also fits the runtime's call costs), as
    ``conveyor.planner.calibrate.fit_to_run`` does for the planner; steps from the same
    interleaved rounds as every other configuration, so that a slower or faster spell of the
    machine cannot separate the fit from the measurements."""
    fitted, used = profile, []
    for index, count in enumerate(MICROBATCHES):
        name, units, placement, m, pipe = next(
            c for c in configs if c[0] == FIT_SCHEDULE and c[3] == count
        )
        kept = [pipe.timeline(step) for step in range(-num_steps, 0)]
        graph, stage_units = layout(fitted, units, placement)
        predicted = predict(
            build_program(name, graph, m),
            graph,
            ProfileCost(fitted, graph, stage_units, model.batch_size / m, m),
        )
        fitted = fit(
            fitted, kept, predicted.timeline, None if index == 0 else model.batch_size // m
        )
        used.append((name, len(units), m))
    return fitted, used


def _trace_overhead(steps: int, profile: Profile, rank: int, picture: Path) -> dict[str, float]:
    """Median step time of the GPT untraced, traced, and traced with memory accounting, steps
    alternating; rank 0 also draws the last traced step above its prediction
    (``picture``)."""
    model = MODELS[0]
    workload = model.workload()
    inputs, targets = workload.batch(model.batch_size)
    variants = {
        "off_s": {},
        "on_s": {"trace": True},
        "memory_s": {"trace": True, "measure_memory": True},
    }
    pipes = []
    for options in variants.values():
        torch.manual_seed(0)
        pipes.append(
            Pipeline(
                model.workload().model,
                loss_fn=workload.loss_fn,
                schedule="1f1b",
                num_microbatches=8,
                **options,
            )
        )
    times = step_times(pipes, inputs, targets, max(steps // 2, 4), 2)  # >= 8 traced steps
    kept = [pipes[1].timeline(step) for step in range(-8, 0)]
    measured = sorted(kept, key=lambda t: t.step_time)[len(kept) // 2]  # a typical step
    graph, units = layout(profile, _chain_layouts("1f1b", profile.num_units)[0][0], [0, 1])
    predicted = predict(
        build_program("1f1b", graph, 8),
        graph,
        ProfileCost(profile, graph, units, model.batch_size / 8, 8),
    ).timeline
    predicted.meta.update(measured.meta)
    if rank == 0:
        write_png(
            picture,
            measured,
            predicted,
            title="GPT, 1F1B, 8 micro-batches on 2 ranks: measured (top), predicted",
        )
    found: dict[str, float] = {
        name: statistics.median(t) for name, t in zip(variants, times, strict=True)
    }
    return found | {"steps": len(times[0])}


def _pipeline(
    model: Model,
    workload: Workload,
    schedule: str,
    units: list[list[int]],
    placement: list[int],
    m: int,
    trace: bool = False,
    measure_memory: bool = False,
) -> Pipeline:
    torch.manual_seed(0)
    fresh = model.workload().model
    options: dict[str, Any] = {
        "schedule": schedule,
        "num_microbatches": m,
        "placement": tuple(placement),
        "trace": trace,
        "measure_memory": measure_memory,
    }
    if isinstance(fresh, torch.nn.Sequential):
        options["balance"] = tuple(len(u) for u in units)
    else:
        from conveyor.planner import trace_units

        targets = [u.target for u in trace_units(fresh)[2]]
        options["stage_modules"] = tuple(",".join(targets[u] for u in stage) for stage in units)
    return Pipeline(fresh, loss_fn=workload.loss_fn, **options)


# -- report ------------------------------------------------------------------------------------


def _error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def _markdown(
    results: list[dict[str, Any]],
    tracing: dict[str, float],
    command: str,
    seconds: float,
    load: tuple[float, float],
) -> str:
    rows = [
        "| model | schedule | stages | micro-batches | measured ms | rounds' spread | "
        "predicted ms | error | error, halves | profile alone ms | error | measured peak act. "
        "KiB (rank 0 / 1) | predicted KiB | error (max) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    time_errors, memory_errors, raw_errors = [], [], []
    halves: tuple[list[float], list[float]] = ([], [])
    apart, spreads = [], []  # per row: its halves' errors apart, its round medians' spread
    for r in results:
        error = _error(r["predicted_s"], r["measured_s"])
        rounds = r["rounds_s"]
        half = len(rounds) // 2
        parts = (rounds[:half] or rounds, rounds[half:])
        split = [_error(r["predicted_s"], statistics.median(part)) for part in parts]
        for found, e in zip(halves, split, strict=True):
            found.append(abs(e))
        spread = (max(rounds) - min(rounds)) / r["measured_s"]
        apart.append(abs(split[0] - split[1]))
        spreads.append(spread)
        raw = _error(r["unfitted_s"], r["measured_s"])
        raw_errors.append(abs(raw))
        memory = [
            _error(p, m) for p, m in zip(r["predicted_peak"], r["measured_peak"], strict=True) if m
        ]
        worst = max(memory, key=abs) if memory else 0.0
        time_errors.append(abs(error))
        memory_errors += [abs(e) for e in memory]
        fitted_here = " (fitted on)" if r["is_fit"] else ""
        rows.append(
            f"| {r['model']} | {r['schedule']}{fitted_here} | {r['stages']} | "
            f"{r['microbatches']} | {r['measured_s'] * 1e3:.2f} | {min(rounds) * 1e3:.1f}-"
            f"{max(rounds) * 1e3:.1f} ({spread:.0%}) | {r['predicted_s'] * 1e3:.2f} "
            f"| {error:+.1%} | {split[0]:+.1%} / {split[1]:+.1%} | {r['unfitted_s'] * 1e3:.2f} | "
            f"{raw:+.1%} | "
            f"{' / '.join(f'{b / 1024:.0f}' for b in r['measured_peak'])} | "
            f"{' / '.join(f'{b / 1024:.0f}' for b in r['predicted_peak'])} | {worst:+.1%} |"
        )
    within = sum(e <= 0.10 for e in time_errors)
    return "\n".join(
        [
            "## Simulator accuracy (predicted vs measured)",
            "",
            f"Command: `{command}` ({seconds / 60:.1f} min). Machine: 2 CPU cores, 2 ranks on "
            "gloo, one torch thread each; load average "
            f"{load[0]:.2f} before and {load[1]:.2f} after (the benchmark's own two ranks "
            "included). Each model is profiled on both ranks at once and the two profiles "
            "averaged; runtime overheads and the link are measured on the same two ranks. The "
            "profile is then fitted (`conveyor.planner.calibrate.fit`) to the traced steps of "
            "1F1B at each micro-batch count (marked; `conveyor plan` fits to 1F1B too), taken "
            "from the same interleaved rounds as every measurement, and predicts every other "
            "configuration; the unfitted profile's predictions are shown too. Each configuration "
            "runs interleaved with the others, every step after a barrier, timed from the first "
            "rank's start to the last rank's end (median of all rounds; beside it the lowest and "
            "highest round median and their distance in percent of the median; *error, halves*: "
            "the error against the first and against the second half of the rounds alone), with "
            "activation accounting off, as pipelines run by default; peak activation memory is "
            "the runtime meter's, in untimed steps of a metered pipeline of each configuration.",
            "",
            f"**Step time: mean absolute percentage error {statistics.mean(time_errors):.1%}, "
            f"{within} of {len(time_errors)} configurations within 10% (worst "
            f"{max(time_errors):.1%}); with the profile alone, unfitted, MAPE "
            f"{statistics.mean(raw_errors):.1%}. The first and the second half of the rounds "
            f"alone: MAPE {statistics.mean(halves[0]):.1%} and {statistics.mean(halves[1]):.1%}, "
            f"{sum(e <= 0.10 for e in halves[0])} and {sum(e <= 0.10 for e in halves[1])} "
            f"within 10%. Peak activation memory: MAPE "
            f"{statistics.mean(memory_errors):.2%} over every rank (worst "
            f"{max(memory_errors):.2%}).**",
            "",
            f"Read with the spread: a row's round medians lie {statistics.median(spreads):.0%} "
            f"apart (median over rows; up to {max(spreads):.0%}), and its errors against the two "
            f"halves of the rounds {statistics.median(apart):.1%} apart (median; up to "
            f"{max(apart):.1%}). A row's error smaller than that is the measurement's, not the "
            "model's; compare runs by the mean error over all rows.",
            "",
            *rows,
            "",
            f"Tracing cost: the GPT above (1F1B, 8 micro-batches) with `trace=True` took "
            f"{tracing['on_s'] * 1e3:.2f} ms per step against {tracing['off_s'] * 1e3:.2f} ms "
            f"without, {tracing['on_s'] / tracing['off_s'] - 1:+.1%} (medians of "
            f"{tracing['steps']:.0f} steps each, in alternating pairs); with memory accounting "
            f"(`measure_memory=True`) too, {tracing['memory_s'] * 1e3:.2f} ms, "
            f"{tracing['memory_s'] / tracing['off_s'] - 1:+.1%}. With tracing off the runtime only "
            "checks that no recorder is set.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds (default 8)")
    parser.add_argument("--steps", type=int, default=4, help="steps per round (default 4)")
    parser.add_argument("--no-write", action="store_true", help="print, don't update docs")
    parser.add_argument("--force", action="store_true", help="publish even on a busy machine")
    parser.add_argument("--save", type=Path, help="also write the raw results here (JSON)")
    args = parser.parse_args()
    started, load = time.perf_counter(), os.getloadavg()[0]
    data, picture = spawn_two_ranks(_worker, args.rounds, args.steps)
    command = (
        "python benchmarks/bench_accuracy.py"
        + (f" --rounds {args.rounds}" if args.rounds != 8 else "")
        + (f" --steps {args.steps}" if args.steps != 4 else "")
    )
    markdown = _markdown(
        data["results"],
        data["tracing"],
        command,
        time.perf_counter() - started,
        (load, os.getloadavg()[0]),
    )
    print(markdown)
    if args.save is not None:
        args.save.write_text(json.dumps(data))
    loads = [load, os.getloadavg()[0]]
    if not args.no_write and publishable(loads, args.force):
        write_section("accuracy", markdown)
        if picture is not None:  # temporary name, then rename: never half-written
            PICTURE.with_suffix(".tmp").write_bytes(picture)
            PICTURE.with_suffix(".tmp").replace(PICTURE)


if __name__ == "__main__":
    main()
