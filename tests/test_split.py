"""Splitting: by balance, split points, annotations (graphs) and automatically; names kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conveyor.graph import MODEL_OUTPUT
from conveyor.models import Block, gpt
from conveyor.split import (
    StageAnnotation,
    balance_to_split_points,
    bind_inputs,
    even_balance,
    run_stages,
    split_by_modules,
    split_model,
)
from conveyor.split.auto import auto_split
from conveyor.split.cut import DataflowGraph, best_cut, branch_order, cut_in_order


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
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        even_balance(2, 3)


def test_balance_must_cover_every_layer() -> None:
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(8)])
    assert balance_to_split_points(model, [3, 5]) == ["3"]
    with pytest.raises(ValueError, match="sum to 8"):
        balance_to_split_points(model, [3, 4])


def test_split_points_keep_qualified_names_and_compute_the_same() -> None:
    model = Residual().double()
    graph = split_model(model, ["layers.2"])
    names = [sorted(n for n, _ in s.module.named_parameters()) for s in graph.stages]
    assert names[0] == ["embed.bias", "embed.weight", "layers.0.bias", "layers.0.weight",
                        "layers.1.bias", "layers.1.weight"]
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


@pytest.mark.parametrize(("points", "message"), [
    (["layers.9"], "split point 'layers.9' is not a submodule"),
    (["layers.3", "layers.1"], "list split points in the order forward calls them"),
    (["layers.1", "layers.1"], "repeat a name"),
])
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
        return self.head(torch.cat([self.a(x).mean(-1, keepdim=True).expand(-1, 8), self.b(y)],
                                   dim=-1))


def _inputs(dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(4, 8, dtype=dtype), "y": torch.randn(4, 8, dtype=dtype)}


@pytest.mark.parametrize("stages", [
    [["a"], ["b"], ["head"]], ["a", "b", "head"], {"a": 0, "b": 1, "head": 2},
])
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
        "b.layers.2.weight", "b.layers.2.bias"]
    inputs = _inputs()
    torch.testing.assert_close(run_stages(graph, inputs), model(**inputs), rtol=0, atol=0)


@pytest.mark.parametrize(("stages", "message"), [
    (["a", "nope", "head"], "annotated module 'nope' is not a submodule of TwoTowers"),
    ({"a": 0, "b": 2, "head": 3}, r"annotations use stages \[0, 2, 3\]"),
    (["head", "a", "b"], r"module 'head' in stage 0 uses .* from stage \d; number stages in the "
                         "order data flows"),
    ([["a", "b"], ["b", "head"]], "module 'b' is annotated for stages 0 and 1"),
])
def test_bad_annotations_say_what_is_wrong(stages: StageAnnotation, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_by_modules(TwoTowers(), stages)


def test_relayed_skips_pass_through_every_stage_between() -> None:
    model = TwoTowers().double()
    graph = split_by_modules(model, ["a", "b", "head"], relay_skips=True)
    assert graph.consumers(0) == [1] and graph.consumers(1) == [2] and graph.depth == 3
    inputs = _inputs()
    torch.testing.assert_close(run_stages(graph, inputs), model(**inputs), rtol=0, atol=0)


# -- graphs: automatic split ------------------------------------------------------------------


class Joined(nn.Module):
    """Concatenation, a projection and a tower: costs about as much as each input tower."""

    def __init__(self) -> None:
        super().__init__()
        self.project = nn.Linear(16, 8)
        self.tower = Tower(3)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.tower(self.project(torch.cat([a, b], dim=-1)))
        return out


class ThreeTowers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Tower(3)
        self.b = Tower(3)
        self.head = Joined()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.a(x), self.b(y))
        return out


@pytest.mark.parametrize("example", [True, False])
def test_auto_split_puts_independent_branches_on_different_stages(example: bool) -> None:
    model = ThreeTowers().double()
    inputs = _inputs()
    # towers this small cost less than sending their outputs: leave transfers out
    graph = auto_split(model, 3, example_inputs=inputs if example else None, byte_cost=0.0)
    assert graph.depth == 2 and graph.consumers(0) == [2] and graph.consumers(1) == [2]
    torch.testing.assert_close(run_stages(graph, inputs), model(**inputs), rtol=0, atol=0)


def test_auto_split_balances_a_chain_by_cost() -> None:
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
    graph = auto_split(model, 4)  # no inputs: parameter counts, equal layers
    sizes = [len(list(s.module.parameters())) for s in graph.stages]
    assert sizes == [4, 4, 4, 4]
    costs = {"0": 1.0, "1": 1.0, "2": 1.0, "3": 1.0, "4": 1.0, "5": 1.0, "6": 1.0, "7": 7.0}
    heavy = auto_split(model, 2, costs=costs)  # e.g. profiled times: the last layer is slow
    assert [n for n, _ in heavy.stages[1].module.named_parameters()] == ["7.weight", "7.bias"]
    with pytest.raises(ValueError, match=r"costs name \['layers.0'\], which match no traced"):
        auto_split(model, 2, costs={"layers.0": 1.0})
    with pytest.raises(ValueError, match="too few for 9 stages"):
        auto_split(model, 9)


class Ordinary(nn.Module):
    """What people write: residuals, a mask and a keyword argument, a tuple output, a shared
    submodule applied twice, a buffer, a parameter used directly."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.shared = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.register_buffer("offset", torch.linspace(-1, 1, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, *,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(x)
        h = self.shared(self.shared(h).relu()) + h  # the same weights twice
        for block in self.blocks:
            h = h + block(h * mask).relu() * self.gate
        out = self.head(h + self.offset) * scale
        return out, h.pow(2).mean()


def test_auto_split_handles_ordinary_modules() -> None:
    model = Ordinary().double()
    x = torch.randn(5, 4, dtype=torch.float64)
    mask = (torch.rand(5, 8) > 0.2).double()
    expected = model(x, mask, scale=0.5)
    for example in (None, {"x": x, "mask": mask, "scale": 0.5}):
        graph = auto_split(model, 3, example_inputs=example, concrete_args={"scale": 0.5},
                           keep_shared=True)
        assert graph.model_inputs == ("x", "mask", "scale")
        inputs = bind_inputs(model, {"x": x, "mask": mask, "scale": 0.5})
        torch.testing.assert_close(run_stages(graph, inputs), expected, rtol=0, atol=0)
        owners = [s.index for s in graph.stages for n, _ in s.module.named_parameters()
                  if n.startswith("shared.")]
        assert len(set(owners)) == 1  # both uses of the shared layer in one stage
        assert "offset" in dict(graph.stages[-1].module.named_buffers())
        assert all(s.module is not None for s in graph.stages) and graph.num_stages == 3


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Untraceable()
        self.other = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.other(self.inner(x))


def test_untraceable_model_error_names_the_operation_and_how_to_annotate() -> None:
    with pytest.raises(TypeError) as error:
        auto_split(Branchy(), 2)
    message = str(error.value)
    assert "cannot be used as inputs to control flow" in message  # the operation
    assert "inside module 'inner' (Untraceable)" in message
    assert "if x.sum() > 0" in message  # the line
    assert "leaf_modules=['inner']" in message and "split_by_modules" in message
    model = Branchy()
    graph = auto_split(model, 2, leaf_modules=["inner"])  # kept whole: never traced
    for sign in (1.0, -1.0):  # both sides of the data-dependent branch
        x = sign * torch.rand(3, 2)
        torch.testing.assert_close(run_stages(graph, {"x": x}), model(x), rtol=0, atol=0)
    annotated = split_by_modules(Branchy(), ["inner", "other"])
    assert annotated.num_stages == 2


def test_auto_split_may_cut_between_the_users_of_tied_weights() -> None:
    model = gpt(vocab_size=16, seq_len=8, dim=8, num_layers=2, num_heads=2, dropout=0.0,
                tie_embeddings=True).double()
    with pytest.raises(TypeError, match=r"leaf_modules=\['1'\]"):  # Block is not traceable
        auto_split(model, 2)
    graph = auto_split(model, 2, leaf_modules=[Block])  # keep every Block whole
    owners = [s.index for s in graph.stages for n, _ in s.module.named_parameters()
              if n in ("0.tokens.weight", "3.out.weight")]
    assert owners == [0, 1]  # the embedding and the output layer, tied across stages
    ids = torch.randint(0, 16, (2, 8))
    torch.testing.assert_close(run_stages(graph, {"input": ids}), model(ids), rtol=0, atol=0)
    with pytest.raises(ValueError, match="only 0 places to cut"):
        auto_split(model, 2, leaf_modules=[Block], keep_shared=True)  # all between the users


def test_auto_split_on_the_meta_device_allocates_nothing() -> None:
    with torch.device("meta"):
        model = Ordinary()
    graph = auto_split(model, 2, concrete_args={"scale": 1.0})
    assert all(p.is_meta for s in graph.stages for p in s.module.parameters())


def test_stage_graph_inputs_bind_by_name_or_position() -> None:
    graph = split_by_modules(TwoTowers(), ["a", "b", "head"])
    x, y = torch.ones(1, 8), torch.zeros(1, 8)
    assert bind_inputs(graph, (x, y)) == {"x": x, "y": y}
    assert bind_inputs(graph, {"y": y, "x": x}) == {"x": x, "y": y}
    with pytest.raises(ValueError, match=r"takes model inputs \['x', 'y'\]"):
        bind_inputs(graph, x)


# -- the search behind auto_split, on plain data (conveyor.split.cut) -----------------------


def test_branch_order_finishes_each_branch_before_the_next() -> None:
    # fx order interleaves two towers: a0 b0 a1 b1 join
    inputs = [[], [], [0], [1], [2, 3]]
    assert branch_order(inputs) == [0, 2, 1, 3, 4]
    assert branch_order([[], [0], [1]]) == [0, 1, 2]


def test_best_cut_trades_the_worst_stage_against_depth() -> None:
    towers = DataflowGraph(costs=[4, 4, 4, 4, 8], inputs=[[], [], [0], [1], [2, 3]])
    plan = best_cut(towers, 3, num_microbatches=4)
    assert plan.stage_of == (0, 1, 0, 1, 2) and plan.depth == 2  # towers side by side
    light = DataflowGraph(costs=[1.0] * 10 + [1.0] * 10 + [0.1],
                          inputs=[[]] + [[i - 1] for i in range(1, 10)] + [[]]
                          + [[i - 1] for i in range(11, 20)] + [[9, 19]])
    # with a light join, cutting the towers into a balanced chain is faster
    assert best_cut(light, 3).depth == 3


def test_cut_keeps_units_and_shared_weights_whole() -> None:
    chain = DataflowGraph(costs=[1] * 6, inputs=[[]] + [[i - 1] for i in range(1, 6)],
                          units=["a", "a", "a", "b", "b", "b"])
    assert cut_in_order(chain, range(6), 2).starts == (0, 3)
    tied = DataflowGraph(costs=[1] * 6, inputs=[[]] + [[i - 1] for i in range(1, 6)],
                         together=[[0, 4]])
    assert cut_in_order(tied, range(6), 2).starts == (0, 5)
    with pytest.raises(ValueError, match="only 0 places to cut"):
        cut_in_order(DataflowGraph(costs=[1] * 3, inputs=[[], [0], [1]], units=["a"] * 3),
                     range(3), 2)
    with pytest.raises(ValueError, match="topological order"):
        DataflowGraph(costs=[1, 1], inputs=[[1], []])


def test_byte_cost_keeps_cuts_away_from_large_tensors() -> None:
    costs, inputs = [0.5, 1.0, 1.5, 1.0], [[], [0], [1], [2]]
    sizes = [1.0, 100.0, 1.0, 1.0]  # node 1 produces a large tensor
    assert cut_in_order(DataflowGraph(costs, inputs, sizes), range(4), 2).starts == (0, 2)
    costly = DataflowGraph(costs, inputs, sizes, byte_cost=0.05)
    plan = cut_in_order(costly, range(4), 2)
    assert plan.starts == (0, 3) and plan.stage_costs == pytest.approx((3.0, 1.05))
