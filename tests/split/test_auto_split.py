"""The automatic split (conveyor.split.auto): branches apart, chains balanced, clear errors."""

from __future__ import annotations

import pytest
import torch
from test_split import Tower, TwoTowers, Untraceable, _inputs
from torch import nn

from conveyor.models import Block, gpt
from conveyor.split import bind_inputs, run_stages, split_by_modules
from conveyor.split.auto import auto_split


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

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, *, scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
        graph = auto_split(
            model, 3, example_inputs=example, concrete_args={"scale": 0.5}, keep_shared=True
        )
        assert graph.model_inputs == ("x", "mask", "scale")
        inputs = bind_inputs(model, {"x": x, "mask": mask, "scale": 0.5})
        torch.testing.assert_close(run_stages(graph, inputs), expected, rtol=0, atol=0)
        owners = [
            s.index
            for s in graph.stages
            for n, _ in s.module.named_parameters()
            if n.startswith("shared.")
        ]
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
    with pytest.raises(TypeError) as error:  # in the model's own forward: no module to name
        auto_split(Untraceable(), 1)
    assert "<name>" not in str(error.value)
    assert "move that code into a submodule and name the submodule" in str(error.value)


def test_auto_split_may_cut_between_the_users_of_tied_weights() -> None:
    model = gpt(
        vocab_size=16, seq_len=8, dim=8, num_layers=2, num_heads=2, dropout=0.0, tie_embeddings=True
    ).double()
    with pytest.raises(TypeError, match=r"leaf_modules=\['1'\]"):  # Block is not traceable
        auto_split(model, 2)
    graph = auto_split(model, 2, leaf_modules=[Block])  # keep every Block whole
    owners = [
        s.index
        for s in graph.stages
        for n, _ in s.module.named_parameters()
        if n in ("0.tokens.weight", "3.out.weight")
    ]
    assert owners == [0, 1]  # the embedding and the output layer, tied across stages
    ids = torch.randint(0, 16, (2, 8))
    torch.testing.assert_close(run_stages(graph, {"input": ids}), model(ids), rtol=0, atol=0)
    with pytest.raises(ValueError, match="only 0 places to cut"):
        auto_split(model, 2, leaf_modules=[Block], keep_shared=True)  # all between the users


def test_auto_split_on_the_meta_device_allocates_nothing() -> None:
    # .to("meta"), not a torch.device("meta") block: once a Hugging Face model has run in this
    # process (another test), torch.linspace ignores that block and Ordinary's gate is real
    model = Ordinary().to("meta")
    graph = auto_split(model, 2, concrete_args={"scale": 1.0})
    assert all(p.is_meta for s in graph.stages for p in s.module.parameters())


def test_stage_graph_inputs_bind_by_name_or_position() -> None:
    graph = split_by_modules(TwoTowers(), ["a", "b", "head"])
    x, y = torch.ones(1, 8), torch.zeros(1, 8)
    assert bind_inputs(graph, (x, y)) == {"x": x, "y": y}
    assert bind_inputs(graph, {"y": y, "x": x}) == {"x": x, "y": y}
    with pytest.raises(ValueError, match=r"takes model inputs \['x', 'y'\]"):
        bind_inputs(graph, x)


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # a branch on a tensor's value: neither fx nor export traces it
            return self.linear(x)
        return x


def test_a_model_neither_tracer_can_trace_is_named_with_its_module_and_line() -> None:
    model = nn.Sequential(nn.Linear(4, 4), _Gate(), nn.Linear(4, 4))
    wrapped = nn.ModuleDict({"body": model})

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = wrapped

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.inner["body"](x)
            return out

    with pytest.raises(TypeError) as error:
        auto_split(Outer(), 2, example_inputs=torch.ones(2, 4), tracer="export")
    message = str(error.value)
    assert "in module 'inner.body.1' (_Gate)" in message
    assert "if x.sum() > 0" in message and "tracer='fx'" in message
    assert "<name>" not in message
