"""Local SGD's and DiLoCo's step in live recovery (`ringtrain train --live --strategy diloco`).

    hooks = strategy.live_hooks()       # a RoundLiveHooks
    hooks.commits_at(step)              # True at the meetings: every --sync-every H steps

The rule for rounds. Between two meetings the replicas differ, each member's a function of its
own shares: a lost member takes its part of the round with it, and no survivor could rebuild
it. So the commit points are the meetings (`commits_at`): a fault anywhere in a round, in an
inner step or inside the meeting itself, sends the survivors back to the state after the last
meeting, and the whole round is redone over whoever is left, each step's global batch re-split
over them (`ringtrain.training.live`); a replacement is let in there, takes the lost member's
rank and its shares, and redoes the round with them. A fault costs up to H steps trained again
(torchft's LocalSGD discards the round the same way). The committed state is the model and
everything the strategy holds (`round_state_dict`: the inner optimizer, the last meeting's
weights, the step count in the period, DiLoCo's anchor and outer momentum).

One piece of that is not a replica: each member's inner optimizer state (AdamW's moments of its
own gradients). So at each meeting every member also sends its inner optimizer state to its
ring successor (rank r + 1 mod W; one send/recv pair, `_exchange`), and a commit holds the
member's own state and its predecessor's. After the members change, in the first step (inside
the recovery's retry, `_repair_moments`), a member that took a peer's commit (a replacement) at
rank r of a generation as large as the commit's receives rank r's moments from the member
holding the copy, so the round it redoes is the fault-free one, bit for bit; then it takes a
copy of its predecessor's, so a second loss in the round finds one as well. The price, in live
mode only: the predecessor's inner optimizer state per member, held live and in the commit
(for AdamW, 4 model sizes), and 2 model sizes sent and received per member per meeting (the
meeting's all-reduce itself sends 2 (W - 1) / W). Two adjacent ranks lost in one recovery lose
a state and its only copy: that replacement keeps its healer's moments (close, not
bit-identical), as does one let in after the survivors went on without it (the commit was made
by fewer members: no fault-free run then).
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ringtrain.strategies.base import LiveHooks, StepResult
from ringtrain.tensor_tree import send_recv_state

if TYPE_CHECKING:
    from ringtrain.runtime import Runtime

__all__ = ["RoundLiveHooks"]


class RoundLiveHooks(LiveHooks):
    """The live step of replicas that train alone and meet every `sync_every` steps
    (`strategy.module`, `optimizer`, `runtime`, `inner_step`, `round_state_dict`, as
    `LocalSGDStrategy` has them after setup). See the module docstring for the rule.

    Args:
        strategy: a set-up `LocalSGDStrategy` (or `DiLoCoStrategy`).
        sync_every: its H: the steps between meetings.
    """

    def __init__(self, strategy: Any, sync_every: int):
        self.strategy, self.sync_every = strategy, sync_every
        self.model = strategy.module
        self.optimizer = self  # committed and healed: `state_dict` is the strategy's round state
        self.token = uuid.uuid4().hex  # tells this process's own commits from a peer's
        # As of the commit loaded last (or about to be made): this member's rank in it (None: a
        # peer's commit, its own moments not known), the generation's size, and its
        # predecessor's inner optimizer state with that rank.
        self.slot_rank: int | None = None
        self.commit_size = 0
        self.buddy: dict[str, Any] | None = None
        self.buddy_of: int | None = None
        # (inner steps, rank, state): moments received in a repair, for a peer's commit that a
        # later fault in the same round restores again
        self.repaired: tuple[int, int, dict[str, Any]] | None = None
        self.rebuilt: tuple[int, int, dict[str, Any]] | None = None  # the same, of the copy
        self._repair = False  # new members: find missing moments in the next step

    def commits_at(self, step: int) -> bool:
        return step % self.sync_every == 0

    def on_members(self, runtime: Runtime) -> None:
        self.strategy.runtime = runtime  # its meetings go over the generation's group
        # Every member, whoever loaded a commit: the repair is a collective of all of them.
        self._repair = True

    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
                   lr: float, grad_clip: float | None, weight: float,
                   held: Any = None) -> StepResult:
        # `held` never comes: `contribution()` is None, a faulted step is redone whole.
        # `weight` is unused: each member steps on its own share's mean gradient, as local
        # SGD's ranks do; the meeting averages the replicas, one vote each.
        if self._repair:  # inside the recovery's retry: a fault here redoes the round again
            self._repair_moments()
        result = self.strategy.inner_step(micro_batches, lr=lr, grad_clip=grad_clip)
        if self.strategy.inner_steps % self.sync_every == 0:  # it met: the next commit's copy
            self._exchange()
        return result

    def _exchange(self) -> None:
        """Send this member's inner optimizer state to its ring successor, keep its
        predecessor's (`send_recv_state`: the tensors as they are, no serialized copy)."""
        rt = self.strategy.runtime
        self.slot_rank, self.commit_size = rt.rank, rt.world_size
        self.repaired = self.rebuilt = None
        self.buddy = self.buddy_of = None
        if rt.world_size == 1:
            return
        predecessor = (rt.rank - 1) % rt.world_size
        self.buddy = send_recv_state(rt.process_group, self.strategy.optimizer.state_dict(),
                               dst=(rt.rank + 1) % rt.world_size, src=predecessor)
        self.buddy_of = predecessor

    def _repair_moments(self) -> None:
        """Every member, first step after the members changed (the state is a commit's):
        1. a member without its own moments at rank r (a replacement) takes rank r's from whoever
           holds the copy, if the commit was made by as many members as there are now (ranks
           kept: a replacement takes a lost rank's);
        2. a member without a valid copy of its predecessor's moments (a replacement again)
           takes them from the predecessor itself, so a second loss in the round finds a copy.
        The plan is computed from one all-gather, the same on every member."""
        self._repair = False
        rt = self.strategy.runtime
        if rt.world_size == 1:
            return
        mine = torch.tensor([-1 if self.slot_rank is None else self.slot_rank,
                             -1 if self.buddy is None else self.buddy_of, self.commit_size])
        views = [torch.zeros(3, dtype=torch.int64) for _ in range(rt.world_size)]
        rt.process_group.allgather([views], [mine]).wait()
        slots, buddies, sizes = ([int(v[i]) for v in views] for i in range(3))
        for rank in range(rt.world_size):
            holders = [h for h, b in enumerate(buddies) if b == rank]
            if slots[rank] != -1 or sizes[rank] != rt.world_size or rank in slots or \
                    not holders:
                continue  # its own already, ranks moved, or its copy lost: the healer's moments
            got = self._pass(holders[0], rank, self.buddy)
            slots[rank] = rank
            if got is not None:
                self.strategy.optimizer.load_state_dict(copy.deepcopy(got))
                self.slot_rank = rank
                self.repaired = (self.strategy.inner_steps, rank, got)
        for rank in range(rt.world_size):
            predecessor = (rank - 1) % rt.world_size
            if buddies[rank] != -1 or slots[predecessor] == -1:
                continue
            own = self.strategy.optimizer.state_dict() if rt.rank == predecessor else None
            got = self._pass(predecessor, rank, own)
            if got is not None:
                self.buddy, self.buddy_of = got, predecessor
                self.rebuilt = (self.strategy.inner_steps, predecessor, got)

    def _pass(self, src: int, dst: int, state: dict[str, Any] | None) -> dict[str, Any] | None:
        """`state` from member `src` to member `dst`; what `dst` got (None elsewhere)."""
        rt = self.strategy.runtime
        if rt.rank == src:
            send_recv_state(rt.process_group, state, dst=dst, src=None)
        elif rt.rank == dst:
            return send_recv_state(rt.process_group, None, dst=None, src=src)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {**self.strategy.round_state_dict(), "owner": self.token,
                "slot_rank": self.slot_rank, "commit_size": self.commit_size,
                "buddy": self.buddy, "buddy_of": self.buddy_of}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.strategy.load_round_state_dict(state)
        self.commit_size = int(state["commit_size"])
        if state["owner"] == self.token:  # its own commit, restored
            self.slot_rank, self.buddy, self.buddy_of = (state["slot_rank"], state["buddy"],
                                                         state["buddy_of"])
            if self.buddy is None and self.rebuilt is not None and \
                    self.rebuilt[0] == self.strategy.inner_steps:
                self.buddy_of, self.buddy = self.rebuilt[1], self.rebuilt[2]
            return
        # A peer's commit (a heal): the peer's moments and copy, not this member's; those it
        # received for this commit in an earlier repair are its own.
        self.slot_rank = self.buddy = self.buddy_of = None
        steps = self.strategy.inner_steps
        if self.repaired is not None and self.repaired[0] == steps:
            # A copy: the optimizer keeps the tensors it is given and would step the cache.
            self.strategy.optimizer.load_state_dict(copy.deepcopy(self.repaired[2]))
            self.slot_rank = self.repaired[1]
        if self.rebuilt is not None and self.rebuilt[0] == steps:
            self.buddy_of, self.buddy = self.rebuilt[1], self.rebuilt[2]
