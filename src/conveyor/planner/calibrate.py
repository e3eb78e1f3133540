"""Fit a Profile to the machine: runtime overheads and the link between ranks (measured on
two ranks), and the ratios a traced step shows between measured and predicted actions.

    overheads, link = measure_overheads(), measure_link()   # inside a two-rank process group
    profile.overheads, profile.link = overheads, link       # (conveyor.planner.local: ranks here)
    profile = fit(profile, pipe.timeline(), prediction.timeline)   # one traced configuration
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from conveyor.config import PipelineConfig
from conveyor.parallel.context_parallel import exchange
from conveyor.parallel.shared_exchange import SharedExchange
from conveyor.pipeline import Pipeline
from conveyor.planner.budget import passed
from conveyor.planner.cost import ProfileCost, layout, predict
from conveyor.planner.profile import Link, Overheads, Profile, Workload, profile_model
from conveyor.planner.search import plan
from conveyor.program import Action
from conveyor.runtime.comm import P2P, Meta
from conveyor.schedule import SCHEDULES
from conveyor.trace import Event, Timeline

__all__ = [
    "busy_warning",
    "fit",
    "fit_to_run",
    "measure_allreduce",
    "measure_between_work",
    "measure_link",
    "measure_overheads",
    "profile_together",
    "ranks_in_time",
]

logger = logging.getLogger(__name__)


def measure_overheads(
    group: dist.ProcessGroup | None = None, steps: int = 30, num_microbatches: int = 8
) -> Overheads:
    """Per-action runtime costs, from a traced pipeline of two tiny stages on ranks 0 and 1.

    Collective over ``group`` (exactly two ranks). The tiny stages' own compute, measured
    the way ``profile_model`` measures units, is subtracted, so what remains is what the
    runtime adds to any stage.
    """
    _need_two(group)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    workload = Workload(
        "tiny",
        model,
        lambda n: (torch.randn(n, 4), torch.randn(n, 4)),
        lambda out, target: ((out - target) ** 2).mean(),
    )
    units = profile_model(workload, [1], threads=None, min_time_s=0.005)
    pipe = Pipeline(
        model,
        loss_fn=workload.loss_fn,
        group=group,
        balance=(1, 1),
        num_microbatches=num_microbatches,
        schedule="gpipe",
        trace=True,
    )
    inputs, targets = workload.batch(num_microbatches)
    step_times = []
    for _ in range(steps):
        dist.barrier(group)
        start = time.perf_counter()
        pipe.step(inputs, targets)
        step_times.append(time.perf_counter() - start)
    rank = dist.get_rank(group)
    unit = units.stats[1][rank]
    loss_forward, loss_backward = units.loss[1] if rank == 1 else (0.0, 0.0)
    recorder = pipe.recorder
    assert recorder is not None
    events = [e for _, step in recorder.steps[steps // 3 :] for e in step]
    run_spans = [
        max(e.end for e in s) - min(e.start for e in s) for _, s in recorder.steps[steps // 3 :]
    ]

    def median(kind: str, minus: float = 0.0) -> float:
        values = [e.duration for e in events if e.kind == kind]
        return max(0.0, statistics.median(values) - minus) if values else 0.0

    waits = [e.duration for e in events if e.kind == "wait" and e.waited_for]
    local = [
        median("forward", unit.forward + loss_forward),
        median("backward", unit.backward + loss_backward),
        median("send"),
        median("recv"),
        min(waits) if waits else 0.0,
        max(0.0, statistics.median(step_times[steps // 3 :]) - statistics.median(run_spans)),
    ]
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, local, group=group)
    # F and B: both ranks run them (rank 1 with the loss); sends on rank 0, receives on both
    averaged = [statistics.mean(values) for values in zip(*gathered, strict=True)]
    send = gathered[0][2]
    return Overheads(averaged[0], averaged[1], send, averaged[3], averaged[4], averaged[5])


def measure_link(
    group: dist.ProcessGroup | None = None,
    sizes: Sequence[int] = (1 << 10, 1 << 22, 1 << 16, 1 << 20),
    repeats: int = 20,
    deadline: float | None = None,
) -> Link:
    """Latency and bandwidth between ranks 0 and 1, from ping-pongs through ``P2P``.

    Collective over ``group`` (exactly two ranks); a least-squares line through the one-way
    times (half a round trip) of each message size. Past ``deadline`` (``time.monotonic``)
    the sizes after the first two are left out.
    """
    _need_two(group)
    rank = dist.get_rank(group)
    p2p = P2P(group, torch.device("cpu"), timedelta(seconds=60))
    peer = 1 - rank
    points: list[tuple[int, float]] = []

    calls: list[tuple[int, float, float]] = []
    for index, size in enumerate(sizes):
        if index >= 2 and not ranks_in_time(deadline, group):
            break
        message = torch.zeros(size, dtype=torch.uint8)
        meta = Meta.of(message)
        samples, sending, posting = [], [], []
        for repeat in range(repeats + 2):
            start = time.perf_counter()
            if rank == 0:
                p2p.send(message, peer, "ping")
                sent = time.perf_counter()
                receive = p2p.post(peer, meta, "pong")
                posted = time.perf_counter()
                p2p.wait(receive)
            else:
                receive = p2p.post(peer, meta, "ping")
                posted = time.perf_counter()
                p2p.wait(receive)
                collected = time.perf_counter()
                p2p.send(message, peer, "pong")
                sent = time.perf_counter()
            p2p.wait_sends()
            if repeat >= 2:
                samples.append((time.perf_counter() - start) / 2)
                if rank == 0:
                    sending.append(sent - start)
                    posting.append(posted - sent)
                else:
                    sending.append(sent - collected)
                    posting.append(posted - start)
        points.append((size, statistics.median(samples)))
        calls.append((size, statistics.median(sending), statistics.median(posting)))
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, (points, calls), group=group)
    (points, calls), _ = gathered
    xs = [float(s) for s, _ in points]
    send_slope, _ = _fit(xs, [t for _, t, _ in calls])
    recv_slope, _ = _fit(xs, [t for _, _, t in calls])
    # a message is there one-way time after the send started; the simulator counts transfer
    # from the send call's end, so the call's own time comes off
    one_way = [t - sending for (_, t), (_, sending, _) in zip(points, calls, strict=True)]
    slope, intercept = _fit(xs, one_way)
    return Link(
        max(intercept, 1e-7), 1.0 / max(slope, 1e-13), max(send_slope, 0.0), max(recv_slope, 0.0)
    )


def measure_allreduce(
    group: dist.ProcessGroup | None = None,
    sizes: Sequence[int] = (1 << 18, 1 << 22, 1 << 20, 1 << 24),
    repeats: int = 20,
    deadline: float | None = None,
) -> Link:
    """The link a ring all-reduce sees between two ranks, from timing ``all_reduce`` itself.

    On two ranks the ring (``conveyor.planner.Replicas``) takes 2 steps of half the bytes:
    time = 2 x latency + bytes / bandwidth, fitted by least squares over ``sizes``; the
    ranks send and receive at once, so it is not the point-to-point link. Collective over
    ``group`` (exactly two ranks). Past ``deadline`` the sizes after the first two are left
    out.
    """
    _need_two(group)
    points: list[tuple[float, float]] = []
    for index, size in enumerate(sizes):
        if index >= 2 and not ranks_in_time(deadline, group):
            break
        buffer = torch.ones(size // 4)
        samples = []
        for _ in range(repeats + 2):
            dist.barrier(group)
            start = time.perf_counter()
            dist.all_reduce(buffer, group=group)
            samples.append(time.perf_counter() - start)
        points.append((float(size), statistics.median(samples[2:])))
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, points, group=group)
    slope, intercept = _fit([x for x, _ in gathered[0]], [y for _, y in gathered[0]])
    return Link(max(intercept / 2, 1e-7), 1.0 / max(slope, 1e-13))


def measure_between_work(
    kind: Literal["all_reduce", "exchange", "shared"],
    group: dist.ProcessGroup | None = None,
    sizes: tuple[int, int] = (1 << 10, 1 << 22),
    work_s: float = 2e-3,
    repeats: int = 100,
) -> Link:
    """The link messages see between two ranks that compute, then meet, as decoding does at
    every layer (tensor or context parallel) and every stage (a pipeline). See Note
    [messages between work].

    Each rank runs ``work_s`` seconds of matrix products before every message: an
    ``all_reduce`` (2 steps of half the bytes on two ranks: time = 2 x latency + bytes /
    bandwidth) or an ``exchange`` (each rank sends its buffer to the other and receives the
    other's: time = latency + bytes / bandwidth), through messages or, ``shared``, through
    shared memory (conveyor.parallel.shared_exchange, as cp decode on one host). The line
    runs through the mean times, over ``repeats`` and both ranks, of a small and a large
    message: a least-squares line through more sizes lets the large ones' spread set the
    latency. Collective over ``group`` (exactly two ranks).
    """
    _need_two(group)
    work = _work_of(work_s)
    shared = SharedExchange(group, timedelta(seconds=60)) if kind == "shared" else None
    means = []
    for size in sizes:
        buffer = torch.ones(size // 4)
        dist.barrier(group)
        samples = []
        for _ in range(repeats + 2):
            work()
            start = time.perf_counter()
            if kind == "all_reduce":
                dist.all_reduce(buffer, group=group)
            elif shared is not None:
                shared(buffer)
            else:
                exchange(buffer, group)
            samples.append(time.perf_counter() - start)
        means.append(statistics.mean(samples[2:]))
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, means, group=group)
    small, large = ((a + b) / 2 for a, b in zip(*gathered, strict=True))
    per_byte = max(large - small, 1e-9) / (sizes[1] - sizes[0])
    steps = 2 if kind == "all_reduce" else 1
    return Link(max(small - sizes[0] * per_byte, 1e-7) / steps, 1.0 / per_byte)


# Note [messages between work]:
# ``measure_link`` and ``measure_allreduce`` time messages between idle ranks that start
# together and keep the median: the transfer alone. In a decode step a rank sends after its
# work, and the other rank arrives at a slightly different time: one waits for the other,
# sleeps in the wait and is woken, and now and then a rank is descheduled for milliseconds.
# The mean of messages after work counts all of it, as a step's time does. Measured on 2 CPU
# cores (gloo, 1 KB, after 2 ms of work), in runs minutes apart: an all-reduce's median
# 0.3-0.5 ms, its mean 0.9-2.3 ms, a tenth of them over 3 ms; an exchange's mean 0.5-1.2 ms.
def _work_of(seconds: float) -> Callable[[], None]:
    """A function that computes (matrix products) for about ``seconds`` on this rank."""
    a = torch.randn(128, 128)
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < 0.05:
        a @ a
        calls += 1
    per_call = (time.perf_counter() - start) / calls
    count = max(1, round(seconds / per_call))

    def work() -> None:
        for _ in range(count):
            a @ a

    return work


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    return slope, mean_y - slope * mean_x


def busy_warning(load: float, cores: int, own: int = 2) -> str | None:
    """What to tell when other processes kept the machine busy while ``own`` ranks measured:
    they slow every measured cost, sends and receives most (Note [busy ranks]), so the
    predictions, and the plan chosen from them, are off (measured: +117% at load 5 on 2
    cores, +36% at load 3). None on a machine the measuring ranks had to themselves."""
    others = load - min(own, cores)
    if others <= max(0.5, 0.25 * cores):
        return None
    return (
        f"the machine was busy while measuring: load average {load:.1f} on {cores} cores, of "
        f"which the {own} measuring ranks make about {min(own, cores)}. Other processes slow "
        "the measured costs (sends and receives most), so predicted step times and the plan "
        "chosen from them may be off; measure again on an idle machine"
    )


def profile_together(
    workload: Workload,
    microbatch_sizes: Sequence[int],
    depth: int = 1,
    group: dist.ProcessGroup | None = None,
    deadline: float | None = None,
) -> Profile:
    """Every rank of ``group`` profiles the model at the same time, so each core is as busy as
    in a pipeline run; the medians of all ranks are averaged (of a size some rank had no time
    for, those of the ranks that measured it: ``profile_model``'s ``deadline``). Collective."""
    dist.barrier(group)
    mine = profile_model(workload, microbatch_sizes, depth=depth, threads=None, deadline=deadline)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine.to_dict(), group=group)
    profiles = [Profile.from_dict(d) for d in gathered]
    sizes = sorted({size for p in profiles for size in p.stats})

    def mean(values: Sequence[float]) -> float:
        return sum(values) / len(values)

    stats, loss, calibration = {}, {}, {}
    for size in sizes:
        having = [p for p in profiles if size in p.stats]
        stats[size] = tuple(
            dataclasses.replace(
                units[0],
                forward=mean([u.forward for u in units]),
                backward=mean([u.backward for u in units]),
                backward_input=mean([u.backward_input for u in units]),
                backward_weight=mean([u.backward_weight for u in units]),
            )
            for units in zip(*(p.stats[size] for p in having), strict=True)
        )
        losses = [p.loss[size] for p in having]
        loss[size] = (mean([f for f, _ in losses]), mean([b for _, b in losses]))
        calibration[size] = having[0].calibration.get(size, (1.0, 1.0))
    return dataclasses.replace(
        mine,
        stats=stats,
        loss=loss,
        calibration=calibration,
        unmeasured_sizes=tuple(s for s in mine.unmeasured_sizes if s not in sizes),
        budget_notes=tuple(dict.fromkeys(n for p in profiles for n in p.budget_notes)),
    )


def fit_to_run(
    workload: Workload,
    profile: Profile,
    batch_size: int,
    microbatch_counts: int | Sequence[int],
    group: dist.ProcessGroup | None = None,
    steps: int = 10,
    deadline: float | None = None,
) -> Profile:
    """``profile`` fitted (``fit``) to ``steps`` traced steps of the model on the ranks of
    ``group``, in the default schedule, split as the planner would split it, once per
    micro-batch count: the first fits every size and the runtime's call costs, each further
    one its own micro-batch size. Counts of sizes the profile has not measured are left out,
    and past ``deadline`` (``time.monotonic``) the rest (in ``budget_notes``). Collective."""
    counts = [microbatch_counts] if isinstance(microbatch_counts, int) else list(microbatch_counts)
    counts = [m for m in counts if round(batch_size / m) not in profile.unmeasured_sizes]
    fitted, done = profile, list[int]()
    for m in counts:
        if not ranks_in_time(deadline, group):
            break
        measured, predicted = _traced_and_predicted(workload, fitted, batch_size, m, group, steps)
        size = round(batch_size / m)
        fitted = fit(fitted, measured, predicted, size if done else None)
        done.append(m)
    if len(done) == len(counts):
        return fitted
    note = f"fitted to traced runs of {done} micro-batches only" if done else "not fitted to a run"
    return dataclasses.replace(fitted, budget_notes=(*fitted.budget_notes, note))


def _traced_and_predicted(
    workload: Workload,
    profile: Profile,
    batch: int,
    m: int,
    group: dist.ProcessGroup | None,
    steps: int,
) -> tuple[list[Timeline], Timeline]:
    schedule = PipelineConfig().schedule
    report = plan(
        workload,
        dist.get_world_size(group),
        1 << 60,
        batch,
        profile=profile,
        schedules=[schedule],
        microbatches=[m],
        objectives=("time",),
        recompute=False,
        time_budget_s=None,
    )
    chosen = report.best
    config = PipelineConfig.from_dict({**report.pipeline_config(chosen), "trace": True})
    pipe = Pipeline(workload.model, config, loss_fn=workload.loss_fn, group=group)
    inputs, targets = workload.batch(batch)
    for _ in range(steps + 2):  # two to warm up
        dist.barrier(group)
        pipe.step(inputs, targets)
    measured = [pipe.timeline(index) for index in range(-steps, 0)]
    graph, units = layout(profile, [list(u) for u in chosen.stage_units], list(chosen.placement))
    predicted = predict(
        SCHEDULES[schedule](graph, m), graph, ProfileCost(profile, graph, units, batch / m, m)
    )
    return measured, predicted.timeline


def ranks_in_time(deadline: float | None, group: dist.ProcessGroup | None = None) -> bool:
    """Whether every rank of ``group`` is still before its ``deadline``: collective, so that
    all ranks go on to the next collective piece of work, or none does."""
    if deadline is None:
        return True
    late = torch.tensor([1 if passed(deadline) else 0])
    dist.all_reduce(late, op=dist.ReduceOp.MAX, group=group)
    return not bool(late.item())


def _need_two(group: dist.ProcessGroup | None) -> None:
    if not dist.is_initialized() or dist.get_world_size(group) != 2:
        raise RuntimeError(
            "measuring the runtime and the link needs a process group of exactly "
            "two ranks; run it under `conveyor run -n 2` (or let `conveyor plan` "
            "start two local ranks)"
        )


# Note [fitting to a measured step]:
# A profile measures units one by one in one process; a pipeline runs them in stages, on two
# busy cores, between messages. What that changes (caches, memory traffic, the other rank)
# is hard to measure apart but easy to see in a trace: run one configuration with tracing,
# predict the same configuration, and compare each action's measured and predicted duration.
# For each kind of compute (forward, backward, I, W) one factor scales the profile's units:
# the measured time of the step's actions of that kind over the predicted, both without the
# runtime's per-action overhead (measured on its own by ``measure_overheads``), so heavy
# actions count most. Sends and receives: See Note [busy ranks]. Predictions of other
# configurations (schedules, micro-batch counts, splits) then carry the machine's behaviour
# with them. Each action counts with its median over the steps, because another process on
# the machine can stretch any one of them. (A line scale x predicted + extra through heavy
# and light stages fitted per-action extras of up to 2 ms from two points, which misjudged
# every split with more stages: 23% on the two-tower model's three stages.)
def fit(
    profile: Profile,
    measured: Timeline | Sequence[Timeline],
    predicted: Timeline,
    microbatch_size: int | None = None,
) -> Profile:
    """``profile`` with compute and call times scaled so that ``predicted`` (a simulated step
    of the configuration that ran) would match ``measured`` (one step, or several) kind by
    kind.

    With ``microbatch_size`` only that size's unit costs are scaled (fit each size with a run
    of its own); without, every size's, and the runtime's call costs too.

    Raises:
        ValueError: the timelines share no kind of action.
    """
    steps = [measured] if isinstance(measured, Timeline) else list(measured)
    expected = {(e.rank, e.action): e for e in predicted.events if e.kind != "wait"}
    seen: dict[tuple[int, str], list[float]] = {}
    for step in steps:  # each action's median over the steps: one preempted step counts once
        for e in step.events:
            if (e.rank, e.action) in expected and e.duration > 0:
                seen.setdefault((e.rank, e.action), []).append(e.duration)
    factor: dict[str, float] = {}
    for kind in ("forward", "backward", "backward_input", "backward_weight"):
        own = profile.overheads.forward if kind == "forward" else profile.overheads.backward
        pairs = [
            (expected[key].duration - own, statistics.median(values) - own)
            for key, values in seen.items()
            if expected[key].kind == kind and expected[key].duration > own
        ]
        if pairs:
            factor[kind] = min(max(sum(y for _, y in pairs) / sum(x for x, _ in pairs), 0.5), 2.0)
    if not factor:
        raise ValueError(
            "the measured and predicted timelines share no kind of action; pass "
            "a traced step and the prediction of the same configuration"
        )
    backward = factor.get("backward", 1.0)
    forward = factor.get("forward", 1.0)
    inputs = factor.get("backward_input", backward)
    weights = factor.get("backward_weight", backward)
    sizes = set(profile.stats) if microbatch_size is None else {microbatch_size}
    stats = {
        size: tuple(
            dataclasses.replace(
                s,
                forward=s.forward * forward,
                backward=s.backward * backward,
                backward_input=s.backward_input * inputs,
                backward_weight=s.backward_weight * weights,
            )
            for s in values
        )
        if size in sizes
        else values
        for size, values in profile.stats.items()
    }
    loss = {
        size: (f * forward, b * backward) if size in sizes else (f, b)
        for size, (f, b) in profile.loss.items()
    }
    calibration = {
        size: (f * forward, b * backward) if size in sizes else (f, b)
        for size, (f, b) in (profile.calibration or {s: (1.0, 1.0) for s in profile.stats}).items()
    }
    fitted = ", ".join(f"{k} x{v:.2f}" for k, v in factor.items())
    if microbatch_size is not None:
        logger.info("fitted %s at micro-batch size %d: %s", profile.model, microbatch_size, fitted)
        return dataclasses.replace(profile, stats=stats, loss=loss, calibration=calibration)
    extra, per_busy = _busy_calls(steps, expected)
    old = profile.overheads
    overheads = dataclasses.replace(
        old,
        send=max(0.0, old.send + extra),
        recv=max(0.0, old.recv + extra),
        busy_call=max(0.0, old.busy_call + per_busy),
    )
    logger.info(
        "fitted %s to a measured step: %s; calls +%.3f ms, +%.3f ms per busy share",
        profile.model,
        fitted,
        extra * 1e3,
        per_busy * 1e3,
    )
    return dataclasses.replace(
        profile, stats=stats, loss=loss, overheads=overheads, calibration=calibration
    )


# Note [busy ranks]:
# On this machine posting a send or a receive takes ~0.05 ms while the peer rank waits, and
# ~2-5 ms while the peer computes: the call waits for the peer's transport threads, which get
# a core late. A traced step of a deliberately unbalanced split shows it plainly: the idle
# rank's calls take milliseconds whenever the busy rank is computing, the busy rank's own
# calls stay fast (with balanced stages both ranks are busy, and either reading fits). So a
# call costs a + k x (its peer's busy share of the step); ``fit`` finds a and k by least
# squares over the ranks of a traced step, and ``predict`` simulates twice, the second time
# knowing each rank's busy share.
def _busy_calls(
    steps: Sequence[Timeline], expected: dict[tuple[int, str], Event]
) -> tuple[float, float]:
    """(a, k): how much longer a send or receive call took than predicted, as a + k x the
    peer's busy share."""
    points: list[tuple[float, float]] = []
    for step in steps:
        span = step.step_time or 1.0
        rank_of = {e.stage: e.rank for e in step.events if e.stage is not None}
        by_peer: dict[int, list[float]] = {}
        for e in step.events:
            if e.kind in ("send", "recv") and (e.rank, e.action) in expected:
                peer = Action.parse(e.action).peer
                if peer in rank_of:
                    by_peer.setdefault(rank_of[peer], []).append(
                        e.duration - expected[(e.rank, e.action)].duration
                    )
        points += [
            (step.busy_time(peer) / span, statistics.median(values))
            for peer, values in by_peer.items()
        ]
    if not points:
        return 0.0, 0.0
    busy = [b for b, _ in points]
    excess = [x for _, x in points]
    if max(busy) - min(busy) < 0.05:  # ranks equally busy: no slope to see
        return statistics.median(excess), 0.0
    slope, intercept = _fit(busy, excess)
    return intercept, slope
