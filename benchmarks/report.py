"""Write one benchmark's results into its own section of docs/benchmarks.md, atomically."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["OWN", "QUIET", "bootstrap_interval", "publishable", "two_ranks", "write_section"]

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = (
    "# Benchmarks\n\nEvery figure below was produced by the command shown in its section, "
    "on the machine named there; ratios are measured side by side in one run, medians.\n"
)


def two_ranks(worker: Callable[..., None], args: Any) -> Any:
    """Run ``worker(rank, args, store, out)`` on two spawned ranks; what rank 0 saved to ``out``
    (a file store and the output in a temporary directory, gone afterwards)."""
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pt")
        mp.spawn(worker, args=(args, os.path.join(tmp, "store"), out), nprocs=2)
        return torch.load(out, weights_only=False)


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


def bootstrap_interval(
    values: list[float], confidence: float = 0.95, resamples: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """A percentile bootstrap interval of the median of ``values`` (per-round ratios)."""
    import random
    import statistics

    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    rng = random.Random(seed)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)
    )
    low = medians[int((1 - confidence) / 2 * resamples)]
    high = medians[int((1 + confidence) / 2 * resamples) - 1]
    return low, high


QUIET = 1.0
"""Load average a benchmark must start under: nothing else running."""
OWN = 2.5
"""Load average a benchmark's own two busy ranks may raise it to (and a little more); above
it, other work joined in."""


def publishable(loads: list[float], force: bool, own: float = OWN) -> bool:
    """Whether figures measured at these load averages (the first before the run, the others
    during and after it) may be published; ``own``: the most the benchmark's own processes
    may make it. Prints why not."""
    if force or (loads[0] <= QUIET and max(loads) <= own):
        return True
    print(
        f"not published: the load average was {loads[0]:.2f} before the run (at most {QUIET}) "
        f"and reached {max(loads):.2f} during it (at most {own}, the benchmark's own processes): "
        "other work shared the cores; rerun on a quiet machine, or pass --force"
    )
    return False
