"""Collectives that name a mismatch instead of hanging: `RINGTRAIN_DEBUG=collectives`.

    RINGTRAIN_DEBUG=collectives ringtrain run --nproc-per-node 2 train.py
    from ringtrain import collectives
    collectives.all_reduce(t)               # torch.distributed.all_reduce, checked first

When two ranks call different collectives (rank 0 all_reduce of a (4,) tensor, rank 1 of (5,);
rank 0 all_reduce, rank 1 broadcast; rank 1 skipping a call), gloo hangs, or fails with a size
error naming neither call. In debug mode every collective that goes through here (ringtrain's
own: the DDP reducer and its unused-parameter status, the DDP constructor's checks, the
trainer's agreement, ZeRO's, the pipeline's, local SGD's, the parameter server's barriers and
broadcasts; and the user's calls to this module's functions) first publishes a
fingerprint (operation, shapes, dtypes, reduce op, call site) in the store under the group's
call number, waits (bounded) for every rank of the group, and compares. A difference raises
`CollectiveMismatchError` on every rank, naming both ranks' calls; a rank that does not arrive
within the timeout is named with the last call it made. Off (the default) it costs one
environment lookup per call. Tests: `.venv/bin/pytest -q tests/test_debug_collectives.py`.

The call site is reported but not compared: one collective can legitimately be reached from
two lines (rank 0's branch and the others'); op, shapes and dtypes must agree.
Not checked: pipeline sends and receives (pairs, not groups), the parameter servers' own
all-reduce (on their threads), collectives inside a user's DDP comm hook.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CollectiveMismatchError", "all_gather", "all_gather_object", "all_reduce", "barrier",
           "broadcast", "check", "enabled", "tensor_device"]

ENV, TIMEOUT_ENV = "RINGTRAIN_DEBUG", "RINGTRAIN_DEBUG_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
_HERE = os.path.abspath(__file__)
_PACKAGE = os.path.dirname(_HERE)


class CollectiveMismatchError(RuntimeError):
    """Ranks called different collectives (or one did not call at all); names each call."""


def enabled() -> bool:
    """True when RINGTRAIN_DEBUG lists `collectives` (comma-separated)."""
    return "collectives" in os.environ.get(ENV, "").replace(" ", "").split(",")


def _site() -> str:
    """`file:line (function)` of the caller, and of the user's code when that is elsewhere."""
    f = sys._getframe(1)
    while f is not None and os.path.abspath(f.f_code.co_filename) == _HERE:
        f = f.f_back
    if f is None:
        return "?"
    site = f"{os.path.relpath(f.f_code.co_filename)}:{f.f_lineno} ({f.f_code.co_name})"
    user = f
    while user is not None and os.path.abspath(user.f_code.co_filename).startswith(_PACKAGE):
        user = user.f_back
    if user is not None and user is not f:
        site += f", called from {os.path.relpath(user.f_code.co_filename)}:{user.f_lineno}"
    return site


def _describe(fp: dict[str, Any]) -> str:
    shapes = ", ".join(f"{tuple(s)} {d}" for s, d in zip(fp["shapes"], fp["dtypes"], strict=True))
    extra = "".join(f" {k}={v}" for k, v in sorted(fp.get("extra", {}).items()))
    return f"{fp['op']}({shapes}){extra} at {fp['site']}"


class _Checker:
    """Per-process call numbers, one sequence per (store, group): the handshake's key names.

    Process state on purpose: the call number of a group is what every rank must agree on, and
    it lives as long as the group does (a new store, a new process group, starts afresh)."""

    def __init__(self):
        self.calls: dict[tuple[int, str], int] = {}

    def check(self, op: str, tensors: Sequence[torch.Tensor], group, timeout_s: float | None,
              extra: dict[str, Any], site: str) -> None:
        from ringtrain.runtime import get_runtime

        world = group if group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(world)
        if len(ranks) < 2:
            return
        store, me = get_runtime().store, dist.get_rank()
        key = (id(store), world.group_name)
        n = self.calls.get(key, 0) + 1
        self.calls[key] = n
        fp = {"op": op, "shapes": [list(t.shape) for t in tensors],
              "dtypes": [str(t.dtype).replace("torch.", "") for t in tensors],
              "extra": {k: str(v) for k, v in extra.items()}, "site": site, "call": n}
        prefix = f"ringtrain/debug/collectives/{world.group_name}"
        store.set(f"{prefix}/{n}/{me}", json.dumps(fp))
        if n > 2:  # every peer has read it: each one passed call n - 1 (it needed ours)
            try:
                store.delete_key(f"{prefix}/{n - 2}/{me}")
            except Exception:  # noqa: BLE001 - a store without delete keeps its keys
                pass
        timeout = (float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)) if timeout_s is None
                   else timeout_s)
        deadline, pause = time.monotonic() + timeout, 0.001
        pending = [r for r in ranks if r != me]
        while pending:
            pending = [r for r in pending if not store.check([f"{prefix}/{n}/{r}"])]
            if pending and time.monotonic() > deadline:
                raise CollectiveMismatchError(self._missing(store, prefix, n, pending, me, fp,
                                                            timeout))
            if pending:
                time.sleep(pause)
                pause = min(0.02, pause * 2)
        theirs = {r: json.loads(store.get(f"{prefix}/{n}/{r}")) for r in ranks if r != me}
        for r, other in sorted(theirs.items()):
            if [other[k] for k in ("op", "shapes", "dtypes", "extra")] != \
                    [fp[k] for k in ("op", "shapes", "dtypes", "extra")]:
                a, b = (me, fp), (r, other)
                lo, hi = sorted([a, b], key=lambda x: x[0])
                raise CollectiveMismatchError(
                    f"collective #{n} on group {world.group_name} (ranks {ranks}) differs between "
                    f"ranks: rank {lo[0]} calls {_describe(lo[1])}; rank {hi[0]} calls "
                    f"{_describe(hi[1])}. Every rank must make the same collective calls in the "
                    "same order with the same shapes and dtypes (RINGTRAIN_DEBUG=collectives)")

    @staticmethod
    def _missing(store, prefix: str, n: int, pending: list[int], me: int, fp: dict[str, Any],
                 timeout: float) -> str:
        last = []
        for r in pending:
            k = f"{prefix}/{n - 1}/{r}"
            if n > 1 and store.check([k]):
                last.append(f"rank {r}'s last collective was #{n - 1}: "
                            f"{_describe(json.loads(store.get(k)))}")
            else:
                last.append(f"rank {r} made no earlier collective on this group")
        return (f"collective #{n}: rank {me} calls {_describe(fp)}, but rank"
                f"{'s' if len(pending) > 1 else ''} {', '.join(map(str, pending))} did not reach "
                f"it within {timeout:g} s; {'; '.join(last)}. A rank skipped a collective (a "
                f"branch taken on one rank only?) or is stuck before it ({TIMEOUT_ENV} sets the "
                "wait)")


_CHECKER = _Checker()


def check(op: str, tensors: Sequence[torch.Tensor] = (), group=None, *,
          timeout_s: float | None = None, **extra: Any) -> None:
    """In debug mode: agree with every rank of `group` on this call before it is made.

    Args:
        op: the collective's name ("all_reduce").
        tensors: the tensors it sends (their shapes and dtypes are compared).
        group: the process group (None: the world).
        timeout_s: how long to wait for the other ranks (default: RINGTRAIN_DEBUG_TIMEOUT or 60).
        extra: other things that must agree (the reduce op, the source rank), by name.
    """
    if enabled():
        _CHECKER.check(op, list(tensors), group, timeout_s, extra, _site())


# ---- torch.distributed's calls, checked first (same arguments) ----------------------------------

def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    check("all_reduce", [tensor], group, reduce_op=op)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    check("broadcast", [tensor], group, src=src)
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None,
               async_op: bool = False):
    check("all_gather", [tensor], group, outputs=len(tensor_list))
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list: list[Any], obj: Any, group=None) -> None:
    check("all_gather_object", [], group, outputs=len(object_list))
    dist.all_gather_object(object_list, obj, group=group)


def barrier(group=None, async_op: bool = False):
    check("barrier", [], group)
    return dist.barrier(group=group, async_op=async_op)


def tensor_device(group=None) -> torch.device:
    """Where a small tensor for one of `group`'s collectives lives (a flag, checksums): the
    current CUDA device under NCCL, which moves only CUDA tensors; else the CPU (no torch.cuda
    call is made then)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
