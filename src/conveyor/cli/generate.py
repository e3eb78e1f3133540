"""`conveyor generate` (the demo GPT or a Hugging Face causal LM saved on disk, pipelined over
local ranks) and `conveyor simulate --decode` (a decode Program as a rank x time grid).

    conveyor generate --prompt "def " --max-new-tokens 64            # the demo GPT, 2 ranks
    conveyor generate --model path/to/saved_model --prompt-ids 1,2,3 --do-sample --seed 1
    conveyor simulate --decode --stages 2 --groups 2 --new-tokens 4
Each rank runs ``python -m conveyor.cli.generate_rank`` under torchrun.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.cli.flags import add_dataclass_flags, build_dataclass, given_fields, read_toml
from conveyor.cli.launch import torchrun
from conveyor.graph import chain
from conveyor.inference import GenerationConfig, decode_items, decode_program
from conveyor.pipeline.decode import DecodePipeline
from conveyor.simulator import simulate
from conveyor.trace import render_grid

__all__ = [
    "GenerateJob",
    "add_decode_flags",
    "add_generate_command",
    "load_model",
    "run",
    "simulate_decode",
    "worker",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class GenerateJob:
    """What `conveyor generate` runs: which model, on how many ranks, after which prompts."""

    ranks: int = 2
    """Processes to start: pipeline stages times cp."""
    cp: int = 1
    """Ranks per context-parallel group: each stage is served by cp ranks that split every
    sequence's KV cache along its length (the stages are ranks / cp)."""
    model: str = "gpt"
    """'gpt' (conveyor's demo GPT) or the directory of a Hugging Face causal LM saved with
    save_pretrained (read from disk, never downloaded)."""
    checkpoint: str | None = None
    """With --model gpt: a conveyor checkpoint (a step-N directory, or the directory a run
    saved them in: its newest valid one) to load the weights from; without one the weights
    are random (seeded by init_seed)."""
    prompt: tuple[str, ...] = ("def ",)
    """Prompt texts, one sequence each (the demo GPT reads characters; a Hugging Face model
    its tokenizer, if saved with it)."""
    prompt_ids: tuple[str, ...] = ()
    """Prompts as comma-separated token ids ('1,2,3'), instead of texts."""
    batch_size: int | None = None
    """Sequences to generate: the prompts repeated in turn (default: one per prompt)."""
    balance: tuple[int, ...] | None = None
    """Units per stage (embedding, blocks, head); default: the blocks evenly."""
    dim: int = 64
    """With --model gpt: model width."""
    num_layers: int = 4
    """With --model gpt: transformer blocks."""
    num_heads: int = 4
    """With --model gpt: attention heads."""
    seq_len: int = 256
    """With --model gpt: context (positions)."""
    init_seed: int = 0
    """With --model gpt and no checkpoint: seed of the random weights."""
    trace: str | None = None
    """Record the generation's timeline to DIR (timeline.png, trace.json)."""

    def __post_init__(self) -> None:
        for name in ("ranks", "cp", "batch_size", "dim", "num_layers", "num_heads", "seq_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.model != "gpt" and not Path(self.model).is_dir():
            raise ValueError(
                f"--model {self.model!r} is neither 'gpt' nor a directory; pass the directory "
                "a Hugging Face model was saved to (model.save_pretrained(DIR))"
            )
        if self.ranks % self.cp:
            raise ValueError(
                f"--cp {self.cp} does not divide --ranks {self.ranks}: the ranks are pipeline "
                f"stages times cp; pass --ranks {self.cp * max(1, self.ranks // self.cp)}"
            )
        stages = self.ranks // self.cp
        if self.balance is not None and len(self.balance) != stages:
            raise ValueError(
                f"--balance gives {len(self.balance)} stages for --ranks {self.ranks} with "
                f"--cp {self.cp}: conveyor generate runs one stage per {self.cp} rank(s); pass "
                f"--ranks {len(self.balance) * self.cp} or a balance of {stages} entries"
            )
        for text in self.prompt_ids:
            tokens = text.split(",")
            if not all(t.strip().isdigit() for t in tokens):
                raise ValueError(
                    f"--prompt-ids {text!r}: expected token ids separated by commas, e.g. 1,2,3"
                )


def add_generate_command(commands: Any) -> None:
    """Add the ``generate`` subcommand to the ``conveyor`` parser."""
    parser = commands.add_parser(
        "generate",
        help="generate tokens with a model pipelined over local ranks (KV cache per stage)",
        description="Generate after the prompts with the demo GPT or a saved Hugging Face "
        "causal LM, split over --ranks local processes, each keeping the KV caches of its own "
        "stages, with groups of sequences in flight. Prints the text, the time to first token "
        "and the decode throughput.",
    )
    parser.add_argument("--config", type=Path, help="TOML file with job and generation fields")
    add_dataclass_flags(parser, GenerateJob)
    add_dataclass_flags(parser, GenerationConfig, skip=("dst",))
    parser.set_defaults(command=_generate)


def _generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    values = read_toml(args.config, GenerateJob, GenerationConfig) if args.config else {}
    if "dst" in values:
        raise ValueError(f"{args.config} sets dst; conveyor generate gives every rank the tokens")
    job = build_dataclass(GenerateJob, args, values)
    options = given_fields(GenerationConfig, args, values)
    GenerationConfig(**options)  # bad settings fail here, before any rank starts
    payload = {"job": dataclasses.asdict(job), "options": options}
    return torchrun(
        [
            "--nproc-per-node",
            str(job.ranks),
            "-m",
            "conveyor.cli.generate_rank",
            json.dumps(payload),
        ],
        resumable=False,
    )


def add_decode_flags(simulate_parser: argparse.ArgumentParser) -> None:
    """Flags of ``conveyor simulate --decode``."""
    simulate_parser.add_argument(
        "--decode", action="store_true", help="simulate a decode Program instead of training"
    )
    # no defaults here: a flag given with its default value is still given, and refused
    # without --decode (conveyor.cli.main._given); simulate_decode fills DECODE_DEFAULTS
    simulate_parser.add_argument(
        "--groups", type=int, help="with --decode: groups of sequences in flight (default 2)"
    )
    simulate_parser.add_argument(
        "--new-tokens", type=int, help="with --decode: tokens to generate (default 4)"
    )
    simulate_parser.add_argument(
        "--prompt-chunks",
        type=int,
        help="with --decode: prefill chunks per prompt, each one unit like a token (default 1)",
    )


DECODE_DEFAULTS = {"groups": 2, "new_tokens": 4, "prompt_chunks": 1}


def simulate_decode(args: argparse.Namespace) -> int:
    """``conveyor simulate --decode``: the decode Program's grid and its busy share."""
    for name, default in DECODE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    graph = chain(args.stages)
    items = decode_items(args.groups, args.prompt_chunks, args.new_tokens, 1)
    program = decode_program(graph, items)
    timeline = simulate(program, graph)
    timeline.meta["schedule"] = "decode"
    print(render_grid(timeline))
    print(
        f"decode: ranks={args.stages} groups={args.groups} new_tokens={args.new_tokens} "
        f"prompt_chunks={args.prompt_chunks} items={len(items)} (item k: group k mod "
        f"{args.groups}) span={timeline.step_time:g} units (every item F=1 per stage) "
        f"busy={1 - timeline.bubble_fraction:.1%}"
    )
    if args.actions:
        print("\n".join(f"rank {r}: {' '.join(map(str, a))}" for r, a in enumerate(program)))
    return 0


# -- the worker (one per rank, under torchrun) ---------------------------------------------


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
"""Files a tokenizer saved beside a model leaves (save_pretrained)."""


def load_model(job: GenerateJob) -> tuple[nn.Module, Any]:
    """(model, tokenizer or None), built the same way on every rank."""
    if job.model != "gpt":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model: Any = AutoModelForCausalLM.from_pretrained(job.model, local_files_only=True)
        tokenizer = None  # saved without one: ids in, ids out
        if any((Path(job.model) / name).is_file() for name in _TOKENIZER_FILES):
            tokenizer = AutoTokenizer.from_pretrained(job.model, local_files_only=True)
        return model, tokenizer
    from conveyor.checkpoint import CheckpointError
    from conveyor.checkpoint import load_model as load_checkpoint
    from conveyor.models import gpt

    torch.manual_seed(job.init_seed)
    model = gpt(
        seq_len=job.seq_len, dim=job.dim, num_layers=job.num_layers, num_heads=job.num_heads
    )
    if job.checkpoint:
        checkpoint = _newest(Path(job.checkpoint))
        try:
            load_checkpoint(checkpoint, model)
        except CheckpointError as error:
            raise CheckpointError(
                error.path,
                error.file,
                f"{error.cause} (conveyor generate builds the GPT from --dim {job.dim}, "
                f"--num-layers {job.num_layers}, --num-heads {job.num_heads} and --seq-len "
                f"{job.seq_len}: give those the checkpoint's model was made with)",
            ) from None
    return model, None


def _newest(path: Path) -> Path:
    """``path`` if it is a checkpoint, else the newest valid checkpoint in it (a run's
    checkpoint directory).

    Raises:
        CheckpointError: ``path`` is neither, naming what it holds.
    """
    from conveyor.checkpoint import CheckpointError, list_checkpoints, verify

    if (path / "manifest.json").exists():
        return path
    found = list_checkpoints(path)
    for _, candidate in found:
        try:
            verify(candidate)
        except CheckpointError as error:
            logger.warning("skipping invalid checkpoint: %s", error)
            continue
        logger.info("generating from %s, the newest valid checkpoint in %s", candidate.name, path)
        return candidate
    what = f"none of its {len(found)} checkpoints is valid" if found else "it holds no step-N"
    raise CheckpointError(
        path,
        None,
        f"is not a checkpoint, and {what}: pass a step-N directory or the directory a run "
        "saved them in",
    )


def _prompts(job: GenerateJob, tokenizer: Any) -> list[torch.Tensor]:
    if job.prompt_ids:
        prompts = [torch.tensor([int(t) for t in text.split(",")]) for text in job.prompt_ids]
    elif job.model == "gpt":
        prompts = [torch.tensor([min(max(ord(c) - 32, 0), 95) for c in t]) for t in job.prompt]
    elif tokenizer is None:
        raise ValueError(f"{job.model} has no tokenizer saved with it; pass --prompt-ids")
    else:
        prompts = [torch.tensor(tokenizer(t)["input_ids"]) for t in job.prompt]
    count = job.batch_size or len(prompts)
    return [prompts[i % len(prompts)] for i in range(count)]


def _text(job: GenerateJob, tokenizer: Any, ids: torch.Tensor) -> str:
    if job.model == "gpt" and not job.prompt_ids:
        return "".join(chr(32 + int(i)) for i in ids)
    if tokenizer is not None:
        return str(tokenizer.decode(ids.tolist()))
    return ",".join(str(int(i)) for i in ids)


def run(job: GenerateJob, options: dict[str, Any]) -> torch.Tensor | None:
    """Generate on this rank (torch.distributed initialized) with the model's own settings
    changed by ``options`` (GenerationConfig fields): rank 0 logs the texts, the rank of the
    last stage the timings."""
    model, tokenizer = load_model(job)
    prompts = _prompts(job, tokenizer)
    decoder = DecodePipeline(model, balance=job.balance, trace=job.trace is not None, cp=job.cp)
    config = decoder.settings(**options)
    tokens = decoder.generate(prompts, config)
    assert tokens is not None and decoder.stats is not None
    width = max(p.numel() for p in prompts)
    first_of_group = decoder.cp_rank == 0  # the ranks of a cp group hold the same tokens
    if decoder.rank == 0 and first_of_group:
        for row, prompt in enumerate(prompts):
            logger.info(
                "%r -> %r",
                _text(job, tokenizer, prompt),
                _text(job, tokenizer, tokens[row, width:]),
            )
    stats = decoder.stats
    if stats.time_to_first_token is not None and first_of_group:
        throughput = stats.decode_tokens_per_s
        logger.info(
            "%d sequences x %d new tokens on %d stages x cp %d (%d group%s in flight) in "
            "%.3f s: time to first token %.1f ms, decode %s tokens/s",
            stats.num_sequences,
            stats.new_tokens,
            decoder.num_ranks,
            decoder.cp_size,
            stats.num_groups,
            "" if stats.num_groups == 1 else "s",
            stats.seconds,
            stats.time_to_first_token * 1e3,
            "-" if throughput is None else f"{throughput:.1f}",
        )
    if job.trace is not None:
        _write_trace(decoder, job.trace, first_of_group)
    return tokens


def _tuples(values: dict[str, Any]) -> dict[str, Any]:
    """Fields read back from JSON: its lists were tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}


def _write_trace(decoder: DecodePipeline, directory: str, writes: bool) -> None:
    from conveyor.trace import write_chrome, write_png

    timeline = decoder.timeline()
    if decoder.rank == 0 and writes:
        Path(directory).mkdir(parents=True, exist_ok=True)
        png = write_png(Path(directory) / "timeline.png", timeline)
        chrome = write_chrome(Path(directory) / "trace.json", timeline)
        logger.info("%s\nwrote %s and %s", timeline.summary_text(), png, chrome)


def worker(argv: list[str] | None = None) -> int:
    """One rank: ``python -m conveyor.cli.generate_rank JSON`` (job and generation options)."""
    parser = argparse.ArgumentParser(prog="python -m conveyor.cli.generate_rank")
    parser.add_argument("payload", help="{'job': GenerateJob fields, 'options': settings given}")
    payload = json.loads(parser.parse_args(argv).payload)
    job = GenerateJob(**_tuples(payload["job"]))
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # an entry point, like cli
    dist.init_process_group("gloo")
    try:
        run(job, _tuples(payload["options"]))
    finally:
        dist.destroy_process_group()
    return 0
