"""Graph pipelines: DAG schedules on paper, and DAG models trained exactly like plain PyTorch."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.graph import MODEL_OUTPUT, Stage, StageGraph, chain
from conveyor.models import (
    classification_loss,
    click_batches,
    click_loss,
    dlrm,
    gpt,
    gpt_loss,
    multimodal_batches,
    segmentation_batches,
    segmentation_loss,
    two_tower,
    unet,
)
from conveyor.schedule import (
    Action,
    Kind,
    Program,
    ProgramError,
    build_program,
    gpipe,
    graph_1f1b,
    graph_gpipe,
    one_f_one_b,
    validate,
)
from conveyor.simulator import simulate
from conveyor.split import balance_to_split_points, run_stages, split_by_modules, split_model
from conveyor.split.auto import auto_split
from dist import run_ranks

GRAPH_SCHEDULES = ["gpipe", "1f1b", "graph-gpipe", "graph-1f1b"]
TOLERANCE = {"rtol": 1e-10, "atol": 1e-10}


# -- topologies (no modules): schedules on paper ----------------------------------------------


def towers(placement: tuple[int, int, int] = (0, 1, 2)) -> StageGraph:
    """Two towers (stages 0, 1) joined by a head (stage 2)."""
    return StageGraph(
        (
            Stage(0, placement[0], ("x",), ("a",)),
            Stage(1, placement[1], ("y",), ("b",)),
            Stage(2, placement[2], ("a", "b"), (MODEL_OUTPUT,)),
        ),
        ("x", "y"),
    )


def unet_levels(placement: tuple[int, ...]) -> StageGraph:
    """Encoder 0 -> 1, decoder 2 -> 3, skips 0 -> 3 and 1 -> 2."""
    return StageGraph(
        (
            Stage(0, placement[0], ("x",), ("h0", "s0")),
            Stage(1, placement[1], ("h0",), ("h1", "s1")),
            Stage(2, placement[2], ("h1", "s1"), ("h2",)),
            Stage(3, placement[3], ("h2", "s0"), (MODEL_OUTPUT,)),
        ),
        ("x",),
    )


def diamond(placement: tuple[int, ...]) -> StageGraph:
    """Stage 0 feeds stages 1 and 2 (fan-out), which both feed stage 3 (fan-in)."""
    return StageGraph(
        (
            Stage(0, placement[0], ("x",), ("h",)),
            Stage(1, placement[1], ("h",), ("l",)),
            Stage(2, placement[2], ("h",), ("r",)),
            Stage(3, placement[3], ("l", "r"), (MODEL_OUTPUT,)),
        ),
        ("x",),
    )


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("num_microbatches", [1, 2, 3, 5, 8])
def test_graph_schedules_are_the_chain_schedules_on_a_chain(
    num_stages: int, num_microbatches: int
) -> None:
    graph = chain(num_stages)
    for chain_schedule, graph_schedule in ((gpipe, graph_gpipe), (one_f_one_b, graph_1f1b)):
        expected = chain_schedule(graph, num_microbatches)
        program = graph_schedule(graph, num_microbatches)
        validate(program, graph)
        assert str(program.compute_only()) == str(expected.compute_only())


DAGS = {
    "towers": towers(),
    "towers on 2 ranks": towers((0, 1, 1)),
    "u-net on 4 ranks": unet_levels((0, 1, 2, 3)),
    "u-net V on 2 ranks": unet_levels((0, 1, 1, 0)),
    "diamond on 4 ranks": diamond((0, 1, 2, 3)),
    "diamond on 2 ranks": diamond((0, 1, 0, 1)),
}


@pytest.mark.parametrize("name", sorted(DAGS))
@pytest.mark.parametrize("num_microbatches", [1, 2, 4, 7])
def test_every_schedule_gives_a_valid_program_for_dags(name: str, num_microbatches: int) -> None:
    graph = DAGS[name]
    one_per_rank = graph.num_ranks == graph.num_stages
    times = {}
    for schedule in GRAPH_SCHEDULES:
        if schedule == "1f1b" and not one_per_rank:
            with pytest.raises(ValueError, match="runs one stage per rank"):
                build_program(schedule, graph, num_microbatches)
            continue
        program = build_program(schedule, graph, num_microbatches)  # validates: no deadlock
        times[schedule] = simulate(program, graph).step_time
    # the list schedules never lose to GPipe's fixed order
    assert times["graph-gpipe"] <= times["gpipe"] and times["graph-1f1b"] <= times["gpipe"]


def test_graph_1f1b_bounds_the_micro_batches_each_stage_holds() -> None:
    graph = unet_levels((0, 1, 1, 0))
    program = graph_1f1b(graph, 8)
    for rank_actions in program:
        alive: dict[int, int] = {}
        for action in (a for a in rank_actions if a.is_compute):
            alive[action.stage] = alive.get(action.stage, 0) + (1 if action.kind is Kind.F else -1)
            assert alive[action.stage] <= graph.distance_to_sink(action.stage) + 1


@pytest.mark.parametrize("num_microbatches", [1, 2, 4, 8])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "graph-gpipe", "graph-1f1b"])
def test_dag_step_follows_the_bubble_formula(num_microbatches: int, schedule: str) -> None:
    # equal stages: a chain of 3 takes (m + 2) slots of F + B, two towers and a head (m + 1)
    dag, relayed = towers(), chain(3)
    m = num_microbatches
    assert simulate(build_program(schedule, dag, m), dag).step_time == (m + 1) * 3
    assert simulate(build_program(schedule, relayed, m), relayed).step_time == (m + 2) * 3


def test_validator_covers_fan_in_and_fan_out() -> None:
    graph = towers()
    program = gpipe(graph, 2)
    dropped = Program(tuple(tuple(a for a in r if str(a) != "2RF0<1") for r in program), 2)
    with pytest.raises(ProgramError, match=r"2F0: comes before 2RF0<1, which it depends on"):
        validate(dropped, graph)
    swapped = [list(r) for r in program]  # stage 0's two sends to different peers is fine...
    rank2 = swapped[2]
    first, second = rank2.index(Action.parse("2RF0<0")), rank2.index(Action.parse("2RF1<0"))
    rank2[first], rank2[second] = rank2[second], rank2[first]  # ...but not out of channel order
    with pytest.raises(ProgramError, match="ranks must post receives in the order"):
        validate(Program(tuple(tuple(r) for r in swapped), 2), graph)


# -- multi-process: each model and schedule equals plain training -----------------------------


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def _check(
    rank: int,
    model: nn.Module,
    make: Callable[[nn.Module], conveyor.Pipeline],
    inputs: Any,
    targets: torch.Tensor,
    loss_fn: Callable[..., torch.Tensor],
    what: str,
) -> conveyor.Pipeline:
    """One pipelined step of a copy of ``model`` against one plain step of another copy."""
    reference = copy.deepcopy(model)
    expected = loss_fn(_call(reference, inputs), targets)
    expected.backward()
    pipe = make(copy.deepcopy(model))
    loss = pipe.step(inputs, targets)
    if loss is not None:
        torch.testing.assert_close(loss, expected.detach(), **TOLERANCE, msg=what)
    grads = {name: p.grad for name, p in reference.named_parameters(remove_duplicate=False)}
    checked = 0
    for name, p in pipe.named_parameters():
        assert p.grad is not None, f"{what}: rank {rank} {name} has no gradient"
        torch.testing.assert_close(p.grad, grads[name], **TOLERANCE, msg=f"{what}: {name}")
        checked += 1
    assert checked > 0, f"{what}: rank {rank} holds no parameters"
    return pipe


def _unet_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = unet(width=4, depth=2).double()  # Down, Down, Bottom, Up, Up, Head
    ((images, masks),) = segmentation_batches(4, 8, 1, dtype=torch.float64)
    for schedule in GRAPH_SCHEDULES:  # two stages, three skips from stage 0 to stage 1
        for mode in ("never", "always", "except_last"):
            _check(
                rank,
                model,
                lambda m, s=schedule, c=mode: conveyor.Pipeline(
                    m,
                    balance=[3, 3],
                    schedule=s,
                    recompute=c,
                    num_microbatches=4,
                    loss_fn=segmentation_loss,
                ),
                images,
                masks,
                segmentation_loss,
                f"u-net {schedule} {mode}",
            )
    # encoder and decoder level on one rank: skips stay local; skip 1 jumps two stages
    for schedule in ("gpipe", "graph-gpipe", "graph-1f1b"):
        for mode in ("never", "always"):
            _check(
                rank,
                model,
                lambda m, s=schedule, c=mode: conveyor.Pipeline(
                    m,
                    balance=[1, 2, 2, 1],
                    placement=(0, 1, 1, 0),
                    schedule=s,
                    recompute=c,
                    num_microbatches=3,
                    loss_fn=segmentation_loss,
                ),
                images,
                masks,
                segmentation_loss,
                f"u-net V {schedule} {mode}",
            )


def small_two_tower(**options: Any) -> nn.Module:
    """The two-tower model the graph tests split (seed 0), small enough for a test."""
    torch.manual_seed(0)
    return two_tower(
        vocab_size=16, seq_len=6, num_patches=4, patch_dim=6, dim=8, text_layers=2,
        image_layers=1, num_heads=2, **options,
    )  # fmt: skip


def _small_towers() -> tuple[nn.Module, tuple[Any, torch.Tensor]]:
    """``small_two_tower`` in float64 and one batch of 6 for it."""
    model = small_two_tower().double()
    ((inputs, labels),) = multimodal_batches(
        6, 1, vocab_size=16, seq_len=6, num_patches=4, patch_dim=6, dtype=torch.float64
    )
    return model, (inputs, labels)


def _branches_worker(rank: int, world_size: int) -> None:
    towers_model, (inputs, labels) = _small_towers()
    for schedule in ("gpipe", "graph-gpipe", "graph-1f1b"):  # tower B and the head share rank 1
        for mode in ("never", "except_last"):
            _check(
                rank,
                towers_model,
                lambda m, s=schedule, c=mode: conveyor.Pipeline(
                    m,
                    stage_modules=("text", "image", "head"),
                    placement=(0, 1, 1),
                    schedule=s,
                    recompute=c,
                    num_microbatches=3,
                    loss_fn=classification_loss,
                ),
                inputs,
                labels,
                classification_loss,
                f"two-tower {schedule} {mode}",
            )
    recommender = dlrm(
        num_dense=5, num_tables=3, table_size=20, dim=4, bottom=(8,), top=(8,)
    ).double()
    ((batch, clicks),) = click_batches(
        8, 1, num_dense=5, num_tables=3, table_size=20, bag=2, dtype=torch.float64
    )
    for schedule in ("gpipe", "graph-gpipe", "graph-1f1b"):  # bottom and top MLP on rank 0
        for mode in ("never", "always"):
            _check(
                rank,
                recommender,
                lambda m, s=schedule, c=mode: conveyor.Pipeline(
                    m,
                    stage_modules=("bottom", "embeddings", "top"),
                    placement=(0, 1, 0),
                    schedule=s,
                    recompute=c,
                    num_microbatches=4,
                    loss_fn=click_loss,
                ),
                batch,
                clicks,
                click_loss,
                f"dlrm {schedule} {mode}",
            )
    for schedule in GRAPH_SCHEDULES:  # whatever the automatic split chooses
        _check(
            rank,
            recommender,
            lambda m, s=schedule: conveyor.Pipeline(
                m,
                auto_split=True,
                example_inputs=batch,
                schedule=s,
                num_microbatches=4,
                loss_fn=click_loss,
            ),
            batch,
            clicks,
            click_loss,
            f"dlrm auto {schedule}",
        )
    # a language model with tied embeddings: auto_split cuts between the two users
    lm = gpt(
        vocab_size=16, seq_len=6, dim=8, num_layers=2, num_heads=2, dropout=0.0, tie_embeddings=True
    ).double()
    ids, next_ids = torch.randint(0, 16, (4, 6)), torch.randint(0, 16, (4, 6))
    pipe = _check(
        rank,
        lm,
        lambda m: conveyor.Pipeline(
            m, auto_split=True, leaf_modules=("Block",), num_microbatches=2, loss_fn=gpt_loss
        ),
        ids,
        next_ids,
        gpt_loss,
        "tied gpt auto",
    )
    assert pipe.graph.num_stages == 2


class Diamond(nn.Module):
    """h feeds two branches, one on h's rank and one on the other: its gradient is the sum."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 6)
        self.left = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.right = nn.Sequential(nn.Linear(6, 6), nn.Sigmoid())
        self.join = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        out: torch.Tensor = self.join(torch.cat([self.left(h), self.right(h) * h], dim=-1))
        return out


class TwinDropout(nn.Module):
    """Two identical branches with dropout on the same input, side by side in the output."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
        self.b = copy.deepcopy(self.a)
        self.head = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.cat([self.a(x), self.b(x)], dim=-1))
        return out


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def _summing_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = Diamond().double()
    x, target = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    for schedule in ("gpipe", "graph-gpipe", "graph-1f1b"):
        for mode in ("never", "always"):
            _check(
                rank,
                model,
                lambda m, s=schedule, c=mode: conveyor.Pipeline(
                    m,
                    stage_modules=("stem", "left", "right", "join"),
                    placement=(0, 1, 0, 1),
                    schedule=s,
                    recompute=c,
                    num_microbatches=3,
                    loss_fn=_mse,
                ),
                x,
                target,
                _mse,
                f"diamond {schedule} {mode}",
            )
    # dropout: the same masks whatever the schedule or recomputation; each branch its own
    twins = TwinDropout().double()
    x, target = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    losses, grads = [], []
    for schedule in ("gpipe", "graph-gpipe", "graph-1f1b"):
        for mode in ("never", "always", "except_last"):
            pipe = conveyor.Pipeline(
                copy.deepcopy(twins),
                stage_modules=("a", "b", "head"),
                placement=(0, 1, 1),
                schedule=schedule,
                recompute=mode,
                num_microbatches=4,
                loss_fn=_mse,
            )
            losses.append(pipe.step(x, target))
            grads.append([p.grad.clone() for _, p in pipe.named_parameters()])
            output = pipe.forward(x)
            if output is not None:  # identical weights: only the masks tell the halves apart
                assert not torch.equal(output[:, :8], output[:, 8:]), (
                    "both branches drew the same dropout masks"
                )
    for loss, grad in zip(losses[1:], grads[1:], strict=True):
        if loss is not None:
            torch.testing.assert_close(loss, losses[0], rtol=0, atol=0)
        for g, g0 in zip(grad, grads[0], strict=True):  # summed in another order: rounding
            torch.testing.assert_close(g, g0, **TOLERANCE)


def _three_rank_worker(rank: int, world_size: int) -> None:
    model, (inputs, labels) = _small_towers()
    for schedule in GRAPH_SCHEDULES:  # text | image | head: the towers run side by side
        for mode in ("never", "always", "except_last"):
            _check(
                rank,
                model,
                lambda m, s=schedule, c=mode: conveyor.Pipeline(
                    m,
                    stage_modules=("text", "image", "head"),
                    schedule=s,
                    recompute=c,
                    num_microbatches=3,
                    loss_fn=classification_loss,
                ),
                inputs,
                labels,
                classification_loss,
                f"two-tower 3 ranks {schedule} {mode}",
            )
    # U-Net over 3 ranks: rank 1 holds the middle; skips 0 and 1 jump over it
    net = unet(width=4, depth=3).double()
    ((images, masks),) = segmentation_batches(4, 8, 1, dtype=torch.float64)
    points = balance_to_split_points(net, [3, 2, 3])
    peaks = {}
    for relay in (False, True):
        graph = split_model(copy.deepcopy(net), points, relay_skips=relay)
        pipe = _check(
            rank,
            net,
            lambda m, g=graph: conveyor.Pipeline(
                g,
                schedule="gpipe",
                num_microbatches=4,
                loss_fn=segmentation_loss,
                measure_memory=True,
            ),
            images,
            masks,
            segmentation_loss,
            f"u-net 3 ranks relay={relay}",
        )
        peaks[relay] = pipe.memory().peak_bytes
    if rank == 1:
        assert peaks[False] < peaks[True], f"direct skips {peaks[False]} B, relayed {peaks[True]} B"


@pytest.mark.dist
def test_unet_matches_plain_training(tmp_path: Path) -> None:
    run_ranks(_unet_worker, tmp_path, timeout_s=240)


@pytest.mark.dist
def test_branch_models_match_plain_training(tmp_path: Path) -> None:
    run_ranks(_branches_worker, tmp_path, timeout_s=240)


@pytest.mark.dist
def test_fan_out_gradients_are_summed_and_dropout_is_schedule_invariant(tmp_path: Path) -> None:
    run_ranks(_summing_worker, tmp_path, timeout_s=240)


@pytest.mark.dist
def test_three_rank_graph_pipelines(tmp_path: Path) -> None:
    run_ranks(_three_rank_worker, tmp_path, world_size=3, timeout_s=240)


def test_relayed_graph_matches_the_plain_model_too() -> None:
    model = unet(width=4, depth=2).double()
    ((images, _),) = segmentation_batches(2, 8, 1, dtype=torch.float64)
    graph = split_by_modules(model, [["0"], ["1", "2", "3"], ["4", "5"]], relay_skips=True)
    assert graph.consumers(0) == [1]  # skip 0 travels through stage 1
    torch.testing.assert_close(run_stages(graph, {"input": images}), model(images), rtol=0, atol=0)
    relayed = auto_split(model, 3, relay_skips=True)
    assert relayed.consumers(0) == [1] and relayed.consumers(1) == [2]
    torch.testing.assert_close(run_stages(relayed, {"input": images}), model(images))
