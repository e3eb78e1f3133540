"""A head and loss cut along the vocabulary: the same loss and gradients as the whole head's
cross-entropy, stages that start inside it, and a pipeline through it equal to plain training."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import conveyor
from conveyor.models import ChunkedGPT, gpt, gpt_loss
from conveyor.split import balance as module
from conveyor.split.balance import UnitCosts, decoder_layers, split_points_by_cost
from conveyor.split.vocab import ChunkedHeadLoss, vocab_chunks
from dist import run_ranks

VOCAB = 50


def labels(shape: tuple[int, ...], vocab: int = VOCAB) -> torch.Tensor:
    """Labels over the whole vocabulary, its first and last token and some -100 among them."""
    found = torch.randint(0, vocab, shape)
    found.view(-1)[:3] = torch.tensor([0, vocab - 1, -100])
    return found


@pytest.mark.parametrize("chunks", [1, 3, 7, VOCAB])
@pytest.mark.parametrize("bias", [False, True])
def test_the_chunked_loss_and_its_gradients_are_the_whole_heads(chunks: int, bias: bool) -> None:
    linear = nn.Linear(16, VOCAB, bias=bias).double()
    head = ChunkedHeadLoss.from_linear(linear, chunks)
    hidden = torch.randn(4, 6, 16, dtype=torch.float64, requires_grad=True)
    target = labels((4, 6))
    expected = F.cross_entropy(linear(hidden).flatten(0, 1), target.flatten())
    (grad_expected,) = torch.autograd.grad(expected, hidden, retain_graph=True)
    loss = head(hidden, target)
    (grad,) = torch.autograd.grad(loss, hidden, retain_graph=True)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, grad_expected, rtol=0, atol=1e-12)
    expected.backward()
    loss.backward()
    assert linear.weight.grad is not None
    weight_grads = torch.cat([c.weight.grad for c in head.chunks])  # type: ignore[misc]
    torch.testing.assert_close(weight_grads, linear.weight.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(head.logits(hidden), linear(hidden), rtol=0, atol=1e-12)
    starts = [int(rows[0]) for rows in torch.arange(VOCAB).tensor_split(chunks)]
    assert [c.start for c in head.chunks] == starts


def test_half_precision_logits_are_taken_to_float32() -> None:
    linear = nn.Linear(16, VOCAB).to(torch.bfloat16)
    hidden, target = torch.randn(4, 6, 16, dtype=torch.bfloat16), labels((4, 6))
    loss = ChunkedHeadLoss.from_linear(linear, 3)(hidden, target)
    expected = F.cross_entropy(linear(hidden).float().flatten(0, 1), target.flatten())
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected)


def test_a_vocabulary_is_cut_into_one_to_its_size_chunks() -> None:
    with pytest.raises(ValueError, match=r"cannot cut a vocabulary of 50 tokens into 51 chunks"):
        ChunkedHeadLoss.from_linear(nn.Linear(4, VOCAB), VOCAB + 1)


def test_chunks_that_do_not_tile_the_vocabulary_are_refused() -> None:
    first, second = ChunkedHeadLoss.from_linear(nn.Linear(4, VOCAB), 2).chunks
    with pytest.raises(ValueError, match="chunk 0 starts at token 25, expected 0"):
        ChunkedHeadLoss([second, first])  # type: ignore[list-item]


def test_a_gpt_with_a_chunked_head_computes_the_gpts_loss() -> None:
    torch.manual_seed(0)
    plain = gpt(vocab_size=VOCAB, seq_len=8, dim=16, num_layers=2, dropout=0.0).double()
    chunked = ChunkedGPT(copy.deepcopy(plain), chunks=4)
    ids, target = torch.randint(0, VOCAB, (3, 8)), labels((3, 8))
    mask = target != -100
    expected = gpt_loss(plain(ids)[mask].unsqueeze(0), target[mask].unsqueeze(0))
    torch.testing.assert_close(chunked(ids, target)["loss"], expected, rtol=0, atol=1e-12)


def test_a_gpt_whose_head_is_tied_to_its_embedding_is_refused() -> None:
    tied = gpt(vocab_size=VOCAB, seq_len=8, dim=16, num_layers=2, tie_embeddings=True)
    with pytest.raises(ValueError, match=r"tied to its token embedding.*tie_embeddings=False"):
        ChunkedGPT(tied, chunks=2)


def test_stages_may_start_at_the_blocks_and_the_vocabulary_chunks() -> None:
    """The chunks come after the blocks, and are never taken for the blocks (here there are
    more of them)."""
    model = ChunkedGPT(gpt(vocab_size=VOCAB, seq_len=8, dim=16, num_layers=2), chunks=5)
    assert decoder_layers(model) == ["layers.0", "layers.1"]
    assert vocab_chunks(model) == [f"head.chunks.{i}" for i in range(5)]


def test_a_split_by_measured_cost_cuts_a_heavy_head_inside_it() -> None:
    """A head costing most of the model: any cut between blocks leaves one stage all of it,
    so the cut by measured cost falls between its chunks."""
    torch.manual_seed(0)
    model = ChunkedGPT(gpt(vocab_size=32768, seq_len=16, dim=32, num_layers=2), chunks=8)
    ids = torch.randint(0, 32768, (4, 16))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1)}
    choice = split_points_by_cost(
        model, 2, batch, loss_fn=conveyor.hf.loss.model_loss, time_budget_s=0.3
    )
    assert choice.split_points[0].startswith("head.chunks."), choice


def _through_the_head(rank: int, world_size: int) -> None:
    """Cuts inside the head, by hand for 1f1b and zb-v and chosen by (made-up) measured costs
    out of the box: the loss and every gradient are plain training's (float64)."""
    torch.set_default_dtype(torch.float64)
    starts = ("layers.0", "layers.1", *(f"head.chunks.{i}" for i in range(4)))
    heavy = UnitCosts(starts, (0.001,) * 3 + (0.010,) * 4, (0.001,) * 3 + (0.010,) * 4)
    module.measure_unit_costs = lambda *args, **kwargs: heavy  # type: ignore[assignment]
    ids = torch.randint(0, VOCAB, (8, 8), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": labels((8, 8))}
    configs = [
        {"split_points": ["head.chunks.1"], "schedule": "1f1b"},
        {"split_points": ["layers.1", "head.chunks.0", "head.chunks.2"], "schedule": "zb-v"},
        {"example_inputs": batch},
    ]
    for options in configs:
        torch.manual_seed(0)
        model = ChunkedGPT(gpt(vocab_size=VOCAB, seq_len=8, dim=16, num_layers=2), chunks=4)
        model.eval()  # no dropout: the reference may run the whole batch at once
        plain = copy.deepcopy(model)
        pipe = conveyor.Pipeline(model, num_microbatches=4, timeout_s=30, **options)
        if "example_inputs" in options:
            assert pipe.split_points == ("head.chunks.2",), pipe.split_points
        assert_step_is_plain(pipe, plain, batch, str(options))


def assert_step_is_plain(pipe: conveyor.Pipeline, plain: nn.Module, batch: dict, what: str) -> None:
    """One step of ``pipe`` on ``batch``: its loss (where this rank has it) and every gradient
    it holds equal those of ``plain``, the unsplit model computing its own loss (float64)."""
    loss = pipe.step(batch)
    expected = plain(**batch)["loss"]
    expected.backward()
    if loss is not None:
        torch.testing.assert_close(loss, expected, rtol=0, atol=1e-10)
    reference = dict(plain.named_parameters())
    for name, parameter in pipe.named_parameters():
        assert parameter.grad is not None, f"{what}: {name} has no gradient"
        torch.testing.assert_close(
            parameter.grad, reference[name].grad, rtol=0, atol=1e-10,
            msg=lambda m, n=name: f"{what}: {n}: {m}",
        )  # fmt: skip


@pytest.mark.dist
def test_a_pipeline_cut_inside_the_head_trains_as_plain(tmp_path: Path) -> None:
    run_ranks(_through_the_head, tmp_path, 2, timeout_s=120)
