"""Stash/pop skips: plain runs unchanged, the verifier names layers, splits make direct edges."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conveyor.graph import MODEL_OUTPUT
from conveyor.models import segmentation_batches, unet
from conveyor.split import balance_to_split_points, run_stages, split_model
from conveyor.split.skip import pop, rename, skip_names, skippable, stash, verify_skips


@skippable(stash=["skip"])
class Keep(nn.Module):
    """Linear layer that stashes its input."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stash("skip", x)
        out: torch.Tensor = self.linear(x).tanh()
        return out


@skippable(pop=["skip"])
class Add(nn.Module):
    """Linear layer that adds the popped value (or nothing, if it is None)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = pop("skip")
        out: torch.Tensor = self.linear(x)
        return out if skip is None else out + skip


@skippable(stash=["skip"])
class KeepNothing(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stash("skip", None)
        return x * 2


def _reference(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """The same computation written out by hand, without conveyor.skip."""
    keep, middle, add = model[0], model[1], model[2]
    return add.linear(middle(keep.linear(x).tanh())) + x


def test_skippable_layers_run_unchanged_without_conveyor() -> None:
    model = nn.Sequential(Keep(), nn.Linear(4, 4), Add()).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(model(x), _reference(model, x), rtol=0, atol=0)
    model(x).sum().backward()  # gradients flow through the skip as through any tensor
    assert model[0].linear.weight.grad is not None


def test_none_can_be_stashed_and_popped() -> None:
    model = nn.Sequential(KeepNothing(), nn.Linear(4, 4), Add())
    x = torch.randn(2, 4)
    torch.testing.assert_close(model(x), model[2].linear(model[1](x * 2)))
    graph = split_model(model, ["1", "2"])
    torch.testing.assert_close(run_stages(graph, {"input": x}), model(x))


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ([Keep(), nn.Linear(4, 4)], r"layer 0 \(Keep\) stashes 'skip', which no later layer pops"),
        ([nn.Linear(4, 4), Add()], r"layer 1 \(Add\) pops 'skip', which no earlier layer stashes"),
        ([Keep(), Keep(), Add()], r"layers 0 \(Keep\) and 1 \(Keep\) both stash 'skip'"),
        ([Add(), Keep(), Add()], r"layer 0 \(Add\) pops 'skip', which no earlier layer stashes"),
    ],
)
def test_verifier_names_the_layers(layers: list[nn.Module], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        verify_skips(nn.Sequential(*layers))


def test_rename_gives_each_instance_its_own_name() -> None:
    model = nn.Sequential(
        rename(Keep(), skip="outer"),
        rename(Keep(), skip="inner"),
        rename(Add(), skip="inner"),
        rename(Add(), skip="outer"),
    )
    verify_skips(model)
    assert skip_names(model[1]) is not None and skip_names(model[1]).stashes == ("inner",)
    x = torch.randn(2, 4)
    expected = (
        model[3].linear(
            model[2].linear(model[1].linear(model[0].linear(x).tanh()).tanh())
            + model[0].linear(x).tanh()
        )
        + x
    )
    torch.testing.assert_close(model(x), expected)
    with pytest.raises(ValueError, match="has no skip names"):
        rename(Keep(), other="x")


def test_misuse_says_what_to_declare() -> None:
    @skippable(stash=["a"])
    class Wrong(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            stash("b", x)
            return x

    with pytest.raises(RuntimeError, match=r"calls stash\('b'\) but declares stash=\['a'\]"):
        Wrong()(torch.ones(1))
    with pytest.raises(RuntimeError, match="outside the forward of a @skippable layer"):
        pop("a")
    with pytest.raises(TypeError, match=r"decorates nn\.Module classes"):
        skippable(stash=["a"])(int)  # type: ignore[type-var]  # the wrong kind, on purpose

    @skippable(stash=["skip"])
    class Forgets(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    model = nn.Sequential(Forgets(), nn.Linear(4, 4), Add())
    graph = split_model(model, ["2"])
    with pytest.raises(RuntimeError, match=r"declares stash \['skip'\] but its forward did not"):
        run_stages(graph, {"input": torch.ones(1, 4)})


def test_split_sends_each_skip_straight_to_the_layer_that_pops_it() -> None:
    model = nn.Sequential(Keep(), nn.Linear(4, 4), nn.Linear(4, 4), Add()).double()
    graph = split_model(model, balance_to_split_points(model, [1, 1, 2]))
    assert graph.consumers(0) == [1, 2]  # the skip jumps over stage 1
    assert len(graph.edge_values(0, 2)) == 1
    assert len(graph.stages[1].inputs) == 1  # stage 1 never sees the skip
    x = torch.randn(5, 4, dtype=torch.float64)
    torch.testing.assert_close(run_stages(graph, {"input": x}), model(x), rtol=0, atol=0)
    relayed = split_model(model, balance_to_split_points(model, [1, 1, 2]), relay_skips=True)
    assert relayed.consumers(0) == [1] and len(relayed.stages[1].inputs) == 2
    torch.testing.assert_close(run_stages(relayed, {"input": x}), model(x), rtol=0, atol=0)


def test_unet_skips_become_long_edges() -> None:
    model = unet(width=4, depth=3).double()
    graph = split_model(model, balance_to_split_points(model, [2, 2, 2, 2]))
    # stage 0 holds Down 0-1 (skip0, skip1); stage 1 Down 2 + Bottom; stage 2 Up 2-1; stage 3
    assert graph.consumers(0) == [1, 2, 3] and graph.consumers(1) == [2]
    assert graph.stages[3].outputs == (MODEL_OUTPUT,)
    ((images, _),) = segmentation_batches(2, 16, 1, dtype=torch.float64)
    torch.testing.assert_close(run_stages(graph, {"input": images}), model(images))


def test_trace_checks_stash_and_pop_in_any_module() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.add = Add()
            self.keep = Keep()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.keep(self.add(x))  # pops before anything was stashed

    with pytest.raises(ValueError, match=r"layer add \(Add\) pops 'skip', which no layer before"):
        split_model(Model(), ["keep"])
