"""Split a model into pipeline stages: pure planning, no processes.

A model is an `nn.Sequential` or a list of modules ("layers"); a partition gives each of the
`pp` stages a contiguous run of layers, balanced by parameter count (the min-max linear
partition) or by an explicit list of layer counts. Stage `s` is an `nn.Sequential` of the
original layer objects under their original keys, so the union of the stages' `state_dict()`
keys is exactly the full model's.

Weights tied across stages (a GPT's token embedding reused as its output layer) are found by
object identity; `tied_parameters` names them so the runtime can sum their gradients between
the stages that hold them.

    .venv/bin/pytest -q tests/test_partition.py
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn


def _layers(model: nn.Module | Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    if isinstance(model, (list, tuple, nn.ModuleList)) and all(isinstance(m, nn.Module)
                                                               for m in model):
        return [(str(i), m) for i, m in enumerate(model)]
    raise TypeError(
        f"cannot split a {type(model).__name__} into pipeline stages: pass an nn.Sequential or a "
        "list of modules (layers run in order, each taking the previous one's output); for a "
        "model with its own forward, give it a to_sequential() method"
    )


def parameter_counts(model: nn.Module | Sequence[nn.Module]) -> list[int]:
    """Parameters per layer (a parameter used by two layers counts in both: both compute)."""
    return [sum(p.numel() for p in layer.parameters()) for _, layer in _layers(model)]


def balanced_sizes(weights: Sequence[int], pp: int) -> list[int]:
    """Layers per stage for `pp` contiguous stages minimising the heaviest stage's weight.

    The linear-partition dynamic programme, O(pp * n^2). Among equally good splits the
    earliest cuts win, so early stages get fewer layers: under 1F1B they hold the most
    micro-batches in flight.

    Args:
        weights: cost of each layer, e.g. its parameter count.
        pp: number of stages; every stage gets at least one layer.
    """
    n = len(weights)
    if pp < 1:
        raise ValueError(f"pp={pp}: the number of pipeline stages must be at least 1")
    if n < pp:
        raise ValueError(
            f"pp={pp} stages but the model has only {n} layers: every stage needs at least one "
            f"layer. Use --pp {max(1, n)} or fewer, or split the model into more layers"
        )
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + int(w))
    inf = float("inf")
    # best[k][i]: minimal max-stage weight of the first i layers in k stages; cut[k][i]: last cut.
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0
    for k in range(1, pp + 1):
        for i in range(k, n - (pp - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:  # strict: the earliest cut among equals
                    best[k][i], cut[k][i] = cost, j
    sizes, i = [], n
    for k in range(pp, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def check_sizes(sizes: Sequence[int], num_layers: int, pp: int) -> list[int]:
    """Validate an explicit split (layers per stage) and return it as a list."""
    sizes = [int(s) for s in sizes]
    if len(sizes) != pp:
        raise ValueError(f"split={sizes} has {len(sizes)} entries but pp={pp}: give one layer "
                         "count per stage")
    if any(s < 1 for s in sizes):
        raise ValueError(f"split={sizes}: every stage needs at least one layer")
    if sum(sizes) != num_layers:
        raise ValueError(
            f"split={sizes} covers {sum(sizes)} layers but the model has {num_layers}: "
            "the layer counts must add up to the number of layers"
        )
    return sizes


def partition(model: nn.Module | Sequence[nn.Module], pp: int,
              split: Sequence[int] | None = None) -> list[nn.Sequential]:
    """Split `model` into `pp` stages; stage s is an `nn.Sequential` sharing the layers' objects.

    Args:
        model: an `nn.Sequential`, or a list of modules applied in order.
        pp: number of stages.
        split: layers per stage (e.g. `[3, 2]`); default: balanced by parameter count.
    """
    layers = _layers(model)
    if split is None:
        sizes = balanced_sizes(parameter_counts(model), pp)
    else:
        sizes = check_sizes(split, len(layers), pp)
    stages, start = [], 0
    for size in sizes:
        stages.append(nn.Sequential(OrderedDict(layers[start:start + size])))
        start += size
    return stages


@dataclass(frozen=True)
class TiedParameter:
    """One parameter object held by several stages: `(stage, name in that stage)` per holder."""

    holders: tuple[tuple[int, str], ...]

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(s for s, _ in self.holders)


def tied_parameters(stages: Sequence[nn.Module]) -> list[TiedParameter]:
    """Parameters that appear (by identity) in more than one stage, in first-seen order."""
    seen: dict[int, list[tuple[int, str]]] = {}
    for s, stage in enumerate(stages):
        for name, p in stage.named_parameters():  # deduplicated within the stage
            holders = seen.setdefault(id(p), [])
            if not holders or holders[-1][0] != s:
                holders.append((s, name))
    return [TiedParameter(tuple(h)) for h in seen.values() if len(h) > 1]
