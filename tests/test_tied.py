"""Finding tied parameters in a split model: by identity, and declared by name."""

from __future__ import annotations

import pytest
from torch import nn

from conveyor.graph import place
from conveyor.models import gpt
from conveyor.runtime.tied import Tie, find_ties
from conveyor.split import balance_to_split_points, split_model


def split(model: nn.Sequential, balance: list[int], num_ranks: int = 2):  # type: ignore[no-untyped-def]
    return split_model(
        model, balance_to_split_points(model, balance), place(len(balance), num_ranks)
    )


def test_the_same_parameter_in_two_stages_is_a_tie() -> None:
    graph = split(gpt(num_layers=2, tie_embeddings=True), [2, 2])
    ties = find_ties(graph)
    assert ties == [Tie(((0, "0.tokens.weight"), (1, "3.out.weight")))]
    assert ties[0].ranks(graph) == [0, 1] and ties[0].name == "0.tokens.weight"
    assert find_ties(split(gpt(num_layers=2), [2, 2])) == []
    assert find_ties(split(gpt(num_layers=2, tie_embeddings=True), [4], 1)) == []  # one stage


def test_declared_ties_merge_with_found_ones() -> None:
    graph = split(gpt(num_layers=2), [1, 1, 1, 1])
    ties = find_ties(graph, ["0.tokens.weight, 3.out.weight"])
    assert ties == [Tie(((0, "0.tokens.weight"), (3, "3.out.weight")))]
    assert ties[0].ranks(graph) == [0, 1]
    with pytest.raises(ValueError, match="which no stage holds"):
        find_ties(graph, ["0.tokens.weight,3.nothing"])
    with pytest.raises(ValueError, match="mixes shapes"):
        find_ties(graph, ["0.tokens.weight,3.norm.weight"])
