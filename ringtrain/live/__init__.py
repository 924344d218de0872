"""Live recovery: survivors of a lost member keep training; a replacement heals from a peer.

Read in this order:
- `batches.py`: `GlobalBatches`, each step's global batch and a member's share of it, from the
  step alone: a step redone by fewer members trains the same samples (exactly once).
- `state.py`: `LiveState`, what a member commits in memory each step and restores on a failure
  (model, optimizer, step, batches, RNG), as Horovod elastic's `State`; and what a
  replacement makes before it is let in, so that its heal places no memory
  (`prepare_heal`).
- `heal.py`: the members of a new generation agree on the newest committed step and take it
  from a member that has it, over the new group (torchft's heal from a live peer).
- `heartbeats.py`: `Heartbeats`, each process's beat in the store (a thread) and how long each
  member has been silent: how a lost member is found, inside a collective or between steps.
- `watched.py`: `WatchedGroup`, a gloo group whose collectives wait in short slices and give
  up once a member's heartbeat stops (a hang or a lost link found in ~1 s, not a timeout).
- `roster.py`: who is in the job as the store says: the processes waiting to be let in, the
  members gone, the member list a new generation proposes (survivors keep their ranks).
- `joining.py`: how a process becomes a member: it registers, then generation 0 forms once
  all its processes have, or a replacement (or a warm spare) waits until a generation lists it.
- `group.py`: `LiveGroup`, the generations: who is a member, agreed through the store; one
  watched gloo group per generation on its own store prefix; replacements let in at step
  boundaries.
- `redo.py`: after a fault, the members keep what they computed of the failed step
  (`LiveGradients`) and redo only the samples nobody holds (`agree_shares`).
- `loop.py`: `train_live`, the loop that ties them: share, step, commit; recover on a failed
  collective; and `all_reduce_gradients`.

A library layer for `ringtrain run` scripts; `ringtrain train --live` uses it through
`ringtrain.training.live` (docs/fault_tolerance.md, "Live recovery").
Tests: `.venv/bin/pytest -q tests/test_live*.py`.
May import: torch, `ringtrain.data`, `ringtrain.checkpoint` (the RNG state), `ringtrain.store_keys`,
`ringtrain.tensor_tree`, `ringtrain.flat_sum`.
"""

from ringtrain.live.batches import GlobalBatches
from ringtrain.live.group import LiveGroup, LiveMemberLostError, LiveRecoveryError
from ringtrain.live.heal import HealReport, heal
from ringtrain.live.joining import LiveJobLostError
from ringtrain.live.loop import all_reduce_gradients, train_live
from ringtrain.live.redo import LiveGradients, agree_shares, gather_ids
from ringtrain.live.state import LiveState, make_optimizer_state
from ringtrain.live.watched import LiveMemberSilentError, WatchedGroup

__all__ = ["GlobalBatches", "HealReport", "LiveGradients", "LiveGroup", "LiveJobLostError",
           "LiveMemberLostError", "LiveMemberSilentError", "LiveRecoveryError", "LiveState",
           "WatchedGroup", "agree_shares", "all_reduce_gradients", "gather_ids", "heal",
           "make_optimizer_state", "train_live"]
