"""The documentation is kept true by these checks: code shown in the README is the examples'
own, every public name and every PipelineConfig field is in docs/api.md, every link and every
file named goes to a file that exists, and no file cites anything outside the repository."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest

import conveyor
from conveyor.config import PipelineConfig

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _blocks() -> list[tuple[str, str]]:
    """(example file, code) for each Python block of the README that names its example in
    the paragraph just before it."""
    found = []
    for match in re.finditer(r"```python\n(.*?)```", README, re.S):
        before = README[: match.start()].rstrip().rsplit("\n\n", 1)[-1]
        named = re.findall(r"examples/(\w+\.py)", before)
        if named:
            found.append((named[-1], match.group(1)))
    return found


def test_the_readme_fits_a_newcomers_reading() -> None:
    assert len(README.splitlines()) <= 300


@pytest.mark.parametrize(("example", "code"), _blocks(), ids=lambda v: str(v)[:20])
def test_readme_code_is_copied_from_its_example(example: str, code: str) -> None:
    text = (ROOT / "examples" / example).read_text().replace("  # fmt: skip", "")
    source = {line.strip() for line in text.splitlines()}
    for line in code.splitlines():
        text = line.strip()
        if text and text != "...":
            assert text in source, f"README shows {text!r}, which examples/{example} lacks"


def test_every_python_block_of_the_readme_names_its_example() -> None:
    assert len(_blocks()) == README.count("```python")


def test_every_public_name_and_config_field_is_in_the_api_reference() -> None:
    api = (ROOT / "docs" / "api.md").read_text()
    missing = [name for name in conveyor.__all__ if f"| `{name}` |" not in api]
    assert not missing, f"docs/api.md does not mention {missing}"
    fields = [f.name for f in dataclasses.fields(PipelineConfig)]
    absent = [f for f in fields if f"`{f}`" not in api]
    assert not absent, f"docs/api.md's field table lacks {absent}"


def test_every_link_and_file_named_in_the_docs_exists() -> None:
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to {target}"
        for path in re.findall(
            r"\b((?:tests|benchmarks|examples|src)/[\w/]+\.py)\b", page.read_text()
        ):
            assert (ROOT / path).exists(), f"{page.name} names {path}, which does not exist"


def test_no_file_of_the_project_cites_anything_outside_it() -> None:
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    outside = re.compile(r"\.\./shared|\bSTYLE\.md\b|\bDESIGN\.md\b")
    found = [
        name
        for name in tracked
        if name.endswith((".py", ".md", ".toml", ".cfg", ".txt"))
        and outside.search((ROOT / name).read_text(errors="ignore"))
    ]
    assert not found, f"{found} cite files outside the repository"


def _family_table() -> dict[str, list[bool]]:
    """docs/models.md's table of families: each row's marks, by model type."""
    text = (ROOT / "docs" / "models.md").read_text()
    section = text.split("## Families, and what each is tested to do", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `"):
            rows[cells[0].strip("`")] = [c == "yes" for c in cells[1:]]
    return rows


def test_the_family_table_of_the_docs_is_what_the_tests_test() -> None:
    from test_context_decode import CONTEXT_PARALLEL
    from test_generate_families import FAMILIES as GENERATE
    from test_meta_families import TESTED as META
    from test_weight_keys import FAMILIES as WEIGHTS
    from test_weight_keys import META_PIPELINES

    from conveyor.hf.decode import ADAPTERS
    from conveyor.hf.decode import CONTEXT_PARALLEL as SHARDED

    table = _family_table()
    columns = [
        {*META, *META_PIPELINES, "llama"},  # llama: tests/test_weights.py
        {*WEIGHTS, *META},
        set(GENERATE),
        set(CONTEXT_PARALLEL),
    ]
    for index, tested in enumerate(columns):
        marked = {family for family, marks in table.items() if marks[index]}
        assert marked == tested, (index, sorted(marked ^ tested))
    assert set(GENERATE) == set(ADAPTERS) and set(CONTEXT_PARALLEL) == set(SHARDED)
