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
own gradients). So at each meeting the members also all-gather their inner optimizer states
(`_exchange`), and the commit holds every member's, by rank: a replacement that takes rank r of
a generation as large as the commit's takes rank r's moments, and the round it redoes is the
fault-free one, bit for bit. The price, in live mode only: each member holds W inner optimizer
states (twice the model per member for AdamW) and receives W - 1 of them per meeting (about
W - 1 times the meeting's own all-reduce). Where the commit was made by fewer members (the
survivors went on without a replacement), a replacement keeps its healer's moments: no
fault-free run to match then. A neighbour's copy alone would do at scale (one state, not W).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ringtrain.strategies.base import LiveHooks, StepResult

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
        self.slots: list[torch.Tensor] = []  # every member's inner optimizer state, by rank
        self.slot_rank: int | None = None  # this member's rank at the last exchange
        self._reload = False  # a commit was loaded: take this member's slot (`on_members`)

    def commits_at(self, step: int) -> bool:
        return step % self.sync_every == 0

    def on_members(self, runtime: Runtime) -> None:
        self.strategy.runtime = runtime  # its meetings go over the generation's group
        if not self._reload:
            return
        self._reload = False
        # A survivor's slot is its own state (restored already, or a peer's newer commit); a
        # replacement takes the slot of the rank it took, where the commit had this many.
        slot = self.slot_rank
        if slot is None and len(self.slots) == runtime.world_size:
            slot = runtime.rank
        if slot is not None and slot < len(self.slots):
            self.strategy.optimizer.load_state_dict(
                torch.load(io.BytesIO(self.slots[slot].numpy().tobytes()), weights_only=True))

    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *,
                   lr: float, grad_clip: float | None, weight: float) -> StepResult:
        # `weight` is unused: each member steps on its own share's mean gradient, as local
        # SGD's ranks do; the meeting averages the replicas, one vote each.
        result = self.strategy.inner_step(micro_batches, lr=lr, grad_clip=grad_clip)
        if self.strategy.inner_steps % self.sync_every == 0:  # it met: the next commit's slots
            self._exchange()
        return result

    def _exchange(self) -> None:
        """All-gather every member's inner optimizer state (serialized: a fresh member's may
        have no moments yet), so the commit can heal any member's."""
        rt = self.strategy.runtime
        buf = io.BytesIO()
        torch.save(self.strategy.optimizer.state_dict(), buf)
        mine = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        self.slot_rank = rt.rank
        if rt.world_size == 1:
            self.slots = [mine]
            return
        pg = rt.process_group  # a generation's group, outside torch's registry: its own methods
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(rt.world_size)]
        pg.allgather([sizes], [torch.tensor([mine.numel()])]).wait()
        width = max(int(n) for n in sizes)
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[:mine.numel()] = mine
        out = [torch.empty_like(padded) for _ in range(rt.world_size)]
        pg.allgather([out], [padded]).wait()
        self.slots = [t[:int(n)].clone() for t, n in zip(out, sizes, strict=True)]

    def state_dict(self) -> dict[str, Any]:
        return {**self.strategy.round_state_dict(), "slots": list(self.slots)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.strategy.load_round_state_dict(state)
        self.slots = list(state["slots"])
        self._reload = True
