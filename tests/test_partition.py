"""Layer partitioning and micro-batch splitting: pure, no processes (the layout: test_grid.py).

    .venv/bin/pytest -q tests/test_partition.py
"""

from itertools import pairwise

import pytest
import torch
from torch import nn

from ringtrain.pipeline.engine import split_batch
from ringtrain.pipeline.partition import (
    balanced_sizes,
    parameter_counts,
    partition,
    tied_parameters,
)


def _stack(widths=(4, 8, 8, 8, 2)):
    layers = []
    for a, b in pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def test_balanced_sizes_minimise_the_heaviest_stage():
    assert balanced_sizes([1] * 6, 3) == [2, 2, 2]
    assert balanced_sizes([1] * 5, 2) == [2, 3]  # ties: the earlier stage gets fewer
    assert balanced_sizes([10, 1, 1, 1, 1, 10], 2) == [3, 3]
    assert balanced_sizes([100, 1, 1, 1], 2) == [1, 3]
    assert balanced_sizes([5, 5, 5, 5, 20], 3) == [2, 2, 1]
    assert balanced_sizes([7], 1) == [1]


def test_balanced_sizes_is_optimal_by_brute_force():
    import itertools

    weights = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    for pp in range(1, 6):
        best = min(
            max(sum(weights[a:b]) for a, b in pairwise((0, *cuts, len(weights))))
            for cuts in itertools.combinations(range(1, len(weights)), pp - 1)
        )
        sizes = balanced_sizes(weights, pp)
        bounds = [sum(sizes[:i]) for i in range(pp + 1)]
        assert sum(sizes) == len(weights) and min(sizes) >= 1
        assert max(sum(weights[a:b]) for a, b in pairwise(bounds)) == best


def test_partition_keeps_layer_objects_and_names():
    model = _stack()
    stages = partition(model, 2)
    assert len(stages) == 2
    assert ([n for s in stages for n, _ in s.named_children()]
            == [n for n, _ in model.named_children()])
    assert all(a is b for a, b in zip([m for s in stages for m in s], model, strict=True))
    keys = [k for s in stages for k in s.state_dict()]
    assert keys == list(model.state_dict())
    x = torch.randn(3, 4)
    torch.testing.assert_close(stages[1](stages[0](x)), model(x))


def test_partition_by_parameter_count_and_explicit_split():
    model = nn.Sequential(nn.Linear(10, 100), nn.Linear(100, 10), nn.Linear(10, 10),
                          nn.Linear(10, 10))
    assert parameter_counts(model) == [1100, 1010, 110, 110]
    assert [len(s) for s in partition(model, 2)] == [1, 3]
    assert [len(s) for s in partition(model, 2, split=[3, 1])] == [3, 1]
    assert [len(s) for s in partition(list(model), 4)] == [1, 1, 1, 1]


def test_partition_errors_carry_values_and_fix():
    with pytest.raises(ValueError, match=r"pp=5 stages but the model has only 3 layers.*--pp 3"):
        partition(nn.Sequential(nn.Linear(1, 1), nn.ReLU(), nn.Linear(1, 1)), 5)
    with pytest.raises(ValueError, match=r"split=\[1, 1\] covers 2 layers but the model has 3"):
        partition(nn.Sequential(nn.Linear(1, 1), nn.ReLU(), nn.Linear(1, 1)), 2, split=[1, 1])
    with pytest.raises(ValueError, match="one layer count per stage"):
        partition(nn.Sequential(nn.Linear(1, 1), nn.ReLU()), 2, split=[2])
    with pytest.raises(TypeError, match="to_sequential"):
        partition(nn.Linear(1, 1), 1)


def test_tied_parameters_found_across_stages():
    emb, head = nn.Embedding(7, 4), nn.Linear(4, 7, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, nn.Linear(4, 4), head)
    assert tied_parameters(partition(model, 1)) == []  # within one stage: autograd sums it
    ties = tied_parameters(partition(model, 2, split=[2, 1]))
    assert len(ties) == 1
    assert ties[0].holders == ((0, "0.weight"), (1, "2.weight"))
    assert ties[0].stages == (0, 1)


def test_split_batch_errors_name_the_choices():
    assert [t.shape[0] for t in split_batch(torch.zeros(8, 3), 4)] == [2, 2, 2, 2]
    with pytest.raises(ValueError, match=r"batch of 10 samples cannot be split into "
                                         r"microbatches=4.*\[1, 2, 5, 10\]"):
        split_batch(torch.zeros(10), 4)
    with pytest.raises(ValueError, match=r"use --microbatches in \[5, 10\]"):
        split_batch(torch.zeros(10), 4, at_least=3)  # only choices >= pp are suggested
    with pytest.raises(ValueError, match="microbatches=8 equal micro-batches; "
                                         "use a batch size that is a multiple of 8"):
        split_batch(torch.zeros(2), 8, at_least=4)
