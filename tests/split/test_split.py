"""Splitting by balance, split points and stage modules (graphs); names kept."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import conveyor
from conveyor.graph import MODEL_OUTPUT
from conveyor.split import (
    StageAnnotation,
    balance_to_split_points,
    bind_inputs,
    even_balance,
    run_stages,
    split_by_modules,
    split_model,
)


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.scale = nn.Parameter(torch.ones(8))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        skip = h
        for layer in self.layers:
            h = layer(h).relu() + h
        return self.head((h + skip) * self.scale * mask)


def test_even_balance() -> None:
    assert even_balance(8, 3) == [3, 3, 2]
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages: every stage"):
        even_balance(2, 3)
    with pytest.raises(ValueError, match=r"no layers to split into 2 stages \(an empty"):
        even_balance(0, 2)


def test_balance_must_cover_every_layer() -> None:
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(8)])
    assert balance_to_split_points(model, [3, 5]) == ["3"]
    with pytest.raises(ValueError, match="sum to 8"):
        balance_to_split_points(model, [3, 4])
    layer = nn.Linear(2, 2)  # one module at two positions: not a balance problem
    with pytest.raises(
        ValueError, match=r"same module object at positions \[0, 2\].*deepcopy.*'0.weight,2.weight'"
    ):
        balance_to_split_points(nn.Sequential(layer, nn.Tanh(), layer), [1, 2])


def test_inputs_that_do_not_bind_say_how_to_pass_a_tuple() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    a, b = torch.ones(1, 2), torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"a tuple of 2 values .* pipe\.forward\(\(\(a, b\),\)\)"):
        bind_inputs(model, (a, b))
    assert bind_inputs(model, ((a, b),)) == {"input": (a, b)}


def test_split_points_keep_qualified_names_and_compute_the_same() -> None:
    model = Residual().double()
    graph = split_model(model, ["layers.2"])
    names = [sorted(n for n, _ in s.module.named_parameters()) for s in graph.stages]
    assert names[0] == [
        "embed.bias",
        "embed.weight",
        "layers.0.bias",
        "layers.0.weight",
        "layers.1.bias",
        "layers.1.weight",
    ]
    assert "scale" in names[1] and "head.weight" in names[1]
    assert set(names[0]) | set(names[1]) == set(model.state_dict())
    # the skip value goes straight from stage 0 to stage 1, next to the running value
    assert len(graph.edge_values(0, 1)) == 2
    assert graph.stages[1].outputs == (MODEL_OUTPUT,)
    x, mask = torch.randn(3, 4, dtype=torch.float64), torch.ones(3, 1, dtype=torch.float64)
    values = {"x": x, "mask": mask}
    for stage in graph.stages:
        out = stage.module(*[values[n] for n in stage.inputs])
        values.update(zip(stage.outputs, out, strict=True))
    torch.testing.assert_close(values[MODEL_OUTPUT], model(x, mask), rtol=0, atol=0)


def test_split_a_model_on_the_meta_device_allocates_nothing() -> None:
    with torch.device("meta"):
        model = Residual()
    graph = split_model(model, ["layers.1", "layers.3"])
    assert graph.num_stages == 3
    assert all(p.is_meta for s in graph.stages for p in s.module.parameters())


@pytest.mark.parametrize(
    ("points", "message"),
    [
        (["layers.9"], "split point 'layers.9' is not a submodule"),
        (["layer.2"], r"did you mean one of \['layers.2', "),
        (["layers.3", "layers.1"], "list split points in the order forward calls them"),
        (["layers.1", "layers.1"], "repeat a name"),
    ],
)
def test_bad_split_points_say_what_to_do(points: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_model(Residual(), points)


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow in the traced module
            x = x * 2
        return self.b(self.a(x))


def test_untraceable_model_error_names_the_line() -> None:
    with pytest.raises(TypeError, match=r"if x.sum\(\) > 0") as error:
        split_model(Untraceable(), ["b"])
    assert "split points" in str(error.value)


# -- graphs: annotations ----------------------------------------------------------------------


class Tower(nn.Module):
    def __init__(self, depth: int, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


class TwoTowers(nn.Module):
    """head(cat(a(x), b(y))): the concatenation is unannotated code joining two stages."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Tower(3)
        self.b = Tower(3)
        self.head = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(
            torch.cat([self.a(x).mean(-1, keepdim=True).expand(-1, 8), self.b(y)], dim=-1)
        )


def _inputs(dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(4, 8, dtype=dtype), "y": torch.randn(4, 8, dtype=dtype)}


@pytest.mark.parametrize(
    "stages",
    [
        [["a"], ["b"], ["head"]],
        ["a", "b", "head"],
        {"a": 0, "b": 1, "head": 2},
    ],
)
def test_annotated_towers_become_parallel_stages(stages: StageAnnotation) -> None:
    model = TwoTowers().double()
    graph = split_by_modules(model, stages)
    assert graph.consumers(0) == [2] and graph.consumers(1) == [2] and graph.depth == 2
    # code after a tower that only it feeds stays with it (the pooling goes as one tensor);
    # code joining two stages (the cat) runs where it is used
    assert len(graph.edge_values(0, 2)) == 1 and "cat" not in graph.stages[1].outputs
    inputs = _inputs()
    torch.testing.assert_close(run_stages(graph, inputs), model(**inputs), rtol=0, atol=0)
    names = [sorted(n for n, _ in s.module.named_parameters()) for s in graph.stages]
    assert all(n.startswith("a.") for n in names[0]) and all(n.startswith("b.") for n in names[1])


def test_annotation_of_a_nested_module_overrides_its_parent() -> None:
    model = TwoTowers().double()
    graph = split_by_modules(model, ["a,b", "b.layers.2", "head"])
    assert [n for n, _ in graph.stages[1].module.named_parameters()] == [
        "b.layers.2.weight",
        "b.layers.2.bias",
    ]
    inputs = _inputs()
    torch.testing.assert_close(run_stages(graph, inputs), model(**inputs), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        (["a", "nope", "head"], "annotated module 'nope' is not a submodule of TwoTowers"),
        ({"a": 0, "b": 2, "head": 3}, r"annotations use stages \[0, 2, 3\]"),
        (
            ["head", "a", "b"],
            r"module 'head' in stage 0 uses .* from stage \d; number stages in the "
            "order data flows",
        ),
        ([["a", "b"], ["b", "head"]], "module 'b' is annotated for stages 0 and 1"),
    ],
)
def test_bad_annotations_say_what_is_wrong(stages: StageAnnotation, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_by_modules(TwoTowers(), stages)


def test_relayed_skips_pass_through_every_stage_between() -> None:
    model = TwoTowers().double()
    graph = split_by_modules(model, ["a", "b", "head"], relay_skips=True)
    assert graph.consumers(0) == [1] and graph.consumers(1) == [2] and graph.depth == 3
    inputs = _inputs()
    torch.testing.assert_close(run_stages(graph, inputs), model(**inputs), rtol=0, atol=0)


class Decides(nn.Module):
    """A forward whose Python decides, once, at trace time: by mode and by an input's type."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.a(x).tanh()
        if self.training:
            h = h * 0.5
        if isinstance(mask, torch.Tensor):  # a symbolic value while tracing: never taken
            h = h * mask
        return self.b(h)


class Masked(Decides):
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.a(x)
        if mask is not None:  # a symbolic value while tracing: always taken
            h = h * mask
        return self.b(h)


def test_an_input_the_trace_dropped_or_needs_is_refused_before_any_work() -> None:
    x, mask = torch.randn(2, 4), torch.ones(2, 4)
    graph = split_model(Decides(), ["b"])
    with pytest.raises(ValueError, match="tensor for 'mask', which the traced model never reads"):
        bind_inputs(graph, (x, mask))
    assert sorted(bind_inputs(graph, x)) == ["mask", "x"]
    graph = split_model(Masked(), ["b"])
    with pytest.raises(ValueError, match=r"concrete_args=\{'mask': None\}"):
        bind_inputs(graph, x)
    run_stages(graph, bind_inputs(graph, (x, mask)))
    model = Masked()
    graph = split_model(model, ["b"], concrete_args={"mask": None})
    with pytest.raises(ValueError, match="specialized to None"):
        bind_inputs(graph, (x, mask))
    torch.testing.assert_close(run_stages(graph, bind_inputs(graph, x)), model(x))


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: int = 1, flag: bool = True) -> torch.Tensor:
        h = self.a(x) * scale
        return self.b(h.relu() if flag else h)


def test_a_value_concrete_args_fixed_is_refused_when_the_batch_changes_it() -> None:
    """fx keeps a concrete value in the graph: another one would fail mid-step in fx's own
    assertion, so the binding refuses it first."""
    x, model = torch.randn(2, 4), Scaled()
    graph = split_model(model, ["b"], concrete_args={"scale": 3, "flag": True})
    expected = model(x, scale=3)
    for same in ({"x": x, "scale": 3}, (x, 3, True)):
        torch.testing.assert_close(run_stages(graph, bind_inputs(graph, same)), expected)
    with pytest.raises(ValueError, match=r"split with scale=3 \(concrete_args\).*binds scale=5"):
        bind_inputs(graph, {"x": x, "scale": 5})
    with pytest.raises(ValueError, match=r"binds scale=1 \(given, or forward's default\)"):
        bind_inputs(graph, {"x": x})
    with pytest.raises(ValueError, match="split with flag=True"):
        bind_inputs(graph, (x, 3, False))
    with pytest.raises(ValueError, match="fixes 'scale' to NaN, which equals nothing"):
        split_model(model, ["b"], concrete_args={"scale": float("nan"), "flag": True})
    with pytest.raises(ValueError, match=r"names 'scael', which Scaled.forward does not take"):
        split_model(model, ["b"], concrete_args={"scael": 3})
    for value in ((5, 6), torch.ones(2)):  # fx checks these element by element, or not at all
        with pytest.raises(ValueError, match="fix only None, bools, numbers and strings"):
            split_model(model, ["b"], concrete_args={"scale": value})


class LengthBranch(nn.Module):
    """Branches on the sequence length, which torch.fx cannot trace and export fixes."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y = self.a(x) * mask[..., None]
        if x.shape[1] > 8:
            y = y * 0.5
        return self.b(y)


def test_an_exported_split_refuses_sizes_its_graph_does_not_hold_for() -> None:
    x, mask = torch.randn(2, 12, 4), torch.ones(2, 12)
    model = LengthBranch()
    graph = split_model(model, ["b"], example_inputs=(x, mask), tracer="export")
    ten = (x[:, :10], mask[:, :10])
    torch.testing.assert_close(run_stages(graph, bind_inputs(graph, ten)), model(*ten))
    with pytest.raises(ValueError, match=r"dimension 1 has size 5 .* sizes 9 and up only"):
        bind_inputs(graph, (x[:, :5], mask[:, :5]))
    with pytest.raises(ValueError, match=r"'mask' dimension 1 has size 11 .* only runs size 12"):
        bind_inputs(graph, (x, mask[:, :11]))
    one = (x[:1], mask[:1])  # export assumes sizes from 2, which binds no batch
    torch.testing.assert_close(run_stages(graph, bind_inputs(graph, one)), model(*one))


ONE_RANK = {"schedule": "interleaved-1f1b", "num_microbatches": 1}
"""Both stages on this process's one rank."""


def test_a_forward_that_reads_the_mode_keeps_the_mode_it_was_split_in(one_rank: None) -> None:
    model = Decides()
    assert split_model(model, ["b"]).training is True
    assert split_model(model.eval(), ["b"]).training is False
    assert split_model(Masked(), ["b"]).training is None
    pipe = conveyor.Pipeline(Decides(), split_points=["b"], placement=[0, 0], **ONE_RANK)
    pipe.train()
    with pytest.raises(
        ValueError,
        match=r"split in train mode into stages that hold for that mode only.*model.eval\(\) first",
    ):
        pipe.eval()
    x = torch.randn(2, 4)
    reference = Decides().eval()
    pipe = conveyor.Pipeline(
        copy.deepcopy(reference), split_points=["b"], placement=[0, 0], **ONE_RANK
    )
    torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=0)


class WithUnused(nn.Module):
    """Parameters and buffers the forward never reads: an auxiliary head, a saved buffer, an
    unsaved one, and the second layer of a list whose first one is used."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.aux_head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.register_buffer("calibration", torch.ones(3))
        self.register_buffer("scratch", torch.ones(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.layers[0](self.a(x)))


def test_what_no_stage_reads_is_kept_by_the_first_stage(one_rank: None) -> None:
    model = WithUnused()
    graph = split_model(model, ["b"])
    first, second = (stage.module for stage in graph.stages)
    assert first is not None and second is not None
    assert sorted(second.state_dict()) == ["b.bias", "b.weight"]
    assert sorted([*first.state_dict(), *second.state_dict()]) == sorted(model.state_dict())
    assert first.get_buffer("scratch") is model.scratch  # kept, and still not saved
    assert first.get_parameter("layers.1.weight") is model.layers[1].weight
    pipe = conveyor.Pipeline(WithUnused(), split_points=["b"], placement=[0, 0], **ONE_RANK)
    plain = WithUnused()
    plain.load_state_dict(pipe.state_dict())  # strict: every name there
    pipe.load_state_dict(model.state_dict())
    torch.testing.assert_close(pipe.state_dict(), model.state_dict(), rtol=0, atol=0)
