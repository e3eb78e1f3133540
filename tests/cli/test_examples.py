"""Every file in examples/ runs with its defaults, the way its docstring says to run it.

An example whose docstring shows ``conveyor run ... examples/<name>.py ...`` is started with
that command line (torchrun, several ranks); any other with ``python examples/<name>.py``.
New examples are picked up without changing this file.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
TIMEOUT_S = 280
FINAL = {"train_gpt": "step 30 | loss", "dlrm": "step 40 | loss", "unet": "step 20 | loss"}
"""The last line of training some examples log, with their default number of steps."""


def command(example: Path) -> list[str]:
    """The command line the example's docstring gives, with its path made absolute."""
    docstring = ast.get_docstring(ast.parse(example.read_text())) or ""
    relative = f"examples/{example.name}"
    for line in docstring.splitlines():
        start = line.find("conveyor run")
        if start < 0 or relative not in line:
            continue
        text = line[start:].split("`")[0]
        words = [str(example) if w == relative else w for w in shlex.split(text)]
        return [sys.executable, "-m", "conveyor.cli", *words[1:]]
    return [sys.executable, str(example)]


def test_examples_are_found() -> None:
    names = {e.name for e in EXAMPLES}
    assert {"unet.py", "multimodal.py", "dlrm.py", "dag_split.py"} <= names
    assert command(ROOT / "examples" / "unet.py")[3:6] == ["run", "-n", "4"]
    assert command(ROOT / "examples" / "dag_split.py")[1:] == [str(ROOT / "examples/dag_split.py")]
    assert command(ROOT / "examples" / "refurbish.py")[3:6] == ["run", "-n", "2"]


@pytest.mark.dist
@pytest.mark.timeout(TIMEOUT_S + 20)
@pytest.mark.parametrize("example", EXAMPLES, ids=[e.stem for e in EXAMPLES])
def test_example_runs(example: Path, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    env.pop("RANK", None)  # examples decide for themselves whether they run under torchrun
    try:
        done = subprocess.run(
            command(example),
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{example.name} did not finish in {TIMEOUT_S}s: {error}")
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{example.name} failed:\n{output[-4000:]}"
    assert FINAL.get(example.stem, "") in output, output[-4000:]
    losses = re.findall(r"\| loss (\S+)", output)
    assert all(loss[0].isdigit() for loss in losses), losses  # no nan or inf
