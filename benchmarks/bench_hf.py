"""Hugging Face models: conveyor vs torch.distributed.pipelining, each out of the box.

    python benchmarks/bench_hf.py                 # GPT-2 (12 layers) and Llama (8 layers)
    python benchmarks/bench_hf.py --rounds 1 --steps 3 --no-write

Both systems split the same unedited model (transformers, small config, random weights) before
the same middle layer through torch.export, run the same schedule (1F1B), micro-batches and
batch on 2 gloo ranks of one thread each, with the same loss (cross-entropy of the shifted
logits) and SGD step. Each system runs in processes of its own, nothing shared between them,
and the two alternate round by round; a step is the slower rank's zero_grad + step + optimizer
step between barriers, median over the steps of a round, and the table gives the median over
rounds and the ratio. Results go to the `hf` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F  # noqa: N812
import transformers
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_section

import conveyor

VOCAB = 2048


def build(name: str) -> tuple[nn.Module, str]:
    """The model and the layer its second stage starts at."""
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_layer=12, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=256,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config), "transformer.h.6"
    config = transformers.LlamaConfig(
        num_hidden_layers=8, hidden_size=128, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config), "model.layers.4"


def causal_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    if isinstance(output, torch.Tensor):  # torch.distributed.pipelining returns the bare logits
        logits = output
    else:
        logits = output.logits if hasattr(output, "logits") else output[0]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def conveyor_step(
    model: nn.Module, point: str, batch: dict[str, Any], args: Any
) -> Callable[[], None]:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    pipe = conveyor.Pipeline(model, split_points=[point], num_microbatches=args.microbatches,
                             example_inputs=inputs, loss_fn=causal_loss)  # fmt: skip
    optimizer = torch.optim.SGD(pipe.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad()
        pipe.step(inputs, batch["labels"])
        optimizer.step()

    return step


def torch_step(
    model: nn.Module, point: str, batch: dict[str, Any], args: Any
) -> Callable[[], None]:
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    inputs = {k: v for k, v in batch.items() if k != "labels"}
    chunk = {k: v.tensor_split(args.microbatches)[0] for k, v in inputs.items()}
    pipe = pipeline(model, mb_args=(), mb_kwargs=chunk, split_spec={point: SplitPoint.BEGINNING})
    rank = dist.get_rank()
    stage = pipe.build_stage(rank, torch.device("cpu"))
    schedule = Schedule1F1B(stage, args.microbatches, loss_fn=causal_loss)
    optimizer = torch.optim.SGD(stage.submod.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(**inputs)
        else:
            schedule.step(target=batch["labels"], losses=[])
        optimizer.step()

    return step


SYSTEMS = {"conveyor": conveyor_step, "torch.distributed.pipelining": torch_step}


def worker(rank: int, name: str, system: str, args: Any, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=600))  # fmt: skip
    try:
        median = measure(rank, name, system, args)
        if rank == 0:
            Path(out).write_text(json.dumps({"median_s": median}))
    except Exception as error:  # a system that cannot run this model: record why, do not hide it
        Path(f"{out}.{rank}").write_text(describe(error))
    finally:
        dist.destroy_process_group()


def describe(error: BaseException) -> str:
    """The first line of the error and of its root cause (the peer wraps the cause)."""
    root = error
    while root.__cause__ is not None:
        root = root.__cause__

    def line(e: BaseException) -> str:
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"

    return (line(error) + (f" ({line(root)})" if root is not error else ""))[:400]


def measure(rank: int, name: str, system: str, args: Any) -> float:
    model, point = build(name)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (args.batch, args.seq_len), generator=generator)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    step = SYSTEMS[system](model, point, batch, args)
    times = []
    for index in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        if index >= args.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(name: str, system: str, args: Any) -> dict[str, Any]:
    """One round of one system; a failed rank's own error, not its peer's lost connection."""
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory, "result.json")
        mp.spawn(worker, args=(name, system, args, str(Path(directory, "store")), str(out)),  # type: ignore[no-untyped-call]
                 nprocs=2)  # fmt: skip
        errors = sorted((p.read_text() for p in Path(directory).glob("result.json.*")),
                        key=lambda text: "closed by peer" in text)  # fmt: skip
        if errors:
            return {"error": errors[0]}
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = []
    for name in args.models:
        medians: dict[str, list[float]] = {system: [] for system in SYSTEMS}
        errors: dict[str, str] = {}
        for _ in range(args.rounds):
            for system in SYSTEMS:  # alternate, so drift in the machine hits both
                result = run(name, system, args)
                if "error" in result:
                    errors[system] = result["error"]
                else:
                    medians[system].append(result["median_s"])
            print(name, {s: [f"{t * 1e3:.1f}" for t in v] for s, v in medians.items()}, errors)
        rows.append((name, medians, errors))
    text = render(args, rows, time.perf_counter() - started)
    print(text)
    if not args.no_write:
        write_section("hf", text)


def render(args: Any, rows: list[Any], seconds: float) -> str:
    lines = [
        "## Hugging Face models: conveyor vs torch.distributed.pipelining, out of the box",
        "",
        f"Command: `python benchmarks/bench_hf.py` ({seconds / 60:.1f} min). Each system in its "
        f"own 2 gloo processes (1 thread each), alternating, {args.rounds} rounds of "
        f"{args.steps} steps after {args.warmup} warm-up; batch {args.batch} x {args.seq_len} "
        f"tokens, {args.microbatches} micro-batches, 1F1B, the same split (before the middle "
        "layer, through torch.export), loss and SGD step. Step time: median over rounds of "
        "each round's median.",
        "",
        "| model | conveyor ms/step | torch.distributed.pipelining ms/step | conveyor / torch |",
        "|---|---|---|---|",
    ]
    for name, medians, errors in rows:
        ours = statistics.median(medians["conveyor"]) if medians["conveyor"] else None
        peer = medians["torch.distributed.pipelining"]
        theirs = statistics.median(peer) if peer else None
        ratio = f"{ours / theirs:.2f}" if ours and theirs else "—"
        peer_text = (
            f"{theirs * 1e3:.1f}"
            if theirs
            else f"fails: {errors.get('torch.distributed.pipelining', '')}"
        )
        ours_text = f"{ours * 1e3:.1f}" if ours else f"failed: {errors.get('conveyor', '')}"
        lines.append(f"| {name} | {ours_text} | {peer_text} | {ratio} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
