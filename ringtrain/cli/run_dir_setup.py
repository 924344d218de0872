"""What a `ringtrain train` job does to its run directory before it trains: whose it is, and
what of an earlier run stays in the way.

    held = take_run_dir(run_dir, rt)        # one run per directory (rank 0's lock), or ConfigError
    resume = resume_or_clear(opts, rt, log)  # --no-resume, --resume-from, a finished run extended
    trainer.on_start = when_started(opts, rt, record, log)  # once the resume is accepted

Rank 0 decides and moves; the others learn its outcome through the store where they must wait
for it (`_decided_by_rank0`). Nothing is deleted: what an earlier run left that would mislead
this one is set aside under RUN_DIR/set-aside/ (`checkpoint/rewind.py`), on the job's first start
only (a restarted worker goes on with the run it belongs to).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ringtrain.checkpoint.run_dir import unless_full
from ringtrain.cli.options import TrainOptions
from ringtrain.errors import ConfigError
from ringtrain.models.export import CONFIG, WEIGHTS

# A finished run's end: what --resume-from and a resume past the end move aside together.
END_FILES = ("summary.json", WEIGHTS, CONFIG, "report.png")


def _first_start() -> bool:
    """Whether the job starts for the first time: not restarted by the launcher, not requeued
    by Slurm (the same command again), not a live replacement (the job's snapshots stay)."""
    from ringtrain.launch.live_agent import REPLACEMENT_ENV

    restarts = (os.environ.get(name, "0") for name in ("TORCHELASTIC_RESTART_COUNT",
                                                        "SLURM_RESTART_COUNT"))
    return not any(int(n or 0) for n in restarts) and not os.environ.get(REPLACEMENT_ENV)


def resume_or_clear(opts: TrainOptions, rt, log) -> bool:
    """Whether to resume; on the job's first start only, --no-resume makes rank 0 set the
    earlier run aside whole (`_start_afresh`), --resume-from STEP the later snapshots
    (`_rewind`); a finished run with no snapshot to go on from is refused (`_past_end`).
    Nothing is deleted.

    A restarted worker resumes from the newest: it must continue the run it belongs to.
    """
    run = opts.run
    if not _first_start():
        return True
    if run.resume_from is not None:
        _rewind(run, rt, log)
    if run.resume:
        _decided_by_rank0(rt, GO_ON_KEY, lambda: _other_start(run) or _past_end(run.run_dir),
                          f"rank 0 did not say within 10 minutes whether --run-dir "
                          f"{run.run_dir}'s earlier run can go on")
        return True
    if rt.rank == 0:
        _start_afresh(run.run_dir, log)
    return False


def _start_afresh(run_dir: str, log) -> None:
    """--no-resume: move what an earlier run left in `run_dir` (its snapshots, config, metrics,
    summary, final model, report, TensorBoard events, trace) to RUN_DIR/set-aside/fresh-<time>/,
    where no resume looks. The other ranks need not wait: their first save comes after steps
    that rank 0 takes part in, so after the move."""
    import time

    from ringtrain.checkpoint.rewind import FRESH_PREFIX, set_aside
    from ringtrain.training.tensorboard import SUBDIR

    names = ("snapshots", "config.json", "metrics.jsonl", *END_FILES, SUBDIR, "trace.json")
    into = os.path.join(run_dir, "set-aside", FRESH_PREFIX + time.strftime("%Y%m%d-%H%M%S"))
    if moved := set_aside([os.path.join(run_dir, n) for n in names], into=into):
        log.info("--no-resume: the earlier run's %s set aside in %s (delete it when it is no "
                 "longer needed)", ", ".join(os.path.basename(p) for p in moved), into)


GO_ON_KEY = "ringtrain/train/go_on"  # rank 0's outcome: "ok" or why the run cannot go on


def not_a_run(run_dir: str) -> str | None:
    """Why `run_dir` cannot take a run, or None: it is a prepared dataset or an export, whose
    files a run would write into (config.json and model.safetensors over an export's)."""
    from ringtrain.cli.dir_contents import holds
    from ringtrain.data.prepare import META

    kind = holds(run_dir)
    if kind == "a prepared dataset":
        return (f"--run-dir {run_dir} is a prepared dataset ({META}, train.bin), not a run "
                f"directory: a run would write its files among them. Give the run a directory "
                f"of its own (and this one as --data {run_dir})")
    if kind is not None and kind.endswith("export"):
        return (f"--run-dir {run_dir} holds {kind}, not a run: a run would write its "
                f"config.json and model.safetensors over it. Give the run a directory of its "
                f"own (--init-from {run_dir} starts it from that model)")
    return None


def has_snapshot(run_dir: str) -> bool:
    """Whether RUN_DIR/snapshots holds a committed snapshot (a run there to resume)."""
    from ringtrain.checkpoint.files import COMMITTED, snap_dirs

    return any((p / COMMITTED).is_file() for p in snap_dirs(Path(run_dir) / "snapshots"))


def _run_args(run_dir: str) -> dict | None:
    """The options the run in `run_dir` was started with (its config.json's), or None."""
    import json

    try:
        with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
            args = json.load(f)["args"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return args if isinstance(args, dict) else None


def _other_start(run) -> str:
    """Rank 0, resuming: why --init-from cannot be taken (the run to resume started from other
    weights, and a resume goes on with its snapshot's), or "". The same command again (the
    run's own --init-from) resumes."""
    if not run.init_from or not has_snapshot(run.run_dir):
        return ""
    args = _run_args(run.run_dir)
    started = "?" if args is None else args.get("init_from")
    if started and os.path.realpath(started) == os.path.realpath(run.init_from):
        return ""
    was = ("random weights" if started is None else "weights this ringtrain cannot read back"
           if started == "?" else f"--init-from {started}")
    return (f"--init-from {run.init_from}: --run-dir {run.run_dir} holds a run to resume, which "
            f"started from {was}, and a resume goes on with its snapshot's weights, not these. "
            f"--no-resume starts afresh from {run.init_from} (the earlier run is set aside in "
            f"{run.run_dir}/set-aside/); or give another --run-dir; or drop --init-from to resume")


def _past_end(run_dir: str) -> str:
    """Rank 0, resuming: "ok", or why a finished run in `run_dir` cannot go on (a finished
    run and no snapshot)."""
    import json

    try:
        with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
            ended = int(json.load(f)["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return "ok"  # never ended, or an end this code cannot read: left as it is
    root = os.path.join(run_dir, "snapshots")
    if not has_snapshot(run_dir):
        # Resuming nothing would train from step 0 over the run's metrics, model and summary.
        every = (_run_args(run_dir) or {}).get("snapshot_every")
        why = ("it ran with --snapshot-every 0" if every == 0 else
               f"its {ended} steps took none at --snapshot-every {every}"
               if isinstance(every, int) and ended < every else f"{root} holds none")
        return (f"--run-dir {run_dir} holds a finished run of {ended} steps and no snapshot to "
                f"go on from ({why}): training now would start at step 0 and replace its "
                f"results. --no-resume sets that run aside in {run_dir}/set-aside/ and trains "
                f"afresh; or give another --run-dir (--init-from {run_dir} starts a new run "
                f"from its final model)")
    return "ok"


def when_started(opts: TrainOptions, rt, record: dict, log) -> Callable[[int], None]:
    """What rank 0 does once the run's resume is accepted (`Trainer.on_start`, told the steps
    the run trains from and to): a finished run's end set aside where the run goes past it
    (`_set_aside_end`; not an early stop run again, which trains nothing), and `record` written as
    config.json. Not before: a command whose resume is refused (other options, fewer --steps,
    the data changed) leaves the run directory as it was, which explain and sample read."""
    def start(step: int, until: int) -> None:  # the run trains from `step` to `until`
        from ringtrain.training.progress import write_json

        if rt.rank != 0:
            return
        if opts.run.resume and _first_start():
            _set_aside_end(opts.run.run_dir, until, log)
        unless_full(write_json, os.path.join(opts.run.run_dir, "config.json"), record)

    return start


def _set_aside_end(run_dir: str, steps: int, log) -> None:
    """A finished run resumed for more steps: its end (summary, final model, report) described
    the run as over at that step, and `ringtrain sample`, `export` and `explain` presented it as
    the run's, an older model than the snapshots training writes since. It moves to
    RUN_DIR/set-aside/end-STEP-<time>/, so they read the run as one in progress (the newest
    snapshot) until its new end is written. Nobody else reads these files before the end."""
    import json
    import time

    from ringtrain.checkpoint.rewind import END_PREFIX, set_aside

    try:
        with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
            ended = int(json.load(f)["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # never ended (or set aside already), or an end this code cannot read
    if ended >= steps:
        return
    into = os.path.join(run_dir, "set-aside",
                        f"{END_PREFIX}{ended}-{time.strftime('%Y%m%d-%H%M%S')}")
    if moved := set_aside([os.path.join(run_dir, n) for n in END_FILES], into=into):
        log.info("the run goes on from its end at step %d to --steps %d: that end's %s set aside "
                 "in %s (until the run ends again, `ringtrain sample` and `export` read its "
                 "newest snapshot)", ended, steps, ", ".join(p.name for p in moved), into)


LOCK_KEY = "ringtrain/train/run_dir_lock"  # rank 0's outcome, per restart: "ok" or who holds it


def take_run_dir(run_dir: str, rt) -> int | None:
    """Rank 0 takes RUN_DIR's lock for the run (`checkpoint/run_lock.py`: a second run in the
    same directory is refused, naming the first); the others wait for its word in the store.
    RunDirInUse (a ConfigError) on every rank, one message; rank 0's lock file otherwise."""
    from ringtrain.checkpoint.run_lock import hold_run_dir
    from ringtrain.launch.live_agent import REPLACEMENT_ENV, SPARE_ENV

    if os.environ.get(SPARE_ENV) or os.environ.get(REPLACEMENT_ENV):
        return None  # --live: it joins the run that holds the lock (its rank 0 may be stuck)
    held = None

    def take() -> str:
        nonlocal held
        try:
            held = hold_run_dir(run_dir)
        except ConfigError as e:
            return str(e)
        return "ok"

    # Per attempt: torchrun's store outlives a restart, whose new rank 0 takes the lock again.
    _decided_by_rank0(rt, f"{LOCK_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT') or 0}",
                      take, f"rank 0 did not say within 10 minutes whether it could take "
                            f"--run-dir {run_dir}'s lock")
    return held


def _decided_by_rank0(rt, key: str, decide: Callable[[], str], silent: str) -> None:
    """Rank 0 runs `decide` ("ok", or the mistake in words) and tells the others through the
    store under `key`; a mistake is a ConfigError on every rank. The others wait at most 10
    minutes, then raise `silent` (the message)."""
    from datetime import timedelta

    if rt.rank == 0:
        outcome = decide()
        if rt.world_size > 1:
            rt.store.set(key, outcome)
    else:
        try:
            rt.store.wait([key], timedelta(minutes=10))
        except RuntimeError:  # torch's store timeout (DistStoreError is one)
            raise ConfigError(silent) from None
        outcome = rt.store.get(key).decode()
    if outcome != "ok":
        raise ConfigError(outcome)


REWIND_KEY = "ringtrain/train/resume_from"  # rank 0's outcome: "ok" or the reason it refused


def _rewind(run, rt, log) -> None:
    """--resume-from STEP: rank 0 moves the snapshots after STEP, with the abandoned run's
    final model and summary (and a copy of its metrics), to RUN_DIR/set-aside/ before any rank
    looks for the newest snapshot; the others wait for its word. ConfigError on every rank when
    there is no intact snapshot of STEP (nothing moved)."""
    def set_aside() -> str:
        import time

        from ringtrain.checkpoint.files import snap_step
        from ringtrain.checkpoint.rewind import set_aside_after

        def here(name: str) -> str:
            return os.path.join(run.run_dir, name)

        into = here(f"set-aside/after-{run.resume_from}-{time.strftime('%Y%m%d-%H%M%S')}")
        try:  # the abandoned run's end is moved; its metrics, which the resume trims, copied
            moved = set_aside_after(
                here("snapshots"), run.resume_from, into=into, copy=[here("metrics.jsonl")],
                move=[here(n) for n in END_FILES])
        except ValueError as e:
            return str(e)
        if moved:
            steps = ", ".join(str(snap_step(p)) for p in reversed(moved))
            log.info("--resume-from %d: %s, with the final model and summary of the run that "
                     "made %s and a copy of its metrics.jsonl, set aside in %s", run.resume_from,
                     f"the later snapshot (step {steps})" if len(moved) == 1 else
                     f"the {len(moved)} later snapshots (steps {steps})",
                     "it" if len(moved) == 1 else "them", into)
        return "ok"

    # The others' wait: hashing the snapshot's files takes rank 0 about a second per GB.
    _decided_by_rank0(rt, REWIND_KEY, set_aside, f"--resume-from {run.resume_from}: rank 0 did "
                      "not say within 10 minutes whether the later snapshots were set aside")
