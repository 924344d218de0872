"""The layout-free form of a strategy's state: what lets any strategy resume any other's snapshot.

    portable = DDPStrategy.to_portable(read_parts, shared, metadata)   # from a snapshot's files
    strategy.load_portable_state_dict(portable)                        # into any layout

One form, so that N strategies need N converters (each strategy's own `to_portable` and
`load_portable_state_dict`), not one per pair:

    {"format": 1,
     "model": {name: tensor},             # the full model's state_dict entries by name
     "optimizer": {"state": {param_name: {"exp_avg": .., "exp_avg_sq": .., "step": ..}}},
     "step": 37}                          # the loop's step at the snapshot (the resume adds it)

Parameters are named as `model.named_parameters()` names them (a tied weight once, under its
first name); each one's optimizer state is whole (unsharded, in the parameter's shape), so the
AdamW moments and step carry over exactly. The sampler's position, the step and the metrics
window are the loop's state (`shared.pt`'s "trainer"), already free of the layout; the RNG is
seeded afresh from (seed, rank, step), as on any resume onto another layout. The form keeps
no parameter groups: the optimizer's options are this run's own (`--lr`'s schedule sets the LR
every step and `--weight-decay` must match the snapshot's; a changed `--beta1`/`--beta2` applies
from the resume on, where a resume in the same layout keeps the saved ones).

`ringtrain.checkpoint.resume.Checkpointer` goes through it when the snapshot's strategy or
`Strategy.state_layout()` differs from this run's, or the strategy cannot reshard its own
state to this world size (a pipeline).

Pure functions on dicts and modules (no process group): `.venv/bin/pytest -q
tests/test_portable_resume.py -k unit`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

FORMAT = 1

__all__ = ["FORMAT", "check", "is_moment", "load_model", "load_optimizer", "make", "mean",
           "merge", "param_names", "optimizer_by_name", "optimizer_param_names", "step_of"]


def make(model: Mapping[str, torch.Tensor], optimizer: Mapping[str, Any]) -> dict[str, Any]:
    """The portable form of a model state (name -> tensor) and an optimizer state by name."""
    return {"format": FORMAT, "model": dict(model), "optimizer": dict(optimizer)}


def check(state: Mapping[str, Any]) -> None:
    if state.get("format") != FORMAT:
        raise ValueError(f"portable state of format {state.get('format')!r}; this ringtrain "
                         f"reads format {FORMAT}: resume it with the ringtrain that wrote it")


def param_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in `module` (a parameter shared by two modules: its first name,
    as `named_parameters` gives it)."""
    return {id(p): name for name, p in module.named_parameters()}


def optimizer_param_names(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> list[str]:
    """The name of each parameter of `optimizer`, in its own order (group after group: the
    numbering of its `state_dict()`); `names` maps id(parameter) to a name."""
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def optimizer_by_name(state: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The per-parameter state of a torch optimizer's `state_dict()`, by name: `names` are its
    parameters' names in its own order (`optimizer_param_names`, saved with it)."""
    numbered = [i for g in state["param_groups"] for i in g["params"]]
    if len(numbered) != len(names):
        raise ValueError(f"the optimizer state numbers {len(numbered)} parameters but "
                         f"{len(names)} names came with it: saved by another model")
    name_of = dict(zip(numbered, names, strict=True))
    return {"state": {name_of[i]: dict(s) for i, s in state["state"].items()}}


def merge(parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One optimizer state by name from several (the stages of a pipeline). A tied weight held
    by two stages is stepped alike on both (its gradient is summed between them): either
    copy is it."""
    state: dict[str, Any] = {}
    for part in parts:
        for name, s in part["state"].items():
            state.setdefault(name, s)
    return {"state": state}


def is_moment(key: str, value: Any) -> bool:
    """An optimizer state entry shaped like its parameter (AdamW's moments), not a count
    (its `step`): what is averaged over replicas, or cut into rows with the parameter."""
    return (key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point()
            and value.dim() > 0)


def mean(parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One optimizer state by name from the replicas' own (local SGD's ranks), taken one at a
    time (a generator reads one rank's file after another: one replica's state in memory besides
    the sum): each moment (`is_moment`) averaged over the parts (summed in order, then divided;
    one part is itself, bit for bit), the rest (AdamW's `step`, the same on every replica) the
    first part's."""
    parts = iter(parts)
    state = {name: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for name, s in next(parts)["state"].items()}
    count = 1
    for part in parts:
        count += 1
        for name, s in state.items():
            for key, total in s.items():
                if is_moment(key, total):
                    total += part["state"][name][key]
    for s in state.values():
        for key, total in s.items():
            if count > 1 and is_moment(key, total):
                total /= count
    return {"state": state}


def step_of(state: Mapping[str, Any]) -> int:
    """The loop's step at the snapshot, for a strategy whose own state counts steps."""
    if "step" not in state:
        raise ValueError("the portable state has no step: the resume adds the snapshot's "
                         "(`Checkpointer`); a caller of load_portable_state_dict sets it too")
    return int(state["step"])


def load_model(module: nn.Module, model: Mapping[str, torch.Tensor], *,
               names: Mapping[str, Sequence[str]] | None = None) -> None:
    """Copy the portable model's tensors into `module` (all of its parameters, its buffers where
    saved). `names`: the module's state_dict key -> the model's names for it, where they differ
    (a pipeline stage's keys; a tied weight has two); default the key itself. Raises ValueError
    naming what differs."""
    own = module.state_dict(keep_vars=True)
    params = {id(p) for p in module.parameters()}
    loaded: set[int] = set()
    with torch.no_grad():
        for key, t in own.items():
            candidates = list(names[key]) if names is not None else [key]
            saved = next((model[n] for n in candidates if n in model), None)
            if saved is None:
                if id(t) in params and id(t) not in loaded:
                    raise ValueError(f"the snapshot has no parameter {candidates[0]!r}: it was "
                                     "saved from another model; resume with the model options "
                                     "it was saved with")
                continue  # a tied weight's second name, or a buffer ZeRO does not keep
            if tuple(saved.shape) != tuple(t.shape):
                raise ValueError(f"parameter {candidates[0]!r} is {tuple(saved.shape)} in the "
                                 f"snapshot, {tuple(t.shape)} here: saved from another model")
            t.copy_(saved)
            loaded.add(id(t))


def load_optimizer(optimizer: torch.optim.Optimizer, names: Sequence[str],
                   portable: Mapping[str, Any]) -> None:
    """Load the state by name into `optimizer`, whose parameters are named `names` in its own
    order (`optimizer_param_names`). Its options stay its own (see the module docstring).
    A parameter without saved state (the snapshot was taken before the first step) gets none."""
    own = optimizer.state_dict()
    numbered = [i for g in own["param_groups"] for i in g["params"]]
    if len(numbered) != len(names):
        raise ValueError(f"{len(names)} names for an optimizer of {len(numbered)} parameters")
    saved = portable["state"]
    unknown = sorted(set(names) - set(saved)) if saved else []
    if unknown:
        raise ValueError(f"the snapshot has no optimizer state for {unknown[:5]}: it was saved "
                         "from another model; resume with the model options it was saved with")
    state = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v
                 for k, v in saved[name].items()}
             for i, name in zip(numbered, names, strict=True) if name in saved}
    optimizer.load_state_dict({"state": state, "param_groups": own["param_groups"]})
