"""Write one benchmark's results into its own section of docs/benchmarks.md, atomically."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

__all__ = ["write_section"]

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = (
    "# Benchmarks\n\nEvery figure below was produced by the command shown in its section, "
    "on the machine named there; ratios are measured side by side in one run, medians.\n"
)


def write_section(name: str, markdown: str) -> None:
    """Replace the section ``name`` (between its markers) or append it; temp file + rename."""
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    text = DOC.read_text() if DOC.exists() else HEADER
    block = f"{begin}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else f"{text}\n{block}\n"
    DOC.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=DOC.parent, delete=False, suffix=".tmp") as tmp:
        tmp.write(text)
    os.replace(tmp.name, DOC)
