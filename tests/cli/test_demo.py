"""The demo's progress output: a bar on a terminal only; log lines everywhere."""

from __future__ import annotations

import io

import pytest

from conveyor.demo import DemoConfig, progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_bar(stream: io.StringIO, steps: int = 5, is_shown: bool = True) -> str:
    with progress_bar(steps, is_shown, stream) as bar:
        for _ in range(steps):
            bar.set_postfix(loss="2.345")
            bar.update()
    return stream.getvalue()


def test_a_terminal_gets_a_bar_updated_in_place() -> None:
    text = run_bar(Terminal())
    assert "5/5" in text and "loss=2.345" in text
    assert text.count("\r") >= 2  # redrawn over itself, one line on screen
    assert run_bar(Terminal(), is_shown=False) == ""  # ranks without the loss show none


def test_a_log_file_gets_no_bar() -> None:
    # 300 steps of carriage-return updates were ~300 bytes each; the log lines every
    # log_every steps (test_cli.py::test_demo_trains) are all that is written
    assert run_bar(io.StringIO(), steps=300) == ""


def test_log_every_must_be_positive() -> None:
    with pytest.raises(ValueError, match="log_every must be >= 1, got 0"):
        DemoConfig(log_every=0)
