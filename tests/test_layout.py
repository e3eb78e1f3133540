"""The package layout itself: imports run one way, each module imports alone, one definition
per Note, private torch APIs in one module, the public API in ``conveyor``, and the code
formatted and linted as docs/development.md says."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import conveyor

SRC = Path(conveyor.__file__).parent
ROOT = SRC.parent.parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """conveyor modules ``path`` imports, at any depth, except under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module in modules:
            # `from package import submodule` imports the submodule, not the package's names
            subs = {f"{node.module}.{a.name}" for a in node.names}
            found |= (subs & set(modules)) or {node.module}
            if subs - set(modules):
                found.add(node.module)
    return found


def test_imports_run_one_way() -> None:
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                cycle = [*path[path.index(other) :], other]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if other not in state:
                visit(other, [*path, other])
        state[name] = 2

    for name in modules:
        if name not in state:
            visit(name, [name])


LAYERS = [
    "cli", "demo", "checkpoint", "planner", "pipeline", "hf", "inference", "models", "split",
    "data", "parallel", "config", "schedule", "simulator", "runtime", "trace", "program",
    "graph", "text", "files", "torch_compat",
]  # fmt: skip
"""conveyor's packages and top-level modules, top to bottom (docs/design.md, "Where things
live"): each imports only what stands below it."""


def test_packages_import_only_what_stands_below_them() -> None:
    """Every import of one package (or top-level module) from another runs down LAYERS, at
    any depth of the code, under ``if TYPE_CHECKING`` too."""
    rank = {name: index for index, name in enumerate(LAYERS)}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts == ("__init__",):
            continue  # conveyor's own __init__ is the public API: it may import anything
        here = parts[0]
        assert here in rank, f"{here} is in no layer: add it to LAYERS and docs/design.md"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in (n for n in names if n.split(".")[0] == "conveyor"):
                there = name.split(".")[1] if "." in name else "conveyor"
                assert there == here or rank.get(there, -1) > rank[here], (
                    f"{path.relative_to(SRC)} imports {name}, which stands above it "
                    f"({here} > {there} in LAYERS)"
                )


@pytest.mark.dist  # a process of its own, or seconds of measuring
@pytest.mark.timeout(300)
def test_every_module_imports_alone() -> None:
    # an interpreter per half (torch loads once in each); conveyor is forgotten before each
    # module; entry points (__main__) run a command when imported, so they are left out
    names = sorted(name for name in _modules() if not name.endswith("__main__"))
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _import_each(names[half::2])],
            stderr=subprocess.PIPE,
            text=True,
        )
        for half in (0, 1)
    ]
    for process in processes:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-2000:]


HEAVY = ("torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint")
"""What costs about as much as torch to import; See Note [DTensor unimported]."""

_PLAIN_RUN = """
import sys, tempfile, torch, torch.distributed as dist
import conveyor, conveyor.cli
store = tempfile.mktemp()
dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(4)))
pipe = conveyor.Pipeline(
    model, balance=[2, 2], schedule="gpipe", num_microbatches=2, loss_fn=torch.nn.MSELoss()
)
pipe.step(torch.randn(4, 4), torch.randn(4, 4))
pipe.clip_grad_norm_(1.0)
print(sorted(name for name in {heavy!r} if name in sys.modules))
from conveyor import Checkpointer  # read on first use
print(sorted(name for name in {heavy!r} if name in sys.modules))
dist.destroy_process_group()
"""


@pytest.mark.dist  # a process of its own
def test_a_pipeline_without_dtensors_or_checkpoints_does_not_import_them() -> None:
    """Every rank's start and every command pays for what ``import conveyor`` loads."""
    done = subprocess.run(
        [sys.executable, "-c", _PLAIN_RUN.format(heavy=HEAVY)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = done.stdout.splitlines()[-2:]
    assert before == "[]"
    assert after == str(sorted(HEAVY))  # the check sees them once they are loaded


def _import_each(names: list[str]) -> str:
    """Code that imports each of ``names`` with no conveyor module loaded before it. Importing
    any module runs ``conveyor/__init__`` first, so a module that ``import conveyor`` loads
    is imported in the same order whichever was asked for: one fresh ``import conveyor``
    covers them all, and only the others need an import of their own."""
    return (
        "import importlib, sys\n"
        "def forget():\n"
        "    for loaded in [m for m in sys.modules if m.split('.')[0] == 'conveyor']:\n"
        "        del sys.modules[loaded]\n"
        "import conveyor\n"
        "covered = set(sys.modules)\n"
        f"for name in {names!r}:\n"
        "    if name not in covered:\n"
        "        forget()\n"
        "        importlib.import_module(name)\n"
    )


def test_each_module_says_what_it_holds_and_what_it_exports() -> None:
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), f"{name} has no docstring"
        assigned = {
            t.id
            for node in tree.body
            if isinstance(node, ast.Assign | ast.AnnAssign)
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Name)
        }
        assert "__all__" in assigned, f"{name} declares no __all__"


LONGEST_FUNCTION = 80
"""Lines of a function's body, its docstring aside; the longest are a constructor of costs
and argument parsers, every other fits a screen."""


def test_every_function_fits_a_screen() -> None:
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                body = (
                    node.body[1:] if ast.get_docstring(node) and len(node.body) > 1 else node.body
                )
                lines = (node.end_lineno or 0) - body[0].lineno + 1
                if lines > LONGEST_FUNCTION:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert not long, f"split these into functions of at most {LONGEST_FUNCTION} lines: {long}"


def test_notes_are_defined_once_and_every_reference_has_its_definition() -> None:
    text = {path: path.read_text() for path in SRC.rglob("*.py")}
    definitions = [
        m for t in text.values() for m in re.findall(r"^# Note \[([^\]]+)\]:$", t, flags=re.M)
    ]
    assert len(definitions) == len(set(definitions)), "a Note is defined twice"
    references = {
        m for t in text.values() for m in re.findall(r"See Note \[([^\]]+)\]", " ".join(t.split()))
    }
    assert references <= set(definitions), f"undefined Notes {references - set(definitions)}"


def test_private_torch_apis_are_used_in_torch_compat_only() -> None:
    private = re.compile(r"torch(\.\w+)*\._[a-z]\w*|\._(modules|parameters|buffers)\b")
    for path in SRC.rglob("*.py"):
        if path.name == "torch_compat.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            code = line.split("#")[0]
            assert not private.search(code), f"{path.name}:{number}: {line.strip()}"


def test_the_public_api_is_reachable_from_conveyor() -> None:
    for name in (
        "Pipeline",
        "PipelineConfig",
        "Checkpointer",
        "CheckpointConfig",
        "Timeline",
        "plan",
        "simulate",
        "SCHEDULES",
        "build_program",
        "PeerLostError",
        "skippable",
        "DeferredBatchNorm",
        "ResumableLoader",
    ):
        assert name in conveyor.__all__ and hasattr(conveyor, name), name


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]])
def test_ruff_passes(command: list[str]) -> None:
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    result = subprocess.run(
        [str(ruff), *command, "src", "tests", "benchmarks", "examples"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-1000:]
