"""The placement record (placement.py, from step 4): a rank's piece of a parameter, where it starts
in the full tensor and the full shape, for one split and for splits nested on one dim or two."""

import itertools

import pytest
import torch
from conftest import import_step

placement = import_step("step4_tensor_parallel", "placement")
Split = placement.Split


@pytest.mark.parametrize(
    "axes",
    [
        [("tp", 0, 2)],  # column parallel
        [("tp", 1, 4)],  # row parallel
        [("tp", 0, 2), ("dp", 0, 3)],  # a shard of a shard, on the same dim
        [("tp", 1, 2), ("dp", 0, 2)],  # two dims
    ],
)
def test_pieces_tile_the_full_tensor_and_say_where_they_start(axes):
    full = torch.arange(12 * 8).view(12, 8)
    covered = torch.zeros_like(full)
    for ranks in itertools.product(*[range(size) for _, _, size in axes]):
        splits = [Split(a, dim, r, size) for (a, dim, size), r in zip(axes, ranks, strict=True)]
        mine = placement.piece(full, splits)
        assert placement.full_shape(mine.shape, splits) == list(full.shape)
        first = placement.starts(mine.shape, splits)
        index = [slice(None)] * 2
        for dim, start in first.items():
            index[dim] = slice(start, start + mine.shape[dim])
        assert torch.equal(full[tuple(index)], mine), (splits, first)
        covered[tuple(index)] += 1
    assert torch.equal(covered, torch.ones_like(full))  # every element in exactly one piece


def test_the_record_lives_on_the_module_and_defaults_to_whole():
    module = torch.nn.Linear(4, 6, bias=True)
    placement.place(module, "weight", Split("tp", 0, 1, 2))
    assert placement.record_of(module, "weight") == (Split("tp", 0, 1, 2),)
    assert placement.record_of(module, "bias") == ()
    module.weight = torch.nn.Parameter(torch.empty(3, 4))  # replaced (allocated): the record stays
    assert placement.record_of(module, "weight") == (Split("tp", 0, 1, 2),)
    names = {p.name: p.shape for p in placement.placed_parameters(torch.nn.Sequential(module))}
    assert names == {"0.weight": [6, 4], "0.bias": [6]}
