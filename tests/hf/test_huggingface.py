"""Hugging Face models, unedited, split through torch.export: the model's own loss (token-level,
with padding and -100 labels), and every gradient, equal plain training on the full batch.

Models come from small configs built in the test (nothing is downloaded); dropout is off, so
the plain reference can run the whole batch at once.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import conveyor
from conveyor.hf.loss import label_counts
from conveyor.split.export import export_model
from dist import run_ranks

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

VOCAB = 96


def gpt2(layers: int = 4) -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def bert() -> nn.Module:
    config = transformers.BertConfig(
        num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


def t5() -> nn.Module:
    config = transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, d_kv=8, num_heads=4,
        vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def text_batch(
    masked_lm: bool = False, shape: tuple[int, int] = (8, 12)
) -> dict[str, torch.Tensor]:
    """8 sequences of 12 tokens, some padded (mask 0, label -100), uneven across micro-batches."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, shape, generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 9:] = mask[2, 3:] = mask[6, 10:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if masked_lm:  # a masked LM predicts a few positions only
        keep = torch.rand(ids.shape, generator=generator) < 0.3
        labels = labels.masked_fill(~keep, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def check_against_plain(
    pipe: conveyor.Pipeline, plain: nn.Module, batch: dict[str, torch.Tensor]
) -> None:
    """The pipeline's loss and every gradient on this rank equal the plain model's on the
    whole batch."""
    loss = pipe.step(batch)
    expected = plain(**batch).loss
    expected.backward()
    if pipe.rank == pipe.graph.rank_of(pipe.graph.sink):
        assert loss is not None
        torch.testing.assert_close(loss, expected.detach())
    reference = dict(plain.named_parameters(remove_duplicate=False))
    names = [name for name, _ in pipe.named_parameters()]
    assert names
    for name, parameter in pipe.named_parameters():
        torch.testing.assert_close(
            parameter.grad, reference[name].grad, msg=lambda m, n=name: f"{n}: {m}"
        )
        parameter.grad = None
    plain.zero_grad()


def marian() -> nn.Module:
    config = transformers.MarianConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=32,
        decoder_ffn_dim=32, encoder_attention_heads=2, decoder_attention_heads=2,
        pad_token_id=0, decoder_start_token_id=0, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.MarianMTModel(config)  # no loss_type: its forward computes its loss


def llava() -> nn.Module:
    text = transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=32, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=VOCAB,
    )  # fmt: skip
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        image_size=16, patch_size=8,
    )  # fmt: skip
    config = transformers.LlavaConfig(
        text_config=text, vision_config=vision, image_token_id=VOCAB - 1
    )  # "ForConditionalGeneration", and transformers' causal loss
    return transformers.LlavaForConditionalGeneration(config)


def xlnet() -> nn.Module:
    config = transformers.XLNetConfig(vocab_size=VOCAB, d_model=32, n_layer=1, n_head=2, d_inner=32)
    return transformers.XLNetLMHeadModel(config)  # no loss_type; a cross entropy in place


def bart_decoder() -> nn.Module:
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, decoder_layers=1, decoder_attention_heads=2,
        decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0,
    )  # fmt: skip
    return transformers.BartForCausalLM(config)  # "ForCausalLM", but its labels in place


def bert_pretraining() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForPreTraining(config)


MODELS = [gpt2, llama, t5, bert, marian, llava, xlnet, bart_decoder]


@pytest.mark.parametrize("build", MODELS, ids=lambda b: b.__name__)
def test_micro_batches_weighted_by_their_counted_labels_make_the_full_batch_loss(build) -> None:  # type: ignore[no-untyped-def]
    """What label_counts counts is what each model's own loss averages over: shifted tokens
    for causal LMs (also a vision-language model's "ForConditionalGeneration"), unshifted ones
    for encoder-decoders and masked LMs, whether or not transformers names the loss."""
    torch.manual_seed(0)
    model = build().eval()
    batch = text_batch(masked_lm=build is bert)
    chunks = [{k: v[i : i + 2] for k, v in batch.items()} for i in range(0, 8, 2)]
    counts = label_counts(model, [chunk["labels"] for chunk in chunks])
    with torch.no_grad():
        losses = torch.stack([model(**chunk).loss for chunk in chunks])
        expected = model(**batch).loss
    weights = torch.tensor(counts, dtype=losses.dtype) / sum(counts)
    torch.testing.assert_close((losses * weights).sum(), expected)


def roberta_classifier(num_labels: int = 3) -> nn.Module:
    config = transformers.RobertaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        vocab_size=VOCAB, max_position_embeddings=40, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=num_labels, pad_token_id=1,
    )  # fmt: skip
    return transformers.RobertaForSequenceClassification(config)


def ignored_class_labels(generator: torch.Generator, classes: int = 3) -> torch.Tensor:
    """8 class labels, -100 (ignored) unevenly: micro-batch 1 of 4 has none that count."""
    labels = torch.randint(0, classes, (8,), generator=generator)
    labels[[2, 3, 5]] = -100
    return labels


def _weighted(losses: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The runtime's weighting: a micro-batch that counts nothing adds nothing (not NaN)."""
    weights = torch.tensor(counts, dtype=losses.dtype) / sum(counts)
    return torch.where(weights > 0, losses * weights, torch.zeros(())).sum()


@pytest.mark.parametrize("kind", ["text", "image", "regression"])
def test_one_label_per_sample_is_weighted_by_the_labels_that_count(kind: str) -> None:
    """Classification ignores -100 labels (a micro-batch may count none); a regression counts
    every sample."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(5)
    if kind == "image":
        model, batch = vit().eval(), image_batch()
        batch["labels"] = ignored_class_labels(generator, 5)
    else:
        model = roberta_classifier(1 if kind == "regression" else 3).eval()
        batch = {k: v for k, v in text_batch().items() if k != "labels"}
        batch["labels"] = (
            torch.randn(8, generator=generator) if kind == "regression"
            else ignored_class_labels(generator)
        )  # fmt: skip
    chunks = [{k: v[i : i + 2] for k, v in batch.items()} for i in range(0, 8, 2)]
    counts = label_counts(model, [chunk["labels"] for chunk in chunks])
    assert counts == ([2, 2, 2, 2] if kind == "regression" else [2, 0, 1, 2])
    with torch.no_grad():
        losses = torch.stack([model(**chunk).loss for chunk in chunks])
        expected = model(**batch).loss
    torch.testing.assert_close(_weighted(losses, counts), expected)


def _classifiers_with_ignored_labels(rank: int, world_size: int) -> None:
    generator = torch.Generator().manual_seed(5)
    text = {k: v for k, v in text_batch().items() if k != "labels"}
    cases = [
        (roberta_classifier, {"split_points": ["roberta.encoder.layer.1"]},
         {**text, "labels": ignored_class_labels(generator)}),
        (vit, {"split_points": ["vit.layers.2"]},
         {**image_batch(), "labels": ignored_class_labels(generator, 5)}),
    ]  # fmt: skip
    for build, options, batch in cases:
        torch.manual_seed(0)
        model = build()
        plain = copy.deepcopy(model)
        pipe = conveyor.Pipeline(
            model, num_microbatches=4, example_inputs=batch, timeout_s=60, **options
        )
        check_against_plain(pipe, plain, batch)


def test_classifiers_with_ignored_labels_train_as_plain(tmp_path: Path) -> None:
    """A micro-batch whose labels are all -100 made the step's loss NaN; others were weighted
    by their samples, not the labels that count."""
    run_ranks(_classifiers_with_ignored_labels, tmp_path, 2, timeout_s=400)


def test_a_sum_of_two_losses_is_refused_naming_loss_fn() -> None:
    """BERT's pre-training adds its next-sentence loss (a mean over samples) to the masked LM's
    (a mean over tokens): no weights make the full batch's from micro-batches'."""
    batch = text_batch(masked_lm=True)
    inputs = {**batch, "next_sentence_label": torch.zeros(8, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"adds \['next_sentence_label'\] to the loss"):
        label_counts(bert_pretraining(), [batch["labels"]], inputs)
    assert label_counts(bert_pretraining(), [batch["labels"]], batch)  # the masked LM alone
    config = transformers.MixtralConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=32, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=VOCAB, num_local_experts=2, output_router_logits=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="router's load-balancing loss"):
        label_counts(transformers.MixtralForCausalLM(config), [batch["labels"]], batch)
    off = {**batch, "output_router_logits": False}
    assert label_counts(transformers.MixtralForCausalLM(config), [batch["labels"]], off)


def test_a_loss_in_code_conveyor_cannot_read_is_refused_naming_loss_fn() -> None:
    """XLM computes its loss in its prediction layer: nothing in its forward says whether
    the labels are shifted."""
    config = transformers.XLMConfig(vocab_size=VOCAB, emb_dim=32, n_layers=1, n_heads=2)
    with pytest.raises(ValueError, match=r"XLMWithLMHeadModel computes its loss in code"):
        label_counts(transformers.XLMWithLMHeadModel(config), [text_batch()["labels"]])
    prophet = transformers.ProphetNetConfig(
        vocab_size=VOCAB, hidden_size=32, num_encoder_layers=1, num_decoder_layers=1,
        num_encoder_attention_heads=2, num_decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32,
    )  # fmt: skip
    # its docstring's example slices labels[:, 1:]; its loss, in a helper, reads them in place
    with pytest.raises(ValueError, match=r"ProphetNetForCausalLM computes its loss in code"):
        label_counts(transformers.ProphetNetForCausalLM(prophet), [text_batch()["labels"]])


LLAMA_QUARTERS = ["model.layers.1", "model.layers.2", "model.layers.3"]
GPT2_QUARTERS = ["transformer.h.1", "transformer.h.2", "transformer.h.3"]


def _check_eval_loss(
    pipe: conveyor.Pipeline, plain: nn.Module, batch: dict[str, torch.Tensor]
) -> None:
    """In eval mode, the output's loss is the whole batch's (the micro-batches' weighed by
    their counted tokens), also when a micro-batch has none (its own mean is NaN)."""
    batch = {**batch, "labels": batch["labels"].clone()}
    batch["labels"][:2] = -100  # the first of 4 micro-batches counts nothing
    pipe.eval(), plain.eval()
    with torch.no_grad():
        output, expected = pipe(batch), plain(**batch)
    if output is not None:
        torch.testing.assert_close(output.loss, expected.loss)
        torch.testing.assert_close(output.logits, expected.logits)
    pipe.train(), plain.train()


def _attention_dropout_follows_the_mode() -> None:
    """GPT-2 passes attention's dropout probability only in training: split in training mode,
    evaluation turns it off; split in evaluation mode, training is refused."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, attn_pdrop=0.3
    )
    model = transformers.GPT2LMHeadModel(config)
    plain = copy.deepcopy(model).eval()
    batch = text_batch()
    options: dict[str, Any] = {"split_points": ["transformer.h.1"], "example_inputs": batch}
    pipe = conveyor.Pipeline(model, num_microbatches=2, timeout_s=30, **options).eval()
    with torch.no_grad():
        output, expected = pipe(batch), plain(**batch)
    if output is not None:
        torch.testing.assert_close(output.logits, expected.logits)
    evaluating = conveyor.Pipeline(plain, num_microbatches=2, timeout_s=30, **options)
    with pytest.raises(ValueError, match="split in eval mode into stages that hold for that"):
        evaluating.train()


def test_reentrant_gradient_checkpointing_is_refused_before_export() -> None:
    model = llama()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match=r"use_reentrant=True, which torch\.export traces"):
        export_model(model, text_batch())


def _language_models(rank: int, world_size: int) -> None:
    cases: list[tuple[Any, dict[str, Any], bool]] = [
        (gpt2, {"split_points": ["transformer.h.2"], "schedule": "zb-h1"}, False),
        (llama, {"auto_split": True, "schedule": "1f1b"}, False),  # export keeps a dead read
        # 4 stages on 2 ranks: the mask and rotary tables, made by stage 0, are relayed
        (llama, {"split_points": LLAMA_QUARTERS, "schedule": "zb-v"}, False),
        (gpt2, {"split_points": GPT2_QUARTERS, "schedule": "interleaved-1f1b"}, False),
        (bert, {"split_points": ["bert.encoder.layer.2"], "schedule": "zb-h1"}, True),
    ]
    for build, options, masked_lm in cases:
        torch.manual_seed(0)
        model = build()
        plain = copy.deepcopy(model)
        batch = text_batch(masked_lm)
        pipe = conveyor.Pipeline(
            model, num_microbatches=4, example_inputs=batch, timeout_s=30, **options
        )
        check_against_plain(pipe, plain, batch)
        _check_eval_loss(pipe, plain, batch)
    _attention_dropout_follows_the_mode()
    # the batch and sequence dimensions stayed dynamic: another shape runs, as plain
    check_against_plain(pipe, plain, text_batch(masked_lm, shape=(12, 7)))
    without_mask = {k: v for k, v in batch.items() if k != "attention_mask"}
    with pytest.raises(ValueError, match=r"example inputs \['attention_mask', 'input_ids'"):
        pipe.step(without_mask)


def test_language_models_train_as_plain_on_two_ranks(tmp_path: Path) -> None:
    run_ranks(_language_models, tmp_path, 2, timeout_s=400)


def _replicated_language_model(rank: int, world_size: int) -> None:
    """dp=2 x pp=2: each replica trains on its half of the batch (with different numbers of
    counted tokens), the tied embedding and head on two ranks; reduced by DDP's reducer
    (1F1B) or FSDP2 (ZB-H1)."""
    batches = [text_batch(), text_batch(masked_lm=True)]
    for schedule in ("1f1b", "zb-h1"):
        torch.manual_seed(0)
        model = gpt2()
        plain = copy.deepcopy(model)
        pipe = conveyor.Pipeline(
            model, dp=2, num_microbatches=2, example_inputs=batches[0], timeout_s=30,
            split_points=["transformer.h.2"], schedule=schedule, broadcast_loss=True,
        )  # fmt: skip
        share = slice(4 * pipe.replica, 4 * pipe.replica + 4)
        for batch in batches:  # two steps: the gradients accumulate
            loss = pipe.step({k: v[share] for k, v in batch.items()})
            expected = plain(**batch).loss
            expected.backward()
            assert loss is not None
            assert float(loss) == pytest.approx(float(expected), rel=1e-5), schedule
        reference = dict(plain.named_parameters(remove_duplicate=False))
        for name, parameter in pipe.named_parameters():
            assert parameter.grad is not None, f"{schedule}: {name} has no gradient"
            grad = parameter.grad
            torch.testing.assert_close(
                grad.full_tensor() if isinstance(grad, DTensor) else grad,
                reference[name].grad,
                msg=lambda m, n=name, s=schedule: f"{s}: {n}: {m}",
            )


def test_a_replicated_language_model_trains_as_plain_on_the_global_batch(
    tmp_path: Path,
) -> None:
    run_ranks(_replicated_language_model, tmp_path, 4, timeout_s=300)


def _seq2seq(rank: int, world_size: int) -> None:
    # a graph pipeline: the encoder's output feeds both decoder stages directly
    torch.manual_seed(0)
    model = t5()
    plain = copy.deepcopy(model)
    batch = text_batch()
    batch["labels"] = batch["labels"][:, :7].contiguous()  # a shorter target than the source
    modules = (
        "shared,encoder",
        "decoder.block.0",
        "decoder.block.1,decoder.final_layer_norm,lm_head",
    )
    pipe = conveyor.Pipeline(
        model,
        stage_modules=modules,
        schedule="graph-1f1b",
        num_microbatches=4,
        example_inputs=batch,
        timeout_s=60,
    )
    assert set(pipe.graph.consumers(0)) == {1, 2}
    check_against_plain(pipe, plain, batch)


def test_an_encoder_decoder_trains_as_a_graph_pipeline(tmp_path: Path) -> None:
    run_ranks(_seq2seq, tmp_path, 3, timeout_s=400)


def vit() -> nn.Module:
    config = transformers.ViTConfig(
        num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        image_size=16, patch_size=4, num_labels=5, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config)


def resnet() -> nn.Module:
    config = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16, 16], depths=[1, 1, 1], num_labels=5
    )
    return transformers.ResNetForImageClassification(config)


def image_batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    pixels = torch.randn(8, 3, 16, 16, generator=generator)
    return {"pixel_values": pixels, "labels": torch.randint(0, 5, (8,), generator=generator)}


def check_microbatched(
    pipe: conveyor.Pipeline, plain: nn.Module, batch: dict[str, torch.Tensor]
) -> None:
    """Against plain training micro-batch by micro-batch (batch norm sees micro-batches):
    losses weighted by their share of the samples, gradients and running statistics."""
    loss = pipe.step(batch)
    m = pipe.config.num_microbatches
    expected = torch.zeros(())
    chunks = [dict(zip(batch, values, strict=True)) for values in
              zip(*(v.tensor_split(m) for v in batch.values()), strict=True)]  # fmt: skip
    for chunk in chunks:
        weighted = plain(**chunk).loss * (len(chunk["labels"]) / len(batch["labels"]))
        weighted.backward()
        expected += weighted.detach()
    if pipe.rank == pipe.graph.rank_of(pipe.graph.sink):
        assert loss is not None
        torch.testing.assert_close(loss, expected)
    reference = dict(plain.named_parameters(remove_duplicate=False))
    for name, parameter in pipe.named_parameters():
        torch.testing.assert_close(parameter.grad, reference[name].grad, msg=name)
    buffers = dict(plain.named_buffers())
    for name, buffer in pipe.state_dict().items():
        if "running" in name:
            torch.testing.assert_close(buffer, buffers[name], msg=name)
    plain.zero_grad()


def _vision(rank: int, world_size: int) -> None:
    for build, options in [
        (resnet, {"auto_split": True}),
        (resnet, {"split_points": ["resnet.encoder.stages.1"]}),
        (vit, {"split_points": ["vit.layers.2"], "schedule": "zb-h1"}),
    ]:
        torch.manual_seed(0)
        model = build()
        plain = copy.deepcopy(model)
        batch = image_batch()
        pipe = conveyor.Pipeline(
            model, num_microbatches=4, example_inputs=batch, timeout_s=60, **options
        )
        check_microbatched(pipe, plain, batch)
        pipe.eval()  # batch norm on its running statistics, as the plain model in eval mode
        output = pipe(batch)
        if output is not None:
            expected = plain.eval()(**batch)
            assert type(output) is type(expected)
            torch.testing.assert_close(output.logits, expected.logits)


def test_vision_models_train_as_plain(tmp_path: Path) -> None:
    run_ranks(_vision, tmp_path, 2, timeout_s=400)


def _four_ranks_with_dropout(rank: int, world_size: int) -> None:
    # dropout on: each micro-batch draws the masks plain training draws when seeded the same
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=4, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.2
    )
    model = transformers.GPT2LMHeadModel(config)
    plain = copy.deepcopy(model)
    batch = text_batch()
    points = ["transformer.h.1", "transformer.h.2", "transformer.h.3"]
    pipe = conveyor.Pipeline(model, split_points=points, num_microbatches=4, example_inputs=batch)
    loss = pipe.step(batch)
    chunks = [dict(zip(batch, values, strict=True)) for values in
              zip(*(v.tensor_split(4) for v in batch.values()), strict=True)]  # fmt: skip
    counted = [int((c["labels"][:, 1:] != -100).sum()) for c in chunks]
    expected = torch.zeros(())
    for k, chunk in enumerate(chunks):
        torch.manual_seed(conveyor.microbatch_seed(0, 0, k))
        weighted = plain(**chunk).loss * (counted[k] / sum(counted))
        weighted.backward()
        expected += weighted.detach()
    if rank == 3:
        assert loss is not None
        torch.testing.assert_close(loss, expected)
    reference = dict(plain.named_parameters(remove_duplicate=False))
    for name, parameter in pipe.named_parameters():
        torch.testing.assert_close(parameter.grad, reference[name].grad, msg=name)


def test_four_ranks_draw_plain_trainings_dropout_masks(tmp_path: Path) -> None:
    run_ranks(_four_ranks_with_dropout, tmp_path, 4, timeout_s=400)
