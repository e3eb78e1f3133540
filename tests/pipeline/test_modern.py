"""Modern schedules on real ranks: interleaved 1F1B, ZB-H1, ZB-V and DualPipeV train exactly
as plain training does (with virtual stages, checkpointing and tied weights), hold the
activation memory their papers promise, and deferred batch norm keeps the plain model's
statistics."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.distributed.tensor import DTensor

import conveyor
from conveyor.graph import StageGraph
from conveyor.models import gpt, gpt_loss, text_batches
from conveyor.runtime.batchnorm import DeferredBatchNorm
from conveyor.schedule import Kind, Program
from conveyor.schedule.interleaved import rounds
from dist import run_ranks

pytestmark = pytest.mark.dist

# (schedule, stages per rank): every layout each schedule runs
LAYOUTS = [
    ("gpipe", 1),
    ("gpipe", 2),
    ("1f1b", 1),
    ("interleaved-1f1b", 1),
    ("interleaved-1f1b", 2),
    ("zb-h1", 1),
    ("zb-v", 2),
    ("dualpipev", 2),
]


class Scale(nn.Module):
    """x * 2: keeps the first stage's saved input a fresh tensor of its own (see
    ``storage_peak``), not a view of the whole batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


def tied_chain(num_stages: int, width: int = 8, tie: bool = True) -> nn.Sequential:
    """Per stage a Linear and a Tanh, float64; the first and the last Linear share one weight
    (tied, as a GPT's embedding and output projection; unless ``tie`` is False), and the first
    stage starts with Scale."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [Scale()]
    for _ in range(num_stages):
        layers += [nn.Linear(width, width, bias=False), nn.Tanh()]
    model = nn.Sequential(*layers).double()
    if tie:
        model[-2].weight = model[1].weight
    return model


def balance(num_stages: int) -> list[int]:
    return [3] + [2] * (num_stages - 1)  # Scale joins the first stage


def reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, m: int) -> torch.Tensor:
    """Plain training on one process: micro-batch losses weighted by their share."""
    total = torch.zeros((), dtype=x.dtype)
    for xk, yk in zip(torch.tensor_split(x, m), torch.tensor_split(y, m), strict=True):
        loss = F.mse_loss(model(xk), yk) * (len(xk) / len(x))
        loss.backward()
        total += loss.detach()
    return total


def check_step(
    pipe: conveyor.Pipeline, plain: nn.Module, x: torch.Tensor, y: torch.Tensor, what: str
) -> None:
    expected = reference(plain, x, y, pipe.config.num_microbatches)
    loss = pipe.step(x, y)
    if pipe.rank == pipe.graph.rank_of(pipe.graph.sink):
        assert loss is not None
        torch.testing.assert_close(loss, expected, rtol=0, atol=1e-10, msg=what)
    grads = dict(plain.named_parameters(remove_duplicate=False))
    for stage in pipe.stages.values():
        for name, param in stage.named_parameters(remove_duplicate=False):
            torch.testing.assert_close(
                param.grad,
                grads[name].grad,
                rtol=0,
                atol=1e-10,
                msg=lambda text, n=name: f"{what} {n}: {text}",
            )


def _correctness(
    rank: int, world_size: int, cases: list[tuple[str, int, int, str]], tie: bool = True
) -> None:
    x = torch.randn(12, 8, dtype=torch.float64)
    y = torch.randn(12, 8, dtype=torch.float64)
    for schedule, per_rank, m, recompute in cases:
        what = f"{schedule} x{per_rank} m={m} recompute={recompute} on {world_size} ranks"
        what += ":" if tie else " (no tie):"
        num_stages = per_rank * world_size
        plain = tied_chain(num_stages, tie=tie)
        pipe = conveyor.Pipeline(
            copy.deepcopy(plain),
            balance=balance(num_stages),
            schedule=schedule,
            num_microbatches=m,
            recompute=recompute,
            loss_fn=F.mse_loss,
            timeout_s=15,
        )
        assert len(pipe.graph.stages_on(rank)) == per_rank
        ours = torch.optim.SGD(pipe.parameters(), lr=0.5)
        theirs = torch.optim.SGD(plain.parameters(), lr=0.5)
        for _ in range(2):  # the second step checks that the tied copies stayed one weight
            check_step(pipe, plain, x, y, what)
            ours.step()
            theirs.step()
            ours.zero_grad()
            theirs.zero_grad()
        assert pipe.ties.max_difference() == 0.0
        output = pipe.forward(x)  # inference runs every layout too
        if rank == pipe.graph.rank_of(pipe.graph.sink):
            with torch.no_grad():
                torch.testing.assert_close(output, plain(x), rtol=0, atol=1e-12, msg=what)


def cases(microbatches: list[int], checkpoints: list[str]) -> list[tuple[str, int, int, str]]:
    return [(s, v, m, c) for s, v in LAYOUTS for m in microbatches for c in checkpoints]


def test_every_schedule_matches_plain_training_on_2_ranks(tmp_path: Path) -> None:
    grid = cases([1, 2, 3, 5], ["never"]) + cases([2, 5], ["always", "except_last"])
    run_ranks(_correctness, tmp_path, world_size=2, timeout_s=240, cases=grid)


def test_every_schedule_matches_plain_training_on_4_ranks(tmp_path: Path) -> None:
    grid = [
        (s, v, m, c)
        for s, v in LAYOUTS
        if (s, v) != ("gpipe", 2)
        for m, c in ((4, "never"), (6, "never"), (5, "always"))
    ]
    grid.append(("dualpipev", 2, 8, "never"))  # DualPipeV's steady state needs m >= 2p
    run_ranks(_correctness, tmp_path, world_size=4, timeout_s=300, cases=grid)


def test_dualpipev_without_a_tie_matches_plain_training(tmp_path: Path) -> None:
    grid = [("dualpipev", 2, m, c) for m, c in ((1, "never"), (4, "never"), (6, "always"))]
    run_ranks(_correctness, tmp_path, world_size=2, timeout_s=120, cases=grid, tie=False)


def _replicated(rank: int, world_size: int) -> None:
    """dp=2 x pp=2: each replica runs DualPipeV on its half of the batch; the loss and every
    gradient are plain training's on the whole batch, with and without the tie."""
    m = 4
    x = torch.randn(24, 8, dtype=torch.float64)
    y = torch.randn(24, 8, dtype=torch.float64)
    for tie in (True, False):
        what = f"dualpipev dp=2 x pp=2 m={m} tie={tie}:"
        plain = tied_chain(4, tie=tie)
        pipe = conveyor.Pipeline(
            copy.deepcopy(plain),
            dp=2,
            balance=balance(4),
            schedule="dualpipev",
            num_microbatches=m,
            loss_fn=F.mse_loss,
            broadcast_loss=True,
            timeout_s=15,
        )
        assert pipe.num_replicas == 2 and len(pipe.graph.stages_on(pipe.rank)) == 2
        share = slice(12 * pipe.replica, 12 * pipe.replica + 12)
        ours = torch.optim.SGD(pipe.parameters(), lr=0.5)
        theirs = torch.optim.SGD(plain.parameters(), lr=0.5)
        for _ in range(2):  # the second step checks that the tied copies stayed one weight
            expected = reference(plain, x, y, 2 * m)  # the replicas' micro-batches, in order
            loss = pipe.step(x[share], y[share])
            torch.testing.assert_close(loss, expected, rtol=0, atol=1e-10, msg=what)
            grads = dict(plain.named_parameters(remove_duplicate=False))
            for name, param in pipe.named_parameters():
                grad = param.grad  # a replicated stage's, with split backward, is a DTensor
                torch.testing.assert_close(
                    grad.full_tensor() if isinstance(grad, DTensor) else grad,
                    grads[name].grad,
                    rtol=0,
                    atol=1e-10,
                    msg=lambda text, n=name, w=what: f"{w} {n}: {text}",
                )
            ours.step()
            theirs.step()
            ours.zero_grad()
            theirs.zero_grad()
        assert pipe.ties.max_difference() == 0.0


def test_dualpipev_with_data_parallelism_matches_plain_training(tmp_path: Path) -> None:
    run_ranks(_replicated, tmp_path, world_size=4, timeout_s=180)


# -- memory -------------------------------------------------------------------------------


def theory(schedule: str, p: int, v: int, m: int, rank: int) -> int:
    """The papers' peak of (stage, micro-batch) activation sets alive on ``rank``
    (tests/test_schedules.py checks the programs against the same formulas)."""
    below = p - 1 - rank
    warmup = below if v == 1 else (v - 1) * rounds(m, p)[0] + 2 * below
    return {
        "gpipe": v * m,
        "1f1b": min(m, p - rank),
        "interleaved-1f1b": min(v * m, warmup + 1),
        "zb-h1": min(m, p),
        "zb-v": min(2 * p, 2 * m, m + 1 + rank),
        "dualpipev": min(2 * p + 1, 2 * m, m + 1 + rank),
    }[schedule]


def storage_peak(program: Program, graph: StageGraph, rank: int) -> int:
    """Most activation storages ``rank`` keeps at once, for ``tied_chain``: a stage keeps its
    input (a received buffer, or its local producer's output) and its output (saved by
    Linear and Tanh); after I, also the gradient W starts from; all until B or W."""
    alive: dict[tuple[int, int], set[tuple[str, int, int]]] = {}
    peak = 0
    for action in program[rank]:
        s, k = action.stage, action.microbatch
        if action.kind is Kind.F:
            local = s > 0 and graph.rank_of(s - 1) == rank
            alive[(s, k)] = {("out", s - 1, k) if local else ("in", s, k), ("out", s, k)}
        elif action.kind is Kind.I:
            alive[(s, k)].add(("grad", s, k))
        elif action.kind in (Kind.B, Kind.W):
            del alive[(s, k)]
        peak = max(peak, len(set().union(*alive.values())))
    return peak


def _memory(rank: int, world_size: int, microbatches: list[int]) -> None:
    batch_per_microbatch = 3
    for schedule, per_rank in LAYOUTS:
        for m in microbatches:
            num_stages = per_rank * world_size
            pipe = conveyor.Pipeline(
                tied_chain(num_stages),
                balance=balance(num_stages),
                schedule=schedule,
                num_microbatches=m,
                loss_fn=F.mse_loss,
                timeout_s=15,
                measure_memory=True,
            )
            x = torch.randn(batch_per_microbatch * m, 8, dtype=torch.float64)
            pipe.step(x, torch.randn_like(x))
            report = pipe.memory()
            what = f"{schedule} x{per_rank} m={m} rank {rank}"
            assert report.peak_microbatches == theory(schedule, world_size, per_rank, m, rank), what
            storage = batch_per_microbatch * 8 * 8  # one (3, 8) float64 tensor
            expected = storage_peak(pipe.program, pipe.graph, rank) * storage
            assert report.peak_bytes == expected, f"{what}: {report.peak_bytes} != {expected}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_peak_activation_memory_matches_theory(tmp_path: Path, world_size: int) -> None:
    microbatches = [1, 3, 4, 7] if world_size == 2 else [3, 8]
    run_ranks(_memory, tmp_path, world_size=world_size, timeout_s=240, microbatches=microbatches)


# -- the demo's GPT with tied embeddings, float32 -----------------------------------------


def _gpt(rank: int, world_size: int) -> None:
    x, y = text_batches(8, 16, 1)[0]
    for schedule in ("1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipev"):
        torch.manual_seed(0)
        plain = gpt(seq_len=16, dim=32, num_layers=4, dropout=0.0, tie_embeddings=True)
        pipe = conveyor.Pipeline(
            copy.deepcopy(plain),
            schedule=schedule,
            num_microbatches=4,
            loss_fn=gpt_loss,
            timeout_s=20,
        )
        is_v = schedule in ("zb-v", "dualpipev")
        assert len(pipe.ties.params) == (0 if is_v else 1)  # V: one rank
        loss = pipe.step(x, y)
        total = torch.zeros(())
        for xk, yk in zip(x.chunk(4), y.chunk(4), strict=True):
            part = gpt_loss(plain(xk), yk) / 4
            part.backward()
            total += part.detach()
        if loss is not None:
            torch.testing.assert_close(loss, total)
        grads = dict(plain.named_parameters(remove_duplicate=False))
        for stage in pipe.stages.values():
            for name, param in stage.named_parameters(remove_duplicate=False):
                torch.testing.assert_close(
                    param.grad, grads[name].grad, msg=lambda t, n=name, s=schedule: f"{s} {n}: {t}"
                )


def test_gpt_with_tied_embeddings(tmp_path: Path) -> None:
    run_ranks(_gpt, tmp_path, world_size=2, timeout_s=180)


# -- declared ties, deferred batch norm ---------------------------------------------------


def _declared(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    plain = copy.deepcopy(model)
    plain[2].weight = plain[0].weight  # what the declaration means
    pipe = conveyor.Pipeline(
        model,
        balance=[2, 1],
        tie_weights=("0.weight,2.weight",),
        loss_fn=F.mse_loss,
        num_microbatches=2,
        schedule="zb-h1",
    )
    x = torch.randn(6, 4, dtype=torch.float64)
    y = torch.randn(6, 4, dtype=torch.float64)
    check_step(pipe, plain, x, y, "declared tie:")  # rank 1 took rank 0's value at start
    with pytest.raises(ValueError, match="which no stage holds"):
        conveyor.Pipeline(
            copy.deepcopy(model),
            balance=[2, 1],
            loss_fn=F.mse_loss,
            tie_weights=("0.weight,9.weight",),
        )


def test_declared_ties(tmp_path: Path) -> None:
    run_ranks(_declared, tmp_path, world_size=2, timeout_s=120)


CUSTOM = """
# ZB-H1's idea by hand: rank 1 defers both weight gradients to the end
rank 0: 0F0 0F1 0F2 0I0 0W0 0I1 0W1 0I2 0W2
rank 1: 1F0 1I0 1F1 1I1 1F2 1I2 1W0 1W1 1W2
"""


def _custom(rank: int, world_size: int, path: str) -> None:
    x = torch.randn(9, 8, dtype=torch.float64)
    y = torch.randn(9, 8, dtype=torch.float64)
    for recompute in ("never", "always"):
        plain = tied_chain(2)
        pipe = conveyor.Pipeline(
            copy.deepcopy(plain),
            balance=balance(2),
            schedule=path,
            num_microbatches=3,
            recompute=recompute,
            loss_fn=F.mse_loss,
        )
        assert [str(a) for a in pipe.program.compute_only()[rank]] == CUSTOM.strip().splitlines()[
            1 + rank
        ].split(": ")[1].split()
        check_step(pipe, plain, x, y, f"custom schedule from {path}, {recompute}:")


def test_custom_schedule_file_trains_like_plain(tmp_path: Path) -> None:
    path = tmp_path / "custom.txt"
    path.write_text(CUSTOM)
    run_ranks(_custom, tmp_path, world_size=2, timeout_s=120, path=str(path))


def batch_norm_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 6),
        nn.BatchNorm1d(6),
        nn.Tanh(),
        nn.Linear(6, 6),
        nn.BatchNorm1d(6),
        nn.Linear(6, 2),
    ).double()


def _batch_norm(rank: int, world_size: int) -> None:
    x = torch.randn(12, 4, dtype=torch.float64)
    y = torch.randn(12, 2, dtype=torch.float64)
    m = 3
    for schedule, recompute in (("1f1b", "never"), ("zb-h1", "always"), ("gpipe", "except_last")):
        plain = batch_norm_model()
        # plain BatchNorm layers fed, as one mini-batch, what each layer sees in the pipeline
        whole = {
            name: copy.deepcopy(module)
            for name, module in plain.named_modules()
            if isinstance(module, nn.BatchNorm1d)
        }
        micro = DeferredBatchNorm.convert(copy.deepcopy(plain), m)
        seen: dict[str, list[torch.Tensor]] = {name: [] for name in whole}
        for name in whole:
            micro.get_submodule(name).register_forward_pre_hook(
                lambda _, args, inputs=seen[name]: inputs.append(args[0].detach())
            )
        pipe = conveyor.Pipeline(
            copy.deepcopy(plain),
            balance=[3, 3],
            schedule=schedule,
            num_microbatches=m,
            recompute=recompute,
            deferred_batch_norm=True,
            loss_fn=F.mse_loss,
        )
        for _ in range(2):
            check_step(pipe, micro, x, y, f"deferred batch norm, {schedule}:")
            state = pipe.state_dict()
            for name, module in whole.items():
                module(torch.cat(seen[name]))
                seen[name].clear()
                for key, value in module.state_dict().items():
                    if f"{name}.{key}" in state and key != "weight" and key != "bias":
                        torch.testing.assert_close(
                            state[f"{name}.{key}"],
                            value,
                            rtol=0,
                            atol=1e-12,
                            msg=f"{schedule} {name}.{key}",
                        )

    for schedule, recompute in (("zb-h1", "always"), ("1f1b", "except_last")):
        # plain BatchNorm moves its statistics once per micro-batch, recomputed or not (and
        # the last micro-batch's backward, after the others' recomputations, still runs)
        plain = batch_norm_model()
        pipe = conveyor.Pipeline(
            copy.deepcopy(plain), balance=[3, 3], schedule=schedule, num_microbatches=m,
            recompute=recompute, loss_fn=F.mse_loss,
        )  # fmt: skip
        check_step(pipe, plain, x, y, f"batch norm, {schedule}, {recompute}:")
        expected = plain.state_dict()
        for key, value in pipe.state_dict().items():
            torch.testing.assert_close(value, expected[key], rtol=0, atol=1e-12, msg=key)


def test_batch_norm_statistics_move_as_in_plain_training(tmp_path: Path) -> None:
    run_ranks(_batch_norm, tmp_path, world_size=2, timeout_s=120)


def test_virtual_stages_need_matching_counts(tmp_path: Path) -> None:
    run_ranks(_layout_errors, tmp_path, world_size=2, timeout_s=60)


def _layout_errors(rank: int, world_size: int) -> None:
    model = tied_chain(4)
    with pytest.raises(ValueError, match="makes 6 stages, but the split has 4"):
        conveyor.Pipeline(model, balance=balance(4), virtual_stages=3, loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match="placed in a V"):
        conveyor.Pipeline(
            tied_chain(4),
            balance=balance(4),
            schedule="zb-v",
            placement_style="loop",
            loss_fn=F.mse_loss,
        )
    pipe: Any = conveyor.Pipeline(
        tied_chain(6), virtual_stages=3, placement_style="v", schedule="gpipe", loss_fn=F.mse_loss
    )
    assert [pipe.graph.rank_of(s) for s in range(6)] == [0, 1, 1, 0, 0, 1]
