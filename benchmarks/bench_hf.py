"""Hugging Face models: conveyor vs torch.distributed.pipelining, each out of the box.

    python benchmarks/bench_hf.py          # GPT-2, Llama, Qwen2, Mistral x 1f1b, interleaved-1f1b
    python benchmarks/bench_hf.py --rounds 1 --steps 2 --warmup 1 --no-write   # a quick look
    python benchmarks/bench_hf.py --models llama qwen2 --schedules interleaved-1f1b --no-write
    python benchmarks/bench_hf.py --force  # publish even if other work shared the machine

Both systems split the same unedited model (transformers, small config, random weights,
``use_cache=False``) before the same layers, 2 stages for 1f1b and 4 (2 per rank, loop
placement) for interleaved-1f1b, on 2 gloo ranks of one thread each, with the same loss
(cross-entropy of the shifted logits), micro-batches, batch and SGD step. conveyor is given
``split_points`` and ``example_inputs``; torch.distributed.pipelining is used as its docs show:
``pipeline()`` with a ``SplitPoint.BEGINNING`` per cut, ``build_stage`` for each of the rank's
stages, and ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``. Every (model, schedule, system)
runs in fresh processes of its own started from this file (``--child SPEC RANK``); torch's
never import conveyor, so no process-wide setting of conveyor's reaches them. The systems
alternate round by round (which goes first rotates). A step is the slower rank's zero_grad +
step + optimizer step between barriers; a round's figure is the median of its steps, the
table's the median over rounds. Where a system fails on a row, the failing rank's error is
the row's cell, and that system is not run on the row again. The first step's losses of the
two systems are printed and compared. Results go to the `hf` section of docs/benchmarks.md,
unless other work shared the machine (report.publishable; ``--force`` publishes anyway).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
import transformers
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ootb import RANKS, ROOT, load_average, shared
from report import bootstrap_interval, publishable, write_section

VOCAB = 2048
SYSTEMS = ("conveyor", "torch")
"""conveyor, and torch.distributed.pipelining."""
# schedule: (stages per rank, torch.distributed.pipelining class)
SCHEDULES = {"1f1b": (1, "Schedule1F1B"), "interleaved-1f1b": (2, "ScheduleInterleaved1F1B")}
LOSS_TOLERANCE = 1e-4
"""Largest relative difference of the two systems' first-step losses taken as equal."""
GRACE_S = 10.0
"""How long the other rank may take to report its own error after one rank failed; then it
is killed (it is likely blocked receiving from the failed rank)."""


def _decoder(kind: str) -> Callable[[], nn.Module]:
    """A Llama-shaped family (Llama, Qwen2, Mistral): 8 layers, grouped-query attention."""

    def make() -> nn.Module:
        config = getattr(transformers, f"{kind}Config")(
            num_hidden_layers=8, hidden_size=128, intermediate_size=512, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
            use_cache=False, attention_dropout=0.0,
        )  # fmt: skip
        model: nn.Module = getattr(transformers, f"{kind}ForCausalLM")(config)
        return model

    return make


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=12, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=256,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,  # within the small vocabulary
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


# model: (constructor, qualified name of block i without i, number of blocks)
MODELS: dict[str, tuple[Callable[[], nn.Module], str, int]] = {
    "gpt2": (_gpt2, "transformer.h.", 12),
    "llama": (_decoder("Llama"), "model.layers.", 8),
    "qwen2": (_decoder("Qwen2"), "model.layers.", 8),
    "mistral": (_decoder("Mistral"), "model.layers.", 8),
}


@dataclass
class Spec:
    """What one run of one system does: a model, a schedule, the batch and the step counts."""

    system: str
    model: str
    schedule: str
    batch: int = 16
    seq_len: int = 128
    microbatches: int = 8
    warmup: int = 2
    steps: int = 8
    out: str = ""
    store: str = ""


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[name][0]()
    model.train()
    return model


def split_points(name: str, schedule: str) -> list[str]:
    """The blocks that start stages 1, 2, ...: blocks spread evenly over the stages."""
    _, prefix, blocks = MODELS[name]
    num_stages = SCHEDULES[schedule][0] * RANKS
    return [f"{prefix}{blocks * k // num_stages}" for k in range(1, num_stages)]


def make_batch(spec: Spec) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Token ids and an all-ones attention mask (what a tokenizer gives), and the labels."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (spec.batch, spec.seq_len), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids


def causal_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the shifted logits (the model's own output, or torch's bare logits)."""
    if isinstance(output, torch.Tensor):
        logits = output
    elif hasattr(output, "logits"):
        logits = output.logits
    else:
        logits = output[0]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


Step = Callable[[], "float | None"]
"""One training step (zero_grad, step, SGD step); the step's loss on the last stage's rank."""


def conveyor_step(spec: Spec) -> Step:
    import conveyor

    inputs, labels = make_batch(spec)
    pipe = conveyor.Pipeline(
        build(spec.model), split_points=split_points(spec.model, spec.schedule),
        schedule=spec.schedule, num_microbatches=spec.microbatches, example_inputs=inputs,
        loss_fn=causal_loss, timeout_s=300,
    )  # fmt: skip
    optimizer = torch.optim.SGD(pipe.parameters(), lr=1e-3)

    def step() -> float | None:
        optimizer.zero_grad()
        loss = pipe.step(inputs, labels)
        optimizer.step()
        return None if loss is None else float(loss)

    return step


def torch_step(spec: Spec) -> Step:
    """As torch.distributed.pipelining's docs show: pipeline() on one micro-batch's inputs,
    a SplitPoint.BEGINNING per cut, build_stage for each of this rank's stages (loop)."""
    from torch.distributed import pipelining

    inputs, labels = make_batch(spec)
    chunk = {k: v.tensor_split(spec.microbatches)[0] for k, v in inputs.items()}
    cuts = {
        point: pipelining.SplitPoint.BEGINNING for point in split_points(spec.model, spec.schedule)
    }
    pipe = pipelining.pipeline(build(spec.model), mb_args=(), mb_kwargs=chunk, split_spec=cuts)
    rank, num_stages = dist.get_rank(), pipe.num_stages
    local = [s for s in range(num_stages) if s % RANKS == rank]
    stages = [pipe.build_stage(s, torch.device("cpu")) for s in local]
    per_rank, kind = SCHEDULES[spec.schedule]
    schedule_class = getattr(pipelining, kind)
    runner = schedule_class(
        stages if per_rank > 1 else stages[0], spec.microbatches, loss_fn=causal_loss
    )
    optimizer = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=1e-3)
    first, last = 0 in local, num_stages - 1 in local

    def step() -> float | None:
        optimizer.zero_grad()
        given = inputs if first else {}
        losses: list[torch.Tensor] = []
        if last:
            runner.step(**given, target=labels, losses=losses, return_outputs=False)
        else:
            runner.step(**given, return_outputs=False)
        optimizer.step()
        return float(torch.stack(losses).detach().mean()) if last else None

    return step


STEPS: dict[str, Callable[[Spec], Step]] = {"conveyor": conveyor_step, "torch": torch_step}


def timed(step: Step, spec: Spec) -> tuple[list[float], float | None]:
    """Seconds per step after the warm-up, the slower rank's (barriers on both sides), and
    the first step's loss where this rank knows it."""
    times, first = [], None
    for index in range(spec.warmup + spec.steps):
        dist.barrier()
        start = time.perf_counter()
        loss = step()
        dist.barrier()
        if index == 0:
            first = loss
        if index >= spec.warmup:
            times.append(time.perf_counter() - start)
    return times, first


def describe(error: BaseException) -> str:
    """The type and first sentence of the error, and of the deepest cause that says something
    (torch's stage wraps the error of the traced module, itself raised from a bare one)."""

    def line(e: BaseException) -> str:
        first = (str(e).strip().splitlines() or [""])[0]
        return f"{type(e).__name__}: {re.split(r'(?<=[.!?]) +(?=[A-Z])', first)[0]}"

    causes: list[BaseException] = []
    cause = error.__cause__ or error.__context__
    while cause is not None and len(causes) < 20:
        causes.append(cause)
        cause = cause.__cause__ or cause.__context__
    said = [c for c in causes if str(c).strip()]
    text = line(error) + (f" (from {line(said[-1])})" if said else "")
    return text if len(text) <= 240 else text[:237] + "..."


def child(spec: Spec, rank: int) -> None:
    """One rank of one system: measure, then rank 0 writes the result; an error is written to
    a file of this rank's own, so the report names the failing rank, not the one that lost it."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{spec.store}", rank=rank,
                            world_size=RANKS, timeout=timedelta(seconds=300))  # fmt: skip
    try:
        times, first = timed(STEPS[spec.system](spec), spec)
        gathered: list[Any] = [None] * RANKS
        dist.all_gather_object(gathered, first)
        if rank == 0:
            result = {
                "times": times,
                "loss": next((v for v in gathered if v is not None), None),
                "conveyor_imported": "conveyor" in sys.modules,
            }
            Path(spec.out).write_text(json.dumps(result))
    except Exception as error:  # a system that cannot run this model: record why
        Path(f"{spec.out}.error{rank}").write_text(describe(error))
        sys.stdout.flush()
        os._exit(1)  # the peer may be blocked receiving from us: leave without teardown
    dist.destroy_process_group()


def run(spec: Spec, timeout_s: float = 1800) -> dict[str, Any]:
    """``spec`` in fresh processes (one per rank): its result, or the failing rank's error."""
    with tempfile.TemporaryDirectory() as directory:
        spec.out, spec.store = str(Path(directory, "result.json")), str(Path(directory, "store"))
        spec_file = Path(directory, "spec.json")
        spec_file.write_text(json.dumps(asdict(spec)))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *_pythonpath()]),
            "PYTHONWARNINGS": "ignore::FutureWarning",  # torch's pytree, once per process
        }
        command = [sys.executable, __file__, "--child", str(spec_file)]
        procs = [subprocess.Popen([*command, str(r)], env=env) for r in range(RANKS)]
        errors = wait(procs, Path(directory), time.monotonic() + timeout_s)
        if errors:
            return {"error": errors[0]}
        if not Path(spec.out).exists():
            return {"error": f"ranks exited with {[p.returncode for p in procs]}, no result"}
        # a rank that crashed in teardown, after every step and the report, leaves it valid
        result: dict[str, Any] = json.loads(Path(spec.out).read_text())
        return result


def _pythonpath() -> list[str]:
    given = os.environ.get("PYTHONPATH", "")
    return [given] if given else []


def wait(procs: list[subprocess.Popen[bytes]], directory: Path, deadline: float) -> list[str]:
    """Wait for the ranks; once one reported an error, give the others GRACE_S to report
    theirs, then kill them. The errors, a rank's own before a lost peer's."""
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(directory.glob("result.json.error*")):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + GRACE_S):
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            if failed_at is None:
                return ["no result within the time limit"]
            break
        time.sleep(0.2)
    texts = [p.read_text() for p in sorted(directory.glob("result.json.error*"))]
    lost = ("closed by peer", "Connection reset", "lost rank", "timed out", "Timeout")
    return sorted(texts, key=lambda text: any(word in text for word in lost))


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--no-write", action="store_true", help="print, leave the docs alone")
    parser.add_argument(
        "--force", action="store_true", help="publish even if other work shared the machine"
    )
    return parser.parse_args(argv)


Results = dict[tuple[str, str], dict[str, list[dict[str, Any]]]]
"""(model, schedule) -> system -> each round's result (times and first loss, or an error)."""


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    command = shlex.join(["python", "benchmarks/bench_hf.py", *(argv or sys.argv[1:])])
    rows = [(m, s) for m in args.models for s in args.schedules]
    results: Results = {row: {system: [] for system in SYSTEMS} for row in rows}
    started, loads = time.perf_counter(), [load_average()]
    print(f"load average before: {loads[0]:.2f}", flush=True)
    for index in range(args.rounds):
        order = SYSTEMS[index % 2 :] + SYSTEMS[: index % 2]  # alternate who goes first
        for model, schedule in rows:
            for system in order:
                done = results[model, schedule][system]
                if done and "error" in done[-1]:
                    continue  # it failed on this row: it is not run on it again
                spec = Spec(system, model, schedule, args.batch, args.seq_len,
                            args.microbatches, args.warmup, args.steps)  # fmt: skip
                begun = time.perf_counter()
                done.append(run(spec))
                if system == "torch" and done[-1].get("conveyor_imported"):
                    raise SystemExit("torch's processes imported conveyor: not side by side")
                loads.append(load_average())
                print(f"round {index} {model} {schedule} {system}: {summary(done[-1])} "
                      f"({time.perf_counter() - begun:.0f} s); load {loads[-1]:.1f}",
                      flush=True)  # fmt: skip
    loads.append(load_average())
    print(f"load average after: {loads[-1]:.2f}", flush=True)
    text = render(args, command, results, loads, time.perf_counter() - started)
    print(text)
    if not args.no_write and publishable(loads, args.force):
        write_section("hf", text)


def summary(result: dict[str, Any]) -> str:
    if "error" in result:
        return f"fails: {result['error']}"
    ms = statistics.median(result["times"]) * 1e3
    return f"{ms:.1f} ms/step, first-step loss {result['loss']}"


def render(
    args: argparse.Namespace, command: str, results: Results, loads: list[float], seconds: float
) -> str:
    lines = [
        "## Hugging Face models: conveyor vs torch.distributed.pipelining, each out of the box",
        "",
        f"Command: `{command}` ({seconds / 60:.1f} min) on {platform.machine()}, "
        f"{os.cpu_count()} CPU cores, torch {torch.__version__}, transformers "
        f"{transformers.__version__}. Load average (1 min) during the run: {min(loads):.1f} to "
        f"{max(loads):.1f}"
        + (
            " — the CPU was shared with other work, so step times are noisier and slower "
            "than on an idle machine; ratios come from alternating rounds."
            if shared(loads)
            else "."
        ),
        "",
        "Models from small transformers configs, random weights, `use_cache=False`, no "
        "dropout: GPT-2 (12 blocks, width 128, tied embedding and head), Llama, Qwen2 and "
        "Mistral (8 blocks, width 128, 4 heads, 2 key-value heads); vocabulary 2048. "
        f"Batch {args.batch} x {args.seq_len} tokens (ids and an all-ones attention mask), "
        f"{args.microbatches} micro-batches, loss = cross entropy of the shifted logits, SGD. "
        f"{RANKS} gloo ranks of 1 thread each; blocks spread evenly: 2 stages for 1f1b, 4 (2 "
        "per rank, loop) for interleaved-1f1b; conveyor with `split_points` and "
        "`example_inputs`, torch with `pipeline()`, a `SplitPoint.BEGINNING` per cut and "
        "`Schedule1F1B` / `ScheduleInterleaved1F1B`. Each (model, schedule, system) in "
        "fresh processes (torch's never import conveyor), alternating, "
        f"{args.rounds} rounds of {args.steps} steps after {args.warmup} warm-up; step = "
        "slower rank's zero_grad + step + optimizer.step between barriers; figures are medians "
        "over rounds of each round's median. A system that fails on a row is run on it once.",
        "",
        "| model | schedule | conveyor ms | torch ms | conveyor speed-up = torch ms / conveyor "
        "ms [95% bootstrap interval of the median] (per-round min to max) | first-step loss "
        "conveyor / torch |",
        "|---|---|---|---|---|---|",
    ]
    lines += [row(model, schedule, found) for (model, schedule), found in results.items()]
    lines += ["", verdict(results)]
    return "\n".join(lines) + "\n"


def medians(found: list[dict[str, Any]]) -> list[float]:
    return [statistics.median(r["times"]) for r in found if "times" in r]


def row(model: str, schedule: str, found: dict[str, list[dict[str, Any]]]) -> str:
    ours, theirs = medians(found["conveyor"]), medians(found["torch"])

    def cell(system: str, values: list[float]) -> str:
        if values:
            return f"{statistics.median(values) * 1e3:.0f}"
        error = next((r["error"] for r in found[system] if "error" in r), "not run")
        return f"fails: {system}: {error}"

    speedup = "-"
    if ours and theirs:
        ratios = [t / o for o, t in zip(ours, theirs, strict=False)]
        low, high = bootstrap_interval(ratios)
        speedup = (
            f"**{statistics.median(theirs) / statistics.median(ours):.2f}** "
            f"[{low:.2f}, {high:.2f}] ({min(ratios):.2f} to {max(ratios):.2f})"
        )
    return (
        f"| {model} | {schedule} | {cell('conveyor', ours)} | {cell('torch', theirs)} | "
        f"{speedup} | {losses(found)} |"
    )


def first_loss(found: list[dict[str, Any]]) -> float | None:
    return next((r["loss"] for r in found if r.get("loss") is not None), None)


def losses(found: dict[str, list[dict[str, Any]]]) -> str:
    """The first step's loss of each system; marked where they differ beyond tolerance."""
    ours, theirs = first_loss(found["conveyor"]), first_loss(found["torch"])
    text = " / ".join("-" if v is None else f"{v:.5f}" for v in (ours, theirs))
    if ours is not None and theirs is not None and not same_loss(ours, theirs):
        text += f" **differ** (beyond {LOSS_TOLERANCE:g} relative)"
    return text


def same_loss(a: float, b: float) -> bool:
    return abs(a - b) <= LOSS_TOLERANCE * max(abs(a), abs(b))


def verdict(results: Results) -> str:
    """Which comparable rows have conveyor at least as fast as torch."""
    compared = {
        key: statistics.median(medians(f["torch"])) / statistics.median(medians(f["conveyor"]))
        for key, f in results.items()
        if medians(f["torch"]) and medians(f["conveyor"])
    }
    slower = [f"{m} {s} ({r:.2f})" for (m, s), r in compared.items() if r < 1.0]
    return (
        f"conveyor's speed-up is at least 1.0 on {len(compared) - len(slower)} of the "
        f"{len(compared)} rows both systems run"
        + (f"; below 1.0 on {', '.join(slower)}." if slower else ".")
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(Spec(**json.loads(Path(sys.argv[2]).read_text())), int(sys.argv[3]))
    else:
        main()
