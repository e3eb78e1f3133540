"""Interleaved 1F1B, ZB-H1, ZB-V, DualPipeV and custom text schedules, as plain data: literal
orders, validity, the bubble and the activation memory their papers promise, over grids of
sizes."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.cli import main
from conveyor.graph import MODEL_OUTPUT, Stage, StageGraph, chain, place
from conveyor.runtime.memory import alive_peak
from conveyor.schedule import (
    SCHEDULES,
    Program,
    ProgramError,
    build_program,
    dualpipe_v,
    from_text,
    interleaved_1f1b,
    one_f_one_b,
    schedule_name,
    spec_of,
    stage_placement,
    validate,
    zb_h1,
    zb_v,
)
from conveyor.schedule.interleaved import rounds
from conveyor.simulator import simulate


def compute(program: Program, rank: int) -> list[str]:
    return [str(a) for a in program[rank] if a.is_compute]


def graph_for(name: str, num_ranks: int, virtual_stages: int = 0) -> StageGraph:
    """A chain laid out as the schedule wants it."""
    layout = spec_of(name)
    per_rank = virtual_stages or layout.virtual_stages
    stages = num_ranks * per_rank
    return chain(stages, placement=place(stages, num_ranks, layout.placement))


# -- literal orders ----------------------------------------------------------------------


def test_interleaved_literal() -> None:
    program = interleaved_1f1b(chain(4, num_ranks=2), num_microbatches=4)
    assert compute(program, 0) == [
        "0F0",
        "0F1",
        "2F0",
        "2F1",
        "0F2",
        "2B0",
        "0F3",
        "2B1",
        "2F2",
        "0B0",
        "2F3",
        "0B1",
        "2B2",
        "2B3",
        "0B2",
        "0B3",
    ]
    assert compute(program, 1) == [
        "1F0",
        "1F1",
        "3F0",
        "3B0",
        "3F1",
        "3B1",
        "1F2",
        "1B0",
        "1F3",
        "1B1",
        "3F2",
        "3B2",
        "3F3",
        "3B3",
        "1B2",
        "1B3",
    ]


def test_zb_h1_literal() -> None:
    program = zb_h1(chain(3), num_microbatches=4)
    assert compute(program, 0) == [
        "0F0",
        "0F1",
        "0F2",
        "0I0",
        "0W0",
        "0F3",
        "0I1",
        "0W1",
        "0I2",
        "0W2",
        "0I3",
        "0W3",
    ]
    # the last stage holds back its first two W's (its rank index) and runs them at the end
    assert compute(program, 2) == [
        "2F0",
        "2I0",
        "2F1",
        "2I1",
        "2F2",
        "2I2",
        "2W2",
        "2F3",
        "2I3",
        "2W3",
        "2W0",
        "2W1",
    ]


def test_zb_v_literal() -> None:
    program = zb_v(chain(4, placement=[0, 1, 1, 0]), num_microbatches=4)
    assert compute(program, 0) == [
        "0F0",
        "0F1",
        "0F2",
        "3F0",
        "3I0",
        "3W0",
        "3F1",
        "3I1",
        "3W1",
        "0F3",
        "0I0",
        "0W0",
        "3F2",
        "3I2",
        "3W2",
        "0I1",
        "0W1",
        "3F3",
        "3I3",
        "3W3",
        "0I2",
        "0W2",
        "0I3",
        "0W3",
    ]
    assert compute(program, 1)[:6] == ["1F0", "2F0", "1F1", "2F1", "2I0", "2W0"]


def test_dualpipe_v_literal() -> None:
    program = dualpipe_v(chain(4, placement=[0, 1, 1, 0]), num_microbatches=5)
    # pairs (F of one chunk, then B of the other) from 0F3 on; 0I3 holds its W back
    assert " ".join(compute(program, 0)) == (
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 0F4 3B2 3F3 0B1 "
        "3B3 3F4 0B2 3B4 0I3 0W3 0I4 0W4"
    )
    assert " ".join(compute(program, 1)) == (
        "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 1F4 2B2 2F4 1B2 2B3 1B3 2I4 1I4 2W4 1W4"
    )


def torch_dualpipe_v(num_ranks: int, num_microbatches: int, rank: int) -> list[str] | None:
    """torch.distributed.pipelining's DualPipeV order for ``rank``, in conveyor's text, a full
    backward as B and a paired (overlapped) F and B as the F then the B; None where this torch
    has no ScheduleDualPipeV (the order is read from a private method)."""
    from torch.distributed.pipelining import schedules

    runner_class = getattr(schedules, "ScheduleDualPipeV", None)
    if runner_class is None or not hasattr(runner_class, "_calculate_single_rank_operations"):
        return None
    runner = object.__new__(runner_class)
    runner.pp_group_size, runner._n_microbatches = num_ranks, num_microbatches
    kinds = {schedules.FORWARD: "F", schedules.BACKWARD_INPUT: "I"}
    kinds[schedules.BACKWARD_WEIGHT], kinds[schedules.FULL_BACKWARD] = "W", "B"
    order: list[str] = []

    def add(action: schedules._Action) -> None:
        kind, stage, k = action.computation_type, action.stage_index, action.microbatch_index
        if kind == schedules.OVERLAP_F_B:
            for part in action.sub_actions or ():
                add(part)
        else:
            order.append(f"{stage}{kinds[kind]}{k}")

    for action in runner._calculate_single_rank_operations(rank):
        if action is not None:
            add(action)
    return order


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_dualpipe_v_is_torchs_order(num_ranks: int) -> None:
    """The order torch.distributed.pipelining.ScheduleDualPipeV runs (DeepSeek's), for every
    m it accepts (m >= 2p) up to 16."""
    graph = graph_for("dualpipev", num_ranks)
    for m in range(2 * num_ranks, 17):
        program = dualpipe_v(graph, m)
        for rank in range(num_ranks):
            theirs = torch_dualpipe_v(num_ranks, m, rank)
            if theirs is None:
                pytest.skip("this torch has no ScheduleDualPipeV")
            assert compute(program, rank) == theirs, (m, rank)


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("num_microbatches", [1, 2, 3, 5, 8])
def test_interleaved_with_one_chunk_is_1f1b(num_ranks: int, num_microbatches: int) -> None:
    graph = chain(num_ranks)
    assert interleaved_1f1b(graph, num_microbatches) == one_f_one_b(graph, num_microbatches)


# -- validity and bubble -----------------------------------------------------------------


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("virtual_stages", [1, 2, 3])
@pytest.mark.parametrize("num_microbatches", [1, 2, 3, 4, 5, 6, 7, 9, 12])
def test_interleaved_is_valid_with_megatrons_bubble(
    num_ranks: int, virtual_stages: int, num_microbatches: int
) -> None:
    p, v, m = num_ranks, virtual_stages, num_microbatches
    graph = chain(p * v, num_ranks=p)
    program = interleaved_1f1b(graph, m)
    validate(program, graph)
    if m >= p:  # in chunk units (F=1, B=2 per chunk): the bubble is 1F1B's divided by v,
        # for any m, multiple of p or not (Note [interleaved remainder])
        assert simulate(program, graph).step_time == pytest.approx(3 * m * v + 3 * (p - 1))


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("num_microbatches", [1, 2, 3, 4, 5, 8, 13])
def test_zb_h1_is_valid_and_beats_1f1b(num_ranks: int, num_microbatches: int) -> None:
    p, m = num_ranks, num_microbatches
    graph = chain(p)
    program = zb_h1(graph, m)
    validate(program, graph)
    step = simulate(program, graph).step_time  # F = I = W = 1
    if m >= p:  # the paper's (p - 1)(F + I - W) bubble, against 1F1B's (p - 1)(F + B)
        assert step == pytest.approx(3 * m + (p - 1))
    if p > 1:
        assert step < simulate(one_f_one_b(graph, m), graph).step_time


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("num_microbatches", [1, 2, 3, 4, 6, 7, 10])
def test_zb_v_is_valid_with_a_small_bubble(num_ranks: int, num_microbatches: int) -> None:
    p, m = num_ranks, num_microbatches
    graph = graph_for("zb-v", p)
    program = zb_v(graph, m)
    validate(program, graph)
    step = simulate(program, graph).step_time  # per chunk F = I = W = 1
    if m >= 2 * p - 1:  # only the first forward's ramp down the V is left idle
        assert step == pytest.approx(6 * m + p - 1)
        # half-size chunks: ZB-H1 on the same model would take 2 x (3m + p - 1)
        assert step < 2 * (3 * m + p - 1) or p == 1


def dualpipe_v_step(p: int, m: int) -> int:
    """DualPipeV's step in units of one chunk's F = I = W: 6m of work per rank and p - 1 idle
    once m >= 2p; with fewer, the 2p schedule with the missing micro-batches left out."""
    if m >= 2 * p:
        return 6 * m + p - 1
    if m <= p:
        return 4 * (m + p) - 2
    return min(6 * m + 2 * p - 2, 4 * m + 5 * p - 1)


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("num_microbatches", range(1, 17))
def test_dualpipe_v_is_valid_with_its_bubble_and_memory(
    num_ranks: int, num_microbatches: int
) -> None:
    p, m = num_ranks, num_microbatches
    graph = graph_for("dualpipev", p)
    program = dualpipe_v(graph, m)
    validate(program, graph)  # F, then B or I and W, of every micro-batch on every stage
    timeline = simulate(program, graph)  # per chunk F = I = W = 1
    assert timeline.step_time == pytest.approx(dualpipe_v_step(p, m))
    for rank in range(p):
        assert alive_peak(program[rank]) == theory("dualpipev", p, 2, m, rank)
    if m >= 2 * p:  # ZB-V's step on paper, for one more activation set
        assert dualpipe_v_step(p, m) == simulate(zb_v(graph, m), graph).step_time


def test_zb_h1_runs_on_a_dag_like_1f1b() -> None:
    # stage 0 feeds 1 and 2, both feed 3: depth 3, so stage 0 holds back no W and 3 holds two
    stages = (
        Stage(0, 0, ("input",), ("a",)),
        Stage(1, 1, ("a",), ("b",)),
        Stage(2, 2, ("a",), ("c",)),
        Stage(3, 3, ("b", "c"), (MODEL_OUTPUT,)),
    )
    graph = StageGraph(stages)
    program = zb_h1(graph, 4)
    validate(program, graph)
    assert compute(program, 3)[:6] == ["3F0", "3I0", "3F1", "3I1", "3F2", "3I2"]


# -- activation memory: the papers' peaks ------------------------------------------------


def theory(name: str, p: int, v: int, m: int, rank: int) -> int:
    """Peak (stage, micro-batch) activation sets alive on ``rank``, from the papers.

    GPipe keeps every micro-batch of every local stage; 1F1B at most p - rank; interleaved
    1F1B its warm-up plus one; ZB-H1 p on every rank (1F1B's peak); ZB-V 2p half-size chunks
    (p full stages, 1F1B's peak) once m fills the V; DualPipeV one more than ZB-V.
    """
    if name == "gpipe":
        return v * m
    if name == "1f1b":
        return min(m, p - rank)
    if name == "interleaved-1f1b":
        below = p - 1 - rank
        warmup = below if v == 1 else (v - 1) * rounds(m, p)[0] + 2 * below
        return min(v * m, warmup + 1)
    if name == "zb-h1":
        return min(m, p)
    if name == "zb-v":
        return min(2 * p, 2 * m, m + 1 + rank)
    if name == "dualpipev":
        return min(2 * p + 1, 2 * m, m + 1 + rank)
    raise AssertionError(name)


@pytest.mark.parametrize(
    "name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipev"]
)
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("num_microbatches", [1, 2, 3, 4, 5, 8, 11])
def test_peak_activations_match_theory(name: str, num_ranks: int, num_microbatches: int) -> None:
    graph = graph_for(name, num_ranks)
    v = graph.num_stages // num_ranks
    program = SCHEDULES[name](graph, num_microbatches)
    for rank in range(num_ranks):
        assert alive_peak(program[rank]) == theory(name, num_ranks, v, num_microbatches, rank)


def test_alive_peak_counts_until_w() -> None:
    program = Program.parse("0F0 0F1 0I0 0F2 0W0 0I1 0W1 0I2 0W2")
    assert alive_peak(program[0]) == 3
    assert alive_peak(Program.parse("0F0 0B0 0F1 0B1")[0]) == 1


# -- placement and layouts ---------------------------------------------------------------


def test_place() -> None:
    assert place(6, 3) == [0, 1, 2, 0, 1, 2]
    assert place(6, 3, "v") == [0, 1, 2, 2, 1, 0]
    assert place(8, 2, "v") == [0, 1, 1, 0, 0, 1, 1, 0]
    with pytest.raises(ValueError, match="same number per rank"):
        place(5, 2)
    with pytest.raises(ValueError, match="one of"):
        place(4, 2, "zigzag")  # type: ignore[arg-type]


def test_layouts() -> None:
    zb_v_spec, interleaved = spec_of("zb-v"), spec_of("interleaved-1f1b")
    assert (zb_v_spec.virtual_stages, zb_v_spec.placement, zb_v_spec.exact) == (2, "v", True)
    assert (interleaved.virtual_stages, interleaved.placement) == (2, "loop")
    assert spec_of(zb_v) is zb_v_spec and zb_v_spec.needs_chain and zb_v_spec.split_backward
    assert spec_of("1f1b").virtual_stages == spec_of("my_schedule.txt").virtual_stages == 1
    # a spec's split_backward is what its Programs do
    for name, spec in SCHEDULES.items():
        program = spec(graph_for(name, 2), 4)
        assert program.has_split_backward == spec.split_backward, name


def test_a_schedule_function_is_named_in_configs_and_logs() -> None:
    """A shipped function by its name, so it gets its layout; any other by where it lives."""
    assert schedule_name(zb_v) == "zb-v" and spec_of(schedule_name(zb_v)) is SCHEDULES["zb-v"]
    assert schedule_name(interleaved_1f1b) == "interleaved-1f1b"
    assert schedule_name("mine.txt") == "mine.txt"

    def mine(graph: StageGraph, num_microbatches: int) -> Program:
        return one_f_one_b(graph, num_microbatches)

    assert schedule_name(mine).endswith(
        ".test_a_schedule_function_is_named_in_configs_and_logs.<locals>.mine"
    )


@pytest.mark.parametrize(
    ("name", "num_stages", "message"),
    [
        ("zb-v", 3, "needs 2 stages on each rank: 4 on 2 ranks, but the split makes 3"),
        ("zb-v", 2, "give a balance of 4 entries"),
        ("zb-v", 6, "needs 2 stages on each rank"),
        ("interleaved-1f1b", 3, "the same number of stages on each of the 2 ranks"),
    ],
)
def test_a_stage_count_a_layout_cannot_place_is_named(
    name: str, num_stages: int, message: str
) -> None:
    """Before the split: '3 stages on 2 ranks, launch with -n 3' cannot help ZB-V."""
    with pytest.raises(ValueError, match=message):
        stage_placement(name, 2, num_stages=num_stages)
    assert stage_placement("1f1b", 2, num_stages=3) == [0, 1, 2]  # the split says -n 3
    with pytest.raises(ValueError, match="virtual_stages=3 makes 6; pass virtual_stages=2"):
        stage_placement("zb-v", 2, virtual_stages=3)
    assert stage_placement("interleaved-1f1b", 2, num_stages=6) == [0, 1, 0, 1, 0, 1]


@pytest.mark.parametrize(
    ("name", "graph", "message"),
    [
        ("interleaved-1f1b", chain(4, placement=[0, 1, 1, 0]), "placed in a loop"),
        ("interleaved-1f1b", chain(3, num_ranks=2), "placed in a loop"),
        ("zb-v", chain(4, num_ranks=2), "placed in a V"),
        ("zb-v", chain(2), "placed in a V"),
        ("dualpipev", chain(4, num_ranks=2), "'dualpipev' needs 4 stages placed in a V"),
        ("zb-h1", chain(4, num_ranks=2), "one stage per rank"),
        ("1f1b", chain(4, num_ranks=2), "interleaved"),
    ],
)
def test_wrong_layouts_say_what_to_use(name: str, graph: StageGraph, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SCHEDULES[name](graph, 4)


def test_interleaving_needs_a_chain() -> None:
    stages = (
        Stage(0, 0, ("input",), ("a",)),
        Stage(1, 1, ("a",), ("b",)),
        Stage(2, 0, ("a", "b"), ("c",)),
        Stage(3, 1, ("c",), (MODEL_OUTPUT,)),
    )
    graph = StageGraph(stages)
    expected = r"but stage 0 feeds stages \[1, 2\].*one of 'gpipe', 'graph-1f1b', 'graph-gpipe',"
    with pytest.raises(ValueError, match=expected):
        SCHEDULES["interleaved-1f1b"](graph, 4)  # the registry names the alternatives
    with pytest.raises(ValueError, match="rank 0 holds stages \\[0, 2\\]; use one of 'gpipe'"):
        SCHEDULES["1f1b"](graph, 4)


# -- custom schedules from text ----------------------------------------------------------

CUSTOM = """
# 1F1B with the weight gradients of rank 1 deferred to the end
rank 0: 0F0 0F1 0I0 0W0 0I1 0W1
rank 1: 1F0 1I0 1F1 1I1 1W0 1W1
"""


def test_custom_text_gets_communication_and_runs_on_the_simulator() -> None:
    graph = chain(2)
    program = from_text(CUSTOM, graph)
    assert program.num_microbatches == 2
    assert str(program) == (
        "0F0 0SF0>1 0RB0<1 0F1 0SF1>1 0RB1<1 0I0 0W0 0I1 0W1\n"
        "1RF0<0 1RF1<0 1F0 1I0 1SB0>0 1F1 1I1 1SB1>0 1W0 1W1"
    )
    # rank 0 | 0F0 0F1  .  0I0 0W0 0I1 0W1
    # rank 1 |  .  1F0 1I0 1F1 1I1 1W0 1W1
    assert simulate(program, graph).step_time == pytest.approx(7)


def test_custom_text_round_trips_a_full_program() -> None:
    graph = graph_for("zb-v", 2)
    program = zb_v(graph, 5)
    assert from_text(str(program), graph) == program


def test_custom_schedule_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.txt"
    path.write_text(CUSTOM)
    assert build_program(str(path), chain(2), 2) == from_text(CUSTOM, chain(2))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0F0 0W0 0I0\n1F0 1B0", "comes before 0I0"),
        ("0F0 0B0\n1F0", "0 B, 0 I and 0 W"),
        ("0F0 0B0\n1F0 1B0 1F0", "appears twice"),
        ("0F0 1F0 0B0\n1B0", "not on rank 0"),
        ("0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1", "program deadlocks"),
        ("0F0 0X0\n1F0 1B0", "cannot parse action '0X0'"),
    ],
)
def test_custom_text_is_validated_before_it_runs(text: str, message: str) -> None:
    with pytest.raises((ProgramError, ValueError), match=message):
        from_text(text, chain(2))


# -- conveyor simulate -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--schedule", "zb-v", "--stages", "2", "--microbatches", "4"],
            "ranks=2 stages=4 microbatches=4 step=25",
        ),
        (
            ["--schedule", "dualpipev", "--stages", "4", "--microbatches", "8"],
            "ranks=4 stages=8 microbatches=8 step=51 units (per stage F=1, B=2 or I=1 + W=1) "
            "bubble=5.9% peak activations=[9, 9, 9, 9]",
        ),
        (
            ["--schedule", "interleaved-1f1b", "--stages", "2", "--virtual-stages", "3"],
            "ranks=2 stages=6 microbatches=8 step=75",
        ),
        (
            ["--schedule", "zb-h1", "--stages", "3", "--microbatches", "4"],
            "step=14 units (per stage F=1, B=2 or I=1 + W=1) bubble=14.3% "
            "peak activations=[3, 3, 3]",
        ),
        (
            [
                "--schedule",
                "gpipe",
                "--stages",
                "2",
                "--virtual-stages",
                "2",
                "--placement",
                "v",
                "--microbatches",
                "2",
            ],
            "peak activations=[4, 4]",
        ),
    ],
)
def test_simulate_runs_every_schedule(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *argv]) == 0
    assert expected in capsys.readouterr().out


def test_simulate_names_the_layout_problem(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--schedule", "zb-v", "--stages", "2", "--placement", "loop"])
    assert "placed in a V" in capsys.readouterr().err
