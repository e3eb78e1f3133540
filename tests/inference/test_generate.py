"""Generation: tokens equal independent references (Hugging Face's generate, full recomputation
without a cache, a plain sampling loop over Hugging Face's warpers) on one process and on 2
and 4 ranks; errors before any message (conveyor.pipeline.decode and its adapters)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor import PeerLostError
from conveyor.inference import GenerationConfig
from conveyor.inference.sampling import Sampler, filter_logits, sequence_seed
from conveyor.models import gpt
from conveyor.pipeline.decode import DecodePipeline, generate
from conveyor.runtime.fingerprint import BatchMismatchError, CannotRunError
from dist import run_ranks

VOCAB = 61
SAMPLING = {"do_sample": True, "temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 3}


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """Tiny models run no faster on two threads, and on a busy machine much slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# transformers is imported where used: spawned ranks that run conveyor's GPT only skip it


def llama(layers: int = 4) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=48,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    return LlamaForCausalLM(config).to(torch.float64).eval()


def gpt2(layers: int = 4) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(2)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=layers,
        n_head=4,
        n_positions=48,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    return GPT2LMHeadModel(config).to(torch.float64).eval()


def small_gpt(layers: int = 4) -> nn.Sequential:
    torch.manual_seed(3)
    return gpt(vocab_size=VOCAB, seq_len=48, dim=32, num_layers=layers).to(torch.float64)


def prompts(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask): ``batch`` prompts of 3 to 11 tokens, left-padded with 0."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [3 + (5 * row + seed) % 9 for row in range(batch)]
    ids = torch.zeros((batch, max(lengths)), dtype=torch.long)
    mask = torch.zeros((batch, max(lengths)), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, -length:] = torch.randint(1, VOCAB, (length,), generator=generator)
        mask[row, -length:] = 1
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def hf_warpers(temperature: float, top_k: int | None, top_p: float | None) -> Any:
    from transformers import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    return LogitsProcessorList(
        [TemperatureLogitsWarper(temperature)]
        + ([TopKLogitsWarper(top_k)] if top_k else [])
        + ([TopPLogitsWarper(top_p)] if top_p else [])
    )


def hf_sampling_reference(
    model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, steps: int, eos: int | None = None
) -> torch.Tensor:
    """Full recomputation each token (no cache) with Hugging Face's own warpers, each sequence
    sampled from its own generator (Hugging Face's sampler draws the batch from one global
    generator, which no pipeline of groups can match)."""
    warpers = hf_warpers(SAMPLING["temperature"], SAMPLING["top_k"], SAMPLING["top_p"])
    generators = [
        torch.Generator().manual_seed(sequence_seed(SAMPLING["seed"], row))
        for row in range(len(ids))
    ]
    unfinished = torch.ones(len(ids), dtype=torch.bool)
    for _ in range(steps):
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, position_ids=positions(mask)).logits
        probs = warpers(ids, logits[:, -1].float()).softmax(-1)
        tokens = torch.cat(
            [torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators, strict=True)]
        )
        tokens = torch.where(unfinished, tokens, 0)
        if eos is not None:
            unfinished &= tokens != eos
        ids = torch.cat([ids, tokens[:, None]], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return ids


def gpt_reference(
    model: nn.Sequential, ids: torch.Tensor, mask: torch.Tensor, steps: int, **options: Any
) -> torch.Tensor:
    """Full recomputation each token through the GPT's own layers (no cache): a query sees the
    real tokens up to itself (and itself, padding included)."""
    sampler = Sampler(GenerationConfig(**options), range(len(ids)), torch.device("cpu"))
    mask = mask.bool()
    model.eval()
    for _ in range(steps):
        length = ids.shape[1]
        key = torch.arange(length)
        visible = (mask[:, None, :] & (key[None, :] <= key[:, None])) | torch.eye(length).bool()
        with torch.no_grad():
            x = model[0].embed(ids, positions(mask))
            for block in model[1:-1]:
                x = block.attend(x, ~visible[:, None])
            logits = model[-1](x)[:, -1]
        ids = torch.cat([ids, sampler(logits)[:, None]], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return ids


# -- one process ---------------------------------------------------------------------------


@pytest.mark.parametrize("make", [llama, gpt2], ids=["llama", "gpt2"])
def test_hugging_face_models_match_their_own_generate(make: Any) -> None:
    model = make()
    ids, mask = prompts(5)
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    for options in [
        {},
        {"num_groups": 2, "prefill_chunk": 4},
        {"num_groups": 3, "cache": "static"},
    ]:
        tokens = generate(model, ids, attention_mask=mask, max_new_tokens=8, **options)
        assert torch.equal(tokens, reference), options
    eos = int(reference[1, -5])
    model.generation_config.eos_token_id = eos  # the model's own stop token: both stop there
    stopped = model.generate(ids, attention_mask=mask, max_new_tokens=30)
    assert torch.equal(generate(model, ids, attention_mask=mask, max_new_tokens=30), stopped)
    model.generation_config.eos_token_id = None
    tokens = generate(model, ids, attention_mask=mask, max_new_tokens=30, eos_token_id=eos)
    assert torch.equal(tokens, stopped)  # one id, as Hugging Face takes it
    sampled = generate(model, ids, attention_mask=mask, max_new_tokens=6, num_groups=2, **SAMPLING)
    assert torch.equal(sampled, hf_sampling_reference(model, ids, mask, 6))
    # padded prompts without a mask: the model's own pad token (no stop token) marks the
    # padding, as Hugging Face reads it; without a pad token every token is real
    model.generation_config.pad_token_id = 0
    assert torch.equal(
        generate(model, ids, max_new_tokens=4), model.generate(ids, max_new_tokens=4)
    )
    model.generation_config.pad_token_id = None
    unmasked = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4)
    assert torch.equal(generate(model, ids, max_new_tokens=4), unmasked)


def test_conveyor_gpt_matches_recomputation_without_a_cache() -> None:
    model = small_gpt()
    ids = torch.randint(0, VOCAB, (4, 6))
    plain = ids
    with torch.no_grad():  # unpadded: the model's own training forward, token by token
        for _ in range(7):
            plain = torch.cat([plain, model.eval()(plain)[:, -1].float().argmax(-1)[:, None]], 1)
    assert torch.equal(generate(model, ids, max_new_tokens=7, num_groups=3, prefill_chunk=4), plain)
    ids, mask = prompts(6, seed=1)
    ragged = [row[m.bool()] for row, m in zip(ids, mask, strict=True)]  # generate pads it
    for options in [{}, SAMPLING]:
        tokens = generate(model, ragged, max_new_tokens=7, num_groups=2, **options)
        assert torch.equal(tokens, gpt_reference(model, ids, mask, 7, **options)), options


def test_the_sampler_filters_as_hugging_face_does() -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    for top_k, top_p, temperature in [(5, None, 1.0), (None, 0.7, 0.5), (12, 0.95, 1.5)]:
        config = GenerationConfig(top_k=top_k, top_p=top_p, temperature=temperature)
        warpers = hf_warpers(temperature, top_k, top_p)
        assert torch.equal(filter_logits(logits, config), warpers(None, logits))


def test_a_stopped_sequence_pads_and_generation_ends_when_all_have_stopped() -> None:
    config = GenerationConfig(eos_token_id=(7,), pad_token_id=1)
    sampler = Sampler(config, range(2), torch.device("cpu"))
    first = torch.full((2, 9), -1.0)
    first[0, 7], first[1, 3] = 1.0, 1.0
    assert sampler(first).tolist() == [7, 3] and not sampler.done
    second = torch.full((2, 9), -1.0)
    second[:, 7] = 1.0
    assert sampler(second).tolist() == [1, 7] and sampler.done


def test_a_stop_token_given_pads_a_model_without_a_pad_token_as_hugging_face_does() -> None:
    model = llama(layers=2)
    model.generation_config.pad_token_id = None
    ids, mask = prompts(2, seed=5)
    greedy = generate(model, ids, attention_mask=mask, max_new_tokens=8)
    stop = int(greedy[0, ids.shape[1] + 1])  # row 0 stops at its second new token
    assert stop not in greedy[1, ids.shape[1] :].tolist()[:2], "pick prompts where row 1 goes on"
    want = model.generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=stop
    )
    tokens = generate(model, ids, attention_mask=mask, max_new_tokens=8, eos_token_id=stop)
    assert torch.equal(tokens, want) and (tokens[0, ids.shape[1] + 2 :] == stop).all()


def test_bad_input_fails_before_any_message() -> None:
    from transformers import LlamaModel

    model = small_gpt(layers=2)
    ids = torch.randint(0, VOCAB, (2, 40))
    with pytest.raises(ValueError, match="needs 50 positions but the model's context is 48"):
        generate(model, ids, max_new_tokens=10)
    with pytest.raises(ValueError, match=r"prompt is 49 tokens .* context is 48 positions"):
        generate(model, torch.zeros((1, 49), dtype=torch.long))
    with pytest.raises(ValueError, match=r"needs 10\.0 KiB of KV cache \(2 blocks x 2 sequences"):
        generate(model, ids[:, :4], max_new_tokens=1, memory_budget=1024)
    for not_an_lm in [LlamaModel(llama().config), nn.Linear(2, 2), nn.Sequential(*model[:-1])]:
        with pytest.raises(TypeError, match="causal LM head"):
            generate(not_an_lm, ids)
    mask = torch.ones_like(ids)
    mask[0, -1] = 0
    with pytest.raises(ValueError, match="rows \\[0\\] have padding after tokens"):
        generate(model, ids, attention_mask=mask)
    for temperature in (0.0, float("nan")):  # NaN failed mid-generation, in sampling
        with pytest.raises(ValueError, match="temperature must be > 0"):
            GenerationConfig(temperature=temperature)
    with pytest.raises(ValueError, match=r"pad_token_id must be a token id .* got None"):
        generate(model, ids, pad_token_id=None)
    with pytest.raises(ValueError, match=r"eos_token_id must be a token id .* got \(1, 'x'\)"):
        generate(model, ids, eos_token_id=[1, "x"])
    with pytest.raises(ValueError, match=r"eos_token_id must be a token id .* got 2\.0"):
        generate(model, ids, eos_token_id=2.0)
    for name, value in [("max_new_tokens", 2.0), ("do_sample", "no"), ("num_groups", True)]:
        with pytest.raises(TypeError, match=f"{name} must be an? .*, got {value!r}"):
            generate(model, ids, **{name: value})
    assert GenerationConfig(eos_token_id=torch.tensor([3, 4])).stop_tokens == (3, 4)
    for bad in [ids.float(), ids.bool(), [ids[0].float()]]:
        with pytest.raises(TypeError, match="token ids must be an integer tensor"):
            generate(model, bad)
    with pytest.raises(ValueError, match=r"at least one prompt, got shape \(0, 4\)"):
        generate(model, ids[:0, :4])
    for token, shown in [(VOCAB, VOCAB), (-1, -1)]:
        outside = ids[:, :4].clone()
        outside[1, 2] = token
        with pytest.raises(ValueError, match=f"hold token {shown}, outside the model's vocab"):
            generate(model, outside)
    with pytest.raises(ValueError, match=f"pad_token_id={VOCAB} is outside"):
        generate(model, ids[:, :4], eos_token_id=5, pad_token_id=VOCAB)
    with pytest.raises(ValueError, match="top_p must be in"):
        generate(model, ids, top_p=1.5)
    with pytest.raises(TypeError, match=r"unknown generation settings \['max_tokens'\]"):
        generate(model, ids, max_tokens=3)
    with torch.device("meta"):
        unloaded = small_gpt(layers=2)
    with pytest.raises(ValueError, match=r"stage 0's Embedding has 'tokens.weight' on the meta"):
        DecodePipeline(unloaded, local=True)
    with pytest.raises(ValueError, match="covers 2 units but the model has 4"):
        DecodePipeline(model, balance=[1, 1], local=True)
    with pytest.raises(ValueError, match="gives a stage 0 units"):
        DecodePipeline(model, balance=[0, 4], local=True)
    with pytest.raises(ValueError, match="places 2 stages on 2 ranks but the process group has 1"):
        DecodePipeline(model, balance=[2, 2], local=True)


# -- on ranks ------------------------------------------------------------------------------


def _check_hf(model: nn.Module, balance: list[int], placement: list[int]) -> None:
    """Batch 1 and 8, greedy and sampled (in chunks), on ``balance`` x ``placement``."""
    decoder = DecodePipeline(model, balance=balance, placement=placement, trace=True)
    for batch, num_groups in [(1, None), (8, 3)]:
        ids, mask = prompts(batch, seed=batch)
        greedy = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        tokens = decoder.generate(ids, attention_mask=mask, max_new_tokens=6, num_groups=num_groups)
        assert torch.equal(tokens, greedy), (type(model).__name__, batch, placement)
        sampled = decoder.generate(
            ids, attention_mask=mask, max_new_tokens=5, prefill_chunk=4, **SAMPLING
        )
        want = hf_sampling_reference(model, ids, mask, 5)
        assert torch.equal(sampled, want), (type(model).__name__, batch, placement)
    timeline = decoder.timeline()  # the last generation: every rank's actions
    assert {e.kind for e in timeline.events} >= {"forward", "send", "recv"}


def _check_gpt(decoder: Any, model: nn.Sequential) -> None:
    for batch in [1, 8]:
        ids, mask = prompts(batch, seed=batch)
        ragged = [row[m.bool()] for row, m in zip(ids, mask, strict=True)]  # padded by generate
        for options in [{}, SAMPLING]:
            tokens = decoder.generate(ragged, max_new_tokens=6, prefill_chunk=5, **options)
            assert torch.equal(tokens, gpt_reference(model, ids, mask, 6, **options)), options


def _two_ranks(rank: int, world_size: int) -> None:
    _check_hf(llama(), balance=[3, 3], placement=[0, 1])
    _check_hf(llama(), balance=[2, 1, 1, 2], placement=[0, 1, 0, 1])  # 4 stages, loop
    _check_hf(gpt2(), balance=[1, 2, 2, 1], placement=[0, 1, 1, 0])  # 4 stages, V: the
    # last stage on the first one's rank, so tokens are fed back without a message
    model = small_gpt()
    pipe = conveyor.Pipeline(
        model, balance=[3, 3], num_microbatches=2, loss_fn=lambda y, t: y.sum()
    )
    _check_gpt(pipe, model)
    ids, mask = prompts(8, seed=2)
    ragged = [row[m.bool()] for row, m in zip(ids, mask, strict=True)]
    steps, width = 40 - ids.shape[1], ids.shape[1]
    greedy = pipe.generate(ragged, max_new_tokens=steps)
    eos = tuple(set(greedy[:, width + 2].tolist()))  # every row stops by its third token
    stopped = pipe.generate(ragged, max_new_tokens=steps, eos_token_id=eos, dst=1)
    padded = ids.masked_fill(mask == 0, eos[0])  # no pad token: the first stop token pads
    want = gpt_reference(model, padded, mask, steps, eos_token_id=eos, pad_token_id=eos[0])
    if rank == 1:  # dst: the only rank that gets the tokens
        assert stopped is not None and width < stopped.shape[1] <= width + 3
        assert torch.equal(stopped, want[:, : stopped.shape[1]])
    else:
        assert stopped is None
    elsewhere = pipe.generate(ragged, max_new_tokens=steps, eos_token_id=eos, dst=0)
    assert (elsewhere is None) == (rank == 1)
    if rank == 1:  # the last stage's rank counts the tokens it sampled, and times them
        assert stopped is not None and pipe.decoder.stats is not None
        assert pipe.decoder.stats.new_tokens == stopped.shape[1] - width
    _failures(pipe, rank, ids)


def _failures(pipe: conveyor.Pipeline, rank: int, ids: torch.Tensor) -> None:
    """Other prompts on one rank: refused on both before any message (the pipeline goes on);
    a stage that fails mid-generation: its peer fails at once, naming it."""
    other = ids.clone()
    other[0, -1] = (other[0, -1] + rank) % VOCAB
    with pytest.raises(BatchMismatchError, match="another batch for generation"):
        pipe.generate(other, max_new_tokens=2)
    pipe.generate(ids, max_new_tokens=2)
    # a problem of one rank's own (its budget): every rank raises, and they stay in step
    with pytest.raises(ValueError if rank == 1 else CannotRunError) as refused:
        pipe.generate(ids, max_new_tokens=2, memory_budget=1 if rank == 1 else None)
    assert rank == 1 or "rank 1 cannot run generation" in str(refused.value)
    pipe.generate(ids, max_new_tokens=2)
    if rank == 1:
        block = next(m for m in pipe.decoder._local_modules() if hasattr(m, "attend"))
        block.attend = lambda *args: (_ for _ in ()).throw(RuntimeError("broken block"))
    start = time.monotonic()
    with pytest.raises(RuntimeError if rank == 1 else PeerLostError) as failure:
        pipe.generate(ids, max_new_tokens=2)
    if rank == 0:
        assert "rank 1 abandoned generation" in str(failure.value) and "broken block" in str(
            failure.value
        )
        assert time.monotonic() - start < 10  # not the 60 s timeout
    with pytest.raises(RuntimeError, match=r"abandoned generation|was closed"):
        pipe.generate(ids, max_new_tokens=2)


@pytest.mark.dist
def test_two_ranks_generate_what_one_process_generates(tmp_path: Path) -> None:
    run_ranks(_two_ranks, tmp_path, world_size=2)


def _four_ranks(rank: int, world_size: int) -> None:
    model = small_gpt()
    _check_gpt(DecodePipeline(model, balance=[2, 1, 1, 2]), model)


@pytest.mark.dist
def test_four_ranks_generate_what_one_process_generates(tmp_path: Path) -> None:
    run_ranks(_four_ranks, tmp_path, world_size=4)


def test_an_empty_prompt_is_refused_saying_what_was_given() -> None:
    model = small_gpt(layers=2)
    with pytest.raises(ValueError, match=r"input_ids has shape \(2, 0\): every prompt is empty"):
        generate(model, torch.zeros((2, 0), dtype=torch.long))  # no mask given
    ids = torch.randint(1, VOCAB, (2, 4))
    mask = torch.ones_like(ids)
    mask[1] = 0
    with pytest.raises(ValueError, match=r"attention_mask rows \[1\] are all zeros: those"):
        generate(model, ids, attention_mask=mask)
    with pytest.raises(ValueError, match=r"prompts \[1\] of the list are empty \(length 0\)"):
        generate(model, [ids[0], ids[0, :0]])
    padding = ids.clone()
    padding[0] = 0  # the pad token marks padding without a mask: this row has no token
    with pytest.raises(ValueError, match=r"input_ids rows \[0\] hold only the pad token 0"):
        generate(model, padding, pad_token_id=0)


def _other_settings(rank: int, world_size: int) -> None:
    """Settings that differ between ranks: named on every rank with each rank's value; the
    ranks stay in step."""
    decoder = DecodePipeline(small_gpt(layers=2))
    ids, other = torch.randint(1, VOCAB, (2, 5)), 1 - rank
    cases = [  # what each rank passes, and what each is told
        ({"max_new_tokens": 4 + 4 * rank}, {"max_new_tokens": (4 + 4 * other, 4 + 4 * rank)}),
        (
            {"do_sample": rank == 1, "seed": rank},
            {"do_sample": (other == 1, rank == 1), "seed": (other, rank)},
        ),
        (
            {"eos_token_id": rank + 3, "num_groups": 1 + rank},
            {"eos_token_id": ((other + 3,), (rank + 3,)), "num_groups": (1 + other, 1 + rank)},
        ),
    ]
    for options, told in cases:
        named = [
            f"rank {other} passed {k}={v!r}, rank {rank} passed {w!r}" for k, (v, w) in told.items()
        ]
        with pytest.raises(BatchMismatchError, match=re.escape(named[0])) as refused:
            decoder.generate(ids, **{"max_new_tokens": 2, **options})
        assert f"rank {rank}: ranks were given other settings for generation" in str(refused.value)
        assert all(n in str(refused.value) for n in named), (str(refused.value), named)
    assert decoder.generate(ids, max_new_tokens=2) is not None  # still in step


@pytest.mark.dist
def test_settings_that_differ_between_ranks_are_named(tmp_path: Path) -> None:
    run_ranks(_other_settings, tmp_path, world_size=2)
