"""`ringtrain train`: train a GPT on the embedded addition task or on your own text.

    ringtrain train                                  # 2-digit addition, one process
    ringtrain train --nproc-per-node 2               # the same on 2 processes (`make demo`)
    ringtrain train --data input.txt --steps 3000    # character-level LM on your text

With `--nproc-per-node N` > 1 it relaunches itself through `ringtrain run` (the elastic
launcher): the launching side writes the options to RUN_DIR/.options.json first and the
workers read them from there (`RINGTRAIN_CONFIG` names the file), so a worker runs exactly the
options that were checked. Rank 0 writes config.json, with what only the job knows (world
size, model, resolved trainer), once the run starts: a command refused (its resume, for other
options) leaves the run's own. Each worker starts the process
group, trains, and rank 0 prints the progress bar and the summary. Each run writes
`runs/<timestamp>/` (or `--run-dir`): config.json, metrics.jsonl, summary.json, report.png, the
final model (model.safetensors + model_config.json, `ringtrain sample` reads them), and
snapshots/ every `--snapshot-every` steps and on SIGTERM. What is trained (the task's data and
GPT) is `ringtrain.cli.job`; `--data DIR` takes a `ringtrain prepare` directory.

    ringtrain train --run-dir runs/a --nproc-per-node 2 --max-restarts 3  # restart and resume
    ringtrain train --run-dir runs/a --nproc-per-node 3                   # resume on 3 workers

A run directory with a committed snapshot is resumed by itself (`--no-resume` starts afresh).
After SIGTERM, SIGUSR1 (Slurm's `--signal=USR1@90`) or Ctrl-C (SIGINT) every worker saves the
same step; `ringtrain train` says how to resume and exits with 143 after SIGTERM or SIGUSR1
(`REQUEUE_EXIT_CODE`, "requeue me"), 130 after Ctrl-C. Run directly under `srun -n N` (one task
per process) it does the same on each task (docs/clusters.md).

A mistake in the options exits with 2 after one message: `check_args` finds most before any
worker starts; what only the workers can find (a snapshot written with other options) raises
`ConfigError` on every rank, rank 0 prints it and the launcher adds nothing. An unusable
`--run-dir` (a file, read-only, full) is one message and exit 2 before any worker starts; a disk
that fills up during the run stops every rank at its last committed snapshot, with one message
(where, how full, the fix) and exit code 74 (`ringtrain.checkpoint.run_dir`; every exit
code: `exits.py`).

    ringtrain train --strategy ps --servers 1 --ps-mode async --nproc-per-node 4

With `--strategy ps --ps-mode async|ssp`, a worker other than rank 0 that dies is dropped with
a warning and the others finish the run (`tolerated_ranks`); any other death ends the job.

This file parses and checks the options, says the warnings and makes the run directory; then
`relaunch.py` decides where this process stands (the typed command, or a launched worker) and
starts the workers through the launcher, `worker.py` runs one worker's part of the job
(`run_job`), and `exits.py` holds the exit codes and says a mistake once.
"""

from __future__ import annotations

import os
import sys
import time

from ringtrain.checkpoint.run_dir import RunDirError, check_run_dir
from ringtrain.cli.exits import interrupted
from ringtrain.cli.relaunch import (
    in_launched_worker,
    job_rank,
    known_world_size,
    needs_launcher,
    relaunch,
)
from ringtrain.cli.run_dir_setup import not_a_run
from ringtrain.cli.train_args import build_parser, check_args, given_options, options_from
from ringtrain.cli.worker import run_job
from ringtrain.errors import USAGE_EXIT_CODE


def main(argv: list[str] | None = None) -> int:
    """`ringtrain train ARGS`; returns the exit code (0, 2 for a mistake, 128 + a signal)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before any worker started (importing torch takes seconds)
        return interrupted()


def _main(argv: list[str] | None) -> int:
    started_at = float(os.environ.get("RINGTRAIN_STARTED_AT", time.time()))
    parser = build_parser()
    try:
        given, from_file = given_options(parser, sys.argv[1:] if argv is None else argv,
                                         launched=in_launched_worker())
    except SystemExit as e:  # --help (0) or a bad option (2): argparse has printed why
        return int(e.code or 0)
    try:
        opts = options_from(given, parse_text=from_file)
        warnings = check_args(opts, world_size=known_world_size(opts))
    except ValueError as e:
        if in_launched_worker():  # every rank finds it: said once, by rank 0, once they meet
            if "opts" not in locals():  # not even the options could be built: say it here
                print(f"ringtrain train: error: {e}", file=sys.stderr)
                return USAGE_EXIT_CODE
            return run_job(opts, started_at, mistake=e)
        parser.print_usage(sys.stderr)
        print(f"ringtrain train: error: {e}", file=sys.stderr)
        return USAGE_EXIT_CODE
    run = opts.run
    if not in_launched_worker():  # said once, where the command was typed
        for warning in warnings:
            print(f"ringtrain train: warning: {warning}", file=sys.stderr, flush=True)
    try:
        if run.run_dir is None and job_rank() == 0:
            # Decided once, before any relaunch, so all workers agree; under an outside launcher
            # only rank 0 (the one that writes) makes one.
            run.run_dir = new_run_dir()
        if run.run_dir is not None and not in_launched_worker():
            # Before any worker starts: an unusable directory is one line, not a traceback per
            # worker. Launched workers skip it (their launcher checked; one failing alone would
            # leave the others waiting for it).
            check_run_dir(run.run_dir)
            if why := not_a_run(run.run_dir):
                raise ValueError(why)
            if run.resume_from is not None:  # the workers set the later ones aside
                from ringtrain.checkpoint.rewind import check_step

                check_step(os.path.join(run.run_dir, "snapshots"), run.resume_from)
    except (RunDirError, ValueError) as e:
        print(f"ringtrain train: error: {e}", file=sys.stderr)
        return USAGE_EXIT_CODE
    if needs_launcher(opts.launch):
        return relaunch(opts, started_at)
    return run_job(opts, started_at)


def new_run_dir(root: str = "runs") -> str:
    """runs/<timestamp>, made unique (and created) so two runs never share one."""
    base = os.path.join(root, time.strftime("%Y%m%d-%H%M%S"))
    path, n = base, 0
    while True:
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            n += 1
            path = f"{base}-{n}"
        except OSError as e:
            raise RunDirError(f"cannot create the run directory {path} ({e.strerror}); pass "
                              "--run-dir with a directory you can write to") from None


if __name__ == "__main__":
    sys.exit(main())
