"""Uneven inputs: `DistributedDataParallel.join()` with torch's `Join` context manager.

When ranks have different numbers of batches (a `DistributedSampler(exact=True)` shard, a
dataset split by hand), the rank that runs out first would leave the others waiting in their
next gradient all-reduce. Under `torch.distributed.algorithms.Join` (or `ddp.join()`, which
makes one) a rank that ran out "joins": until every rank has, it keeps issuing the collectives
of a training iteration with nothing to contribute, and at the end the last rank to join
broadcasts its model. This is the design of torch's `_DDPJoinHook`; step 3 carries one more
flag than torch's, so that a forward without grad (an evaluation inside the Join) or a no_sync
one is shadowed exactly (torch's joined rank rebuilds and shadows a backward regardless).

    with ddp.join():                       # or: with Join([ddp, zero_optimizer]):
        for x, y in loader:                # ranks may have different numbers of batches
            loss_fn(ddp(x), y).backward()
            opt.step(); opt.zero_grad()

One iteration of a rank that still trains, and what a joined rank's `main_hook` issues to match
it, in order on the DDP's process group:
  1. Join's "not joined yet" all-reduce of ones  <->  Join's count of those ranks (torch's code)
  2. buffers, if synced before this forward: all-reduce MAX of the ranks that may be the source
     (the training ones), then a broadcast from it  <->  the same, as no candidate
  3. "grad enabled? does this backward sync?" all-reduce  <->  the same with zeros; the sums
     tell the joined rank whether steps 4 and 5 come
  4. if grad is enabled, the one-time bucket rebuild (a broadcast, once the first synced backward
     gave the order)  <->  the same, when due (the joined rank counts its shadow rounds as rounds)
  5. the backward's buckets and status  <->  zeros (`Reducer.shadow_backward`, `uneven.py`)
After all ranks joined, `post_hook` broadcasts the parameters (and buffers) of the highest rank
among the last to join, so every rank ends with the same model.

`throw_on_early_termination=True` (Join's own all-reduces) makes every rank raise as soon as one
runs out, for training loops with collectives of their own that a joined rank cannot shadow
(SyncBatchNorm, a metric's all-reduce). Not with `delay_all_reduce_named_params` or
`skip_all_reduce_unused_params`: where in backward the delayed all-reduce goes, and which
buckets are skipped, depend on the training ranks' data, which a joined rank does not see (torch
shadows neither and hangs); `join()` refuses them.
Tests: `.venv/bin/pytest -q tests/test_ddp_join.py`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ringtrain import collectives  # checked first under RINGTRAIN_DEBUG=collectives
from ringtrain.ddp import ignored
from ringtrain.ddp.ctor_args import DDPArgumentError
from ringtrain.ddp.init_sync import broadcast_coalesced


class DDPJoinHook(JoinHook):
    """What a joined rank does for `DistributedDataParallel` (torch's `_DDPJoinHook`)."""

    def __init__(self, ddp: JoinableDDP, divide_by_initial_world_size: bool):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size
        ddp._uneven_input_join = True  # torch's logging reports it ("join_uneven_inputs")

    def main_hook(self) -> None:
        """Match one iteration of the ranks still training (steps 2-5 of the module docstring)."""
        ddp = self.ddp
        if ddp._check_sync_bufs_pre_fwd():  # torch's _check_and_sync_module_buffers
            ddp._sync_buffers(common_rank(ddp, candidate=False))
        grad, should_sync = _announce(ddp, grad=False, syncs=False, joined=True)
        if grad:  # the training ranks' one-time bucket rebuild (a broadcast), if it is due
            ddp.reducer._rebuild_buckets()
        # As on the training ranks, whose forward sets it: the buffers of the next iteration
        # are synced only after a synced one.
        ddp.require_forward_param_sync = should_sync
        if should_sync:
            ddp.reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the model of the highest-numbered rank among the last to join."""
        ddp = self.ddp
        ddp._authoritative_rank = common_rank(ddp, candidate=is_last_joiner)
        # What construction syncs (ignored parameters and buffers stay as they are), as torch.
        states = [p.detach() for _, p in
                  ignored.synced_parameters(ddp.module, ddp.parameters_to_ignore)]
        if ddp.forward_sync_buffers:
            states += ignored.synced_buffers(ddp.module, ddp.parameters_to_ignore)
        with torch.no_grad():
            broadcast_coalesced(states, ddp._authoritative_rank, ddp.process_group,
                                ddp.broadcast_bucket_size)


def common_rank(ddp: JoinableDDP, candidate: bool) -> int:
    """The highest rank (in the DDP's group) of those that call this with `candidate` True."""
    rank = torch.tensor([ddp.process_group.rank() if candidate else -1], device=ddp.device)
    collectives.all_reduce(rank, op=dist.ReduceOp.MAX, group=ddp.process_group)
    found = int(rank.item())
    if found < 0:
        raise RuntimeError("ringtrain bug: no rank was a candidate source in the join protocol "
                           "(every rank had joined, yet a main hook ran); please report it")
    return found


def _announce(ddp: JoinableDDP, grad: bool, syncs: bool, joined: bool) -> tuple[bool, bool]:
    """Step 3: tell the joined ranks whether this forward has grad enabled (the bucket rebuild
    may follow) and whether its backward is synced; (grad, syncs) of any training rank."""
    flags = torch.tensor([float(grad), float(syncs)], device=ddp.device)
    work = collectives.all_reduce(flags, group=ddp.process_group, async_op=True)
    if not joined:
        # A training rank does not wait (the result is for the joined ones); the work and its
        # tensor stay referenced until the next forward, never released by gloo's thread alone.
        ddp._join_kept = (*ddp._join_kept[:1], work, flags)
        return grad, syncs
    work.wait()
    return bool(flags[0].item() != 0), bool(flags[1].item() != 0)


class JoinableDDP(Joinable):
    """The `Joinable` half of `DistributedDataParallel` (a base class of it).

    `join()` and `join_hook()` are torch's, with the same arguments; the `_join_*` methods are
    the forward's three steps under a Join context (no collective outside one).
    """

    # Set by DistributedDataParallel.__init__.
    module: nn.Module
    process_group: dist.ProcessGroup
    device: torch.device
    reducer: Any
    forward_sync_buffers: bool
    parameters_to_ignore: set[str]
    broadcast_bucket_size: int
    skip_all_reduce_unused_params: bool
    _delayed_names: list[str]
    require_forward_param_sync: bool
    _sync_buffers: Any
    will_sync_module_buffers: Any
    _check_sync_bufs_pre_fwd: Any

    _divide_by_initial_world_size = True
    _uneven_input_join = False  # a Join was built with this DDP (torch logs it)
    _authoritative_rank: int | None = None  # set when a Join ends (torch's attribute)
    _join_kept: tuple = ()  # this forward's async join works and tensors (see _announce)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for training with uneven inputs across ranks (torch's `DDP.join`).

        Args:
            divide_by_initial_world_size: average gradients over the world size even once ranks
                have joined (every sample weighs the same), or, with False, over the ranks
                still training.
            enable: False turns the context manager off (inputs known to be even).
            throw_on_early_termination: raise on every rank as soon as one runs out of inputs,
                instead of shadowing (ignores divide_by_initial_world_size).
        """
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook a `Join` context runs on a joined rank; kwargs: divide_by_initial_world_size."""
        refused = [name for name, on in (
            ("delay_all_reduce_named_params", bool(self._delayed_names)),
            ("skip_all_reduce_unused_params", self.skip_all_reduce_unused_params)) if on]
        if refused:  # here, on every rank before any collective (Join calls it when built)
            raise DDPArgumentError(
                f"join() / Join cannot shadow a DistributedDataParallel built with {refused[0]}: "
                "a rank that ran out of inputs cannot know "
                + ("where in backward the delayed all-reduce goes" if refused[0].startswith("delay")
                   else "which buckets the training ranks skip")
                + " (torch's DDP shadows neither and hangs); build it without that argument, or "
                "give every rank the same number of batches")
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    def _join_notify(self, syncs: bool) -> None:
        """Step 1: tell a Join context this rank has inputs; set this round's divisor."""
        work = Join.notify_join_context(self)  # raises under throw_on_early_termination
        self._join_kept = () if work is None else (work,)
        if self._join_config.enable:
            # Joined ranks report every parameter unused: the counts a static graph compares
            # no longer say what the training ranks used (static_graph.py).
            self.reducer.static_graph = None
        if syncs:
            self.reducer.divide_by(
                work if work is not None and not self._divide_by_initial_world_size else None)

    def _buffer_source(self) -> int:
        """Step 2's source: rank 0, or under a Join the highest rank still training."""
        return common_rank(self, candidate=True) if self._join_config.enable else 0

    def _join_announce(self, grad: bool, syncs: bool) -> None:
        """Step 3, on a rank that still trains."""
        if self._join_config.enable:
            _announce(self, grad, syncs, joined=False)
