"""Measure on two ranks started here, within a deadline: the runtime's overheads, the links
between ranks and a profile fitted to a traced run, as ``conveyor plan`` plans with them.

    profile = measured_profile(example("gpt"), num_ranks=2, batch_size=32, spec="gpt")
    overheads, link = measure_local()          # for a profile made in this process

Rank 0 writes what the ranks have measured after each phase; this process logs each phase
as it ends, and at the deadline stops the ranks and keeps what they wrote (See Note
[planning budget] in ``conveyor.planner.budget``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conveyor.files import write_atomic
from conveyor.planner.budget import Budget
from conveyor.planner.calibrate import (
    busy_warning,
    fit_to_run,
    measure_allreduce,
    measure_link,
    measure_overheads,
    profile_together,
    ranks_in_time,
)
from conveyor.planner.profile import Link, Overheads, Profile, Workload, profile_model
from conveyor.planner.search import (
    microbatch_counts,
    microbatch_sizes,
    search_seconds,
    unit_depth,
)
from conveyor.planner.workloads import load_workload
from conveyor.schedule import SCHEDULES, spec_of

__all__ = [
    "TWO_RANKS_MIN_S",
    "measure_local",
    "measure_reduce_link",
    "measured_profile",
    "profile_local",
    "with_reduce_link",
]

logger = logging.getLogger(__name__)

TWO_RANKS_MIN_S = 15.0
"""The least time worth measuring on two local ranks: starting them (each imports torch)
and measuring the overheads and the links take about 10 s on 2 loaded cores. With less,
the profile is made in this process only, without them."""

_GRACE_S = 5.0
"""Seconds the ranks get past their own deadline to end the piece of work they are in (one
unit's measurement, one traced run) before they are stopped; their deadline is this much
before the measuring deadline, so the search keeps its time."""

_EXIT_S = 3.0
"""Seconds the ranks get to exit after writing that they are done."""

# Note [finished ranks]:
# A rank that has written its last result may still take long to exit (seen: over 10 s on a
# loaded machine, in its process group's and transport threads' shutdown). Waiting for the
# exit kept ``conveyor plan`` silent for minutes; the parent now stops waiting a few seconds
# after the final write and kills what is left, since everything it needs is in the file.

_PROFILE_PART = 0.6
"""Part of what is left of the measuring time (after the links) for profiling on the two
ranks; fitting to traced runs gets the rest."""


def measure_local(timeout_s: float = 180.0) -> tuple[Overheads, Link]:
    """Runtime overheads and the link between two ranks started here (gloo, one thread each),
    for a profile made in a process that has no peers."""
    data = _on_two_local_ranks(timeout_s, {})
    return Overheads(**data["overheads"]), Link(**data["link"])


def measure_reduce_link(timeout_s: float = 180.0) -> Link:
    """``measure_allreduce`` on two ranks started here (gloo, one thread each)."""
    return Link(**_on_two_local_ranks(timeout_s, {})["reduce_link"])


def profile_local(
    spec: str,
    microbatch_sizes: Sequence[int],
    depth: int,
    batch_size: int,
    microbatch_counts: Sequence[int],
    timeout_s: float = 900.0,
    deadline: float | None = None,
) -> Profile:
    """A fitted profile of the workload ``spec`` (see ``conveyor.planner.load_workload``), made
    on two ranks started here, as ``conveyor plan`` uses it.

    Both ranks profile the model at once (each core as busy as in a run) and the two are
    averaged; the runtime's overheads and the links are measured; then the model runs traced
    on both ranks in the default schedule, split as the planner would split it with
    each of ``microbatch_counts``, and the profile is fitted to those runs (``fit_to_run``).
    Past ``deadline`` (``time.monotonic``) the ranks cut their work short, as the profile's
    ``budget_notes`` say.

    Raises:
        RuntimeError: the ranks did not get as far as a profile (timeout, or the deadline).
    """
    job = _job(spec, microbatch_sizes, depth, batch_size, microbatch_counts)
    data = _on_two_local_ranks(timeout_s, job, deadline)
    if "profile" not in data:
        raise RuntimeError(
            f"the two local ranks measured {_measured(data)} but no profile before the "
            "deadline; give them more time, or profile in this process (profile_model)"
        )
    return Profile.from_dict(data["profile"])


def measured_profile(
    workload: Workload,
    num_ranks: int,
    batch_size: int,
    microbatches: Sequence[int] | None = None,
    schedules: Sequence[str] | None = None,
    spec: str | None = None,
    time_budget_s: float | Budget | None = None,
) -> Profile:
    """The profile ``plan`` would measure, plus the runtime's overheads and the links between
    two ranks started on this machine; with ``spec`` (the workload's example name or import
    path) the profile is made on those two ranks and fitted to a traced run
    (``profile_local``).

    ``time_budget_s`` is the whole planning call's (pass the ``Budget`` on to ``plan``):
    measuring stops at its ``profile_deadline``. What the ranks did not finish by then is made
    in this process (a profile) or left out (overheads, links), as the profile's
    ``budget_notes`` say.
    """
    names = list(SCHEDULES) if schedules is None else list(schedules)
    counts = microbatch_counts(batch_size, num_ranks, names, microbatches)
    deadline = Budget.of(time_budget_s).profile_deadline(search_seconds(num_ranks, names, counts))
    max_virtual = max(spec_of(n).virtual_stages for n in names)
    depth = unit_depth(workload.model, num_ranks * max_virtual)
    sizes = microbatch_sizes(batch_size, counts)
    data: dict[str, Any] = {}
    if _time_for_two_ranks(deadline):
        job = {}
        if spec is not None:
            job = _job(spec, sizes, depth, batch_size, [m for m in counts if batch_size % m == 0])
        data = _on_two_local_ranks(900.0 if spec else 180.0, job, deadline)
        if "profile" in data:
            return Profile.from_dict(data["profile"])
    notes = []
    if spec is not None:
        notes.append("made in this process, not on two ranks, and not fitted to a run")
    profile = profile_model(workload, sizes, depth=depth, deadline=deadline)
    return _with_links(profile, data, notes)


def with_reduce_link(profile: Profile, time_budget_s: float | Budget | None = None) -> Profile:
    """``profile`` with the all-reduce link of two ranks started here when it has none (for
    gradient reductions over replicas), if the budget's measuring share leaves time."""
    if profile.reduce_link is not None:
        return profile
    deadline = Budget.of(time_budget_s).profile_deadline()
    data = _on_two_local_ranks(180.0, {}, deadline) if _time_for_two_ranks(deadline) else {}
    if "reduce_link" not in data:
        return dataclasses.replace(
            profile, budget_notes=(*profile.budget_notes, "all-reduce link not measured")
        )
    return dataclasses.replace(profile, reduce_link=Link(**data["reduce_link"]))


def _job(
    spec: str, sizes: Sequence[int], depth: int, batch_size: int, counts: Sequence[int]
) -> dict[str, Any]:
    return {
        "spec": spec,
        "sizes": list(sizes),
        "depth": depth,
        "batch_size": batch_size,
        "counts": list(counts),
    }


def _time_for_two_ranks(deadline: float | None) -> bool:
    left = None if deadline is None else deadline - time.monotonic()
    if left is None or left >= TWO_RANKS_MIN_S:
        return True
    logger.warning(
        "not measuring on two local ranks: %.1f s of the time budget is left for measuring, "
        "and they need about %.0f s; profiling in this process, without the runtime's "
        "overheads and the links (raise the time budget to measure them)",
        max(left, 0.0),
        TWO_RANKS_MIN_S,
    )
    return False


_PARTS = (
    ("overheads", "runtime overheads"),
    ("link", "link"),
    ("reduce_link", "all-reduce link"),
)


def _measured(data: dict[str, Any]) -> str:
    return ", ".join(what for key, what in _PARTS if key in data) or "nothing"


def _with_links(profile: Profile, data: dict[str, Any], notes: list[str]) -> Profile:
    """``profile`` with what the two ranks measured, and a note on what they did not."""
    missing = [what for key, what in _PARTS if key not in data]
    if missing:
        notes.append(", ".join(missing) + " not measured")
    return dataclasses.replace(
        profile,
        overheads=Overheads(**data["overheads"]) if "overheads" in data else profile.overheads,
        link=Link(**data["link"]) if "link" in data else profile.link,
        reduce_link=Link(**data["reduce_link"]) if "reduce_link" in data else None,
        budget_notes=(*profile.budget_notes, *notes),
    )


def _on_two_local_ranks(
    timeout_s: float, job: dict[str, Any], deadline: float | None = None
) -> dict[str, Any]:
    """What two ranks started here measured (``_local_worker``): everything, or, when
    ``deadline`` (``time.monotonic``) comes first, what they had written by then.

    Raises:
        RuntimeError: ``timeout_s`` passed first.
    """
    load_before = os.getloadavg()[0]
    wall = None if deadline is None else time.time() + deadline - _GRACE_S - time.monotonic()
    hard = time.monotonic() + timeout_s
    stop = hard if deadline is None else min(hard, deadline)
    logger.info(
        "measuring on two local ranks: runtime overheads, links%s%s",
        ", profile, fit to traced runs" if job else "",
        "" if deadline is None else f" (for up to {max(0.0, deadline - time.monotonic()):.0f} s)",
    )
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory, "measured.json")
        context = mp.spawn(  # type: ignore[attr-defined,no-untyped-call]  # untyped in torch
            _local_worker,
            args=(str(Path(directory, "store")), str(out), {**job, "deadline_wall": wall}),
            nprocs=2,
            join=False,
        )
        progress = _Progress(out)
        try:
            while not context.join(timeout=min(1.0, max(0.1, stop - time.monotonic()))):
                progress.log()
                if progress.data.get("complete"):  # See Note [finished ranks]
                    stop = min(stop, time.monotonic() + _EXIT_S)
                if time.monotonic() < stop:
                    continue
                if progress.data.get("complete"):
                    logger.warning(
                        "the two local ranks finished measuring but had not exited %.0f s "
                        "later; stopped them",
                        _EXIT_S,
                    )
                    break
                if stop == hard:
                    raise RuntimeError(
                        f"measuring on two local ranks took over "
                        f"{timeout_s:.0f} s; pass --no-link to plan without it"
                    )
                logger.warning(
                    "stopped the two local ranks %.0f s past their own deadline; keeping what "
                    "they measured: %s",
                    _GRACE_S,
                    _measured(progress.data) + (", profile" if "profile" in progress.data else ""),
                )
                break
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        progress.log()
    warning = busy_warning(max(load_before, os.getloadavg()[0]), os.cpu_count() or 1)
    if warning:
        logger.warning("%s", warning)
    return {k: v for k, v in progress.data.items() if k != "phases"}


class _Progress:
    """Reads what rank 0 has written so far and logs each phase once, as it ends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {}
        self._logged = 0

    def log(self) -> None:
        if not self.path.exists():
            return
        self.data = json.loads(self.path.read_text())  # written atomically
        for text, seconds in self.data["phases"][self._logged :]:
            logger.info("  two local ranks: %s (%.1f s)", text, seconds)
        self._logged = len(self.data["phases"])


class _Written:
    """A rank's results so far; rank 0 writes them after each phase, for ``_Progress``."""

    def __init__(self, rank: int, path: str) -> None:
        self.rank, self.path = rank, path
        self.result: dict[str, Any] = {"phases": []}
        self.began = time.monotonic()

    def done(self, key: str | None, value: Any, text: str) -> None:
        if key is not None:
            self.result[key] = value
        self.result["phases"].append([text, time.monotonic() - self.began])
        if self.rank == 0:
            write_atomic(self.path, json.dumps(self.result))


def _local_worker(rank: int, store: str, out: str, job: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    wall = job.get("deadline_wall")  # the same moment on this process's clock
    deadline = None if wall is None else time.monotonic() + wall - time.time()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=120),
    )
    try:
        written = _Written(rank, out)
        written.done(None, None, "started")
        _measure_links(written, deadline)
        if job.get("spec") and "reduce_link" in written.result:
            _measure_profile(written, job, deadline)
        written.done("complete", True, "done")
    finally:
        dist.destroy_process_group()


def _measure_links(written: _Written, deadline: float | None) -> None:
    """The runtime's overheads, the link and the all-reduce link, each while time is left."""
    if not ranks_in_time(deadline):
        return
    overheads = measure_overheads()
    written.done(
        "overheads",
        dataclasses.asdict(overheads),
        f"runtime overheads: {overheads.forward * 1e3:.3f} ms per forward, "
        f"{overheads.send * 1e3:.3f} ms per send",
    )
    for key, measure in (("link", measure_link), ("reduce_link", measure_allreduce)):
        if not ranks_in_time(deadline):
            return
        link = measure(deadline=deadline)
        written.done(
            key,
            dataclasses.asdict(link),
            f"{dict(_PARTS)[key]}: latency {link.latency * 1e3:.3f} ms, "
            f"{link.bandwidth / 1e6:.0f} MB/s",
        )


def _measure_profile(written: _Written, job: dict[str, Any], deadline: float | None) -> None:
    """Both ranks profile at once, then the profile is fitted to traced runs."""
    if not ranks_in_time(deadline):
        return
    now = time.monotonic()
    profile_by = None if deadline is None else now + _PROFILE_PART * (deadline - now)
    workload = load_workload(job["spec"])
    profile = profile_together(workload, job["sizes"], job["depth"], deadline=profile_by)
    result = written.result
    profile = dataclasses.replace(
        profile,
        overheads=Overheads(**result["overheads"]),
        link=Link(**result["link"]),
        reduce_link=Link(**result["reduce_link"]),
    )
    written.done(
        "profile",
        profile.to_dict(),
        f"profiled on both ranks at micro-batch sizes {profile.microbatch_sizes}",
    )
    profile = fit_to_run(workload, profile, job["batch_size"], job["counts"], deadline=deadline)
    written.done("profile", profile.to_dict(), "fitted to traced runs")
