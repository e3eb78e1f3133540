"""Freed host memory is kept for reuse: a tensor allocated again after it was freed costs no
page faults (conveyor.runtime.host_memory); measured in fresh processes, since the setting is
process-wide."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

_FAULTS = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from conveyor.runtime.host_memory import keep_freed_memory
    assert keep_freed_memory()
torch.empty(64 << 20, dtype=torch.uint8).fill_(1)  # allocated, touched, freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(6):
    torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _FAULTS, mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(done.stdout.split()[-1])


@pytest.mark.dist  # a process of its own, or seconds of measuring
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc only")
def test_freed_memory_is_reused_without_page_faults() -> None:
    pages = (64 << 20) // 4096
    assert _page_faults("default") >= 5 * pages  # returned each time: faults every time
    # kept: reused (once in a few runs the heap cannot grow in place and the first one is new;
    # the allocator's own bookkeeping may touch a few more pages)
    assert _page_faults("keep") <= pages + 256


def test_pipeline_config_keeps_host_memory_by_default() -> None:
    from conveyor import PipelineConfig

    assert PipelineConfig().keep_host_memory
