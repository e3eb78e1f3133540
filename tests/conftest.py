import importlib.util
import multiprocessing
import multiprocessing.forkserver
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# Note [rank fork server]:
# Test ranks (dist.run_ranks) start from a fork server that has imported torch, conveyor and
# transformers once for the session: a rank then starts in milliseconds instead of the 1.6 s
# a fresh interpreter takes to import them again (the suite took 17 minutes with fresh
# interpreters, under 9 with the server). The server only imports and forks, never runs test
# code, so every rank starts from freshly imported modules. It starts with the session, and
# ranks see the environment of that moment, not the calling test's: a test that needs a
# variable in its ranks sets it inside the rank function.
# Tests mirror the packages (tests/runtime/ tests conveyor.runtime, ...) and import each
# other's helpers and the harness by module name (``from dist import run_ranks``): every test
# directory is on the path, for the session and for the ranks it starts.
_TESTS = Path(__file__).resolve().parent
sys.path[:0] = [
    str(_TESTS),
    *sorted(str(d) for d in _TESTS.iterdir() if d.is_dir() and not d.name.startswith(("_", "."))),
]

_PRELOAD = [
    "torch", "torch.distributed", "conveyor", "conveyor.models", "pytest", "transformers",
    "conveyor.checkpoint", "torch.distributed.fsdp",  # conveyor imports these on first use
]  # fmt: skip


def pytest_sessionstart(session: pytest.Session) -> None:
    multiprocessing.set_forkserver_preload(
        [name for name in _PRELOAD if importlib.util.find_spec(name.split(".")[0]) is not None]
    )
    multiprocessing.forkserver.ensure_running()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A gloo world of this one process (every stage local), ended after the test."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'one-rank-store'}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=20),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
