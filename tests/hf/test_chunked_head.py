"""A transformers causal LM with its head in vocabulary chunks: the model's own loss and
gradients, a pipeline cut inside the head equal to plain training, and the models it refuses."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from test_vocab import assert_step_is_plain
from torch import nn

import conveyor
from conveyor.hf.head import ChunkedCausalLM
from dist import run_ranks

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.dist

VOCAB = 96


def llama(tied: bool = False) -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
        tie_word_embeddings=tied,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids, and what the model's own loss predicts from them in place: the next token,
    -100 last and after some padding."""
    ids = torch.randint(0, VOCAB, (8, 12), generator=torch.Generator().manual_seed(1))
    own = ids.clone()
    own[1, 9:] = -100  # padding: not counted by either
    labels = torch.full_like(own, -100)
    labels[:, :-1] = own[:, 1:]
    return ids, labels


def test_the_chunked_loss_and_gradients_are_the_models_own() -> None:
    """In float32: transformers computes its loss in float32 whatever the model's dtype."""
    torch.manual_seed(0)
    model = llama()
    chunked = ChunkedCausalLM(copy.deepcopy(model), chunks=3)
    ids, labels = batch()
    own = ids.clone()
    own[1, 9:] = -100
    expected = model(input_ids=ids, labels=own).loss
    loss = chunked(ids, labels)["loss"]
    torch.testing.assert_close(loss, expected)
    expected.backward()
    loss.backward()
    head = torch.cat([c.weight.grad for c in chunked.head.chunks])  # type: ignore[misc]
    torch.testing.assert_close(head, model.lm_head.weight.grad)
    torch.testing.assert_close(
        chunked.model.layers[0].mlp.up_proj.weight.grad,
        model.model.layers[0].mlp.up_proj.weight.grad,
    )


def test_a_tied_head_and_another_family_are_refused() -> None:
    with pytest.raises(ValueError, match=r"tied to its token embedding \(tie_word_embeddings"):
        ChunkedCausalLM(llama(tied=True), chunks=2)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2))
    with pytest.raises(ValueError, match=r"model_type 'gpt2'.*\['llama', 'mistral'"):
        ChunkedCausalLM(gpt2, chunks=2)


def _cut_inside_the_head(rank: int, world_size: int) -> None:
    """Split through torch.export, the second stage starting at the head's second chunk: the
    loss and every gradient equal the unsplit model's (float64)."""
    torch.set_default_dtype(torch.float64)
    ids, labels = batch()
    example = {"input_ids": ids, "labels": labels}
    model = ChunkedCausalLM(llama(), chunks=4)
    plain = copy.deepcopy(model)
    pipe = conveyor.Pipeline(
        model, split_points=["head.chunks.1"], num_microbatches=4, example_inputs=example,
        timeout_s=60,
    )  # fmt: skip
    assert_step_is_plain(pipe, plain, example, "cut at head.chunks.1")


def test_a_pipeline_cut_inside_a_llamas_head_trains_as_plain(tmp_path: Path) -> None:
    run_ranks(_cut_inside_the_head, tmp_path, 2, timeout_s=180)


def _loaded_from_files(rank: int, world_size: int, directory: str) -> None:
    """Built on the meta device and loaded from transformers' own files: each rank's chunks
    are the rows of the saved ``lm_head.weight``, and the loss is the loaded model's own."""
    if rank == 0:
        torch.manual_seed(0)
        llama().save_pretrained(directory)
    torch.distributed.barrier()
    with torch.device("meta"):
        model = ChunkedCausalLM(llama(), chunks=4)
    ids, labels = batch()
    example = {"input_ids": ids, "labels": labels}
    pipe = conveyor.Pipeline(
        model, split_points=["head.chunks.2"], num_microbatches=4, example_inputs=example,
        weights=directory, timeout_s=60,
    )  # fmt: skip
    plain = transformers.LlamaForCausalLM.from_pretrained(directory)
    rows = plain.lm_head.weight.detach().tensor_split(4)
    held = dict(pipe.named_parameters())
    for index, expected in enumerate(rows):
        if f"head.chunks.{index}.weight" in held:
            torch.testing.assert_close(
                held[f"head.chunks.{index}.weight"], expected, rtol=0, atol=0
            )
    assert ("head.chunks.3.weight" in held) == (rank == 1)
    loss = pipe.step(example)
    own = ids.clone()
    own[1, 9:] = -100
    if loss is not None:
        torch.testing.assert_close(loss, plain(input_ids=ids, labels=own).loss.detach())


def test_a_chunked_llama_loads_its_head_from_the_models_files(tmp_path: Path) -> None:
    run_ranks(_loaded_from_files, tmp_path, 2, timeout_s=180, directory=str(tmp_path / "w"))
