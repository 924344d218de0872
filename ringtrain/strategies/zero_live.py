"""ZeRO's step in live recovery (`ringtrain train --strategy zero --zero-stage 2 --live`).

    hooks = strategy.live_hooks()       # a ZeroLiveHooks
    hooks.on_members(runtime)           # a new generation: the shards are rebuilt in its 1st step
    result = hooks.train_step(micro, lr=lr, grad_clip=1.0, weight=len(ids) / global_batch)

The rule. Each member holds only its shard of the optimizer state (AdamW's moments), and at
stage 3 only its shard of the parameters too: a lost member would take its shard with it. So
after every step each member also sends its shard to its *buddy*
(`ringtrain.zero.live.buddy_offset`: the next rank, or one a host away), and a commit holds the
member's own shard and its copy of one peer's (`buddy_part`). At stages 1 and 2 that is the
moments only (every member holds the whole model, replicated, committed and healed as ddp's
is; the step count is one scalar): 2/N of the model's bytes at fp32 AdamW sent and received
per member per step, as much held. At stage 3 it is the fp32 parameter shard too (3/N), and
the model the live loop commits and heals is its buffers alone (`BuffersOnly`,
`zero_live_stage3.py`): the parameters have no storage between uses, and their only copies are
the shards. A new
generation (members lost, or let in) rebuilds the sharded state in its first step, inside the
recovery's retry: every member says which parts of the last commit it holds (`rebuild_plan`),
each member receives from one holder the parts the new layout's rank needs of it
(`reshard.sources`: the index math of resuming a snapshot on another number of ranks) and
loads them, parameters and moments together, into a ZeRO wrapper built over the new group
(`ZeroDataParallel.load_shard_state_dicts`). A replacement gets its shard by that re-shard
(and, at stages 1 and 2, the model by the heal). A member and its buddy lost in one recovery
take a shard and its only copy: `ZeroShardsLostError`, and the job restarts from its last
snapshot (never a silent wrong state).

Two details make it exact. The step's gradients are reduce-scattered inside backward, scaled by
1/N, so each member's loss is scaled by `weight` x N first: the sum over the generation is the
global batch's mean gradient whatever the shares (`live_step.py` says why a sum). And a step
ends with an 8-byte all-reduce (the commit vote) after the buddy copy: a member that finishes
it knows every member reached it, so when a fault splits the members (some committed the step,
some failed in its last collective), those behind still hold the step's shards (`pending`,
kept over the restore as `stash`) and the re-shard finds them.

Snapshots: the members' rank 0 writes them alone; in a step after which the trainer saves
(`LiveHooks.will_save`), every member sends it its shard and it keeps the whole state as one
part of one rank, the form any number of ranks resumes (`ringtrain.zero.reshard`). A stop
signal between two such steps is agreed by every member in the loop's stop vote
(`StopVoteAgreement`): when it says stop, the shards go to rank 0 there, so the stop's
snapshot is of the step it stops at, as without --live (`zero_live_snapshot.py`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ringtrain.agreement.base import Agreement
from ringtrain.strategies.base import LiveHooks, StepResult
from ringtrain.strategies.step import accumulate, lr_into, optimizer_step
from ringtrain.strategies.zero_live_snapshot import StopVoteAgreement, one_rank_part
from ringtrain.strategies.zero_live_stage3 import BuffersOnly, give_storage
from ringtrain.tensor_tree import send_recv_state
from ringtrain.zero.live import (
    ZeroShardsLostError,
    buddy_offset,
    buddy_part,
    rebuild_plan,
    with_params,
)

if TYPE_CHECKING:
    from ringtrain.runtime import Runtime

__all__ = ["ZeroLiveHooks", "ZeroShardsLostError"]


@dataclass(frozen=True)
class Held:
    """Parts of one commit a member holds: after `steps` steps, of a layout of `size` ranks,
    saved rank -> its part as `buddy_part` keeps it. `initial`: the layout a process starts
    from before any generation (its own, not the job's: dropped by a heal)."""

    steps: int
    size: int
    parts: dict[int, dict[str, Any]]
    initial: bool = False


class ZeroLiveHooks(LiveHooks):
    """The live step of ZeRO (`strategy.module`, `model` (the wrapper), `optimizer`, `loss_fn`,
    `runtime`, `tracer`, `rebuild`, `zero_stage`, as `ZeroStrategy` has them after setup).
    See the module docstring for the rule.

    Args:
        strategy: a set-up `ZeroStrategy` (built on a one-rank runtime).
        local_world_size: members per host, for the choice of buddies (`buddy_offset`).
    """

    def __init__(self, strategy: Any, *, local_world_size: int = 1):
        self.strategy, self.local_world_size = strategy, local_world_size
        self.stage = int(strategy.zero_stage)
        # What the loop commits and heals of the model: all of it where it is replicated; at
        # stage 3 its buffers (the parameters are in the shards this class keeps).
        self.model = strategy.module if self.stage < 3 else BuffersOnly(strategy.module)
        self.optimizer = self  # committed and healed: `state_dict` is a marker, parts kept here
        self.token = uuid.uuid4().hex  # tells this process's own commits from a peer's
        self.steps = 0  # steps trained, as of the commit loaded or made last
        self.held: Held | None = None  # the commit's parts this member holds
        self.pending: Held | None = None  # the step just trained, until it is committed
        self.stash: Held | None = None  # a pending step kept over a restore (module docstring)
        self._rebuild = False  # new members: rebuild the shards in the next step
        self._save_next = False  # gather the whole state to rank 0 in the next step
        self.snapshot: tuple[int, dict[str, Any]] | None = None  # (steps, one rank's part)
        self.copy_bytes, self.copy_s = 0, 0.0  # the buddy copy's cost, summed over steps
        self.copied_steps = 0

    def on_members(self, runtime: Runtime) -> None:
        self.strategy.runtime = runtime  # its rank and size are its data and eval shard
        self._rebuild = True  # every member: the rebuild is a collective of all of them

    def will_save(self, step: int) -> None:
        self._save_next = True

    def agreement(self, current: Callable[[], Runtime]) -> Agreement:
        return StopVoteAgreement(current, self.gather_for_stop)

    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
                   lr: float, grad_clip: float | None, weight: float,
                   held: Any = None) -> StepResult:
        # `held` never comes: `contribution()` is None, a faulted step is redone whole.
        s = self.strategy
        if self._rebuild:  # inside the recovery's retry: a fault here redoes the step again
            self._rebuild_shards()
        rt, zero = s.runtime, s.model
        if not micro_batches:
            raise ValueError(f"member {rt.rank} of {rt.world_size} got no sample of this step: "
                             "every ZeRO member reduces its gradients in backward; use a global "
                             "batch of at least one sample per member")
        start = time.perf_counter()
        lr_into(s.optimizer, lr)
        # The wrapper averages (x 1/N) in backward: a loss scaled by weight x N makes the sum
        # over the generation the global batch's mean gradient (exactly 1 with equal shares).
        scale = weight * rt.world_size
        loss_fn = s.loss_fn if scale == 1.0 else (lambda out, y: s.loss_fn(out, y) * scale)
        acc = accumulate(micro_batches, zero, loss_fn, device=rt.device, tracer=s.tracer,
                         no_sync=zero.no_sync)
        optimizer_step(s.optimizer, s.tracer, grad_clip=grad_clip, clip=zero.clip_grad_norm_)
        t0 = time.perf_counter()
        with s.tracer.span("buddy copy"):
            self._copy_and_vote()
        comm_s = time.perf_counter() - t0
        loss_sum = acc.loss_sum if scale == 1.0 else acc.loss_sum / scale
        return StepResult(loss_sum=loss_sum, count=acc.count,
                          compute_s=time.perf_counter() - start - comm_s, comm_s=comm_s)

    def _copy_and_vote(self) -> None:
        """Send this member's shard to its buddy, keep the one it is sent (the step's pending
        commit); on a snapshot step, every shard to rank 0; then the commit vote."""
        rt, zero = self.strategy.runtime, self.strategy.model
        t0 = time.perf_counter()
        own = buddy_part(zero.shard_state_dict())  # waits for the parameters' all-gather
        parts = {rt.rank: own}
        offset = buddy_offset(rt.world_size, self.local_world_size)
        if offset:
            src = (rt.rank - offset) % rt.world_size
            parts[src] = send_recv_state(rt.process_group, own, dst=(rt.rank + offset) %
                                         rt.world_size, src=src)
            self.copy_bytes += _nbytes(own)
        self.copy_s += time.perf_counter() - t0
        self.copied_steps += 1
        if self._save_next:
            self._save_next = False
            self._gather_for_snapshot(own, self.steps + 1)
        self.pending = Held(self.steps + 1, rt.world_size, parts)  # before the vote: see above
        rt.process_group.allreduce([torch.ones(1)]).wait()
        self.steps += 1

    def _gather_for_snapshot(self, own: dict[str, Any], steps: int) -> None:
        """Every member's shard (`own`, after `steps` steps) to rank 0, which keeps the whole
        state as one rank's part."""
        rt = self.strategy.runtime
        if rt.rank != 0:
            send_recv_state(rt.process_group, own, dst=0, src=None)
            return
        parts = {0: own}
        for r in range(1, rt.world_size):
            parts[r] = send_recv_state(rt.process_group, None, dst=None, src=r)
        whole = [self._with_params(p) for _, p in sorted(parts.items())]
        self.snapshot = (steps, one_rank_part(whole))

    def gather_for_stop(self) -> None:
        """Every member, once the stop vote said stop: the shards of the step committed last to
        rank 0, for the stop's snapshot (`snapshot_state`); nothing where they are there
        already (a snapshot step) or a member holds everything (after `settle`)."""
        self.settle()
        if self.strategy.runtime.world_size == 1 or (self.snapshot is not None
                                                     and self.snapshot[0] == self.steps):
            return
        own = buddy_part(self.strategy.model.shard_state_dict())
        self._gather_for_snapshot(own, self.steps)

    def settle(self) -> None:
        """Every member, outside a step: a generation that has not re-sharded yet (healed to a
        step a peer had committed, or formed after the last step, `LiveDriver.settle`) does it
        now, so the wrapper is the members' (stage 3 gathers the final model through it)."""
        if self._rebuild:
            self._rebuild_shards()

    def _with_params(self, part: dict[str, Any]) -> dict[str, Any]:
        """A kept part as it loads: stages 1 and 2 cut its parameters from this member's model
        (replicated, at the same commit); stage 3's has them."""
        if self.stage == 3:
            return part
        return with_params(part, [u.full[:u.plan.numel] for u in self.strategy.model.units])

    def snapshot_state(self) -> dict[str, Any]:
        """The whole ZeRO state of the last step as one rank's part (`ZeroStrategy.state_dict`
        in live mode, on the members' rank 0). Raises RuntimeError when it was not gathered."""
        zero = self.strategy.model
        if zero.world_size == 1:  # one member (or none yet): its shard is all of it
            return zero.shard_state_dict()
        if self.snapshot is None or self.snapshot[0] != self.steps:
            raise RuntimeError(
                f"live ZeRO gathers its shards for a snapshot in the steps after which one is "
                f"due (--snapshot-every) and when the members vote to stop; step {self.steps} "
                "of this process is neither, or a member was lost in the gather: the last "
                "snapshot resumes the run")
        return self.snapshot[1]

    def figures(self) -> dict[str, float]:
        """The buddy copy's cost on this member, per step it trained (bytes sent, seconds of
        the shard's copy and its exchange), for the run's summary."""
        steps = max(self.copied_steps, 1)
        return {"zero_buddy_bytes_per_step": self.copy_bytes / steps,
                "zero_buddy_s_per_step": round(self.copy_s / steps, 6)}

    # -- the commit (LiveState's "optimizer") --------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A commit: the step just trained becomes the commit this member holds parts of."""
        if self.pending is not None and self.pending.steps == self.steps:
            self.held, self.pending, self.stash = self.pending, None, None
        elif self.held is None:  # the first commit: the state this process starts from
            part = buddy_part(self.strategy.model.shard_state_dict())
            self.held = Held(self.steps, int(part["world_size"]), {int(part["rank"]): part},
                             initial=True)
        return {"owner": self.token, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        steps = int(state["steps"])
        if state["owner"] == self.token:  # its own commit, restored after a failed step
            if self.pending is not None and self.pending.steps == steps + 1:
                self.stash = self.pending  # the step may have been committed by others
            self.pending = None
        else:  # a peer's (a heal): of its parts this member holds the step's own, if any
            held = self.held
            if self.stash is not None and self.stash.steps == steps:
                held = self.stash
            elif held is not None and (held.initial or held.steps != steps):
                held = None
            self.held, self.pending, self.stash = held, None, None
        self.steps = steps
        self._rebuild = True

    # -- a new generation -----------------------------------------------------------------------
    def _rebuild_shards(self) -> None:
        """Every member, first step of a generation: the last commit's parts re-sharded over
        the members, into a ZeRO wrapper built over their group (module docstring)."""
        s = self.strategy
        rt = s.runtime
        pg, held = rt.process_group, self.held
        mine = torch.tensor([self.steps, held.size if held is not None else 0])
        views = [torch.zeros(2, dtype=torch.int64) for _ in range(rt.world_size)]
        pg.allgather([views], [mine]).wait()
        steps = {int(v[0]) for v in views}
        sizes = {int(v[1]) for v in views if int(v[1]) > 0}
        if len(steps) != 1 or len(sizes) > 1:
            raise ZeroShardsLostError(
                f"the members hold parts of different commits (steps {sorted(steps)}, layouts "
                f"of {sorted(sizes)} ranks) after the heal: the job restarts from its last "
                "snapshot (run the same command again)")
        size = sizes.pop() if sizes else 1
        mask = torch.zeros(size, dtype=torch.int64)
        for r in (held.parts if held is not None and held.size == size else {}):
            mask[r] = 1
        masks = [torch.zeros(size, dtype=torch.int64) for _ in range(rt.world_size)]
        pg.allgather([masks], [mask]).wait()
        held_by = [[r for r in range(size) if int(m[r])] for m in masks]
        if self.stage == 3:
            give_storage(s.model)
        s.rebuild(pg)
        zero = s.model
        needs, moves = rebuild_plan(held_by, size, [u.plan.numel for u in zero.units],
                                    rt.world_size, self.steps)
        parts = dict(held.parts) if held is not None and held.size == size else {}
        for r, src, dst in moves:  # one after the other, in one order everywhere
            if rt.rank == src:
                send_recv_state(pg, parts[r], dst=dst, src=None)
            elif rt.rank == dst:
                parts[r] = send_recv_state(pg, None, dst=None, src=src)
        # What it received is the commit's too: a second fault before the next commit finds it.
        self.held = Held(self.steps, size, parts)
        zero.load_shard_state_dicts({r: self._with_params(parts[r]) for r in needs[rt.rank]})


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_nbytes(v) for v in obj)
    return 0
