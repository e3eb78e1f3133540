"""Generation for every decoder-only Hugging Face family conveyor adapts (conveyor.hf.decode):
the tokens of tiny models of each family equal Hugging Face's own generate on one process
and on 2 ranks, sliding windows crossed; an unsupported family is refused naming the registry."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_generate import SAMPLING, VOCAB, hf_sampling_reference
from torch import nn

from conveyor.hf.decode import ADAPTERS
from conveyor.inference import Context
from conveyor.inference.prompts import positions_of
from conveyor.pipeline.decode import DecodePipeline, as_causal_lm, generate
from dist import run_ranks

WINDOW = 4
"""Sliding window of the families that have one: the longer prompt and the new tokens
cross it."""


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """Tiny models run no faster on two threads, and on a busy machine much slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# transformers is imported where used: spawned ranks import it once, from the fork server


def _tiny(
    make: Callable[[], nn.Module], seed: int, dtype: torch.dtype = torch.float64
) -> nn.Module:
    torch.manual_seed(seed)
    return make().to(dtype).eval()


def _common() -> dict[str, Any]:
    """Config fields of every family: 4 layers (2 per stage), no stop token, pad 0."""
    return {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "pad_token_id": 0,
        "bos_token_id": None,
        "eos_token_id": None,
        "initializer_range": 0.1,
    }


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return _tiny(lambda: LlamaForCausalLM(LlamaConfig(**_common(), num_key_value_heads=2)), 1)


def qwen2() -> nn.Module:
    """Full attention in layers 0 and 1, a sliding window in 2 and 3: one type per stage."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **_common(),
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=2,
    )
    return _tiny(lambda: Qwen2ForCausalLM(config), 2)


def mistral() -> nn.Module:
    """A sliding window in every layer (the config's sliding_window, no layer types)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**_common(), num_key_value_heads=2, sliding_window=WINDOW)
    return _tiny(lambda: MistralForCausalLM(config), 3)


def phi3() -> nn.Module:
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(**_common(), num_key_value_heads=2, sliding_window=WINDOW + 1)
    return _tiny(lambda: Phi3ForCausalLM(config), 4)


def gemma2() -> nn.Module:
    """Sliding and full layers alternating within each stage; scaled embeddings, soft caps
    on attention scores and logits. float32: in float64, transformers' eager attention
    (which soft caps need) turns the padded positions to NaN, and every later one with them."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        **_common(),
        num_key_value_heads=2,
        head_dim=8,
        query_pre_attn_scalar=8,
        sliding_window=WINDOW,
        final_logit_softcapping=3.0,
        attn_logit_softcapping=5.0,
    )
    return _tiny(lambda: Gemma2ForCausalLM(config), 5, torch.float32)


def gemma3() -> nn.Module:
    """Sliding, full, sliding, full, with local and global rotary tables."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **_common(),
        num_key_value_heads=2,
        head_dim=8,
        query_pre_attn_scalar=8,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    return _tiny(lambda: Gemma3ForCausalLM(config), 6)


def gpt_neox() -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return _tiny(lambda: GPTNeoXForCausalLM(GPTNeoXConfig(**_common())), 7)


def opt() -> nn.Module:
    """Token embeddings narrower than the hidden states (project_in and project_out)."""
    from transformers import OPTConfig, OPTForCausalLM

    fields = {k: v for k, v in _common().items() if k != "intermediate_size"}
    config = OPTConfig(**fields, ffn_dim=64, word_embed_proj_dim=16)
    return _tiny(lambda: OPTForCausalLM(config), 8)


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=4,
        n_head=4,
        n_positions=64,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    return _tiny(lambda: GPT2LMHeadModel(config), 9)


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "llama": llama,
    "qwen2": qwen2,
    "mistral": mistral,
    "phi3": phi3,
    "gemma2": gemma2,
    "gemma3_text": gemma3,
    "gpt_neox": gpt_neox,
    "opt": opt,
    "gpt2": gpt2,
}


def two_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask): prompts of 9 and 3 tokens, left-padded with 0; 9 crosses the window."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (2, 9), generator=generator)
    mask = torch.ones_like(ids)
    ids[1, :6], mask[1, :6] = 0, 0
    return ids, mask


def test_every_family_in_the_registry_is_tested() -> None:
    assert sorted(FAMILIES) == sorted(ADAPTERS)
    for model_type, make in FAMILIES.items():
        assert make().config.model_type == model_type


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_one_process_matches_hugging_face(family: str) -> None:
    model = FAMILIES[family]()
    ids, mask = two_prompts()
    lm = as_causal_lm(model)  # the logits themselves (a soft cap leaves greedy tokens be)
    context = Context(positions_of(mask.bool()), mask.bool(), 0)
    cache = lm.new_cache(range(lm.num_units), 2, ids.shape[1], torch.device("cpu"), "dynamic")
    with torch.no_grad():
        logits = lm.run(range(lm.num_units), ids, cache, context)
        want = model(ids, attention_mask=mask, position_ids=context.positions).logits[:, -1]
    torch.testing.assert_close(logits, want)
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    for options in [{}, {"num_groups": 2, "prefill_chunk": 3, "cache": "static"}]:
        tokens = generate(model, ids, attention_mask=mask, max_new_tokens=8, **options)
        assert torch.equal(tokens, greedy), (family, options)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_static_cache_scores_its_written_slots_only_and_matches_hugging_faces(
    family: str,
) -> None:
    """A padded prompt in two chunks, then three tokens: the adapter's static cache hands
    attention only the slots written so far (See Note [filled slots]) and gives the logits
    of Hugging Face's own StaticCache, which hands it every slot, masked."""
    from transformers import StaticCache

    model = FAMILIES[family]()
    lm = as_causal_lm(model)
    ids, mask = two_prompts()
    units, capacity = range(lm.num_units), 16
    ours = lm.new_cache(units, 2, capacity, torch.device("cpu"), "static")
    theirs = StaticCache(config=model.config, max_cache_len=capacity)
    tokens, key_mask = ids, mask.bool()
    # float64 models; eager attention takes its softmax in float32, whose sum rounds by the
    # row's length
    tolerance = 1e-10 if model.config._attn_implementation == "sdpa" else 1e-5
    for start, end in [(0, 4), (4, 9), (9, 10), (10, 11), (11, 12)]:
        if end > tokens.shape[1]:  # a new token on each row, after the prompt
            tokens = torch.cat([tokens, torch.full((2, 1), 5 + end)], dim=1)
            key_mask = torch.cat([key_mask, torch.ones((2, 1), dtype=torch.bool)], dim=1)
        positions = positions_of(key_mask)[:, start:end]
        context = Context(positions, key_mask[:, :end], start)
        with torch.no_grad():
            logits = lm.run(units, tokens[:, start:end], ours, context)
            want = lm.run(units, tokens[:, start:end], theirs, context)
        torch.testing.assert_close(logits, want, rtol=tolerance, atol=tolerance)
    filled = [layer for layer in ours.layers if hasattr(layer, "filled")]
    full = sum(type(layer).__name__ == "StaticLayer" for layer in theirs.layers)
    assert len(filled) == full  # every full-attention layer; sliding ones keep their window
    assert all(layer.filled == 12 and layer.get_mask_sizes(1) == (13, 0) for layer in filled)


def _families_on_two_ranks(rank: int, world_size: int) -> None:
    ids, mask = two_prompts()
    for family, make in FAMILIES.items():
        model = make()
        decoder = DecodePipeline(model, balance=[3, 3])
        greedy = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        for options in [{}, {"num_groups": 1, "prefill_chunk": 3, "cache": "static"}]:
            tokens = decoder.generate(ids, attention_mask=mask, max_new_tokens=8, **options)
            assert torch.equal(tokens, greedy), (family, options)
        sampled = decoder.generate(ids, attention_mask=mask, max_new_tokens=5, **SAMPLING)
        assert torch.equal(sampled, hf_sampling_reference(model, ids, mask, 5)), family


@pytest.mark.dist
def test_two_ranks_match_hugging_face_for_every_family(tmp_path: Path) -> None:
    run_ranks(_families_on_two_ranks, tmp_path, world_size=2)


def test_a_family_without_an_adapter_is_refused_naming_the_registry() -> None:
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=16, n_layer=1, n_head=2))
    ids = torch.tensor([[1, 2, 3]])
    registry = r"model types \['gemma2', .*'qwen2'\] \(conveyor\.hf\.decode\.ADAPTERS\)"
    with pytest.raises(
        TypeError, match=registry + r", got 'bloom' \(BloomForCausalLM\)"
    ) as refused:
        generate(model, ids, max_new_tokens=1)
    assert "subclass the nearest adapter, conveyor.hf.decode.HfGpt2" in str(refused.value)
    assert "ADAPTERS['bloom'] = YourAdapter" in str(refused.value)
    assert "conveyor.inference.lm.CausalLM" in str(refused.value)


def test_phi3_with_longrope_generates_within_its_original_context_only() -> None:
    """Beyond the original context LongRoPE switches rotary factors and Hugging Face's
    generate recomputes the cache; within it, the tokens are equal."""
    from transformers import Phi3Config, Phi3ForCausalLM

    rope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    config = Phi3Config(
        **_common(),
        num_key_value_heads=2,
        original_max_position_embeddings=16,
        rope_parameters=rope,
    )
    model = _tiny(lambda: Phi3ForCausalLM(config), 4)
    ids, mask = two_prompts()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False)
    assert torch.equal(generate(model, ids, attention_mask=mask, max_new_tokens=7), want)
    with pytest.raises(ValueError, match="needs 17 positions but the model's context is 16"):
        generate(model, ids, attention_mask=mask, max_new_tokens=8)
