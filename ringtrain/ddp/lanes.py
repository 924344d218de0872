"""Communication lanes: extra gloo groups over the same ranks, so buckets travel side by side.

One gloo process group moves one collective at a time over one TCP connection per peer pair;
on a small CPU host a single stream leaves cores idle while the kernel copies the bytes. Buckets
spread round-robin over a few groups of the same ranks (each with its own connections and
threads) are reduced concurrently: on 2 cores, 16 all-reduces of 4 MiB over 3 lanes take less
time than one all-reduce of the same 64 MiB on one group (`benchmarks/ddp_vs_torch.py`,
`--lanes` to compare). NCCL runs one communicator per stream and gains nothing from this.

Lanes are made once per process group and cached (weakly: they go with it). Making a group is
collective: with `dist.new_group` every rank of the world makes the same groups in the same order,
which holds because a DDP is built on every rank of its group, and the world group's ranks are
every rank. Lanes are made only for the world group; a subgroup gets one lane (itself), as a
local-synchronisation group would depend on every member having made the same groups before.
"""

from __future__ import annotations

import os
import weakref

import torch.distributed as dist

from ringtrain.torch_internals import group_timeout

# Lanes per group on gloo (the group itself included). 3 measured best on 2 cores for the
# benchmark's 17 buckets (sync 0.94 of a raw all-reduce, against 0.75 with one lane).
DEFAULT_GLOO_LANES = 3

_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def default_lane_count(process_group: dist.ProcessGroup) -> int:
    """How many lanes to use on `process_group` when the user does not say."""
    if process_group.size() == 1 or dist.get_backend(process_group) != "gloo":
        return 1
    if process_group != dist.group.WORLD:
        return 1  # see the module docstring
    return DEFAULT_GLOO_LANES


def comm_lanes(process_group: dist.ProcessGroup,
               count: int | None = None) -> list[dist.ProcessGroup]:

    """`process_group` followed by `count - 1` groups over the same ranks (made once, cached).

    Collective on the first call for a given group and count: call it on every rank.
    """
    if count is None:
        count = default_lane_count(process_group)
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"comm_lanes={count!r}: the number of communication lanes must be an "
                         "integer >= 1 (1: every bucket on the process group itself)")
    if count == 1 or process_group.size() == 1:
        return [process_group]
    if process_group != dist.group.WORLD:
        raise ValueError(
            f"comm_lanes={count} needs the world group: lanes on a subgroup of ranks "
            f"{dist.get_process_group_ranks(process_group)} are not supported; pass comm_lanes=1")
    extra = _cache.setdefault(process_group, [])  # never the key itself: it would never die
    timeout = group_timeout(process_group)  # a lane fails as soon as its group would
    while len(extra) < count - 1:
        try:
            extra.append(dist.new_group(dist.get_process_group_ranks(process_group),
                                        timeout=timeout,
                                        backend=dist.get_backend(process_group)))
        except RuntimeError as e:
            raise RuntimeError(_lane_failure(e)) from e
    return [process_group, *extra[:count - 1]]


def existing_lanes(process_group: dist.ProcessGroup, count: int) -> list[dist.ProcessGroup]:
    """Up to `count` lanes of `process_group` that this process has already made; never
    collective (for a DDP rebuilt on one rank, by unpickling or copy.deepcopy)."""
    made = _cache.get(process_group, []) if process_group.size() > 1 else []
    return [process_group, *made[:max(count - 1, 0)]]


def _lane_failure(e: RuntimeError) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    why = ("under torchrun's agent a restarted group shares the store of the attempt before and "
           "can read its dead ranks' addresses (pytorch/pytorch#135712): start the group with "
           "ringtrain.init_distributed(), which keeps each restart's keys apart, or export "
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun"
           if restart != "0"
           else "a peer may have died, or the ranks made groups in different orders")
    return (f"could not connect the communication lanes (extra gloo groups of the DDP) on restart "
            f"{restart}: {first}; {why}; comm_lanes=1 makes no extra group")
