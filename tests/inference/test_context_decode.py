"""Context-parallel generation (DecodePipeline(cp=...)): the KV cache split along the sequence
over a cp group gives the tokens of the unsplit model (Hugging Face's generate for its
families, conveyor's own generate for its GPT), alone and under a pipeline, with padding,
greedy and sampled, for prompts from one token to thousands; each rank holds 1/cp of the
cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from conveyor.inference.config import GenerationConfig
from conveyor.models import gpt
from conveyor.parallel.shared_exchange import shared_memory_possible
from conveyor.pipeline.decode import DecodePipeline, generate
from dist import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

VOCAB = 64
SAMPLING = {"do_sample": True, "temperature": 0.9, "top_k": 20, "seed": 7}


def hf(family: str, layers: int = 4, context: int = 4096) -> nn.Module:
    import transformers

    torch.manual_seed(1)
    common: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": context, "pad_token_id": 0, "bos_token_id": None,
        "eos_token_id": None,
    }  # fmt: skip
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif family == "qwen2":
        config = transformers.Qwen2Config(
            **common, use_sliding_window=True, sliding_window=5, max_window_layers=2
        )
        model = transformers.Qwen2ForCausalLM(config)
    else:
        model = transformers.MistralForCausalLM(
            transformers.MistralConfig(**common, sliding_window=6)
        )
    return model.to(torch.float64).eval()


def small_gpt() -> nn.Sequential:
    torch.manual_seed(3)
    return gpt(vocab_size=VOCAB, seq_len=96, dim=32, num_layers=4, dropout=0.0).double().eval()


def padded(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.zeros((len(lengths), max(lengths)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, -length:] = torch.randint(1, VOCAB, (length,), generator=generator)
        mask[row, -length:] = 1
    return ids, mask


CONTEXT_PARALLEL = ("llama", "qwen2", "mistral")
"""Hugging Face families whose tokens at cp 2 and 3 equal their own generate's here."""


def _families(rank: int, world_size: int, cp: int) -> None:
    for family in CONTEXT_PARALLEL:
        model = hf(family)
        decoder = DecodePipeline(model, cp=cp)
        shared = shared_memory_possible(torch.device("cpu"), ["one host"]) is None
        assert decoder.cp_exchange == ("shared" if shared else "group")
        for lengths in ([1], [9, 4, 13], [17, 2]):
            ids, mask = padded(lengths, seed=len(lengths))
            want = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False)
            got = decoder.generate(ids, attention_mask=mask, max_new_tokens=7)
            assert torch.equal(got, want), (family, cp, lengths)
        ids, mask = padded([11, 6])
        sampled = decoder.generate(ids, attention_mask=mask, max_new_tokens=6, **SAMPLING)
        alone = generate(model, ids, attention_mask=mask, max_new_tokens=6, **SAMPLING)
        assert torch.equal(sampled, alone), (family, cp)


def _budget_and_refusals(rank: int, world_size: int) -> None:
    import logging
    from unittest import mock

    model = hf("llama")
    ids, mask = padded([900, 700])
    alone = DecodePipeline(model, local=True)
    need = alone.cache_bytes(2, ids.shape[1] + 8)[0]
    budget = int(need * 0.6)
    with pytest.raises(ValueError, match="over memory_budget"):
        alone.generate(ids, attention_mask=mask, max_new_tokens=8, memory_budget=budget)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("conveyor.pipeline.decode").addHandler(handler)
    with mock.patch("conveyor.pipeline.decode.socket.gethostname", return_value=f"host{rank}"):
        decoder = DecodePipeline(model, cp=2)  # two hosts: messages over the group
        with pytest.raises(ValueError, match=r"cp_exchange='shared' .* several hosts"):
            DecodePipeline(model, cp=2, cp_exchange="shared")
    assert any("spans hosts" in r.getMessage() for r in records)
    assert decoder.cp_exchange == "group"
    want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    got = decoder.generate(ids, attention_mask=mask, max_new_tokens=8, memory_budget=budget)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="prefill_chunk=4 with cp=2"):
        decoder.generate(ids, attention_mask=mask, max_new_tokens=2, prefill_chunk=4)
    with pytest.raises(TypeError, match="GPT2LMHeadModel's attention \\(GPT2Attention\\)"):
        import transformers

        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2)
        DecodePipeline(transformers.GPT2LMHeadModel(config), cp=2)


def test_a_cache_over_one_ranks_budget_is_served_at_cp_2(tmp_path: Path) -> None:
    run_ranks(_budget_and_refusals, tmp_path, 2, timeout_s=300)


@pytest.mark.parametrize("cp", [2, 3])
def test_hugging_face_families_generate_their_own_tokens(tmp_path: Path, cp: int) -> None:
    run_ranks(_families, tmp_path, cp, timeout_s=400, cp=cp)


def _long_and_pipelined(rank: int, world_size: int) -> None:
    model = hf("llama")
    ids, mask = padded([2000, 1500])
    alone = DecodePipeline(model, local=True)
    want = alone.generate(ids, attention_mask=mask, max_new_tokens=4)
    whole = alone.stats.cache_bytes if alone.stats else 0
    decoder = DecodePipeline(model, cp=2)  # 2 stages x cp 2 on 4 ranks
    got = decoder.generate(ids, attention_mask=mask, max_new_tokens=4)
    assert torch.equal(got, want)
    stats = decoder.stats
    assert stats is not None
    # this rank's shards: its stage's half of the blocks, half of the positions (+ 2 slots)
    stage, positions = whole / 2, ids.shape[1] + 4
    per_position = stage / positions
    assert stage / 2 <= stats.cache_bytes <= stage / 2 + 3 * per_position, (stats, whole)
    torch.manual_seed(0)
    gpt_model = small_gpt()
    gpt_ids, gpt_mask = padded([40, 23, 1], seed=3)
    gpt_decoder = DecodePipeline(gpt_model, cp=2, balance=[3, 3])
    for options in ({}, SAMPLING):
        got = gpt_decoder.generate(gpt_ids, attention_mask=gpt_mask, max_new_tokens=8, **options)
        want = generate(gpt_model, gpt_ids, attention_mask=gpt_mask, max_new_tokens=8, **options)
        assert torch.equal(got, want), options


def test_a_long_prompt_on_two_stages_of_two_cp_ranks(tmp_path: Path) -> None:
    run_ranks(_long_and_pipelined, tmp_path, 4, timeout_s=500)


def _logits(rank: int, world_size: int) -> None:
    from conveyor.inference.lm import Context, CpPlace
    from conveyor.parallel.context_parallel import zigzag

    model = hf("mistral")  # sliding window of 6: some shards see none of a query's keys
    decoder = DecodePipeline(model, cp=world_size)
    lm, units = decoder.lm, range(decoder.lm.num_units)
    ids, mask = padded([37, 30])
    steps = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(9))
    full = torch.cat([ids, steps], 1)
    full_mask = torch.cat([mask, torch.ones_like(steps)], 1).bool()
    positions = (full_mask.long().cumsum(-1) - 1).clamp(min=0)
    shards = tuple(tuple(r) for r in zigzag(ids.shape[1], world_size))
    cache = lm.new_cache(units, 2, full.shape[1], torch.device("cpu"), "static")
    mine = CpPlace(rank, shards, False, 0).mine
    context = Context(
        positions[:, mine], full_mask[:, : ids.shape[1]], 0, CpPlace(rank, shards, False, 0)
    )
    with torch.no_grad():
        got = [lm.run(units, ids[:, mine], cache, context)]
        for t in range(ids.shape[1], full.shape[1]):
            place = CpPlace(rank, shards, True, t)
            context = Context(positions[:, t : t + 1], full_mask[:, : t + 1], t, place)
            got.append(lm.run(units, full[:, t : t + 1], cache, context))
        for i, logits in enumerate(got):
            end = ids.shape[1] + i
            want = model(
                full[:, :end],
                attention_mask=full_mask[:, :end].long(),
                position_ids=positions[:, :end],
            ).logits[:, -1]
            torch.testing.assert_close(logits, want, rtol=0, atol=1e-10, msg=f"step {i}")


def test_prefill_and_decode_logits_equal_the_unsplit_models_in_float64(tmp_path: Path) -> None:
    run_ranks(_logits, tmp_path, 3, timeout_s=300)


def _profiled(rank: int, world_size: int) -> None:
    from conveyor.inference import cost
    from conveyor.inference.lm import CpPlace
    from conveyor.parallel.context_parallel import owner_of, zigzag

    lm = DecodePipeline(hf("llama", layers=2), cp=world_size).lm
    block = range(1, 2)
    fit = cost.profile_stage(lm, block, [1], [16, 48], [24, 40], steps=2, repeats=1)
    for part in (fit.decode, fit.prefill):
        assert part.fixed >= 0 and part.per_token >= 0 and part.per_pair >= 0
        assert part.time(1, 1, 64) > 0
    with pytest.raises(ValueError, match="resumed=0"):
        cost.profile_stage(lm, block, [1], [16], [24], resumed=2)
    # the runner puts each rank's zigzag chunks, then the new tokens it owns, in its shard
    runner = cost._Runner(lm, block, 1, 24, GenerationConfig(), torch.device("cpu"))
    with torch.no_grad():
        runner.step(19)
        for _ in range(4):
            runner.step(1)
    shards = tuple(tuple(r) for r in zigzag(19, world_size))
    owned = [t for t in range(19, 23) if owner_of(t, world_size) == rank]
    held = runner.cache[0].shard.held()[2]
    assert held.tolist() == CpPlace(rank, shards, False, 0).mine + owned


def test_a_cp_groups_layers_are_profiled_as_the_group_runs_them(tmp_path: Path) -> None:
    run_ranks(_profiled, tmp_path, 2, timeout_s=200)
