"""Old module names (before the re-layout into packages) import, warning with the new place."""

from __future__ import annotations

import importlib

import pytest

MOVED = [
    ("autosplit", "conveyor.split.auto", "auto_split"),
    ("batchnorm", "conveyor.runtime.batchnorm", "DeferredBatchNorm"),
    ("partition", "conveyor.planner.partition", "bottleneck_split"),
    ("plan", "conveyor.planner", "PlanReport"),
    ("profile", "conveyor.planner.profile", "profile_model"),
    ("skip", "conveyor.split.skip", "skippable"),
    ("huggingface", "conveyor.hf.loss", "label_counts"),
    ("weights", "conveyor.pipeline.weights", "WeightFiles"),
    ("training", "conveyor.pipeline.training", "Throughput"),
    ("inference.pipeline", "conveyor.pipeline.decode", "DecodePipeline"),
    ("inference.hf", "conveyor.hf.decode", "ADAPTERS"),
    ("inference.parallelism", "conveyor.planner.parallelism", "compare"),
    ("runtime.faults", "conveyor.pipeline.faults", "install"),
    ("planner.mesh", "conveyor.planner.layouts", "plan_mesh"),
    ("planner.decode_cost", "conveyor.inference.cost", "DecodeCost"),
]


@pytest.mark.parametrize(("old", "new", "name"), MOVED)
def test_an_old_import_works_and_warns_naming_the_new_module(old: str, new: str, name: str) -> None:
    namespace: dict[str, object] = {}
    with pytest.warns(DeprecationWarning, match=f"conveyor.{old} moved to {new}: import from"):
        exec(f"from conveyor.{old} import {name}", namespace)
    assert namespace[name] is getattr(importlib.import_module(new), name)
    if old == "plan":  # `import conveyor.plan as x` reads conveyor.plan: the function now
        return
    with pytest.warns(DeprecationWarning, match=f"conveyor.{old} moved to {new}"):
        exec(f"import conveyor.{old} as old_module", namespace)
        assert getattr(namespace["old_module"], name) is namespace[name]


def test_a_moved_module_is_an_attribute_of_conveyor_and_plan_stays_the_function() -> None:
    import conveyor.plan
    import conveyor.skip

    with pytest.warns(DeprecationWarning, match="conveyor.skip moved to conveyor.split.skip"):
        assert conveyor.skip.stash is conveyor.stash
    assert callable(conveyor.plan) and conveyor.plan.__module__ == "conveyor.planner.search"
    with pytest.raises(AttributeError, match="module 'conveyor' has no attribute 'skips'"):
        conveyor.skips  # noqa: B018  # the attribute read is the test


def test_a_name_the_new_module_lacks_is_an_import_error() -> None:
    with pytest.warns(DeprecationWarning), pytest.raises(ImportError, match="no_such_name"):
        exec("from conveyor.autosplit import no_such_name", {})
