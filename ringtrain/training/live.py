"""The trainer's live mode (`ringtrain train --live`): each step over whoever is left.

    driver = LiveDriver(settings, strategy.live_hooks(), runtime, train_set, global_batch=...)
    original = driver.register()     # a process of generation 0, or a replacement
    driver.join(step)                # member of a generation; a replacement heals from a peer
    result, micro = driver.step(lr, grad_clip)      # in the trainer's one loop, per step
    driver.close()

The library layer (`ringtrain.live`) does the generations (`LiveGroup`), the in-memory commit
(`LiveState`) and each step's global batch (`GlobalBatches`); this module ties them to the loop:
- a step's micro-batches are this member's share of the step's global batch (`grad_accum`
  pieces), whatever the number of members; the strategy's `LiveHooks` train it over the
  generation's group; the step is then committed in memory;
- the strategy's hooks say which steps are commit points (`LiveHooks.commits_at`): every
  step for ddp and ZeRO, the meetings (every `--sync-every` steps) for local SGD and DiLoCo,
  whose replicas differ between meetings; they are told which steps a snapshot follows
  (`LiveHooks.will_save`: ZeRO gathers its shards to the member that saves);
- a step whose collective fails (a peer died or hangs) is recovered (`LiveGroup.recover`: the
  next generation, the last commit, a heal); the steps from the commit to it are redone over
  the same global batches (one step for ddp, the round so far for local SGD); a replacement
  waiting is let in at the next commit point (`admit`). Where the hooks keep what a member
  computed of the failed step (`LiveHooks.contribution`: ddp), the new generation first agrees
  on who holds which samples (one all-gather) and trains only the rest (`_shares`);
- `--record-samples`: every member's share of a committed step is all-gathered before the
  commit and kept in the sample history, which is committed and healed with the optimizer,
  so the history is the job's whatever members were lost;
- the loop's sums, votes and digests go over the current generation (`agreement`: the
  strategy's `LiveHooks.agreement`, by default `ringtrain.agreement.generations`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from ringtrain.checkpoint.rules import snapshot_due
from ringtrain.data.sample_log import SampleLog
from ringtrain.errors import ConfigError
from ringtrain.live import (
    GlobalBatches,
    LiveGroup,
    LiveState,
    agree_shares,
    gather_ids,
    make_optimizer_state,
)
from ringtrain.runtime import Runtime
from ringtrain.strategies.base import LiveHooks, StepResult, Strategy
from ringtrain.training.config import TrainerConfig, lr_at
from ringtrain.training.evaluate import collate

__all__ = ["DEFAULT_DEAD_AFTER_S", "LiveDriver", "LiveSettings", "live_driver"]

# --live-dead-after's default: five missed heartbeats (`ringtrain.cli.worker._live_settings`).
DEFAULT_DEAD_AFTER_S = 0.5

log = logging.getLogger("ringtrain")


@dataclass(frozen=True)
class LiveSettings:
    """How a live job's members find each other and how long they wait.

    Args:
        store: the job's store, hosted outside the members (the launcher's agent).
        world_size: members when whole.
        timeout_s: a generation's collective timeout: a hung member is found after it.
        replace_wait_s: how long survivors wait for a replacement before going on without.
        dead_after_s: a member whose heartbeat is this old is lost.
        spare: this process is a warm spare (`--live-spares`): it waits, built, to take a lost
            member's place (`LiveGroup`'s `spare`).
        snapshot_every: steps between the trainer's snapshots (0: none), so the strategy's
            hooks gather spread state before a save (`LiveHooks.will_save`).
    """

    store: dist.Store
    world_size: int
    timeout_s: float = 30.0
    replace_wait_s: float = 0.0
    dead_after_s: float = DEFAULT_DEAD_AFTER_S
    join_timeout_s: float = 600.0
    launcher_rank: int = 0  # the RANK the launcher gave this process (its slot, for the record)
    spare: bool = False
    snapshot_every: int = 0  # the trainer's --snapshot-every: the hooks are told those steps


@dataclass(frozen=True)
class _Held:
    """A step's samples this member trained (ids, micro-batches) and, once a fault kept it,
    what it computed of them (`LiveHooks.contribution`)."""

    step: int
    ids: list[int]
    micro: list[tuple[torch.Tensor, torch.Tensor]]
    made: Any = None


class _Committed:
    """What a member commits besides the model: the optimizer and the sample history."""

    def __init__(self, optimizer: Any, samples: SampleLog | None):
        self.optimizer, self.samples = optimizer, samples

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(),
                "samples": self.samples.state_dict() if self.samples is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.samples is not None and state["samples"] is not None:
            self.samples.load_state_dict(state["samples"])


def live_driver(strategy: Strategy, live: LiveSettings, runtime: Runtime, train_set: Dataset,
                config: TrainerConfig, samples: SampleLog | None,
                run_dir: str | None) -> LiveDriver:
    """The trainer's live driver for `strategy`, or the error naming the fix."""
    hooks = strategy.live_hooks()  # asked, never probed: None means it has none
    if hooks is None:
        raise ConfigError(f"--strategy {strategy.name} has no live recovery: drop --live, or use "
                          "--strategy ddp, zero, localsgd or diloco")
    return LiveDriver(live, hooks, runtime, train_set, seed=config.seed,
                      global_batch=config.batch_size * config.grad_accum * live.world_size,
                      grad_accum=config.grad_accum, lr_of=lambda step: lr_at(step, config),
                      steps=config.steps, samples=samples, run_dir=run_dir)


class LiveDriver:
    """One member's steps in a live job (see the module docstring)."""

    def __init__(self, settings: LiveSettings, hooks: LiveHooks, runtime: Runtime,
                 dataset: Dataset, *, global_batch: int, grad_accum: int, seed: int,
                 lr_of: Callable[[int], float], steps: int, samples: SampleLog | None = None,
                 run_dir: str | None = None):
        self.settings, self.hooks, self.dataset = settings, hooks, dataset
        self.steps = steps  # the run's last step: a snapshot is taken after it too
        self.lr_of = lr_of  # step -> its learning rate: a round redone after a fault
        self.run_dir = run_dir  # RUN_DIR/live/PID.json: each process's part, at join and close
        self.grad_accum, self.samples = grad_accum, samples
        self.batches = GlobalBatches(len(dataset), global_batch, seed=seed)  # type: ignore[arg-type]
        self.runtime = runtime  # this member's rank and group in the current generation
        self.group: LiveGroup | None = None
        self.state: LiveState | None = None
        self.recoveries = 0
        # Each recovery's stall: the last commit before the failed step to the first after it
        # (wall clock; the figure docs/fault_tolerance.md reports), in the member's record.
        self.stalls_s: list[float] = []
        self._committed_at: float | None = None
        self._stalled_since: float | None = None
        self.joined_at: int | None = None
        self.agreement = hooks.agreement(lambda: self.runtime)  # over the current generation
        # What this member computed of a step not yet committed (`LiveHooks.contribution`),
        # kept through a fault: the redo trains only the samples nobody holds (`_shares`).
        self._held: _Held | None = None
        self._pending: _Held | None = None  # the step being trained, its contribution unknown
        self._regrouped = False  # the members changed: the next step's shares are agreed
        # Per step redone after a fault: samples the members held, and samples trained again.
        self.redone: list[dict[str, int]] = []
        self.stop: Any = None  # the loop's `StopSignal`: a survivor stops waiting once signalled

    @property
    def world_size(self) -> int:
        return self.settings.world_size

    def register(self) -> bool:
        """Register with the job's store; True for a process of generation 0 (it may resume
        from a snapshot), False for a replacement (it heals from a live peer instead)."""
        s = self.settings
        self.group = LiveGroup(s.store, s.world_size, name="train", timeout_s=s.timeout_s,
                               heartbeat_s=min(0.1, s.dead_after_s / 4),
                               dead_after_s=s.dead_after_s, join_timeout_s=s.join_timeout_s,
                               replace_wait_s=s.replace_wait_s, spare=s.spare,
                               stop_requested=self._stop_requested, slot=s.launcher_rank)
        return self.group.uid < s.world_size

    def _stop_requested(self) -> bool:
        return self.stop is not None and self.stop.received is not None

    def join(self, step: int) -> int | None:
        """Become a member (at `step`, this process's committed step); the step the group is
        at (a replacement's is its healer's), or None if the job ended before it was let in."""
        assert self.group is not None, "register() first"
        # In place where the hooks' step changes the state after its last collective; with
        # --record-samples every step ends with the shares' all-gather (`_record`), after the
        # state changed: a copy then.
        in_place = self.hooks.commits_in_place and self.samples is None
        optimizer = self.hooks.optimizer
        if self.group.uid >= self.world_size and isinstance(optimizer, torch.optim.Optimizer):
            # A replacement or a spare: the memory its heal receives into, made before its
            # first beat (`LiveState.prepare_heal`, which cannot see through `_Committed`).
            make_optimizer_state(optimizer)
        self.state = LiveState(self.hooks.model, _Committed(self.hooks.optimizer, self.samples),
                               self.batches, step=step, in_place=in_place)
        if not self.group.join(self.state):
            return None
        self._members_changed()
        self.joined_at = self.state.step
        heal = self.group.last_heal
        if heal is not None:  # a replacement redoes the round so far with its peers
            self.state.target = max(self.state.step, heal.target)
        self._write_member("training")
        return self.state.target

    def _members_changed(self) -> None:
        g = self.group
        assert g is not None
        self.runtime = replace(self.runtime, rank=g.rank, world_size=g.size,
                               process_group=g.process_group)
        self._regrouped = True
        self.agreement.take_failure()  # a question of the group before this one: answered
        self.hooks.on_members(self.runtime)
        if g.last_heal is not None and g.last_heal.nbytes and g.rank == 0:
            log.info("live: generation %d, %d members; healed to step %d (%d bytes)",
                     g.generation, g.size, g.last_heal.step, g.last_heal.nbytes)

    def step(self, lr: float, grad_clip: float | None
             ) -> tuple[StepResult, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Train and commit the next step over the current members, recovering as needed.

        Returns the step's result and the micro-batches this member trained (none, with count
        0, when a recovery healed this member to a step a peer had committed already).
        """
        from ringtrain.live import LiveMemberLostError, LiveRecoveryError

        g, state = self.group, self.state
        assert g is not None and state is not None, "join() first"
        start = state.target  # the step to train; the commit may be behind it (mid-round)
        while True:
            try:
                lost = self.agreement.take_failure()
                if lost is not None:  # a sum or vote since the last step: recover now, not at
                    # the next collective (a round's is its meeting: generations.py says why)
                    raise RuntimeError(f"a member was lost after step {state.step} ({lost})")
                # Replacements waiting are let in at a commit point (a step boundary, for ddp;
                # a meeting, for local SGD): the state a replacement heals to is the live one.
                if state.step == state.committed_step and g.admit(state):
                    self._members_changed()
                while state.step < start:  # recovered to the round's start: redo it up to here
                    self._train(state.step, self.lr_of(state.step), grad_clip)
                    self._advance()
                result, micro = self._train(start, lr, grad_clip)
            except (LiveMemberLostError, LiveRecoveryError):
                raise  # this process is out, or the error is the job's own: no retry
            except RuntimeError as error:  # a failed collective: a peer died or hangs
                if self._stalled_since is None:
                    self._stalled_since = self._committed_at
                made = self.hooks.contribution()
                if made is not None and self._pending is not None:
                    self._held = replace(self._pending, made=made)
                before = list(g.members)
                g.recover(state, error)
                self.recoveries += 1
                self._members_changed()
                if g.rank == 0:
                    log.warning("live: step %d failed (%s); generation %d: %d of %d members "
                                "(was %d), redoing it from step %d", start + 1,
                                str(error).splitlines()[0], g.generation, g.size,
                                self.world_size, len(before), state.step)
                if state.step > start:  # a peer had committed it: healed to it
                    assert state.step == start + 1, (start, state.step)
                    self._held = None
                    state.target = state.step
                    self._committed()
                    return StepResult(loss_sum=0.0, count=0), []
                continue
            self._advance()
            state.target = state.step
            return result, micro

    def settle(self, agreed: Callable[[], bool]) -> Runtime:
        """After the last step: ask `agreed()` (a question over the members: True once they
        agree) until they do, recovering in between, and return this member's place then.

        A member lost after the last step has no step left to be recovered in: without this,
        if it was rank 0 nobody would write the run's files. The next generation (a spare or
        replacement waiting let in, else the survivors closing ranks) ends the run instead; a
        replacement let in here joins at the last step and asks `agreed()` once, with them.
        """
        g, state = self.group, self.state
        assert g is not None and state is not None, "join() first"
        while not agreed():
            if state.step != state.committed_step:  # mid-round: restoring would undo steps
                log.warning("live: a member was lost after the last step, %d steps past the "
                            "last commit: the run ends without it", state.step -
                            state.committed_step)
                break
            g.recover(state, RuntimeError("a member was lost after the last step"))
            self.recoveries += 1
            self._members_changed()
        return self.runtime

    def _train(self, step: int, lr: float, grad_clip: float | None
               ) -> tuple[StepResult, list[tuple[torch.Tensor, torch.Tensor]]]:
        """This member's share of `step` (0-based), trained and recorded."""
        g = self.group
        assert g is not None
        held = self._held if self._held is not None and self._held.step == step else None
        if self._regrouped:  # after a fault the members may hold parts of this step
            new = self._shares(step, held)
            self._regrouped = False
        else:
            held, new = None, self.batches.share(step, g.rank, g.size)
        self._held = held
        micro = self._micro(new)
        ids, trained = (held.ids + new, held.micro + micro) if held is not None else (new, micro)
        self._pending = _Held(step, ids, trained)
        if snapshot_due(step + 1, every=self.settings.snapshot_every, steps=self.steps):  # `due`
            self.hooks.will_save(step)
        result = self.hooks.train_step(micro, lr=lr, grad_clip=grad_clip,
                                       weight=len(new) / self.batches.global_batch_size,
                                       held=held.made if held is not None else None)
        if self.samples is not None:
            self._record(step, ids)
        return result, trained

    def _shares(self, step: int, held: _Held | None) -> list[int]:
        """This member's ids to train of `step` in a new generation: what nobody holds from
        before a fault (`ringtrain.live.agree_shares`; without a fault, the plain shares)."""
        g = self.group
        assert g is not None and g.process_group is not None
        b = self.batches.global_batch_size
        new, kept = agree_shares(g.process_group, g.rank, self.batches, step,
                                 held.ids if held is not None else [])
        if kept:
            self.redone.append({"step": step + 1, "held": kept, "trained": b - kept})
            if g.rank == 0:
                log.info("live: step %d redone over %d members: %d of its %d samples held from "
                         "before the fault, %d trained again", step + 1, g.size, kept, b, b - kept)
        return new

    def _advance(self) -> None:
        """One step on; committed where the strategy's hooks say it is a commit point."""
        state = self.state
        assert state is not None
        state.step += 1
        self._held = self._pending = None
        if self.hooks.commits_at(state.step):
            state.commit()
            self._committed()

    def _committed(self) -> None:
        now = time.time()
        if self._stalled_since is not None:
            self.stalls_s.append(round(now - self._stalled_since, 3))
            self._stalled_since = None
        self._committed_at = now

    def _micro(self, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`ids` as `grad_accum` micro-batches (sizes differ by at most one)."""
        n = min(self.grad_accum, len(ids))
        cuts = [len(ids) * i // n for i in range(n + 1)] if n else []
        return [collate(self.dataset, ids[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]

    def _record(self, step: int, ids: list[int]) -> None:
        """Every member's share of `step` (0-based) into the history, as step `step + 1`."""
        assert self.group is not None and self.samples is not None
        pg = self.group.process_group
        assert pg is not None
        # Up to the whole batch each: a redo's shares are uneven.
        shares = gather_ids(pg, ids, self.batches.global_batch_size)
        epoch = step // self.batches.steps_per_epoch
        self.samples.steps.append(step + 1)
        self.samples.entries.append([(epoch, share) for share in shares])

    def close(self, status: str = "finished") -> None:
        """Leave the job: waiting replacements learn it is done."""
        if self.group is not None:
            self.group.close()
            if self.joined_at is not None:
                self._write_member(status)
            self.group = None

    def _write_member(self, status: str) -> None:
        """This process's part of the job, for the user and the tests: whether it trained from
        the start (a survivor keeps its pid) or was let in later (a replacement, healed)."""
        if self.run_dir is None or self.group is None or self.state is None:
            return
        folder = os.path.join(self.run_dir, "live")
        os.makedirs(folder, exist_ok=True)
        record = {"pid": os.getpid(), "uid": self.group.uid, "status": status,
                  "launcher_rank": self.settings.launcher_rank, "joined_at_step": self.joined_at,
                  "step": self.state.step, "generation": self.group.generation,
                  "rank": self.runtime.rank, "members": self.runtime.world_size,
                  "recoveries": self.recoveries, "stalls_s": self.stalls_s,
                  "redone": self.redone}
        tmp = os.path.join(folder, f".{os.getpid()}.json")
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, os.path.join(folder, f"{os.getpid()}.json"))
