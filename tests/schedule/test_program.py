"""Actions, Programs, communication insertion and the validator, as plain data."""

from __future__ import annotations

import pytest

from conveyor.graph import chain
from conveyor.program import Action, Kind, Program, add_communication
from conveyor.schedule import ProgramError, from_text, gpipe, validate


@pytest.mark.parametrize(
    "text", ["1F0", "0B12", "3I2", "3W2", "0SF0>1", "1RF0<0", "1SB3>0", "0RB3<1"]
)
def test_action_text_round_trips(text: str) -> None:
    assert str(Action.parse(text)) == text


def test_action_fields() -> None:
    assert Action.parse("0SF4>1") == Action(0, Kind.SEND_F, 4, 1)
    assert Action.parse("1F0").is_compute and not Action.parse("1RF0<0").is_compute


@pytest.mark.parametrize("text", ["F0", "1X0", "0SF0<1", "1F0>2", "1RF0"])
def test_malformed_actions_are_rejected(text: str) -> None:
    with pytest.raises(ValueError):
        Action.parse(text)


def test_program_text_round_trips() -> None:
    program = gpipe(chain(2), 3)
    assert Program.parse(str(program), 3) == program


def test_communication_is_inserted_in_channel_order() -> None:
    compute = [
        [Action.parse(a) for a in ["0F0", "0F1", "0B0", "0B1"]],
        [Action.parse(a) for a in ["1F0", "1B0", "1F1", "1B1"]],
    ]
    program = add_communication(chain(2), compute, 2, prefetch=1)
    assert [str(a) for a in program[0]] == [
        "0F0",
        "0SF0>1",
        "0RB0<1",
        "0F1",
        "0SF1>1",
        "0RB1<1",
        "0B0",
        "0B1",
    ]
    assert [str(a) for a in program[1]] == [
        "1RF0<0",
        "1F0",
        "1RF1<0",
        "1B0",
        "1SB0>0",
        "1F1",
        "1B1",
        "1SB1>0",
    ]
    validate(program, chain(2))


def test_receives_are_posted_up_to_prefetch_computes_ahead() -> None:
    compute = [
        [Action.parse(a) for a in ["0F0", "0F1", "0F2", "0B0", "0B1", "0B2"]],
        [Action.parse(a) for a in ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]],
    ]
    program = add_communication(chain(2), compute, 3)  # default: three computes ahead
    assert [str(a) for a in program[1]][:5] == ["1RF0<0", "1RF1<0", "1F0", "1RF2<0", "1B0"]
    # a gradient's receive still waits for the forward that gives its shape
    assert [str(a) for a in program[0]][:4] == ["0F0", "0SF0>1", "0RB0<1", "0F1"]
    validate(program, chain(2))


def test_text_schedule_gets_its_communication_and_is_validated() -> None:
    program = from_text("rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B0 1F1 1B1  # 1F1B", chain(2))
    assert sum(not a.is_compute for a in program[0]) == 4


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0F0 0F1 0B0\n1F0 1B0 1F1 1B1", "stage 0 micro-batch 1: 0 B"),
        ("0B0 0F0 0F1 0B1\n1F0 1B0 1F1 1B1", "comes before 0F0"),
        ("0F0 0F1 0B0 0B1\n1F1 1B1 1F0 1B0\n", None),  # legal: rank 1 takes micro-batch 1 first
        ("0F0 0F1 0B0 0B1\n1F0 1F1 1B1 1B0 1F2", "micro-batch 2 is outside"),
        ("1F0 1B0\n0F0 0B0", "stage 1 is not on rank 0"),
    ],
)
def test_validator_reports_bad_programs(text: str, message: str | None) -> None:
    if message is None:
        from_text(text, chain(2), 2)
        return
    with pytest.raises(ProgramError, match=message):
        from_text(text, chain(2), 2)


def test_deadlock_is_found() -> None:
    # rank 0 waits for micro-batch 0's gradient before it sends micro-batch 1's activations,
    # which rank 1 needs before it computes that gradient
    program = Program.parse(
        "0F0 0SF0>1 0RB0<1 0B0 0F1 0SF1>1 0RB1<1 0B1\n1RF0<0 1RF1<0 1F0 1F1 1B0 1SB0>0 1B1 1SB1>0"
    )
    with pytest.raises(ProgramError, match="deadlocks"):
        validate(program, chain(2))


def test_receives_out_of_channel_order_are_rejected() -> None:
    program = Program.parse(
        "0F0 0SF0>1 0F1 0SF1>1 0RB0<1 0RB1<1 0B0 0B1\n1RF1<0 1RF0<0 1F0 1F1 1B0 1SB0>0 1B1 1SB1>0"
    )
    with pytest.raises(ProgramError, match="order their peer sends"):
        validate(program, chain(2))
