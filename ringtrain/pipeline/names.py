"""Which of the model's names a rank's stage holds: the full model gathered from the stages, and
a stage's state under the model's names (a pipeline snapshot resumed in another layout).

    names = StageNames.of(model, stages, stage)   # every rank, in setup, before wrapping
    names.local["blocks.0.attn.c_attn.weight"]    # -> "1.attn.c_attn.weight" (this stage's key)
    model_tensors(parts)                          # the saved stages' tensors by the model's names

The stages share the model's own parameter and buffer objects (`partition.py`), so a tensor's
identity says which of the model's names it carries; a tied weight has two, the first being
the one `named_parameters` gives. Pure (no process group): `.venv/bin/pytest -q
tests/test_portable_resume.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class StageNames:
    """The model's names and this rank's stage's keys, both ways."""

    order: list[str]  # the model's state_dict names, in order
    local: dict[str, str]  # model name -> this stage's state_dict key
    keys: dict[str, list[str]]  # this stage's state_dict key -> the model's names for it

    @classmethod
    def of(cls, model: nn.Module, stages: Sequence[nn.Module], stage: nn.Module) -> StageNames:
        """Raises ValueError when some of the model's state is held by no stage (a
        `to_sequential()` that copied layers instead of sharing them)."""
        names: dict[int, list[str]] = {}
        full = model.state_dict(keep_vars=True)
        for name, t in full.items():
            names.setdefault(id(t), []).append(name)
        covered = {name for s in stages for t in s.state_dict(keep_vars=True).values()
                   for name in names.get(id(t), [])}
        missing = [n for n in full if n not in covered]
        if missing:
            raise ValueError(
                f"the model's state {missing[:5]} is held by no pipeline stage: "
                f"{type(model).__name__}.to_sequential() must return layers that share the "
                "model's own parameters and buffers (not copies)")
        local: dict[str, str] = {}
        keys: dict[str, list[str]] = {}
        for key, t in stage.state_dict(keep_vars=True).items():
            keys[key] = names.get(id(t), [])
            for name in keys[key]:
                local.setdefault(name, key)
        return cls(list(full), local, keys)


def model_tensors(parts: Mapping[int, Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """The saved stages' tensors (rank -> a `state_dict` with "stage" and "names") under every
    name the model gives them."""
    out: dict[str, torch.Tensor] = {}
    for _, part in sorted(parts.items()):
        for key, t in part["stage"].items():
            for name in part["names"][key]:
                out[name] = t
    return out
