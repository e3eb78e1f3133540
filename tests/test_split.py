"""Splitting: nn.Sequential by balance, any module by split points, names kept, meta device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conveyor.graph import MODEL_OUTPUT
from conveyor.split import balance_to_split_points, even_balance, split_model


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
