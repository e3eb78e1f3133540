"""Weights by the keys from_pretrained reads (conveyor.hf.weights): every tensor conveyor reads
for a model from a directory equals what ``from_pretrained`` loads from it, for families whose
files name tensors otherwise than their modules (renamed heads, merged experts, one shared
embedding for several names) and across base-model prefixes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.hf.weights import key_map
from conveyor.pipeline.weights import WeightFiles, materialize
from dist import run_ranks

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

VOCAB = 64


def _t5() -> Any:
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=1, num_decoder_layers=1, d_model=16, d_ff=32, d_kv=8, num_heads=2,
        vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    ))  # fmt: skip


def _bart() -> Any:
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0,
    ))  # fmt: skip


def _gpt_neox() -> Any:
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, tie_word_embeddings=False,
    ))  # fmt: skip


def _mixtral() -> Any:
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, num_local_experts=3,
        max_position_embeddings=32,
    ))  # fmt: skip


def _gpt2() -> Any:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32,
    ))  # fmt: skip


def _llama() -> Any:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, max_position_embeddings=32,
    ))  # fmt: skip


def _bert_config() -> Any:
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, num_labels=3,
    )  # fmt: skip


FAMILIES: dict[str, Callable[[], Any]] = {
    "t5": _t5, "bart": _bart, "gpt_neox": _gpt_neox, "mixtral": _mixtral, "gpt2": _gpt2,
    "llama": _llama,
}  # fmt: skip


def _saved(build: Callable[[], Any], directory: Path) -> Any:
    torch.manual_seed(0)
    build().save_pretrained(directory)
    return type(build())


def _meta(build: Callable[[], Any]) -> nn.Module:
    with torch.device("meta"):
        model: nn.Module = build()
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_read_is_what_from_pretrained_loads(family: str, tmp_path: Path) -> None:
    build = FAMILIES[family]
    cls = _saved(build, tmp_path)
    loaded = cls.from_pretrained(tmp_path).state_dict()
    files = WeightFiles(tmp_path, _meta(build))
    assert not files.keys.ignored, files.keys.ignored
    for name, expected in loaded.items():
        tensor = files.tensor(name)
        assert tensor is not None, f"{family}: no source for {name}"
        torch.testing.assert_close(tensor, expected, rtol=0, atol=0, msg=f"{family} {name}")
    assert files.used == set(files.weight_map), set(files.weight_map) - files.used


def test_the_files_differ_from_the_modules_for_these_families(tmp_path: Path) -> None:
    """What the test above covers: stored names that are not the module's."""
    names = {}
    for family in ("t5", "gpt_neox", "mixtral"):
        _saved(FAMILIES[family], tmp_path / family)
        names[family] = set(WeightFiles(tmp_path / family).weight_map)
    assert "encoder.embed_tokens.weight" not in names["t5"] and "shared.weight" in names["t5"]
    assert "embed_out.weight" in names["gpt_neox"] and "lm_head.weight" not in names["gpt_neox"]
    assert any(".experts.0.w1.weight" in k for k in names["mixtral"])


def test_a_base_model_checkpoint_fills_a_task_model_as_from_pretrained(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A masked LM's files into a classifier: the encoder under the prefix, the pre-training
    head left (and named), the classifier initialized (and named), as from_pretrained."""
    config = _bert_config()
    torch.manual_seed(0)
    transformers.BertForMaskedLM(config).save_pretrained(tmp_path)
    reference = transformers.BertForSequenceClassification.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.BertForSequenceClassification(config)
    files = WeightFiles(tmp_path, model)
    assert files.keys.ignored and all(k.startswith("cls.") for k in files.keys.ignored)
    state = reference.state_dict()
    for name in state:
        tensor = files.tensor(name)
        if name.startswith("classifier.") or name.startswith("bert.pooler."):
            assert tensor is None, name  # the masked LM's files have no pooler or classifier
        else:
            assert tensor is not None, name
            torch.testing.assert_close(tensor, state[name], rtol=0, atol=0, msg=name)
    with caplog.at_level(logging.WARNING, logger="conveyor.pipeline.weights"):
        torch.manual_seed(0)
        materialize(
            model,
            torch.device("cpu"),
            initialize=conveyor.hf.weights.initializer(model),
            files=files,
        )
    assert "classifier.weight" in caplog.text and "initialized" in caplog.text


def test_a_model_on_a_real_device_loads_the_files_too(tmp_path: Path) -> None:
    """weights= is not ignored when the model was built on the CPU."""
    _saved(_gpt_neox, tmp_path)
    torch.manual_seed(1)  # other random weights than the files'
    model = _gpt_neox()
    files = WeightFiles(tmp_path, model)
    materialize(model, torch.device("cpu"), initialize=lambda *_: False, files=files)
    loaded = transformers.GPTNeoXForCausalLM.from_pretrained(tmp_path).state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, loaded[name], rtol=0, atol=0, msg=name)


def test_a_plain_model_reads_its_own_names_and_ties(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight  # tied: stored once
    save_file({"0.weight": torch.ones(5, 4), "extra": torch.zeros(1)}, tmp_path / "w.st")
    found = key_map(model, ["0.weight", "extra"])
    assert found.ignored == ["extra"]
    assert found.sources["1.weight"].keys == ("0.weight",)


META_PIPELINES: dict[str, dict[str, Any]] = {
    "gpt_neox": {"split_points": ["gpt_neox.layers.1"]},
    "t5": {"stage_modules": ("shared,encoder", "decoder,lm_head")},
    "bart": {"split_points": ["model.decoder"]},
}
"""Families built on the meta device whose Pipelines hold and train what from_pretrained
loads (every tensor, the loss and every gradient)."""


def _pipelines_read_from_pretrained(rank: int, world_size: int, directory: str) -> None:
    cases = list(META_PIPELINES.items())
    ids = torch.randint(1, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    for family, split in cases:
        path = Path(directory) / family
        if rank == 0:
            _saved(FAMILIES[family], path)
        torch.distributed.barrier()
        batch = {"input_ids": ids, "labels": ids}
        pipe = conveyor.Pipeline(
            _meta(FAMILIES[family]), example_inputs=batch, weights=path, **split
        )
        reference = FAMILIES[family]().__class__.from_pretrained(path)
        expected = reference.state_dict()
        for name, tensor in pipe.state_dict().items():
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
        loss = pipe.step(batch)
        expected_loss = reference(**batch).loss
        expected_loss.backward()
        if loss is not None:
            torch.testing.assert_close(loss, expected_loss.detach())
        grads = dict(reference.named_parameters(remove_duplicate=False))
        for name, parameter in pipe.named_parameters():  # a tie within a stage stays one
            torch.testing.assert_close(parameter.grad, grads[name].grad, msg=name)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_pipelines_built_on_meta_hold_what_from_pretrained_loads(tmp_path: Path) -> None:
    run_ranks(_pipelines_read_from_pretrained, tmp_path, 2, timeout_s=240, directory=str(tmp_path))


def test_a_tie_inside_one_stage_stays_one_parameter(tmp_path: Path) -> None:
    """T5's decoder embedding and head are one weight: loaded from the files, both names
    hold one Parameter (two Parameters would split its gradient)."""
    _saved(_t5, tmp_path)
    model = _meta(_t5)
    files = WeightFiles(tmp_path, model)
    materialize(model, torch.device("cpu"), initialize=lambda *_: False, files=files)
    named = dict(model.named_parameters(remove_duplicate=False))
    assert named["decoder.embed_tokens.weight"] is named["lm_head.weight"]
    assert named["shared.weight"] is named["encoder.embed_tokens.weight"]
