"""Tensor parallelism inside a stage (parallelize_module with a user's plan) on a mesh computes
what plain training computes: tp x pp, and dp x tp with FSDP."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel

import conveyor
from conveyor.models import gpt, gpt_loss, gpt_tp_plan, text_batches
from dist import run_ranks

pytestmark = pytest.mark.dist


def plain_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, m: int) -> torch.Tensor:
    """Plain training on the batch, micro-batch j seeded as conveyor seeds global one j."""
    total = torch.zeros((), dtype=torch.float64)
    for j, (xj, yj) in enumerate(zip(x.tensor_split(m), y.tensor_split(m), strict=True)):
        torch.manual_seed(conveyor.microbatch_seed(0, 0, j))
        loss = gpt_loss(model(xj), yj) * (len(xj) / len(x))
        loss.backward()
        total += loss.detach()
    return total


def _tensor_parallel(rank: int, world_size: int) -> None:
    x, y = text_batches(8, 8, 1)[0]
    for sizes in ({"tp": 2}, {"dp": 2, "tp": 2, "fsdp": True}):  # pp = 2, then pp = 1
        torch.manual_seed(0)
        model = gpt(seq_len=8, dim=16, num_layers=2, num_heads=2, dropout=0.1).double()
        plain = copy.deepcopy(model)
        pipe = conveyor.Pipeline(
            model, tp_plan=gpt_tp_plan(), num_microbatches=2, loss_fn=gpt_loss,
            broadcast_loss=True, timeout_s=15, **sizes,
        )  # fmt: skip
        assert pipe.mesh is not None and pipe.mesh.shape.tp == 2
        share = slice(4 * pipe.replica, 4 * pipe.replica + 4) if "dp" in sizes else slice(None)
        loss = pipe.step(x[share], y[share])
        expected = plain_step(plain, x, y, 2 * pipe.num_replicas)
        torch.testing.assert_close(loss, expected, rtol=0, atol=1e-10, msg=str(sizes))
        names = dict(plain.named_parameters())
        split = [n for n, p in pipe.named_parameters() if "mlp" in n]
        assert split and all(isinstance(dict(pipe.named_parameters())[n], DTensor) for n in split)
        for name, param in pipe.named_parameters():
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            torch.testing.assert_close(grad, names[name].grad, rtol=0, atol=1e-10, msg=name)
        norm = pipe.clip_grad_norm_(0.5)  # each element counted once over dp, tp and pp
        expected_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        torch.testing.assert_close(norm, expected_norm, rtol=0, atol=1e-12, msg=str(sizes))
    model = gpt(seq_len=8, dim=16, num_layers=2, num_heads=2)
    with pytest.raises(ValueError, match="'zb-h1' splits the backward into I and W, which"):
        conveyor.Pipeline(model, tp_plan=gpt_tp_plan(), tp=2, schedule="zb-h1", loss_fn=gpt_loss)
    _exported_stages_are_refused()


def _exported_stages_are_refused() -> None:
    """A model split through torch.export holds graph modules: nothing for a plan to shard."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=32, max_position_embeddings=16,
    )  # fmt: skip
    ids = torch.randint(0, 32, (4, 8))
    plan = {"model.layers.*.mlp.gate_proj": ColwiseParallel()}
    with pytest.raises(ValueError, match=r"was split through torch\.export, whose stages hold"):
        conveyor.Pipeline(
            LlamaForCausalLM(config), tp_plan=plan, tp=2, split_points=["model.layers.1"],
            example_inputs={"input_ids": ids, "labels": ids},
        )  # fmt: skip


def test_tensor_parallel_stages_match_plain_training(tmp_path: Path) -> None:
    run_ranks(_tensor_parallel, tmp_path, 4, timeout_s=240)
