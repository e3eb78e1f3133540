"""One long request on 2 ranks: the unsplit model, a pipeline, context parallelism (cp = 2) and
tensor parallelism, measured side by side and predicted by the planner's comparison of
parallelisms (conveyor.planner.parallelism) from costs measured in the same run.

    python benchmarks/bench_long_context.py          # the 'long-context' section of benchmarks.md
    python benchmarks/bench_long_context.py --quick  # short prompts, one round, nothing written

A Llama-style model (Hugging Face LlamaForCausalLM from a small config: 4 layers, width 256,
4 heads, float32, a static KV cache in every mode) generates 32 tokens after one prompt of
4k, 16k and 64k tokens. Every mode runs in the same two gloo processes (1 thread each),
alternating mode by mode inside each round: the unsplit model on rank 0 (1 and 2 threads)
while rank 1 waits, the pipeline (2 stages, the prompt prefilled in eight chunks as the
planner plans it), cp = 2 (DecodePipeline(cp=2): its decode exchanges through shared
memory, and again with cp_exchange="group", as gloo messages) and tensor parallelism (torch's
parallelize_module over the attention and MLP projections, both ranks running the
generation). Time to first token and decode tokens/s come from ``DecodePipeline.stats``;
medians over rounds, the spread (min-max) beside them. The prediction: right after each
prompt's rounds, each unit (embedding, one block, head) profiled at decode and prefill shapes
with the static cache the modes use (prefill chunks both from an empty cache and after cached
ones, which a model may run another way), on both ranks at once and on one alone (Note
[profiled as the mode runs]), and tp's split block and cp's block (with each of its exchanges)
at decode, the profiles pooled over the run; the point-to-point link between them, an
all-reduce and the shared-memory exchange measured between work, as decode meets them
(``measure_between_work``), in every round next to the modes and pooled over the rounds (Note
[links sampled through the run]); and ``estimate`` run for each mode.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import two_ranks, write_section

from conveyor.inference.config import GenerationConfig
from conveyor.inference.cost import StageFit, profile_stage
from conveyor.pipeline.decode import DecodePipeline, as_causal_lm
from conveyor.planner.calibrate import measure_between_work
from conveyor.planner.parallelism import (
    LayerCosts,
    estimate,
    measured_overhead,
    pipeline_chunk,
)
from conveyor.simulator import Link

MODES = ("unsplit, 1 thread", "unsplit, 2 threads", "pipeline", "cp = 2", "cp = 2, gloo",
         "tp = 2")  # fmt: skip
STRATEGY = {"unsplit, 1 thread": ("pipeline", 1), "pipeline": ("pipeline", 2),
            "cp = 2": ("context", 2), "cp = 2, gloo": ("context", 2),
            "tp = 2": ("tensor", 2)}  # fmt: skip
"""The planner's strategy and device count that predicts each mode."""
LINKS = ("exchange", "all_reduce", "shared")
"""The links measured between work: messages, all-reduces, the shared-memory exchange."""


def build(context: int) -> Any:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=context,
        pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def tensor_parallel(model: Any) -> Any:
    """``model`` with every layer's projections split over the two ranks (Megatron-style)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan: dict[str, Any] = {}
    for i in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):  # fmt: skip
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, init_device_mesh("cpu", (2,)), plan)
    return model


def worker(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(0, 3600)
    )
    context = max(args.prompts) + args.new_tokens
    plain = build(context)
    pipeline = DecodePipeline(build(context), timeout_s=3600)
    cp = DecodePipeline(build(context), cp=2, timeout_s=3600)
    cp_gloo = DecodePipeline(build(context), cp=2, timeout_s=3600, cp_exchange="group")
    split = tensor_parallel(build(context))
    tp = DecodePipeline(split, local=True)
    links = [_links()]
    runs = {
        "unsplit, 1 thread": lambda ids: _alone(rank, plain, ids, args.new_tokens, 1),
        "unsplit, 2 threads": lambda ids: _alone(rank, plain, ids, args.new_tokens, 2),
        "pipeline": lambda ids: _run(pipeline, ids, args.new_tokens, cache="static", chunks=2),
        "cp = 2": lambda ids: _run(cp, ids, args.new_tokens),
        "cp = 2, gloo": lambda ids: _run(cp_gloo, ids, args.new_tokens),
        "tp = 2": lambda ids: _run(tp, ids, args.new_tokens, cache="static"),
    }
    results: dict[Any, Any] = {"loads": [os.getloadavg()[0]], "profiles": {}}
    for prompt in args.prompts:
        ids = torch.randint(1, 1024, (1, prompt), generator=torch.Generator().manual_seed(prompt))
        measured: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
        for round_index in range(0 if args.measured else args.rounds):
            order = MODES if round_index % 2 == 0 else MODES[::-1]  # alternate the order
            for mode in order:
                dist.barrier()
                found = runs[mode](ids)
                if found is not None:
                    measured[mode].append(found)
            links.append(_links())
            print(f"rank {rank}: prompt {prompt} round {round_index} done", flush=True)
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, measured)
        results[prompt] = {m: gathered[0][m] or gathered[1][m] for m in MODES}
        split_lms = {"tp = 2": split, "cp = 2": cp.lm, "cp = 2, gloo": cp_gloo.lm}
        results["profiles"][prompt] = _profiles(rank, args, plain, split_lms)
    results["loads"].append(os.getloadavg()[0])
    results["links"] = links
    dist.barrier()
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def _profiles(
    rank: int, args: argparse.Namespace, plain: Any, split: dict[str, Any]
) -> dict[str, Any]:
    """The units' fits a prompt's modes are predicted from, profiled right after its rounds
    (Note [profiled as the mode runs]): on both ranks at once, on rank 0 alone, and the block
    of each mode that splits it (at decode)."""
    found = {"both": _both(_profile(plain, args))}
    for mode, lm in split.items():
        found[mode] = _both(_profile(lm, args, units=("block",), decode_only=True))["block"]
    found["alone"] = _profile(plain, args) if rank == 0 else None
    return found


def _both(fits: dict[str, Any]) -> dict[str, Any]:
    """Fits both ranks profiled at once, averaged over the two."""
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, fits)
    return {k: (gathered[0][k] + gathered[1][k]) * 0.5 for k in fits}


# Note [links sampled through the run]:
# A message between two ranks that have just computed costs what the machine's scheduler makes
# of it, and on 2 CPU cores that moves from minute to minute: the mean exchange after 2 ms of
# work measured 0.26 ms in one run and 0.4-2.5 ms in five runs on the same machine an hour
# later. Calibrated once, the links describe one moment; calibrated after every round and
# pooled (mean latency, mean seconds per byte), they describe the minutes the modes ran in.
def _links() -> tuple[Link, ...]:
    """Each of ``LINKS``, measured between work."""
    return tuple(measure_between_work(kind) for kind in LINKS)  # type: ignore[arg-type]


def _pooled(links: list[Link]) -> Link:
    """One link for several calibrations: their mean latency and mean seconds per byte."""
    latency = statistics.mean(link.latency for link in links)
    return Link(latency, 1.0 / statistics.mean(1.0 / link.bandwidth for link in links))


def _alone(
    rank: int, model: Any, ids: torch.Tensor, new_tokens: int, threads: int
) -> tuple[float, float] | None:
    """The unsplit model on rank 0 (rank 1 waits at the next barrier)."""
    if rank != 0:
        return None
    torch.set_num_threads(threads)
    try:
        return _run(DecodePipeline(model, local=True), ids, new_tokens, cache="static")
    finally:
        torch.set_num_threads(1)


def _run(
    decoder: DecodePipeline,
    ids: torch.Tensor,
    new_tokens: int,
    chunks: int | None = None,
    **options: Any,
) -> tuple[float, float] | None:
    """(time to first token, decode tokens/s) where the rank knows them (the last stage);
    ``chunks``: prefill in the chunks the planner gives a pipeline of that many stages."""
    if chunks is not None:
        options["prefill_chunk"] = pipeline_chunk(ids.shape[1], chunks)
    decoder.generate(ids, max_new_tokens=new_tokens, **options)
    stats = decoder.stats
    if stats is None or stats.time_to_first_token is None or stats.decode_tokens_per_s is None:
        return None
    return stats.time_to_first_token, stats.decode_tokens_per_s


def _profile(
    model: Any,
    args: argparse.Namespace,
    units: tuple[str, ...] = ("embed", "block", "head"),
    decode_only: bool = False,
) -> dict[str, Any]:
    """``units``' fits (of the embedding, one block, the head), with the static cache the
    modes run with; decode (16 steps) measured after prompts up to a quarter of the longest
    (``_starts``), prefill chunks of 512 to 8k tokens from an empty cache and the two chunks
    after one, all extrapolated linearly in tokens and query-key pairs."""
    lm = as_causal_lm(model)
    longest = max(args.prompts)
    chunks = [] if decode_only else sorted({min(longest // 4, c) for c in (512, 2048, 4096, 8192)})
    last = lm.num_units - 1
    where = {"embed": range(0, 1), "block": range(1, 2), "head": range(last, last + 1)}
    config = GenerationConfig(cache="static")
    return {
        name: profile_stage(
            lm,
            where[name],
            rows=[1],
            starts=_starts(args),
            chunks=chunks,
            resumed=0 if decode_only else 2,
            config=config,
            steps=16,
            repeats=2,
        )
        for name in units
    }


def _starts(args: argparse.Namespace) -> list[int]:
    """The cached tokens decode is profiled after: up to a quarter of the longest prompt."""
    return sorted({min(max(args.prompts) // 4, s) for s in (512, 2048, 8192, 16384)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="prompts 1k and 2k, one round")
    parser.add_argument("--no-write", action="store_true", help="print, do not publish")
    parser.add_argument("--force", action="store_true", help="publish even on a busy machine")
    parser.add_argument("--save", type=Path, help="also write the runs and the profile here")
    parser.add_argument(
        "--measured",
        type=Path,
        help="take the runs a --save wrote, profile afresh and predict them",
    )
    parser.add_argument(
        "--render", type=Path, help="measure nothing: render what a --save wrote, as it was"
    )
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.rounds, args.no_write = [1024, 2048], 1, True
    saved_at = args.measured or args.render
    earlier = torch.load(saved_at, weights_only=False) if saved_at else None
    if earlier is not None:
        args.prompts, args.rounds = earlier["prompts"], earlier["rounds"]
        args.new_tokens = earlier["new_tokens"]
    before = os.getloadavg()[0]
    print(f"load average before: {before:.2f}", flush=True)
    results = earlier if args.render else two_ranks(worker, args)
    after = os.getloadavg()[0]
    if earlier is not None:
        results.update({p: earlier[p] for p in args.prompts})
        before, after = earlier["loads"]
    elif args.save is not None:  # the runs, and the profiles and links predicted from
        saved = {"prompts": args.prompts, "rounds": args.rounds, "new_tokens": args.new_tokens}
        torch.save({**results, **saved, "loads": (before, after)}, args.save)
    text = render(args, results, before, after)
    print(text)
    if args.no_write:
        return
    if before > 1.0 and not args.force:  # its own two ranks keep the load near 2 after
        print("not published: the machine was busy (load above 1 before); rerun alone or --force")
        return
    write_section("long-context", text)


def render(args: argparse.Namespace, results: dict[Any, Any], before: float, after: float) -> str:
    links = results["links"]
    link, collective, shared = (_pooled([each[i] for each in links]) for i in range(3))
    latencies = [each[0].latency * 1e6 for each in links]
    profiles = list(results["profiles"].values())
    costs = _costs_by_mode(args, _pooled_profile(profiles), (link, collective, shared))
    lines = [
        "## One long request: pipeline, tensor and context parallelism, measured and predicted",
        "",
        f"`python benchmarks/bench_long_context.py` ({args.rounds} rounds, mode order "
        f"alternating; load average {before:.2f} before, {after:.2f} after, the benchmark's own "
        f"two busy ranks included; {os.cpu_count()} "
        f"CPU cores, torch {torch.__version__}). Llama-style model: 4 layers, width 256, 4 "
        f"heads, float32, static KV cache; batch 1, {args.new_tokens} new tokens. Median "
        "(min-max); *pred.* is the planner's estimate from the costs profiled "
        + (
            f"in a later run on the same machine (the runs: `--measured {args.measured.name}`) "
            if args.measured
            else "in the same run, after each prompt's rounds, "
        )
        + f"and pooled over the {len(profiles)} profiles (each mode's "
        "units profiled as its ranks run them: the unsplit model's and the pipeline's decode on "
        "one rank while the other waits, the rest on both ranks at once; tp's split layer costs "
        f"{costs['tp = 2'].tensor_overhead * 1e3:.2f} ms more than the planner's share of the "
        "work and its two all-reduces: torch's DTensor dispatch; a cp layer "
        f"{costs['cp = 2'].context_overhead * 1e3:.2f} ms (shared memory) and "
        f"{costs['cp = 2, gloo'].context_overhead * 1e3:.2f} ms (gloo) more than its share of the "
        "attention and its exchange: the shard's mask, packing and merging the partial "
        "results, and over gloo what its collective costs beyond one message; "
        f"messages between work, measured {len(links)} times through the run and pooled: "
        f"point-to-point {link.latency * 1e6:.0f} us (each time {min(latencies):.0f}-"
        f"{max(latencies):.0f}) + "
        f"{link.bandwidth / 1e9:.2f} GB/s; all-reduce {collective.latency * 1e6:.0f} us a step + "
        f"{collective.bandwidth / 1e9:.2f} GB/s; cp's shared-memory exchange "
        f"{shared.latency * 1e6:.0f} us + {shared.bandwidth / 1e9:.2f} GB/s), "
        "*err.* its error against the median.",
        "",
        "| prompt | mode | time to first token (s) | pred. | err. | decode tokens/s | pred. | "
        "err. | decode vs pipeline | decode vs unsplit (2 threads) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for prompt in args.prompts:
        rows = results[prompt]
        base = {m: _median([d for _, d in rows[m]]) for m in MODES if rows.get(m)}
        for mode in MODES:
            if not rows.get(mode):  # older --save runs lack newer modes
                continue
            ttft, decode = [t for t, _ in rows[mode]], [d for _, d in rows[mode]]
            exchange = shared if mode == "cp = 2" else link
            predicted = _predicted(
                mode, costs, (link, collective, exchange), prompt, args.new_tokens
            )
            lines.append(
                f"| {prompt} | {mode} | {_spread(ttft)} | {_pred(predicted, 0)} | "
                f"{_error(predicted, 0, ttft)} | {_spread(decode)} | {_pred(predicted, 1)} | "
                f"{_error(predicted, 1, decode)} | {_median(decode) / base['pipeline']:.2f}x | "
                f"{_median(decode) / base['unsplit, 2 threads']:.2f}x |"
            )
    return "\n".join(lines)


def _pooled_profile(profiles: list[dict[str, Any]]) -> dict[str, Any]:
    """One profile for several taken through the run: each fit's mean (Note [profiled as the
    mode runs])."""

    def mean(fits: list[Any]) -> Any:
        return sum(fits[1:], fits[0]) * (1.0 / len(fits))

    pooled: dict[str, Any] = {}
    for key, first in profiles[0].items():
        if isinstance(first, dict):
            pooled[key] = {unit: mean([p[key][unit] for p in profiles]) for unit in first}
        else:
            pooled[key] = mean([p[key] for p in profiles])
    return pooled


def _costs_by_mode(
    args: argparse.Namespace, profile: dict[str, Any], links: tuple[Link, Link, Link]
) -> dict[str, LayerCosts]:
    """The costs each mode is predicted from: profiled as its ranks run (Note [profiled as
    the mode runs])."""
    together, alone = profile["both"], profile["alone"]
    pipeline = {k: StageFit(alone[k].decode, v.prefill, v.resumed) for k, v in together.items()}
    both, starts = _layer_costs(together), _starts(args)
    tensor = measured_overhead("tensor", both, profile["tp = 2"].decode, links[1], 2, starts)
    context = {
        mode: measured_overhead("context", both, profile[mode].decode, link, 2, starts)
        for mode, link in (("cp = 2", links[2]), ("cp = 2, gloo", links[0]))
    }
    return {
        "unsplit, 1 thread": _layer_costs(alone),
        "pipeline": _layer_costs(pipeline),
        **{mode: replace(both, context_overhead=c) for mode, c in context.items()},
        "tp = 2": replace(both, tensor_overhead=tensor),
    }


# Note [profiled as the mode runs]:
# The machine's speed drifts by 10-30% from minute to minute, and one profile describes its
# minute: profiled after each prompt's rounds, the same shapes gave predictions up to 1.9 times
# apart in one run. So the units are profiled after every prompt's rounds and the fits pooled
# (their mean), as the links are (Note [links sampled through the run]). On 2 CPU cores the two
# ranks share one memory bus, so a unit costs more while the other rank works too: decode over a
# long cache most, as it reads the cache at the bus's speed. Each mode is predicted from the
# costs its ranks meet: the unsplit model from units profiled on one rank while the other waits;
# cp and tp from units profiled on both ranks at once; the pipeline's chunked prefill, in which
# both stages work at once, from the latter and its decode, in which one rank works at a time,
# from the former. tp's layers are also profiled split (both ranks, torch's parallelize_module):
# what they cost beyond their share of the work and their two all-reduces is the framework's
# dispatch of sharded weights, the planner's ``tensor_overhead``. cp's layers are profiled at
# decode as its group runs them, with each of its exchanges: what they cost beyond their half of
# the attention and one exchange is the planner's ``context_overhead``.
def _layer_costs(fits: dict[str, StageFit]) -> LayerCosts:
    """The planner's costs of the benchmark's model from its units' fits."""
    return LayerCosts(
        fits["embed"], fits["block"], fits["head"], hidden_size=256, num_heads=4,
        dtype_bytes=4, block_params=0, head_params=0,
    )  # fmt: skip


def _predicted(
    mode: str,
    costs: dict[str, LayerCosts],
    links: tuple[Link, Link, Link],
    prompt: int,
    new_tokens: int,
) -> tuple[float, float] | None:
    if mode not in STRATEGY:
        return None
    strategy, devices = STRATEGY[mode]
    found = estimate(
        strategy, costs[mode], 4, links[0], devices, prompt, new_tokens,  # type: ignore[arg-type]
        collective=links[1], exchange=links[2],
    )  # fmt: skip
    return None if found is None else (found.time_to_first_token, found.decode_tokens_per_s)


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _spread(values: list[float]) -> str:
    return f"{_median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def _pred(predicted: tuple[float, float] | None, index: int) -> str:
    return "-" if predicted is None else f"{predicted[index]:.3g}"


def _error(predicted: tuple[float, float] | None, index: int, values: list[float]) -> str:
    if predicted is None:
        return "-"
    return f"{predicted[index] / _median(values) - 1:+.0%}"


if __name__ == "__main__":
    main()
