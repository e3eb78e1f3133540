"""Out of the box: conveyor or torch.distributed.pipelining, each in fresh processes of its own.

Used by bench_peer.py, bench_schedules.py and bench_breakdown.py; run as a script it is one
rank of one system (``python ootb.py SPEC.json RANK``), started by ``run_round`` in a new
interpreter. Nothing is shared between systems: the processes of ``torch`` and ``plain``
never import conveyor (the GPT model is loaded from its file, which needs only torch), so no
process-wide setting of conveyor's (``keep_host_memory``: glibc ``mallopt``) can reach them;
each such process checks this and reports it. Every rank that fails writes its error to a
file of its own, so the report names the rank that failed, not the one that lost it.
"""

from __future__ import annotations

import cProfile
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
RANKS = 2

# schedule: (stages per rank, placement, torch.distributed.pipelining class)
SCHEDULES = {
    "gpipe": (1, "loop", "ScheduleGPipe"),
    "1f1b": (1, "loop", "Schedule1F1B"),
    "interleaved-1f1b": (2, "loop", "ScheduleInterleaved1F1B"),
    "zb-v": (2, "v", "ScheduleZBVZeroBubble"),
    "dualpipev": (2, "v", "ScheduleDualPipeV"),
}
PLANNED = "planned"
"""The configuration ``conveyor plan`` chose for the batch (Spec.plan): conveyor only."""
SYSTEMS = ("conveyor", "conveyor-keep-off", "torch")
"""conveyor with its defaults, with keep_host_memory=False, and torch.distributed.pipelining."""


@dataclass
class Spec:
    """What one round of one system runs: the model, the batch, and (schedule, m) configs."""

    system: str
    configs: list[tuple[str, int]]
    layers: int = 8
    dim: int = 256
    heads: int = 4
    seq_len: int = 128
    vocab: int = 2048
    batch: int = 16
    warmup: int = 2
    steps: int = 10
    plan: str = ""
    """A plan file (``conveyor plan --model ootb:workload``), run as configuration PLANNED."""
    profile: bool = False
    """Profile (cProfile) and, for conveyor, trace extra steps after the timed ones."""
    out: str = ""
    store: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    balances: dict[str, list[int]] = field(default_factory=dict)
    """Layers per stage by schedule, for conveyor and torch alike (default: ``balance``)."""
    ranks: int = RANKS
    """Processes of a pipelined system (plain runs on one)."""
    head_chunks: int = 0
    """conveyor only: the GPT as a ChunkedGPT, its head and loss in this many vocabulary
    chunks, cut at ``split_points`` (0: the GPT as it is, cut by ``balances``)."""
    split_points: dict[str, list[str]] = field(default_factory=dict)
    """Where the stages of a ChunkedGPT start, by schedule."""

    @property
    def world(self) -> int:
        return 1 if self.system == "plain" else self.ranks


def gpt_module() -> Any:
    """conveyor/models/gpt.py loaded on its own (it imports only torch), not as conveyor's."""
    spec = importlib.util.spec_from_file_location("bench_gpt", ROOT / "src/conveyor/models/gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def balance(layers: int, num_stages: int) -> list[int]:
    """Blocks spread evenly; the embedding joins the first stage, the head the last."""
    blocks = [layers // num_stages + (i < layers % num_stages) for i in range(num_stages)]
    blocks[0] += 1
    blocks[-1] += 1
    return blocks


def balance_for(spec: Spec, schedule: str) -> list[int]:
    """The layers per stage ``spec`` gives for ``schedule``, else blocks spread evenly."""
    return spec.balances.get(schedule) or balance(spec.layers, SCHEDULES[schedule][0] * spec.ranks)


def placement(schedule: str, ranks: int = RANKS) -> list[int]:
    """Rank of each stage: loop (0, 1, 0, 1) or V (0, 1, 1, 0)."""
    per_rank, shape, _ = SCHEDULES[schedule]
    stages = range(per_rank * ranks)
    if shape == "v":
        return [s if s < ranks else 2 * ranks - 1 - s for s in stages]
    return [s % ranks for s in stages]


def batch(spec: Spec) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq_len + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def model(spec: Spec, gpt: Any) -> nn.Sequential:
    torch.manual_seed(0)
    built: nn.Sequential = gpt.gpt(
        vocab_size=spec.vocab, seq_len=spec.seq_len, dim=spec.dim, num_layers=spec.layers,
        num_heads=spec.heads, dropout=0.0,
    )  # fmt: skip
    return built


def workload() -> Any:
    """The benchmark's GPT, batches and loss for the planner: ``conveyor plan --model
    ootb:workload`` (with benchmarks/ on the path) plans the configuration ``planned`` runs."""
    from conveyor.planner import Workload

    gpt, spec = gpt_module(), Spec("conveyor", [])

    def batches(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch(spec)
        return x[:size], y[:size]

    return Workload("benchmark GPT", model(spec, gpt), batches, gpt.gpt_loss)


Step = Callable[[], "float | None"]
"""One training step (zero_grad, step, optimizer step); returns the loss where it is known."""


def conveyor_step(spec: Spec, schedule: str, m: int, gpt: Any, **options: Any) -> Step:
    import conveyor

    if spec.head_chunks:
        pipe = conveyor.Pipeline(
            chunked_model(spec), split_points=spec.split_points[schedule], schedule=schedule,
            num_microbatches=m, timeout_s=300, **options,
        )  # fmt: skip
    elif schedule == PLANNED:  # everything from the plan file: schedule, m, split, placement
        pipe = conveyor.Pipeline(
            model(spec, gpt), plan=spec.plan, loss_fn=gpt.gpt_loss, timeout_s=300, **options
        )
    else:
        pipe = conveyor.Pipeline(
            model(spec, gpt), balance=balance_for(spec, schedule), schedule=schedule,
            num_microbatches=m, loss_fn=gpt.gpt_loss, timeout_s=300, **options,
        )  # fmt: skip
    return training_step(pipe, spec)


def chunked_model(spec: Spec) -> nn.Module:
    """The benchmark GPT (the same weights) as a ChunkedGPT of ``spec.head_chunks`` chunks."""
    from conveyor.models import ChunkedGPT

    return ChunkedGPT(model(spec, importlib.import_module("conveyor.models.gpt")), spec.head_chunks)


def training_step(pipe: Any, spec: Spec) -> Step:
    """conveyor's step on the benchmark batch: zero_grad, ``pipe.step``, SGD."""
    x, y = batch(spec)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    args = ({"input_ids": x, "labels": y},) if spec.head_chunks else (x, y)

    def step() -> float | None:
        optimizer.zero_grad()
        loss = pipe.step(*args)
        optimizer.step()
        return None if loss is None else float(loss)

    step.pipe = pipe  # type: ignore[attr-defined]
    return step


def torch_step(spec: Spec, schedule: str, m: int, gpt: Any) -> Step:
    from torch.distributed import pipelining

    x, y = batch(spec)
    ranks = placement(schedule, spec.ranks)
    num_stages = len(ranks)
    rank = dist.get_rank()
    layers = list(model(spec, gpt).children())
    bounds = [0]
    for count in balance_for(spec, schedule):
        bounds.append(bounds[-1] + count)
    local = [s for s in range(num_stages) if ranks[s] == rank]
    modules = [nn.Sequential(*layers[bounds[s] : bounds[s + 1]]) for s in local]
    stages = [
        pipelining.PipelineStage(module, s, num_stages, torch.device("cpu"))
        for module, s in zip(modules, local, strict=True)
    ]
    kind = getattr(pipelining, SCHEDULES[schedule][2])
    runner = kind(stages if len(stages) > 1 else stages[0], m, loss_fn=gpt.gpt_loss)
    optimizer = torch.optim.SGD([p for mod in modules for p in mod.parameters()], lr=1e-3)
    first, last = 0 in local, num_stages - 1 in local

    def step() -> float | None:
        optimizer.zero_grad()
        inputs = (x,) if first else ()
        losses: list[torch.Tensor] = []
        if last:
            runner.step(*inputs, target=y, losses=losses, return_outputs=False)
        else:
            runner.step(*inputs, return_outputs=False)
        optimizer.step()
        return float(torch.stack(losses).detach().mean()) if last else None

    return step


def plain_step(spec: Spec, m: int, gpt: Any) -> Step:
    """Plain training, 1 thread, the batch as m micro-batches (gradient accumulation)."""
    x, y = batch(spec)
    net = model(spec, gpt)
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    chunks = list(zip(x.tensor_split(m), y.tensor_split(m), strict=True))

    def step() -> float:
        optimizer.zero_grad()
        total = 0.0
        for xk, yk in chunks:
            loss = gpt.gpt_loss(net(xk), yk) / m
            loss.backward()
            total += float(loss)
        optimizer.step()
        return total

    return step


def build(spec: Spec, schedule: str, m: int, gpt: Any) -> Step:
    if spec.system == "plain":
        return plain_step(spec, m, gpt)
    if spec.system == "torch":
        return torch_step(spec, schedule, m, gpt)
    options = {"keep_host_memory": False} if spec.system == "conveyor-keep-off" else {}
    return conveyor_step(spec, schedule, m, gpt, **options, **spec.extra)


def sync() -> None:
    if dist.is_initialized():
        dist.barrier()


def timed(step: Step, spec: Spec) -> tuple[list[float], float | None, list[float]]:
    """Seconds per step, the slowest rank's (barriers on both sides), after the warm-up; the
    first step's loss where this rank knows it; and this rank's CPU seconds and page faults
    (minor + major) per timed step, which, unlike wall time, hardly depend on what else the
    machine runs."""
    times, first = [], None
    usage = resource.getrusage(resource.RUSAGE_SELF)
    for index in range(spec.warmup + spec.steps):
        if index == spec.warmup:
            usage = resource.getrusage(resource.RUSAGE_SELF)
        sync()
        start = time.perf_counter()
        loss = step()
        sync()
        if index == 0:
            first = loss
        if index >= spec.warmup:
            times.append(time.perf_counter() - start)
    end = resource.getrusage(resource.RUSAGE_SELF)
    cpu = end.ru_utime + end.ru_stime - usage.ru_utime - usage.ru_stime
    faults = end.ru_minflt + end.ru_majflt - usage.ru_minflt - usage.ru_majflt
    return times, first, [cpu / spec.steps, faults / spec.steps]


def profiled(step: Step, spec: Spec, rank: int, label: str) -> None:
    """cProfile ``spec.steps`` more steps into OUT/label.rankN.prof; conveyor's Timeline too."""
    profile = cProfile.Profile()
    for _ in range(spec.steps):
        sync()
        profile.enable()
        step()
        profile.disable()
        sync()
    name = label.replace(" ", "_")
    profile.dump_stats(f"{spec.out}.{name}.rank{rank}.prof")
    pipe = getattr(step, "pipe", None)
    if pipe is not None and pipe.recorder is not None:
        timelines = [pipe.timeline(-1 - i).to_dict() for i in range(spec.steps)]
        if rank == 0:
            Path(f"{spec.out}.{name}.timeline.json").write_text(json.dumps(timelines))


def child(spec: Spec, rank: int) -> None:
    torch.set_num_threads(1)
    world = spec.world
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{spec.store}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=300))  # fmt: skip
    try:
        gpt = gpt_module()
        results = {}
        for schedule, m in spec.configs:
            step = build(spec, schedule, m, gpt)
            times, loss, usage = timed(step, spec)
            if spec.profile:
                profiled(step, spec, rank, f"{schedule}.{m}")
            gathered: list[Any] = [(loss, usage)]
            if world > 1:
                gathered = [None] * world
                dist.all_gather_object(gathered, (loss, usage))
            first = next((v for v, _ in gathered if v is not None), None)
            results[f"{schedule}/{m}"] = {
                "times": times,
                "loss": first,
                "cpu_s": [u[0] for _, u in gathered],
                "faults": [u[1] for _, u in gathered],
            }
        if rank == 0:
            result = {"results": results, "conveyor_imported": "conveyor" in sys.modules}
            Path(spec.out).write_text(json.dumps(result))
        Path(f"{spec.out}.done{rank}").touch()  # what follows is teardown only
    except BaseException as error:
        Path(f"{spec.out}.error{rank}").write_text(f"rank {rank}: {type(error).__name__}: {error}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_round(spec: Spec, timeout_s: float = 1800) -> dict[str, Any]:
    """Run ``spec`` in fresh processes (one per rank); its results, or a failed rank's error."""
    with tempfile.TemporaryDirectory() as directory:
        spec.out = spec.out or os.path.join(directory, "result.json")
        spec.store = os.path.join(directory, "store")
        spec_file = Path(directory, "spec.json")
        spec_file.write_text(json.dumps(asdict(spec)))
        env = {
            **os.environ,
            "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        world = spec.world
        procs = [
            subprocess.Popen([sys.executable, __file__, str(spec_file), str(r)], env=env)
            for r in range(world)
        ]
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                return {"error": f"{spec.system}: no result within {timeout_s:.0f} s"}
        errors = sorted(
            (p.read_text() for p in Path(spec.out).parent.glob(Path(spec.out).name + ".error*")),
            key=lambda text: "closed by peer" in text or "lost rank" in text,
        )
        finished = all(Path(f"{spec.out}.done{r}").exists() for r in range(world))
        if errors or (any(p.returncode for p in procs) and not finished):
            return {"error": errors[0] if errors else f"{spec.system}: a rank exited non-zero"}
        result: dict[str, Any] = json.loads(Path(spec.out).read_text())
        # a rank that crashed after its last step and its report (seen: torch's processes,
        # "terminate called without an active exception" at exit) leaves the figures valid
        result["teardown_crashes"] = sum(1 for p in procs if p.returncode)
        return result


def load_average() -> float:
    return os.getloadavg()[0]


def shared(loads: list[float], ranks: int = RANKS) -> bool:
    """Whether other work shared the CPU: a load above what the benchmark's own ranks make."""
    return max(loads) > ranks + 0.5


def medians(rounds: list[dict[str, Any]], key: str) -> list[float]:
    """Each round's median step time of config ``key``."""
    return [statistics.median(r["results"][key]["times"]) for r in rounds if "results" in r]


if __name__ == "__main__":
    child(Spec(**json.loads(Path(sys.argv[1]).read_text())), int(sys.argv[2]))
