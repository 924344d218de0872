"""The training loop: data, LR schedule, metrics, evaluation, run directory. Model-agnostic.

    trainer = Trainer(strategy, runtime, model_fn, train_set, eval_set, loss_fn, TrainerConfig())
    summary = trainer.fit()

The loop (whose command-line user is `ringtrain train`) knows nothing about the model or how it
is distributed: it hands micro-batches to a `Strategy` and reduces what comes back. Its rules,
each against a classic multi-process bug:
- every rank builds the model from `model_fn` under the same seed (shared initialisation), then
  reseeds from (seed, rank), so dropout differs per rank but is reproducible;
- every rank takes the same number of steps and the same number of evaluation batches, so no
  rank waits in a collective another rank never calls (uneven data never hangs);
- metrics are reduced once per logged step as (sum, count) over the world group, never a mean
  of means; ranks without output contribute 0; decisions (stop early, NaN) use those reduced
  values, which are bit-identical on every rank; a step that logs nothing reads nothing back
  from the device (the loss sum stays a device tensor until then: `LoopState.window`);
- evaluation uses the sampler's exact mode (no padded duplicates);
- every rank runs the loop, also one that reads no data (`data_rank` None, a parameter
  server): it passes no micro-batches, gets count 0 back and joins the same collectives;
- every agreement between ranks (metric sums, the stop vote, the final digest, whether every
  rank is still there for a snapshot) goes through the strategy's `agreement`: collectives for
  lockstep strategies, the store over the ranks still in the job for drifting ones (an async
  parameter server may lose a worker and go on; no snapshot is taken once a rank has left);
  which part of the eval set a rank scores is the strategy's `eval_shard`.
The step counter (with the sampler's state and the metrics window) is the loop's state:
`LoopState` (`ringtrain.training.state`). With `run_dir` and `snapshot_every`,
`ringtrain.checkpoint.resume.Checkpointer` saves it with the model, optimizer and RNG states
every N steps and on SIGTERM, SIGUSR1 or SIGINT (Ctrl-C), and `fit` resumes from the run
directory's newest committed snapshot by itself (`resume=False` starts afresh).

This file is the step loop; what it calls at the edges lives beside it: a logged step's
reduced record (`record.py`), when to save and how to stop on a signal (`snapshots.py`) or
early (`early_stop.py`), the micro-batches (`batches.py`), the end of the run (`ending.py`:
every rank's collectives first, then the last snapshot's write, then the files), and the live
mode's steps (`live.py`: each step is the fault-free run's global batch over whoever is
left; snapshots, metrics and the end are then its rank 0's).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ringtrain.checkpoint.resume import Checkpointer
from ringtrain.checkpoint.run_dir import DiskFullError
from ringtrain.checkpoint.stop import StopSignal
from ringtrain.data.sample_log import SampleLog
from ringtrain.data.sampler import DistributedSampler
from ringtrain.errors import ConfigError
from ringtrain.runtime import Runtime
from ringtrain.strategies.base import StepResult, Strategy
from ringtrain.trace import Tracer
from ringtrain.training.batches import MicroBatches, shard_sampler
from ringtrain.training.config import (
    TrainerConfig,
    adamw,
    autocast,
    compile_problem,
    lr_at,
    param_sha256,
    rank_seed,
)
from ringtrain.training.early_stop import evaluates, stop_met, stopped_at
from ringtrain.training.ending import RunEnd
from ringtrain.training.evaluate import checked_eval_set, eval_sums
from ringtrain.training.live import LiveDriver, LiveSettings, live_driver
from ringtrain.training.metrics_file import RankZeroMetrics
from ringtrain.training.progress import Progress
from ringtrain.training.record import HeldLine, eval_text, flush_held, log_step
from ringtrain.training.snapshots import STOP_SIGNALS, LoopSnapshots
from ringtrain.training.state import RATES, LoopState, WindowSums, token_ids
from ringtrain.types import LossFn, MetricFn, OptimizerFn

__all__ = ["MetricFn", "Trainer", "TrainerConfig", "adamw", "lr_at", "param_sha256", "rank_seed"]

log = logging.getLogger("ringtrain")


class Trainer:
    """Runs `config.steps` optimizer steps of `strategy` on `train_set`, evaluating on `eval_set`.

    Args:
        strategy: how the model is distributed (not yet set up; `fit` calls `setup`).
        runtime: this process's `Runtime`.
        model_fn: builds the plain model; called under the same seed on every rank.
        train_set, eval_set: map-style datasets of (input, target) tensors; eval_set may be None.
        loss_fn: (logits, targets) -> mean loss.
        config: loop settings.
        eval_metrics: name -> fn(logits, targets) giving a per-sample value; reported as the
            mean over the whole eval set under `eval_<name>`.
        run_dir: where rank 0 (live: of now) writes metrics.jsonl, summary.json, report.png.
        optimizer_fn: builds the optimizer from parameters (default: AdamW, `adamw`).
        sample_fn: given the final model on rank 0, a short text for the summary (a generated
            sample, a few answers).
        stop_when: given a reduced metrics record, True to stop early (same answer on all ranks).
        started_at: `time.time()` when the run began (for `wall_s`); default when `fit` starts.
        snapshot_every: steps between snapshots under `run_dir/snapshots` (and one after the
            last step or an early stop's, and on SIGTERM, SIGUSR1 or SIGINT); 0: none (no
            signal is caught).
        keep: committed snapshots kept.
        resume: resume from the newest committed snapshot under `run_dir`, if there is one.
        run_config: options that must equal a snapshot's to resume from it (name -> value, e.g.
            the model's); the trainer adds its own (steps, lr, seed, ...).
        snapshot_timeout_s: bound on each rank's part of a save.
        sync_snapshots: write each snapshot in the step (the step waits for the disk); by
            default the step copies the state to host memory and a thread writes and commits
            it while training goes on (`ringtrain.training.snapshots`).
        trace_steps: (A, B): record a timeline of steps A to B-1 on every rank into
            `run_dir`/trace.json (`ringtrain.trace`); None: none.
        name: names this trainer's store keys (snapshot handshakes, store reductions), the
            same on every rank; a second trainer in one process group that snapshots to the
            same directory, or reduces through the store, needs another name (ValueError).
        live: live recovery (`ringtrain.training.live`): the job's store and bounds. The
            trainer and the strategy then get a one-rank `runtime`
            (`ringtrain.strategies.live_step.one_replica_view`); each generation of the
            members gives them their rank and group.
    """

    def __init__(self, strategy: Strategy, runtime: Runtime, model_fn: Callable[[], nn.Module],
                 train_set: Dataset, eval_set: Dataset | None, loss_fn: LossFn,
                 config: TrainerConfig, *, eval_metrics: dict[str, MetricFn] | None = None,
                 run_dir: str | None = None, optimizer_fn: OptimizerFn | None = None,
                 sample_fn: Callable[[nn.Module], str] | None = None,
                 stop_when: Callable[[dict[str, Any]], bool] | None = None,
                 started_at: float | None = None, snapshot_every: int = 0, keep: int = 2,
                 resume: bool = True, run_config: dict[str, Any] | None = None,
                 snapshot_timeout_s: float = 60.0, name: str = "trainer",
                 trace_steps: tuple[int, int] | None = None, sync_snapshots: bool = False,
                 live: LiveSettings | None = None):
        self.strategy, self.runtime = strategy, runtime
        self.config = config.resolved()
        self.train_set, self.eval_set, self.loss_fn = train_set, checked_eval_set(eval_set), loss_fn
        self.eval_metrics = dict(eval_metrics or {})
        self.run_dir, self.sample_fn, self.stop_when = run_dir, sample_fn, stop_when
        self.started_at = started_at
        self._started = time.time()  # set again by `fit`
        self.on_step: Callable[[int], None] | None = None  # told each finished step (a watchdog)
        self.on_start: Callable[[int, int], None] = lambda first, until: None  # see fit
        c = self.config
        if c.compile and (why := compile_problem(runtime.device)):
            # one line from the ranks, not each rank's traceback from inside the first step
            fix = "triton" if runtime.device.type == "cuda" else "a C++ compiler (apt install g++)"
            raise ConfigError(f"--compile: torch.compile cannot build a {runtime.device.type} "
                              f"kernel here ({why}); install {fix}, or leave out --compile "
                              "(TrainerConfig.compile)")
        torch.manual_seed(c.seed)  # the same initial weights on every rank
        self.model = model_fn()
        self.tracer = Tracer(runtime.rank, trace_steps)  # off (records nothing) without steps
        strategy.trace(self.tracer)  # before setup, which hands it to the engines
        strategy.setup(self.model, optimizer_fn or adamw(c.weight_decay, betas=(c.beta1, c.beta2)),
                       loss_fn)
        if c.compile:
            # From outside the model, after setup: a copy the strategy made in setup (local
            # SGD's weights of the last meeting) stays eager, rather than sharing a compiled
            # call bound to the original. In place, so state_dict names keep no `_orig_mod.`.
            self.model.compile()
        # dropout differs per rank (the tp ranks of a replica: per replica)
        torch.manual_seed(rank_seed(c.seed, strategy.seed_rank(runtime.rank)))
        self.data_rank, self.data_world_size = strategy.data_rank, strategy.data_world_size
        self.agreement = strategy.agreement(runtime, name)  # sums, votes, digests across ranks
        cp_agreement = self.agreement  # live: the one replica's (local), for its snapshots
        samples = SampleLog(self.data_rank) if c.record_samples else None
        self.live: LiveDriver | None = None
        if live is not None:
            self.live = live_driver(strategy, live, runtime, train_set, self.config, samples,
                                    run_dir)
            self.agreement = self.live.agreement  # over the current generation
            self.data_world_size = live.world_size
        self.tracer.align_clocks(self.agreement.gather)  # each rank's offset to rank 0's clock
        self.train_sampler: DistributedSampler | None = None
        if self.data_rank is not None and self.live is None:  # live: the driver's (below)
            self.train_sampler = shard_sampler(train_set, self.data_rank, self.data_world_size,
                                               batch_size=c.batch_size, seed=c.seed)
        # Step, metrics window (per rank, saved so logged losses continue exactly), totals and
        # the sampler's cursor: what a snapshot holds of the loop.
        self.state = LoopState(self.train_sampler, samples=samples)
        self.batches: MicroBatches | None = None
        if self.train_sampler is not None:  # live: the driver takes each step's share
            self.batches = MicroBatches(train_set, self.train_sampler, batch_size=c.batch_size,
                                        samples=self.state.samples,
                                        pin=runtime.device.type == "cuda")
        self.metrics = RankZeroMetrics(run_dir, rank=lambda: self.runtime.rank)  # live: moves
        self.held = HeldLine(list(self.eval_metrics)) if live is not None else None  # record.py
        self.resume = resume
        self.end = RunEnd(strategy, self.tracer, list(self.eval_metrics), run_dir=run_dir,
                          sample_fn=sample_fn, model=self.model, model_fn=model_fn)
        self.checkpointer: Checkpointer | None = None
        self.snapshots: LoopSnapshots | None = None
        if run_dir is not None:
            # Live: the members' rank 0 writes a one-replica snapshot alone (another member may
            # be lost in the middle of a save); a whole-job restart resumes it on every member.
            self.checkpointer = Checkpointer(
                self.state, strategy, runtime, cp_agreement, self.config,
                self.data_world_size, os.path.join(run_dir, "snapshots"), every=snapshot_every,
                keep=keep, timeout_s=snapshot_timeout_s, run_config=run_config, name=name)
            self.snapshots = LoopSnapshots(self.checkpointer, cp_agreement, self.state,
                                           rank=runtime.rank, background=not sync_snapshots)

    def _join_live(self) -> bool:
        """Join the live job (a replacement: at its healer's step); False: the job ended first."""
        assert self.live is not None
        try:
            at = self.live.join(self.step)
        except BaseException:
            self.live.close("failed")
            raise
        if at is None:
            self.live.close()
            return False
        self.state.step, self.runtime = at, self.live.runtime
        return True

    def _writes_snapshots(self) -> bool:
        """Whether this process saves snapshots: every rank, or in live mode rank 0 alone."""
        return self.live is None or self.live.runtime.rank == 0

    @property
    def step(self) -> int:
        return self.state.step

    def _autocast(self):
        return autocast(self.config.dtype, self.runtime.device)

    # -- the loop --------------------------------------------------------------------------------
    def _log(self, step: int, lr: float, evaluated: bool) -> dict[str, Any]:
        """Reduce the window's sums (and eval sums) once; rank 0 writes the metrics line."""
        evaluate = (lambda: eval_sums(self.strategy, self.eval_set, self.loss_fn,
                                      self.eval_metrics, self.config.eval_batch_size,
                                      self._autocast)) if evaluated else None
        return log_step(self.state, self.agreement, self.metrics, step, lr,
                        started=self._started, evaluate=evaluate,
                        eval_names=list(self.eval_metrics), held=self.held)

    def fit(self) -> dict[str, Any]:
        """Train, evaluate, and write the run directory; returns the summary (on every rank).

        Resumes first from the newest committed snapshot under `run_dir` (unless `resume` is
        False). After SIGTERM, SIGUSR1 or SIGINT it saves a snapshot and returns early, with
        `stopped_by` set to the signal's name.
        When a snapshot finds the disk full it returns early on every rank too, with
        `disk_full` holding the message (see `ringtrain.checkpoint.run_dir`).
        """
        started = self._started = self.started_at or time.time()
        cp = self.checkpointer
        # A live replacement heals from a live peer, never from the disk.
        original = self.live is None or self.live.register()
        resumed_at = cp.resume() if cp is not None and self.resume and original else None
        if self.live is not None and not self._join_live():
            return {"steps": self.step, "stopped_by": None, "live_admitted": False}
        if resumed_at is not None:
            # An elastic resume keeps the global batch with another per-rank layout.
            self.config = replace(self.config, batch_size=resumed_at.batch_size,
                                  grad_accum=resumed_at.grad_accum).resolved()
            if self.batches is not None:  # the sampler's cursor moved: a new iterator
                self.batches.restart(self.config.batch_size)
        c = self.config
        progress = Progress(c.steps, enabled=c.progress and self.runtime.rank == 0,
                            initial=self.step, log_every=c.log_every)  # a line per log_every
        done = (resumed_at is not None and self.eval_set is not None  # then nothing is trained
                and stopped_at(self.state.last, self.step, self.stop_when, eval_every=c.eval_every,
                               steps=c.steps, say=self.runtime.rank == 0))
        if original:  # resumed: lines after the snapshot go (trained again); live: metrics_file
            self.metrics.open(resume_at=self.step if self.step > 0 else None)
            # Not before: a resume refused leaves the run as it was.
            self.on_start(self.step, self.step if done else c.steps)
        catch = cp is not None and cp.every > 0
        disk_full = agreed = None
        try:
            with StopSignal(STOP_SIGNALS) if catch else nullcontext() as stop:
                try:
                    stopped = None if done else self._loop(progress, stop,
                                                           resumed=resumed_at is not None)
                except DiskFullError as e:  # raised by the same save on every rank: all stop
                    stopped, disk_full = "disk full", str(e)
            if not stopped:  # every rank's end collectives, then the last write (`ending.py`)
                agreed = self.end.agree(self.runtime, self.agreement, self.state, self.config,
                                        self.data_world_size, started=started,
                                        live=self.live is not None)
                try:
                    if self.snapshots is not None:  # the last snapshot, written meanwhile
                        self.snapshots.wait()
                except DiskFullError as e:
                    stopped, disk_full = "disk full", str(e)
        except BaseException:
            if self.snapshots is not None:  # a snapshot in the background: committed, or none
                self.snapshots.settle()
            if self.live is not None:
                self.live.close("failed")
            raise
        finally:
            progress.close()
            self.metrics.close()
            if self.snapshots is not None:
                self.snapshots.close()  # the writer process of background snapshots
        try:
            if stopped or agreed is None:
                return {"steps": self.step, "stopped_by": stopped, "run_dir": self.run_dir,
                        "snapshot_step": cp.saved_step if cp is not None else None,
                        "disk_full": disk_full}
            return self.end.write(agreed, self.runtime, cp, self.metrics.records,
                                  report=self.config.report)
        finally:
            if self.live is not None:  # after the final digest: waiting replacements may exit
                self.live.close()

    def _loop(self, progress: Progress, stop: StopSignal | None = None,
              resumed: bool = False) -> str | None:
        """The steps; returns the signal it stopped early on ("SIGTERM", "SIGINT"), else None."""
        c, s, cp, snaps = self.config, self.strategy, self.checkpointer, self.snapshots
        if self.live is not None:  # a survivor waiting for a replacement stops waiting on it
            self.live.stop = stop
        while self.step < c.steps:
            lr = lr_at(self.step, c)
            micro = [self.batches.next() for _ in range(c.grad_accum)] if self.batches else []
            t0 = time.perf_counter()
            with self._autocast(), self.tracer.step(self.step + 1):
                if self.live is None:
                    res: StepResult = s.train_step(micro, lr=lr, grad_clip=c.grad_clip)
                else:  # this step's share over whoever is left (recovered in there)
                    res, micro = self.live.step(lr, c.grad_clip)
                    self.runtime = self.live.runtime
            ids = bool(micro) and token_ids(micro[0][0])  # else the rate counts samples
            per_sample = micro[0][0][0].numel() if ids else 1
            reads_data = 1.0 if self.data_rank is not None else 0.0  # whose times are averaged
            self.state.add(WindowSums(loss_sum=res.loss_sum, count=res.count,
                                      tokens=res.count * per_sample,
                                      id_samples=res.count if ids else 0,
                                      compute_s=res.compute_s, comm_s=res.comm_s,
                                      worker_steps=reads_data),
                           time.perf_counter() - t0)
            self.state.step += 1
            if self.state.samples is not None and self.live is None:  # live: the driver's
                self.state.samples.end_step(self.step)
            if resumed:  # the figure behind "recovery time": from a kill to this line
                resumed = False
                self.state.resumes[-1]["first_step_unix"] = time.time()
                log.info("first step after resuming: step %d at unix time %.3f", self.step,
                         self.state.resumes[-1]["first_step_unix"])
            progress.update(self.step)
            if self.on_step is not None:
                self.on_step(self.step)
            last = self.step == c.steps
            evaluated = self.eval_set is not None and evaluates(self.step, eval_every=c.eval_every,
                                                                steps=c.steps)
            logged = self.step % c.log_every == 0 or evaluated or last
            # A snapshot's copies first, the metrics line (which waits for the device) after:
            # the host copies while the device trains (`ringtrain.checkpoint.staged_save`).
            staged = (snaps.stage(self.step) if snaps is not None and cp is not None
                      and cp.due(self.step) and self._writes_snapshots() else None)
            if logged:
                rec = self._log(self.step, lr, evaluated)
                last = self.state.last
                shown = {n: last[f"eval_{n}"] for n in self.eval_metrics if f"eval_{n}" in last}
                key, label = RATES[self.state.unit]
                progress.set_metrics(rec["loss"], rec[key], label, **shown)
                if evaluated and stop_met(rec, self.stop_when):
                    log.info("stopping early at step %d: %s", self.step, eval_text(rec))
                    if staged is None and cp is not None and cp.every > 0 \
                            and self._writes_snapshots():  # else run again it trains afresh
                        staged = snaps.stage(self.step)
                    if staged is not None:  # a resume finds the stop (`early_stop.stopped_at`)
                        staged.save("early stop")
                    break
                if evaluated:
                    log.info("step %d: %s", self.step, eval_text(rec))
            if staged is not None:
                staged.save()
            # Every step, every rank: did any rank get a stop signal? (An agreement whose ranks
            # drift apart answers at metric steps only, which every rank shares.)
            if stop is not None and self.agreement.vote(stop.received is not None,
                                                        at_shared_step=logged):
                assert snaps is not None  # this rank or another got a stop signal
                if not self._writes_snapshots():  # live: the members' rank 0 saves
                    return "SIGTERM" if stop.received is None else signal.Signals(
                        stop.received).name
                return snaps.stop(self.step, stop)
        if self.live is not None:  # a member lost after the last step: the next generation ends
            self.runtime = self.live.settle(lambda: flush_held(self.held, self.agreement,
                                                               self.metrics, self.state))
            if cp is not None and cp.due(self.step) and self._writes_snapshots():
                snaps.save_once(self.step)  # rank 0 now: the lost one's last save, if it was due
        # The last snapshot may still be being written: `fit` joins it after the end's
        # collectives, which rank 0 would otherwise keep the others waiting in (issue 26).
        return None

    def final_model(self) -> nn.Module:
        """The whole model after `fit()`, as a plain module (to export): the one given to the
        strategy may no longer be it (tp replaced its layers by this rank's slices; ZeRO 3
        frees its parameters between uses)."""
        return self.end.final_model()
