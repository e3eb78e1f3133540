"""dp x pp on a DeviceMesh computes what plain training computes on the global batch: the loss,
every gradient (replicated or FSDP-sharded), global clipping, with every schedule and ties."""

from __future__ import annotations

import copy
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.distributed.tensor import DTensor

import conveyor
from conveyor.models import gpt
from conveyor.pipeline.decode import generate
from conveyor.runtime.loss import IGNORE_INDEX
from dist import run_ranks

pytestmark = pytest.mark.dist


def tied_model(width: int = 8) -> nn.Sequential:
    """Eight float64 layers with dropout and layer norm; the last Linear is the first's weight
    (one Parameter object, as a tied embedding is)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [
        nn.Linear(width, width),
        nn.Tanh(),
        nn.Linear(width, width),
        nn.Dropout(0.2),
        nn.Linear(width, width),
        nn.LayerNorm(width),
        nn.Tanh(),
        nn.Linear(width, width, bias=False),
    ]
    layers[-1].weight = layers[0].weight  # type: ignore[union-attr]
    return nn.Sequential(*layers).double()


def plain_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_microbatches: int, step: int
) -> torch.Tensor:
    """Plain training on the global batch: micro-batch j seeded as conveyor seeds global
    micro-batch j, losses weighted by their share of the batch, gradients accumulated."""
    total = torch.zeros((), dtype=x.dtype)
    chunks = zip(x.tensor_split(num_microbatches), y.tensor_split(num_microbatches), strict=True)
    for j, (xj, yj) in enumerate(chunks):
        torch.manual_seed(conveyor.microbatch_seed(0, step, j))
        loss = F.mse_loss(model(xj), yj) * (len(xj) / len(x))
        loss.backward()
        total += loss.detach()
    return total


def whole(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as one tensor (collective over the replicas for a DTensor)."""
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def check_grads(pipe: conveyor.Pipeline, plain: nn.Module, what: str) -> None:
    expected = dict(plain.named_parameters(remove_duplicate=False))
    for name, param in pipe.named_parameters():
        assert param.grad is not None, f"{what}: {name} has no gradient"
        torch.testing.assert_close(
            whole(param.grad),
            expected[name].grad,
            rtol=0,
            atol=1e-10,
            msg=lambda m, n=name: f"{what}: {n}: {m}",
        )


def check_one_reduction_per_stage(pipe: conveyor.Pipeline, what: str) -> None:
    """Each of the rank's stages is reduced once in the step: right after its last B or W
    (FSDP2), or, reduced in flight by DDP's reducer, waited for after every action."""
    assert pipe.recorder is not None and pipe.data_parallel is not None
    actions = [e.action for e in pipe.recorder.steps[-1][1] if not e.action.startswith("wait")]
    reduced = [a for a in actions if a.startswith("reduce")]
    assert sorted(reduced) == [f"reduce {s}" for s in sorted(pipe.stages)], what
    in_flight = pipe.data_parallel.in_flight
    assert bool(in_flight) == (not pipe.config.fsdp and "zb" not in pipe.config.schedule), what
    computed = [i for i, a in enumerate(actions) if re.fullmatch(r"\d+[FBIW]\d+", a)]
    for stage in pipe.stages:
        at = actions.index(f"reduce {stage}")
        if stage in in_flight:  # waited for after the last action
            assert at > computed[-1], (what, actions)
        else:
            weights = [i for i, a in enumerate(actions) if re.fullmatch(rf"{stage}[BW]\d+", a)]
            assert at == weights[-1] + 1, (what, actions)


def _equivalence(rank: int, world_size: int) -> None:
    m, steps = 2, 2
    # a split for another pipeline size is named in the mesh's sizes, before any message
    with pytest.raises(ValueError, match=r"3 pipeline ranks but the mesh has pp=2 \(dp=2 x pp=2 "
                       r"x tp=1 on a world of 4\).* run pp=3 on 6 ranks"):  # fmt: skip
        conveyor.Pipeline(tied_model(), dp=2, balance=[2, 4, 2], loss_fn=F.mse_loss)
    torch.manual_seed(1)
    batches = [(torch.randn(8, 8).double(), torch.randn(8, 8).double()) for _ in range(steps)]
    for schedule in ("1f1b", "interleaved-1f1b", "zb-h1", "zb-v"):
        for fsdp in (False, True):
            what = f"{schedule} fsdp={fsdp}"
            model = tied_model()
            plain = copy.deepcopy(model)
            pipe = conveyor.Pipeline(
                model,
                dp=2,
                fsdp=fsdp,
                reshard_after_forward=fsdp and schedule in ("zb-h1", "interleaved-1f1b"),
                schedule=schedule,
                num_microbatches=m,
                loss_fn=F.mse_loss,
                broadcast_loss=True,
                recompute="except_last" if fsdp else "always",
                trace=True,
                timeout_s=15,
            )
            assert pipe.num_replicas == 2 and pipe.mesh is not None
            share = slice(4 * pipe.replica, 4 * pipe.replica + 4)
            for step, (x, y) in enumerate(batches):  # two steps: gradients accumulate
                loss = pipe.step(x[share], y[share])
                expected = plain_step(plain, x, y, 2 * m, step)
                torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12, msg=what)
            check_grads(pipe, plain, what)
            check_one_reduction_per_stage(pipe, what)
            norm = pipe.clip_grad_norm_(0.1)
            plain_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
            torch.testing.assert_close(norm, plain_norm, rtol=0, atol=1e-12, msg=what)
            check_grads(pipe, plain, f"{what}, clipped")
            assert pipe.ties.max_difference() == 0.0
    for fsdp in (False, True):
        _token_mean_over_replicas(fsdp)
        _sum_over_steps_with_a_weight_without_gradient(fsdp, torch.float64)
    _sum_over_steps_with_a_weight_without_gradient(True, torch.float32)  # no PREMUL_SUM: gloo
    _a_stage_without_any_gradient()
    _generate_over_sharded_replicas()
    _the_same_batch_on_every_replica()
    _frozen_after_ddp_was_made()  # last: the refusal abandons the step


def _the_same_batch_on_every_replica() -> None:
    """Replicas given the same batch (code ported from one pipeline, where every rank passes
    the same batch) are told so, once: each sample would count once per replica."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("conveyor.parallel.data_parallel")
    logger.addHandler(handler)
    try:
        pipe = conveyor.Pipeline(tied_model(), dp=2, num_microbatches=2, loss_fn=F.mse_loss)
        x = torch.ones(4, 8).double()
        for _ in range(2):
            pipe.step(x, x)
    finally:
        logger.removeHandler(handler)
    warned = [r for r in records if "were given the same batch" in r.getMessage()]
    assert len(warned) == (1 if dist.get_rank() == 0 else 0), warned


def _frozen_after_ddp_was_made() -> None:
    """DDP's reducer reduces the parameters it was made for: freezing one later is named
    before the step runs, not left unreduced."""
    pipe = conveyor.Pipeline(tied_model(), dp=2, num_microbatches=2, loss_fn=F.mse_loss)
    for parameter in pipe.parameters():
        if parameter.dim() == 1:  # a bias in every stage
            parameter.requires_grad_(False)
    x = torch.randn(4, 8).double()
    with pytest.raises(RuntimeError, match="were frozen or unfrozen since the Pipeline was made"):
        pipe.step(x, x)


def _generate_over_sharded_replicas() -> None:
    """Decoding reads parameters outside the modules' forward: FSDP's shards are gathered for
    it, and sharded again after."""
    torch.manual_seed(4)
    model = gpt(vocab_size=32, seq_len=16, dim=16, num_layers=2, num_heads=2).double()
    ids = torch.randint(0, 32, (3, 4))
    expected = generate(copy.deepcopy(model), ids, max_new_tokens=5)
    pipe = conveyor.Pipeline(model, dp=2, fsdp=True, num_microbatches=2, timeout_s=15)
    assert torch.equal(pipe.generate(ids, max_new_tokens=5), expected)
    assert all(isinstance(p, DTensor) for p in pipe.parameters())


def _token_mean_over_replicas(fsdp: bool) -> None:
    """A token-level loss whose replicas count different tokens (2 and 4: replica 0's first
    micro-batch has only ignored targets, whose mean is NaN) still gives the global batch's
    token mean and gradients."""
    torch.manual_seed(2)
    x, y = torch.randn(8, 8).double(), torch.randint(0, 8, (8,))
    y[[0, 1]] = IGNORE_INDEX
    model = tied_model()
    plain = copy.deepcopy(model)
    pipe = conveyor.Pipeline(
        model, dp=2, fsdp=fsdp, num_microbatches=2, loss_fn=F.cross_entropy,
        loss_reduction="token_mean", broadcast_loss=True, timeout_s=15,
    )  # fmt: skip
    share = slice(4 * pipe.replica, 4 * pipe.replica + 4)
    loss = pipe.step(x[share], y[share])
    expected = torch.zeros((), dtype=x.dtype)
    for j, (xj, yj) in enumerate(zip(x.tensor_split(4), y.tensor_split(4), strict=True)):
        if j == 0:  # nothing to count
            continue
        torch.manual_seed(conveyor.microbatch_seed(0, 0, j))
        part = F.cross_entropy(plain(xj), yj) * (int((yj != IGNORE_INDEX).sum()) / 6)
        part.backward()
        expected += part.detach()
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12, msg="token_mean")
    check_grads(pipe, plain, f"token_mean over replicas, fsdp={fsdp}")


class Shift(nn.Module):
    """Adds a weight that the loss does not depend on (it is detached): no gradient, ever."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight.detach()


def _a_stage_without_any_gradient() -> None:
    """A replicated stage none of whose trainable parameters gets a gradient: DDP's reducer
    never runs, which is named (FSDP2 would reduce nothing and go on)."""
    model = nn.Sequential(nn.Linear(8, 8), Shift(8)).double()
    pipe = conveyor.Pipeline(model, dp=2, balance=[1, 1], loss_fn=F.mse_loss, timeout_s=15)
    x = torch.randn(4, 8).double()
    if 1 not in pipe.stages:
        pipe.step(x, x)
        return
    with pytest.raises(RuntimeError, match="stage 1: none of its trainable parameters got"):
        pipe.step(x, x)


def _sum_over_steps_with_a_weight_without_gradient(fsdp: bool, dtype: torch.dtype) -> None:
    """A summed loss whose gradients accumulate over two steps, and a weight without any
    gradient in the last stage: the sum over the global batch of both steps, no gradient;
    each step returns its global batch's sum."""
    torch.manual_seed(3)
    model = nn.Sequential(*tied_model(), Shift(8)).to(dtype)
    plain = copy.deepcopy(model)
    pipe = conveyor.Pipeline(
        model, dp=2, fsdp=fsdp, num_microbatches=2, loss_fn=F.mse_loss,
        loss_reduction="sum", broadcast_loss=True, timeout_s=15,
    )  # fmt: skip
    share = slice(4 * pipe.replica, 4 * pipe.replica + 4)
    what = f"sum over two steps, fsdp={fsdp}, {dtype}"
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    for step in range(2):
        x, y = torch.randn(8, 8, dtype=dtype), torch.randn(8, 8, dtype=dtype)
        loss = pipe.step(x[share], y[share])
        total = torch.zeros((), dtype=torch.float64)
        for j, (xj, yj) in enumerate(zip(x.tensor_split(4), y.tensor_split(4), strict=True)):
            torch.manual_seed(conveyor.microbatch_seed(0, step, j))
            part = F.mse_loss(plain(xj), yj)
            part.backward()
            total += part.detach().double()
        torch.testing.assert_close(loss, total, rtol=0, atol=tolerance, msg=what)
    expected = dict(plain.named_parameters(remove_duplicate=False))
    for name, param in pipe.named_parameters():
        if name.endswith(f"{len(model) - 1}.weight"):
            assert param.grad is None and expected[name].grad is None, what
            continue
        assert param.grad is not None, f"{what}: {name} has no gradient"
        torch.testing.assert_close(
            whole(param.grad), expected[name].grad, rtol=0, atol=tolerance, msg=what
        )


def test_dp_x_pp_equals_plain_training_on_the_global_batch(tmp_path: Path) -> None:
    run_ranks(_equivalence, tmp_path, 4, timeout_s=240)


def _first_stage(x: Any) -> Any:
    return x


def _compiled_replicas(rank: int, world_size: int) -> None:
    """Compiled stages on two replicas: DDP's reducer finds the parameters behind the
    compiled region's backward, and the gradients are the global batch's."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).double()
    plain = copy.deepcopy(model)
    pipe = conveyor.Pipeline(
        model, dp=2, num_microbatches=2, loss_fn=F.mse_loss, timeout_s=60
    ).compile(backend="aot_eager")
    assert pipe.data_parallel is not None and pipe.data_parallel.in_flight
    x, y = torch.randn(8, 8).double(), torch.randn(8, 8).double()
    share = slice(4 * pipe.replica, 4 * pipe.replica + 4)
    pipe.step(x[share], y[share])
    plain_step(plain, x, y, 4, 0)
    check_grads(pipe, plain, "compiled, dp=2")


def test_compiled_stages_reduce_over_replicas(tmp_path: Path) -> None:
    run_ranks(_compiled_replicas, tmp_path, 2, timeout_s=120)
