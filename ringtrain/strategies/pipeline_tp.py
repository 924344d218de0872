"""Tensor parallelism inside each pipeline stage (`--strategy pipeline --tp N`): what the
pipeline strategy does differently when the tp ranks of a stage hold slices of its matrices.

    ringtrain train --pp 2 --tp 2 --nproc-per-node 4

- `parallelize_model`: the whole model through `gpt_plan()` on the tp group *before* it is cut
  into stages, so every stage's blocks, the vocab-parallel embedding (first stage) and the
  column-parallel lm_head (last stage) are split alike on every pipeline;
- `StageSlices`: a stage's tensors between this rank's slices and whole ones (the full model
  gathered over the tp group, a snapshot put together across tp ranks, a layout-free state cut
  for this tp rank), by the model's names (`ringtrain.tensor_parallel.state`).
With tp=1 every tensor is held whole and each step below is the identity.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ringtrain.errors import ConfigError
from ringtrain.tensor_parallel import comm, gpt_plan, parallelize
from ringtrain.tensor_parallel.plan import PlanMismatchError
from ringtrain.tensor_parallel.state import Split, param_splits, shard, unshard

WHOLE = Split(None)


def parallelize_model(model: nn.Module, tp_group, *, tp: int, sequence_parallel: bool,
                      recompute_gather: bool = False) -> nn.Module:
    """`model` with every matrix split over `tp_group` (in place), or a ConfigError naming
    what does not split (n_head or the vocabulary). Dropout: the stage's tp ranks draw one
    stream (`PipelineStrategy.seed_rank`), their parts their own (`tensor_parallel.rng`)."""
    try:
        return parallelize(model, gpt_plan(sequence_parallel=sequence_parallel,
                                           recompute_gather=recompute_gather), tp_group)
    except PlanMismatchError as e:
        raise ConfigError(e.for_strategy(f"--strategy pipeline --tp {tp}")) from None
    except (TypeError, ValueError) as e:  # n_head or vocab not divisible
        raise ConfigError(f"--strategy pipeline --tp {tp}: {e}") from None


@dataclass(frozen=True)
class StageSlices:
    """How each of a stage's tensors is held over the tp group, by the model's names.

    Args:
        splits: model name -> `Split` (`WHOLE` for what every tp rank holds entire).
        tp_rank, tp: this rank's place in its tp group and the group's size.
    """

    splits: dict[str, Split]
    tp_rank: int = 0
    tp: int = 1

    @classmethod
    def of(cls, stage: nn.Module, keys: Mapping[str, Sequence[str]], tp_rank: int,
           tp: int) -> StageSlices:
        """From a parallelised stage and its keys' model names (`StageNames.keys`)."""
        by_key = param_splits(stage)
        return cls({name: by_key.get(key, WHOLE) for key, names in keys.items()
                    for name in names}, tp_rank, tp)

    def split(self, name: str) -> Split:
        return self.splits.get(name, WHOLE)

    def is_sliced(self, name: str) -> bool:
        return self.split(name).dim is not None

    def gather(self, tensors: Mapping[str, torch.Tensor], group) -> dict[str, torch.Tensor]:
        """The whole tensors from every tp rank's slices (collective over the tp group, in the
        order of `tensors`, which is the same on every tp rank of a stage)."""
        out = {}
        for name, t in tensors.items():
            if self.tp == 1 or not self.is_sliced(name):
                out[name] = t
            else:
                parts = comm.all_gather(t.unsqueeze(0), 0, group)
                out[name] = unshard(list(parts.unbind(0)), self.split(name))
        return out

    def cut(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This tp rank's slices of whole tensors, by name."""
        return {name: self._cut(name, t) for name, t in tensors.items()}

    def cut_entry(self, name: str, entry: Mapping[str, Any]) -> dict[str, Any]:
        """This tp rank's slice of one parameter's optimizer state (moments have its shape;
        the step count is a scalar, kept)."""
        return {k: self._cut(name, v) if isinstance(v, torch.Tensor) else v
                for k, v in entry.items()}

    def _cut(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return shard(t, self.split(name), self.tp_rank, self.tp) if self.tp > 1 else t

    def to_dict(self) -> dict[str, tuple[int | None, int]]:
        return {k: (s.dim, s.chunks) for k, s in self.splits.items()}


def join_slices(parts: Sequence[Mapping[str, Any]],
                splits: Mapping[str, tuple[int | None, int]]) -> dict[str, Any]:
    """One stage's {name: tensor} (or {name: {key: tensor}}, optimizer state) from its tp
    ranks' slices, in tp_rank order (a snapshot without "splits": held whole)."""
    out: dict[str, Any] = {}
    for name, first in parts[0].items():
        split = Split(*splits[name]) if name in splits else WHOLE
        if isinstance(first, torch.Tensor):
            out[name] = unshard([p[name] for p in parts], split)
        elif isinstance(first, dict):
            out[name] = {k: unshard([p[name][k] for p in parts], split)
                         if isinstance(v, torch.Tensor) else v for k, v in first.items()}
        else:
            out[name] = first
    return out
