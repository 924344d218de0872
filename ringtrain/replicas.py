"""Are the replicas still equal? One small collective that names the first tensor that differs.

    import ringtrain
    ringtrain.check_replicas(model)     # on every rank, now and then; raises naming the tensor

Replicas drift apart silently: gradient accumulation done by hand, a weight changed on one rank
only, a non-deterministic kernel. The loss goes on looking fine while each rank trains a
different model. Each rank here reduces every tensor to a 64-bit checksum of its bits (the
elements' bit patterns summed as integers, so a change of one element by one ulp changes it; a
permutation of elements would not). The checksums are all-gathered, 8 bytes per tensor. The
first tensor, in the module's own order, whose checksums disagree is named with the ranks
holding each version. It costs one read of the parameters and two small all-gathers.

`ringtrain train` runs the same comparison at the end of a run when the replicas' param_sha256
differ, so its warning names the tensor too (`divergence`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ringtrain import collectives  # checked first under RINGTRAIN_DEBUG=collectives

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicasDivergedError(RuntimeError):
    """The ranks' copies of the model are not bit-identical; the message names where."""


def tensor_checksums(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """One int64 per tensor: the sum of its elements' bit patterns (wrapping), on its device."""
    sums = []
    for t in tensors:
        t = t.detach().contiguous().reshape(-1)
        bits = t.view(_INT_OF_SIZE[t.element_size()]) if t.is_floating_point() else t
        sums.append(bits.sum(dtype=torch.int64))
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


def first_divergence(names: Sequence[str], by_rank: Mapping[int, Sequence[int]]) -> str | None:
    """None when every rank has the same checksums, else which tensor differs first and where."""
    ranks = sorted(by_rank)
    differing = [i for i in range(len(names)) if len({by_rank[r][i] for r in ranks}) > 1]
    if not differing:
        return None
    first = differing[0]
    groups: dict[int, list[int]] = {}
    for r in ranks:
        groups.setdefault(by_rank[r][first], []).append(r)
    versions = " | ".join(", ".join(map(str, g)) for g in groups.values())
    return (f"{len(differing)} of {len(names)} tensors differ across ranks; the first is "
            f"{names[first]!r}, one version per group of ranks: {versions}")


def _named(model: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(model, nn.Module):
        model = getattr(model, "module", model)  # a DDP wrapper: the module it wraps
        return dict(model.state_dict())  # parameters and buffers, shared ones once
    if not isinstance(model, Mapping):
        raise TypeError(f"check_replicas compares a module, a DDP wrapper or a state dict, not "
                        f"{type(model).__name__}: pass the model (or its state_dict())")
    other = {k: type(v).__name__ for k, v in model.items() if not isinstance(v, torch.Tensor)}
    if other:
        raise TypeError(f"check_replicas compares tensors, and the state dict holds other values "
                        f"({other}): pass the model, or a dict of its tensors only")
    return dict(model)


def check_replicas(model: nn.Module | Mapping[str, torch.Tensor],
                   process_group: dist.ProcessGroup | None = None, *,
                   raise_error: bool = True) -> str | None:
    """Compare `model` (a module, a DDP wrapper or a state dict) across the group's ranks.

    For replicated models (DDP; local SGD right after a meeting). A ZeRO rank holds a shard,
    not a replica: compare `ZeroDataParallel.full_state_dict()` instead. Call it on every rank
    at the same point. Returns None when all ranks hold the same bits;
    otherwise raises `ReplicasDivergedError` (or returns its message, `raise_error=False`).
    """
    if process_group is None and not dist.is_initialized():
        raise ValueError("check_replicas compares the ranks of a process group, and none is "
                         "initialised: call ringtrain.init_distributed() first (or pass "
                         "process_group=)")
    named = _named(model)  # before the world-size shortcut: a wrong argument fails on 1 rank too
    group = process_group or dist.group.WORLD
    world = dist.get_world_size(group)
    if world == 1:
        return None
    device = collectives.tensor_device(group)
    sums = tensor_checksums(named.values()).to(device)
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    collectives.all_gather(counts, torch.tensor([len(sums)], device=device), group=group)
    if len({int(c) for c in counts}) > 1:
        message = (f"the ranks hold different numbers of tensors ({[int(c) for c in counts]}, by "
                   "rank): not replicas of one model; build the same model on every rank")
    else:
        parts = [torch.empty_like(sums) for _ in range(world)]
        collectives.all_gather(parts, sums, group=group)
        message = first_divergence(list(named), {r: p.tolist() for r, p in enumerate(parts)})
    if message and raise_error:
        raise ReplicasDivergedError(f"replicas diverged: {message}. Look for a change to the "
                                    "weights on some ranks only, or gradients not averaged")
    return message


def divergence(state: Mapping[str, torch.Tensor],
               gather: Callable[[str], dict[int, str]]) -> str | None:
    """`first_divergence` of `state` through a text all-gather (the trainer's agreement)."""
    mine = ",".join(str(int(s)) for s in tensor_checksums(state.values()).tolist())
    by_rank = {r: [int(x) for x in text.split(",") if x] for r, text in gather(mine).items()}
    return first_divergence(list(state), by_rank)
