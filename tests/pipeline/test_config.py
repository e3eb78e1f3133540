"""Configuration (conveyor.config): sections validate their fields, every source in one order."""

from __future__ import annotations

import enum
import json
from pathlib import Path

import pytest

from conveyor.cli.flags import field_docs
from conveyor.config import (
    DP_ENV,
    PLAN_ENV,
    TRACE_ENV,
    ParallelConfig,
    PipelineConfig,
    RuntimeConfig,
    SplitConfig,
    TrainingConfig,
    read_plan,
    resolve,
)


def test_fields_are_set_and_read_flat_and_belong_to_one_section_each() -> None:
    config = PipelineConfig(balance=(3, 3), num_microbatches=8, timeout_s=5.0)
    assert (config.balance, config.num_microbatches, config.timeout_s) == ((3, 3), 8, 5.0)
    sections = [SplitConfig, TrainingConfig, RuntimeConfig, ParallelConfig]
    names = [set(section.__dataclass_fields__) for section in sections]
    assert set.union(*names) == set(PipelineConfig.__dataclass_fields__)
    assert sum(len(n) for n in names) == len(PipelineConfig.__dataclass_fields__)
    docs = field_docs(PipelineConfig)  # every field documents itself (CLI help)
    assert set(docs) == set(PipelineConfig.__dataclass_fields__)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"balance": (3, 3), "split_points": ("4",)}, "pass one way to split"),
        ({"stage_modules": ("a", " ,")}, "has an empty stage"),
        ({"num_microbatches": 0}, "num_microbatches must be >= 1"),
        ({"recompute": "sometimes"}, "recompute must be one of"),
        ({"stage_recompute": ("never", "often")}, r"stage_recompute has modes \['often'\]"),
        ({"timeout_s": 0}, "timeout_s must be positive"),
        ({"timeout_s": float("nan")}, "timeout_s must be positive and finite"),
        ({"compile_timeout_s": -1.0}, "compile_timeout_s must be positive"),
        ({"tie_weights": ("a.weight",)}, "names fewer than two"),
        ({"dp": 0}, "dp must be >= 1, got 0"),
        ({"reshard_after_forward": True}, "pass fsdp=True as well"),
        ({"dp": 2, "measure_memory": True}, "measure activation memory with dp=1"),
    ],
)
def test_each_section_rejects_bad_values(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PipelineConfig(**fields)  # type: ignore[arg-type]  # wrong on purpose


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"split_points": "12"}, r"split_points takes a list .* got str '12'; pass split_points"),
        ({"balance": 2}, r"balance takes a list .* got int 2"),
        ({"stage_recompute": "always"}, r"stage_recompute takes a list"),
        ({"tie_weights": "a.weight,b.weight"}, r"tie_weights takes a list"),
        ({"timeout_s": "60"}, "timeout_s must be a number of seconds, got '60'"),
    ],
)
def test_a_value_of_the_wrong_kind_is_refused_naming_the_field(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(TypeError, match=message):
        PipelineConfig(**fields)  # type: ignore[arg-type]  # wrong on purpose


def test_a_list_field_takes_any_iterable_of_entries() -> None:
    import numpy as np

    config = PipelineConfig(balance=np.array([3, 3]), placement=(r for r in [0, 1]))
    assert (config.balance, config.placement) == ((3, 3), (0, 1))


def test_counts_take_whole_floats_and_refuse_the_rest() -> None:
    config = PipelineConfig(num_microbatches=42.0, balance=(3.0, 5), virtual_stages=2.0)
    assert (config.num_microbatches, config.balance, config.virtual_stages) == (42, (3, 5), 2)
    assert type(config.num_microbatches) is int
    with pytest.raises(ValueError, match=r"num_microbatches must be a whole number, got 42\.5"):
        PipelineConfig(num_microbatches=42.5)
    with pytest.raises(TypeError, match="num_microbatches must be an integer, got str '4'"):
        PipelineConfig(num_microbatches="4")  # type: ignore[arg-type]  # wrong on purpose


# str() of a str mixed with Enum says '_Mode.ALWAYS'; its value is the mode
class _Mode(str, enum.Enum):  # noqa: UP042  # not StrEnum: its str() is the value
    ALWAYS = "always"


class _Named:  # torchgpipe reads the mode with str(), so its users pass such objects
    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return self.name


@pytest.mark.parametrize("given", [_Named("except_last"), _Mode.ALWAYS, _Named("never")])
def test_recompute_takes_an_object_whose_str_is_a_mode_as_that_mode(given: object) -> None:
    config = PipelineConfig(recompute=given)  # type: ignore[arg-type]  # what torchgpipe takes
    assert type(config.recompute) is str
    assert config.recompute == (given.value if isinstance(given, _Mode) else str(given))
    assert json.loads(json.dumps(config.to_dict()))["recompute"] == config.recompute


def test_recompute_refuses_an_object_whose_str_is_no_mode() -> None:
    named = r"got <.*_Named object at .*>, whose str\(\) is 'sometimes'"
    with pytest.raises(ValueError, match=named):
        PipelineConfig(recompute=_Named("sometimes"))  # type: ignore[arg-type]  # on purpose
    with pytest.raises(ValueError, match=r"recompute must be one of .*, got 1$"):
        PipelineConfig(recompute=1)  # type: ignore[arg-type]  # wrong on purpose


def test_checkpoint_is_the_deprecated_name_of_recompute(tmp_path: Path) -> None:
    with pytest.warns(DeprecationWarning) as caught:
        config = PipelineConfig(checkpoint="always", stage_checkpoint=("never", "always"))
    said = [str(w.message).split(" (")[0] for w in caught]
    assert said == [
        "checkpoint= is deprecated and will be removed; it is now recompute=",
        "stage_checkpoint= is deprecated and will be removed; it is now stage_recompute=",
    ]
    assert (config.recompute, config.stage_recompute) == ("always", ("never", "always"))
    assert (config.checkpoint, config.stage_checkpoint) == (None, None)
    assert "checkpoint" not in config.to_dict() and config == PipelineConfig(
        recompute="always", stage_recompute=("never", "always")
    )
    with pytest.raises(ValueError, match="both checkpoint= and recompute= are set"):
        PipelineConfig(checkpoint="always", recompute="except_last")
    # a plan file written before the rename still loads, its fields under the new names
    plan = tmp_path / "plan.json"
    plan.write_text(
        json.dumps({"pipeline": {"balance": [1, 1], "stage_checkpoint": ["always"] * 2}})
    )
    with pytest.warns(DeprecationWarning, match="stage_checkpoint is now stage_recompute"):
        planned = PipelineConfig(stage_recompute=("never", "never")).with_plan(read_plan(plan))
    assert planned.stage_recompute == ("always", "always")


def test_plain_data_round_trips_and_unknown_fields_are_named() -> None:
    config = PipelineConfig(balance=(2, 4), stage_recompute=("never", "always"))
    data = json.loads(json.dumps(config.to_dict()))
    assert data["balance"] == [2, 4]
    assert PipelineConfig.from_dict(data) == config
    with pytest.raises(ValueError, match=r"my.toml sets unknown fields \['microbatches'\]"):
        PipelineConfig.from_dict({"microbatches": 4}, "my.toml")


def test_a_plan_replaces_the_way_to_split(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"pipeline": {"split_points": ["layers.2"], "num_microbatches": 8}}))
    config = PipelineConfig(balance=(3, 3), schedule="gpipe").with_plan(read_plan(plan))
    assert (config.balance, config.split_points) == (None, ("layers.2",))
    assert (config.num_microbatches, config.schedule) == (8, "gpipe")


def test_sources_resolve_in_order(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"pipeline": {"num_microbatches": 8, "schedule": "zb-h1"}}))
    base = PipelineConfig(num_microbatches=2)
    assert resolve(base, environ={}) == base
    # the script's plan, then its options
    script = resolve(base, plan=plan, options={"schedule": "gpipe"}, environ={})
    assert (script.num_microbatches, script.schedule) == (8, "gpipe")
    # `conveyor run --plan` overrides the script; --trace only fills an unset directory
    launched = resolve(
        base, options={"schedule": "gpipe"}, environ={PLAN_ENV: str(plan), TRACE_ENV: "/runs/t"}
    )
    assert (launched.schedule, launched.trace_dir) == ("zb-h1", "/runs/t")
    own = resolve(base, options={"trace_dir": "mine"}, environ={TRACE_ENV: "/runs/t"})
    assert own.trace_dir == "mine"
    # the script's own way to split, or its recompute, replaces what the plan made for its
    # own stages
    planned = {"balance": [2, 1, 1, 2], "placement": [0, 1, 0, 1], "num_microbatches": 8}
    plan.write_text(json.dumps({"pipeline": {**planned, "stage_recompute": ["always"] * 4}}))
    own_split = resolve(base, plan=plan, options={"balance": (3, 3)}, environ={})
    assert (own_split.balance, own_split.placement, own_split.stage_recompute) == (
        (3, 3),
        None,
        None,
    )
    assert own_split.num_microbatches == 8
    own_recompute = resolve(base, plan=plan, options={"recompute": "never"}, environ={})
    assert own_recompute.stage_recompute is None and own_recompute.placement == (0, 1, 0, 1)
    # `conveyor run --dp N` fills an unset data-parallel degree
    assert resolve(base, environ={DP_ENV: "2"}).dp == 2
    assert resolve(base, options={"dp": 4}, environ={DP_ENV: "2"}).dp == 4


def test_bad_plan_files_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match=r"bad\.json' is not JSON"):
        read_plan(bad)
    bad.write_text(json.dumps({"prediction": {}}))
    with pytest.raises(ValueError, match="has no 'pipeline' section"):
        read_plan(bad)


def test_a_mesh_error_names_the_plan_file_that_sized_the_mesh(tmp_path: Path) -> None:
    from conveyor.pipeline.build import blame_plan as _blame_plan

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"pipeline": {"dp": 4, "schedule": "1f1b"}}))
    error = ValueError("a world of 2 ranks does not factor into dp=4 x tp=1 x pp")
    _blame_plan(error, plan)
    assert error.__notes__ == [
        f"the mesh sizes come from plan file {str(plan)!r}, made for another world; plan again "
        "with `conveyor plan --world-size N` for this one"
    ]
