"""The training loop's snapshots: what `Checkpointer` saves, and exact and elastic resume.

    checkpointer = Checkpointer(loop_state, strategy, runtime, agreement, config,
                                data_world_size, "runs/x/snapshots", every=100, keep=2)
    checkpointer.resume()          # every rank, before the loop: the newest committed snapshot
    checkpointer.save(step)        # every rank, at the same step boundary

(`Trainer` does both when given `run_dir` and `snapshot_every`; `ringtrain train` then resumes
by itself from its run directory.) Tests: tests/test_resume.py, test_elastic.py, test_restart.py.

What a snapshot holds (files written by `ringtrain.checkpoint.snapshot.SnapshotManager`):
- `shared.pt` (rank 0): the trainer's state (step, sampler cursor and epoch, running totals,
  resume history), the metrics window summed over ranks, and, for strategies whose ranks hold
  the same state (DDP), the strategy's state: the unwrapped model and the optimizer. The LR
  schedule is a function of the step; the trainer uses no grad scaler (bf16 needs none).
- `rank{r}.pt`: rank r's RNG states (Python, NumPy, torch), its metrics window and, for
  strategies whose ranks hold different parts (pipeline stages, parameter-server shards),
  its part of the strategy's state.
- the manifest's metadata: the options that must match to resume, the topology, and the
  global batch the run started with.

Exact resume (same world size): everything above is restored, so the run continues bit for
bit as if never stopped. Elastic resume (another number of data ranks): the global batch is
kept by changing grad_accum (or the per-rank batch), the sampler re-splits the rest of the
epoch, and each rank's RNG is derived afresh from (seed, rank, step). The strategy's state loads
as saved where the strategy and its `state_layout()` are the snapshot's (replicated state on
any number of ranks, ZeRO resharded); otherwise it goes through the layout-free form
(`ringtrain.strategies.portable`: the saved strategy's `to_portable`, this one's
`load_portable_state_dict`), so ddp, zero and pipeline snapshots resume in one another.
A larger `--steps` extends the run (`TrainerConfig.resume_view`: the schedule of the new length).

Its rules (what must match, the elastic batch, the reseed, which steps save) are functions in
`rules.py`; SIGTERM/SIGINT/SIGUSR1 is `StopSignal` in `stop.py` (both importable from here).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from ringtrain import collectives
from ringtrain.checkpoint.loop_save import LoopSave
from ringtrain.checkpoint.rng import set_rng_state
from ringtrain.checkpoint.rules import (
    check_options,
    config_differences,
    elastic_batch,
    reseed,
    snapshot_due,
)
from ringtrain.checkpoint.run_dir import DiskFullError, no_space_message
from ringtrain.checkpoint.sharded import load_strategy_parts
from ringtrain.checkpoint.snapshot import (
    SaveResult,
    Snapshot,
    SnapshotError,
    SnapshotManager,
    SnapshotNoSpaceError,
    check_topology,
    newest_snapshot_bytes,
    remove_unfinished,
)
from ringtrain.checkpoint.stop import StopSignal
from ringtrain.errors import ConfigError

if TYPE_CHECKING:
    from ringtrain.agreement.base import Agreement
    from ringtrain.runtime import Runtime
    from ringtrain.strategies.base import Strategy

__all__ = ["Checkpointer", "StopSignal", "config_differences", "elastic_batch", "reseed"]

log = logging.getLogger("ringtrain")


class LoopStateLike(Protocol):
    """What the checkpointer needs of the training loop's state (`ringtrain.training.state`)."""

    window: list[float]
    resumes: list[dict[str, Any]]

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def window_state(self) -> dict[str, Any]: ...
    def load_window_state(self, state: dict[str, Any]) -> None: ...
    def restart_window(self, window_sum: list[float], *, holder: bool) -> None: ...


@dataclass(frozen=True)
class ResumePoint:
    """Where a resume put the loop: the step, and the per-rank batch layout that keeps the
    run's global batch on this run's data ranks (changed only by an elastic resume)."""

    step: int
    batch_size: int
    grad_accum: int


class Checkpointer:
    """Saves the loop's state with the strategy's as snapshots and resumes them; every method
    is collective.

    Args:
        state: the training loop's `LoopState` (step, sampler cursor, metrics window).
        strategy: the set-up strategy whose state is saved with it.
        runtime: this process's `Runtime`.
        agreement: the strategy's agreement (sums the metrics window for an elastic resume).
        config: the trainer's resolved `TrainerConfig`: the fields that must match to resume
            (`must_match()`: its fields marked `resume=MUST_MATCH`), the seed, the steps and the
            batch layout are read from it.
        data_world_size: the strategy's number of data ranks.
        root_dir: the snapshot directory, the same on every rank (`<run_dir>/snapshots`).
        every: steps between snapshots, and the last step (`snapshot_due`); 0: none, no SIGTERM.
        keep: committed snapshots kept.
        timeout_s: bound on each rank's part of a save (see `SnapshotManager`).
        run_config: options that must equal the snapshot's to resume (flag name -> value).
        name: names the snapshot handshake's store keys, the same on every rank (see
            `SnapshotManager`); a second checkpointer of the same directory in one process
            group needs another.
    """

    def __init__(self, state: LoopStateLike, strategy: Strategy, runtime: Runtime,
                 agreement: Agreement, config: Any, data_world_size: int,
                 root_dir: str, *, every: int = 0, keep: int = 2, timeout_s: float = 60.0,
                 run_config: dict[str, Any] | None = None, name: str = "trainer"):
        if every < 0:
            raise ValueError(
                f"snapshot_every={every}: use 0 (no snapshots) or a positive step count")
        self.state, self.strategy = state, strategy
        self.runtime, self.agreement = runtime, agreement
        self.every, self.data_world_size, self.seed = every, data_world_size, config.seed
        self.trainer_config = config  # its `resume_view`: the rule of a changed --steps
        self.schedule_changed: list[str] = []  # by --new-schedule, at the resume
        self.manager = SnapshotManager(root_dir, rank=runtime.rank, world_size=runtime.world_size,
                                       store=runtime.store if runtime.world_size > 1 else None,
                                       keep=keep, timeout_s=timeout_s, name=name)
        # The trainer's fields that change the trained weights (TrainerConfig.must_match).
        self.config = {**(run_config or {}), "strategy": strategy.name, **config.must_match()}
        # Every rank holds the same strategy state (DDP): rank 0 alone writes it, and any
        # number of ranks can load it (elastic resume).
        self.replicated = bool(strategy.replicated_state)
        self.batch_size, self.grad_accum = config.batch_size, config.grad_accum
        self.global_batch = config.batch_size * config.grad_accum * data_world_size
        self.steps = config.steps
        self.saves: list[tuple[float, int]] = []  # (seconds, bytes of all ranks) per save
        self.saved_step: int | None = None

    # -- saving --------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return snapshot_due(step, every=self.every, steps=self.steps)

    def _topology(self) -> dict[str, Any]:
        return {"strategy": self.strategy.name, "data_world_size": self.data_world_size,
                "layout": self.strategy.state_layout()}

    def save(self, step: int, reason: str | None = None) -> SaveResult | None:
        """Write a snapshot of `step` on every rank; a failed save is logged, training goes on.

        A save that fails (a rank's disk is too slow, or failing) raises `SnapshotError` on every
        rank inside the manager; the previous snapshot stays the newest, so carrying on is safe.
        A full disk raises `DiskFullError` on every rank instead: training on would only lose
        the steps since the last snapshot, and every later save would fail the same way.
        """
        staged = self.stage(step)
        return staged.save(reason) if staged is not None else None

    def stage(self, step: int) -> LoopSave | None:
        """`save`'s first half (every rank): the strategy's state copied (in the background:
        its device copies queued), nothing read of the loop's state yet, which the metrics
        line may still change; `.save(reason)` reads it and writes (`staged_save.py` says
        why). None where it failed as `save` fails (logged, or `DiskFullError` raised)."""
        s = self.strategy
        start = time.perf_counter()
        rank0 = self.runtime.rank == 0
        # Replicated state: rank 0's alone is written, the others make none. Per rank: every
        # rank's (may be collective: parameter servers).
        strategy = s.state_dict() if rank0 or not self.replicated else None
        shared = {"strategy": strategy if self.replicated else None, "scaler": None} if rank0 \
            else None
        with self._failures(step):
            staged = self.manager.stage(step, shared,
                                        None if self.replicated else {"strategy": strategy},
                                        updated=s.updated_state())
            return LoopSave(self, staged, start)
        return None

    @contextmanager
    def _failures(self, step: int) -> Iterator[None]:
        """A save's failures as `save` says: a full disk raises `DiskFullError`, any other
        `SnapshotError` is logged (the block is left, and the caller goes on)."""
        try:
            yield
        except SnapshotNoSpaceError as e:
            log.debug("snapshot of step %d not saved: %s", step, e)
            need = self.saves[-1][1] if self.saves else newest_snapshot_bytes(self.manager.root)
            raise DiskFullError(no_space_message(self.manager.root, f"the snapshot of step {step}",
                                                 self.saved_step, need)) from None
        except SnapshotError as e:
            log.warning("warning: snapshot of step %d not saved, training goes on: %s", step, e)

    def summary(self) -> dict[str, Any]:
        """Figures for summary.json: saves by this process, their time and size (all ranks)."""
        times = [s for s, _ in self.saves]
        sizes = [b for _, b in self.saves]
        return {
            "snapshot_every": self.every, "snapshots_saved": len(self.saves),
            "snapshot_s_last": times[-1] if times else None,
            "snapshot_s_mean": sum(times) / len(times) if times else None,
            "snapshot_bytes_last": sizes[-1] if sizes else None,
            "snapshot_bytes_mean": sum(sizes) / len(sizes) if sizes else None,
        }

    # -- resuming ------------------------------------------------------------------------------
    def _agreed_step(self, step: int | None) -> int | None:
        """Every rank picked a snapshot on its own (checksums verified): check they agree.

        At the start of a run, when every rank is present: a collective, whatever the strategy.
        """
        rt = self.runtime
        if rt.world_size == 1:
            return step
        t = torch.tensor([-1 if step is None else step] * 2, dtype=torch.int64)
        t[1] = -t[1]
        collectives.all_reduce(t, op=dist.ReduceOp.MAX, group=rt.process_group)
        high, low = int(t[0]), -int(t[1])
        if high != low:
            raise SnapshotError(
                f"ranks disagree on the newest usable snapshot (steps {low} and {high}) in "
                f"{self.manager.root}: is it on a filesystem every rank sees the same way?")
        return None if high < 0 else high

    def resume(self) -> ResumePoint | None:
        """Load the newest committed snapshot that verifies, if any, into the loop's state and
        the strategy; returns where the loop goes on (None: nothing to resume).

        Raises ConfigError when the snapshot's options differ from this run's (naming them),
        when the global batch cannot be kept on this many ranks, or when the state cannot be
        converted to this strategy and layout (naming both, with the world sizes).
        """
        st, rt = self.state, self.runtime
        if rt.rank == 0:  # before any rank saves: the temp folders of saves that never finished
            for p in remove_unfinished(self.manager.root):
                log.info("removed %s, left by a save that did not finish", p)
        with warnings.catch_warnings():
            if rt.rank != 0:  # one report of a skipped snapshot, not one per rank
                warnings.simplefilter("ignore")
            snap = self.manager.latest()
        step = self._agreed_step(snap.step if snap is not None else None)
        if snap is None or step is None:
            skipped = [p for p in self.manager.root.glob("snap-*") if p.is_dir()]
            if skipped and rt.rank == 0:  # each was named in a warning above
                log.warning("warning: none of the %d snapshots in %s can be used; training "
                            "starts afresh from step 0", len(skipped), self.manager.root)
            return None
        meta = snap.metadata
        # --new-schedule's changes: said once every check has passed (below)
        self.schedule_changed = check_options(snap.path, snap.step,
                                              snap.metadata.get("config", {}), self.config,
                                              self.trainer_config, self.steps)
        # Written before layouts were saved: the layout is taken to be this run's.
        saved_topo = {"layout": self.strategy.state_layout(), **(meta.get("topology") or {})}
        own = (saved_topo.get("strategy") == self.strategy.name
               and saved_topo["layout"] == self.strategy.state_layout())
        # Per-rank state saved by another number of ranks: the strategy may name the part
        # this rank takes (None: it cannot be resharded, and the layout-free form is used).
        sources = (None if self.replicated or not own
                   else self.strategy.reshard_sources(int(meta["world_size"])))
        self.global_batch = int(meta["global_batch"])
        self._fit_global_batch(meta)
        if own and (self.replicated or sources is not None or (
                meta["world_size"] == rt.world_size and saved_topo == self._topology())):
            resharded = check_topology(meta, rt.world_size, topology=self._topology(),
                                       reshardable=True)
            shared, per_rank, _ = self.manager.load(
                snap, rank=sources[0] if resharded and sources else None)
            assert shared is not None, "a committed snapshot always has shared.pt"
            if self.replicated:
                self.strategy.load_state_dict(shared["strategy"])
            elif resharded:  # the saved ranks' parts this rank's new share overlaps (ZeRO)
                self.strategy.load_resharded_state_dict(load_strategy_parts(snap, sources or []))
            else:  # the same layout on as many ranks: this rank's own file
                self.strategy.load_state_dict(per_rank["strategy"])
        else:  # another strategy or layout: through the layout-free form
            resharded, per_rank = True, None
            shared = self._load_portable(snap, saved_topo)
        st.load_state_dict(shared["trainer"])
        if not resharded and per_rank is not None:
            set_rng_state(per_rank["rng"])
            st.load_window_state(per_rank)
        else:
            reseed(self.seed, self.strategy.seed_rank(rt.rank), snap.step)
            if rt.rank == 0:
                log.warning(
                    "warning: snapshot of step %d was written by world_size=%d, this run has "
                    "world_size=%d (%s, was %s): random generators (dropout) are seeded afresh "
                    "from (seed, rank, step), so this run is not bit-identical to one without "
                    "the change", snap.step, meta["world_size"], rt.world_size,
                    _layout_text(self._topology()), _layout_text(saved_topo))
            st.restart_window(shared["window_sum"], holder=rt.rank == 0)
        st.resumes.append({"step": snap.step, "world_size": rt.world_size,
                           "saved_world_size": meta["world_size"],
                           "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))})
        self.saved_step = snap.step
        if rt.rank == 0 and self.schedule_changed:
            log.info("--new-schedule: from step %d the learning rate follows this command's "
                     "schedule: %s", snap.step, "; ".join(self.schedule_changed))
        saved_steps = meta.get("config", {}).get("steps")  # said once every check has passed
        if saved_steps is not None and saved_steps != self.steps and rt.rank == 0:
            log.info("the run of %d steps goes on to %d: the learning rate follows the schedule "
                     "of a %d-step run from step %d on (docs/train.md)", saved_steps,
                     self.steps, self.steps, snap.step)
        log.info("resumed from %s: step %d of %d (saved by world_size %d)%s", snap.path, snap.step,
                 self.steps, meta["world_size"],
                 "; nothing left to train: a larger --steps extends the run (--no-resume starts "
                 "afresh)" if snap.step == self.steps else "")
        return ResumePoint(snap.step, self.batch_size, self.grad_accum)

    def _load_portable(self, snap: Snapshot, saved_topo: dict[str, Any]) -> dict[str, Any]:
        """Load a snapshot of another strategy or layout into this one through the layout-free
        form (`ringtrain.strategies.portable`); returns its shared.pt. Every rank reads what
        the source strategy's converter needs (ZeRO: every saved rank's shards)."""
        from ringtrain.strategies import registered  # the registry imports every strategy

        meta = snap.metadata
        shared, _, _ = self.manager.load(snap, rank=0)
        assert shared is not None, "a committed snapshot always has shared.pt"
        saved_name = saved_topo.get("strategy") or meta.get("config", {}).get("strategy")
        source = registered().get(str(saved_name))
        here, there = _layout_text(self._topology()), _layout_text(saved_topo)
        state = None if source is None else source.to_portable(
            lambda ranks: load_strategy_parts(snap, ranks), shared.get("strategy"), meta)

        def own_layout_only(why: str) -> ConfigError:
            return ConfigError(
                f"{snap.path} (step {snap.step}) was saved by {there} on world_size="
                f"{meta['world_size']} and cannot be resumed in {here} on world_size="
                f"{self.runtime.world_size}: {why}. Resume with --strategy {saved_name} on "
                f"world_size={meta['world_size']}, or start afresh with --no-resume or in "
                "another --run-dir")

        if state is None:
            raise own_layout_only(f"--strategy {saved_name}'s snapshots resume only in their own "
                                  "layout")
        state["step"] = snap.step  # for a target that counts steps (local SGD's meetings)
        try:
            self.strategy.load_portable_state_dict(state)
        except NotImplementedError:
            raise own_layout_only(f"--strategy {self.strategy.name} loads no other strategy's or "
                                  "layout's snapshot") from None
        except ValueError as e:
            raise ConfigError(f"{snap.path} (step {snap.step}, saved by {there}) does not load "
                              f"into {here}: {e}") from None
        if self.runtime.rank == 0:
            log.info("resuming a snapshot of %s (world_size=%d) in %s (world_size=%d): the "
                     "model and optimizer state by parameter name", there, meta["world_size"],
                     here, self.runtime.world_size)
        return shared

    def _fit_global_batch(self, meta: dict[str, Any]) -> None:
        """Keep the run's global batch on this run's data ranks (elastic resume)."""
        wd = self.data_world_size
        if self.batch_size * self.grad_accum * wd == self.global_batch:
            return
        b, a = elastic_batch(self.global_batch, wd, self.batch_size,
                             saved_data_world_size=meta["topology"]["data_world_size"])
        log.info("keeping the global batch of %d on %d data ranks: batch_size %d x grad_accum %d "
                 "per rank (was %d x %d on %d)", self.global_batch, wd, b, a, meta["batch_size"],
                 meta["grad_accum"], meta["topology"]["data_world_size"])
        self.batch_size, self.grad_accum = b, a


def _layout_text(topology: dict[str, Any]) -> str:
    """`pipeline, 2 data ranks, pp=2, virtual_stages=1`: a topology in words."""
    layout = ", ".join(f"{k}={v}" for k, v in (topology.get("layout") or {}).items())
    return ", ".join(str(x) for x in (topology.get("strategy"),
                                      f"{topology.get('data_world_size')} data ranks", layout) if x)
