"""Models built on the meta device (``with torch.device("meta")``), split through torch.export on
fake tensors of the stages' device (Note [meta models on fake tensors]), with their weights read
per stage from files: encoders, vision models (batch norm), an encoder-decoder and decoders
train as the plain model built on the CPU does. Mixtral trains built on the CPU and built on
the meta device: its export takes transformers' CPU branch (the meta device's failed on CPU).

Models come from small configs built in the test (nothing is downloaded); dropout is off.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from test_huggingface import (
    VOCAB,
    check_against_plain,
    image_batch,
    resnet,
    text_batch,
    vit,
)
from test_weights import _peak_bytes, _resident_bytes
from torch import nn

import conveyor
from conveyor.split import split_model
from conveyor.split.export import export_model, getattr_path
from dist import run_ranks

transformers = pytest.importorskip("transformers")


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[], dict[str, torch.Tensor]]
    split_points: list[str]
    dtype: torch.dtype = torch.float64
    num_microbatches: int = 2
    """1 for batch norm, so that it sees the batch plain training sees."""


def bert() -> nn.Module:
    """Large enough (4 layers of width 384: 55 MiB in float64) to see a rank hold half."""
    config = transformers.BertConfig(
        num_hidden_layers=4, hidden_size=384, intermediate_size=1536, num_attention_heads=2,
        vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


def distilbert() -> nn.Module:
    config = transformers.DistilBertConfig(
        n_layers=2, dim=32, hidden_dim=64, n_heads=2, vocab_size=VOCAB,
        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0,
    )  # fmt: skip
    return transformers.DistilBertForSequenceClassification(config)


def whisper() -> nn.Module:
    config = transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_source_positions=16, max_target_positions=16, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, dropout=0.0,
    )  # fmt: skip
    return transformers.WhisperForConditionalGeneration(config)


def falcon() -> nn.Module:
    config = transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return transformers.FalconForCausalLM(config)


def mixtral() -> nn.Module:
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32, output_router_logits=False,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def class_batch() -> dict[str, torch.Tensor]:
    labels = torch.randint(0, 2, (8,), generator=torch.Generator().manual_seed(4))
    return {**text_batch(), "labels": labels}


def speech_batch() -> dict[str, torch.Tensor]:
    """4 clips of 8 mel bins x 32 frames (Whisper wants twice max_source_positions), and
    decoder labels of 6 tokens."""
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(4, 8, 32, generator=generator, dtype=torch.float64)
    return {
        "input_features": features,
        "labels": torch.randint(3, VOCAB, (4, 6), generator=generator),
    }


def double_images() -> dict[str, torch.Tensor]:
    batch = image_batch()
    return {**batch, "pixel_values": batch["pixel_values"].double()}


ENCODERS = [
    Family("distilbert", distilbert, class_batch, ["distilbert.transformer.layer.1"]),
    Family("vit", vit, double_images, ["vit.layers.2"]),
    Family("resnet", resnet, double_images, ["resnet.encoder.stages.1"], num_microbatches=1),
]
DECODERS = [
    # the decoder's embedding and its tied head on two ranks: a tie across stages that
    # weights= fills once for both
    Family("whisper", whisper, speech_batch, ["model.decoder.layers.0"]),
    Family("falcon", falcon, lambda: text_batch(), ["transformer.h.1"]),
]
MEMORY_BERT = Family("bert", bert, lambda: text_batch(masked_lm=True), ["bert.encoder.layer.2"])
TESTED = [f.name for f in [*ENCODERS, *DECODERS, MEMORY_BERT]] + ["mixtral"]
"""Families built on the meta device, loaded with weights=, trained as plain here."""


def _built_on_cpu(family: Family) -> nn.Module:
    torch.manual_seed(0)
    return family.build().to(family.dtype)


def _train_from_meta(family: Family, directory: Path, rank: int, measure: bool = False) -> None:
    """The family built on the meta device and loaded from the files rank 0 saved from the
    model built on the CPU trains as that model (built again after the split, so that the
    split's memory is measured alone)."""
    if rank == 0:
        _built_on_cpu(family).save_pretrained(directory)
    torch.distributed.barrier()
    with torch.device("meta"):
        model = family.build().to(family.dtype)
    assert all(t.is_meta for t in model.state_dict().values())
    batch = family.batch()
    Path("/proc/self/clear_refs").write_text("5")  # restart the peak (VmHWM) from here
    before = _resident_bytes()
    pipe = conveyor.Pipeline(
        model, split_points=family.split_points, example_inputs=batch, weights=directory,
        num_microbatches=family.num_microbatches, timeout_s=30,
    )  # fmt: skip
    grown = _peak_bytes() - before
    plain = _built_on_cpu(family)
    if measure:
        whole = sum(t.nbytes for t in plain.state_dict().values())
        print(f"rank {rank}: {family.name} {whole / 2**20:.1f} MiB, peak growth while "
              f"splitting and loading {grown / 2**20:.1f} MiB")  # fmt: skip
        # each rank holds half the layers (and the tied embedding): well under the model
        assert grown < 0.75 * whole, f"{family.name}: grew {grown} bytes, model {whole}"
    assert all(t.device == pipe.device for t in pipe.state_dict().values()), family.name
    check_against_plain(pipe, plain, batch)
    buffers = dict(plain.named_buffers())
    for name, buffer in pipe.state_dict().items():
        if "running" in name:  # batch norm's statistics, updated as plain training does
            torch.testing.assert_close(buffer, buffers[name], msg=name)


def _encoders(rank: int, world_size: int, directory: str) -> None:
    # the first export loads torch.export's own code (tens of MB, once per process): load it
    # before measuring what splitting and loading BERT cost
    with torch.device("meta"):
        linear = nn.Linear(2, 2)
    export_model(linear, torch.ones(1, 2))
    for family in [MEMORY_BERT, *ENCODERS]:
        _train_from_meta(family, Path(directory) / family.name, rank, family is MEMORY_BERT)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_encoders_and_vision_models_built_on_meta_train_as_plain(tmp_path: Path) -> None:
    run_ranks(_encoders, tmp_path, 2, timeout_s=240, directory=str(tmp_path / "weights"))


def _decoders(rank: int, world_size: int, directory: str) -> None:
    for family in DECODERS:
        _train_from_meta(family, Path(directory) / family.name, rank)
    # Mixtral in float32 (transformers' grouped experts refuse float64 on the CPU), built on
    # the CPU, and on the meta device from its files (one tensor per expert, merged on load)
    files = Path(directory) / "mixtral"
    torch.manual_seed(0)
    plain = mixtral()
    if rank == 0:
        plain.save_pretrained(files)
    torch.distributed.barrier()
    with torch.device("meta"):
        meta = mixtral()
    batch = text_batch()
    for model, weights in [(copy.deepcopy(plain), None), (meta, files)]:
        pipe = conveyor.Pipeline(
            model, split_points=["model.layers.1"], example_inputs=batch, num_microbatches=2,
            timeout_s=30, weights=weights,
        )  # fmt: skip
        check_against_plain(pipe, plain, batch)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_decoders_built_on_meta_and_mixtral_train_as_plain(tmp_path: Path) -> None:
    run_ranks(_decoders, tmp_path, 2, timeout_s=240, directory=str(tmp_path / "weights"))


class Embedded(nn.Module):
    """What torch.export could not run on the meta device: a CLS token concatenated to the
    inputs (ViT), batch norm, a loss of the labels, a constant the forward makes (Falcon's
    ``x[..., [-2]]``) and a branch on the device (transformers' experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, 4))
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.head.weight.device.type == "meta":
            raise RuntimeError("traced on the meta device")
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        logits = self.head(x[:, 0][..., [0, 2]])
        return nn.functional.cross_entropy(logits, labels)


def embedded_batch() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(4, 3, 4), "labels": torch.randint(0, 3, (4,))}


def test_a_meta_model_is_exported_as_on_its_device_and_keeps_its_own_tensors() -> None:
    with torch.device("meta"):
        model = Embedded()
    module, _, _ = export_model(model, embedded_batch())
    assert module.get_parameter("cls") is model.cls  # the model's own, to materialize
    assert all(t.is_meta for t in model.state_dict().values())
    # the constant index the forward made is a real tensor, in the stage that reads it
    graph = split_model(model, ["head"], example_inputs=embedded_batch(), tracer="export")
    constants = [
        getattr_path(stage.module, str(node.target))
        for stage in graph.stages
        for node in stage.module.graph.nodes
        if node.op == "get_attr" and "lifted_tensor" in str(node.target)
    ]
    assert constants, "export lifts the index [0, 2] as a constant"
    for constant in constants:
        torch.testing.assert_close(constant, torch.tensor([0, 2]))


@torch.library.custom_op("conveyor_test::without_fake_kernel", mutates_args=())
def without_fake_kernel(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = without_fake_kernel(self.linear(x))
        return out


class Branchy(Custom):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data dependent
            x = x * 2
        out: torch.Tensor = self.linear(x)
        return out


def test_an_export_failure_names_its_cause_and_the_way_around_it() -> None:
    with torch.device("meta"):
        model = Custom()
    with pytest.raises(
        TypeError, match=r"could not run it on fake tensors of device 'cpu'"
    ) as error:
        export_model(model, torch.randn(2, 4))
    message = str(error.value)
    assert "no fake impl" in message and "build the model on 'cpu' instead" in message, message
    assert "branches on tensor values" not in message
    with pytest.raises(TypeError, match="could not trace it") as error:
        export_model(Custom(), torch.randn(2, 4))  # built on the CPU: the same op, no advice
    assert "branches on tensor values" not in str(error.value)
    assert "build the model" not in str(error.value)
    with torch.device("meta"):
        model = Branchy()
    with pytest.raises(TypeError, match="without Python branches on tensor values"):
        export_model(model, torch.randn(2, 4))
