"""`ringtrain train`: train a GPT on the embedded addition task or on your own text.

    ringtrain train                                  # 2-digit addition, one process
    ringtrain train --nproc-per-node 2               # the same on 2 processes (`make demo`)
    ringtrain train --data input.txt --steps 3000    # character-level LM on your text

With `--nproc-per-node N` > 1 it relaunches itself through `ringtrain run` (the elastic
launcher): the launching side writes the options to RUN_DIR/config.json first and the workers
read them from there (`RINGTRAIN_CONFIG` names the file), so a worker runs exactly the options
that were checked, and the file says what ran even if no worker starts. Rank 0 rewrites it with
what only the job knows (world size, model, resolved trainer). Each worker starts the process
group, trains, and
rank 0 prints the progress bar and the summary. Each run writes `runs/<timestamp>/` (or
`--run-dir`): config.json, metrics.jsonl, summary.json, report.png, the final model
(model.safetensors + model_config.json, `ringtrain sample` reads them), and snapshots/ every
`--snapshot-every` steps and on SIGTERM. What is trained (the task's data and GPT) is
`ringtrain.cli.job`; `--data DIR` takes a `ringtrain prepare` directory.

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
(where, how full, the fix) and exit code 74 (`ringtrain.checkpoint.run_dir`).

    ringtrain train --strategy ps --servers 1 --ps-mode async --nproc-per-node 4

With `--strategy ps --ps-mode async|ssp`, a worker other than rank 0 that dies is dropped with
a warning and the others finish the run (`tolerated_ranks`); any other death ends the job.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from dataclasses import asdict
from datetime import timedelta

from ringtrain.checkpoint.run_dir import (
    DISK_FULL_EXIT_CODE,
    RunDirError,
    check_run_dir,
    unless_full,
)
from ringtrain.cli.job import build_job, export_final
from ringtrain.cli.options import TrainOptions
from ringtrain.cli.step_hook import STEP_HOOK_ENV, load_step_hook
from ringtrain.cli.train_args import (
    CONFIG_ENV,
    build_parser,
    check_args,
    given_options,
    options_from,
    run_config,
    tolerated_ranks,
    write_options,
)
from ringtrain.errors import REQUEUE_EXIT_CODE, USAGE_EXIT_CODE, ConfigError

# What a launched worker exits with after it stopped on a signal (SIGTERM, SIGUSR1 or SIGINT)
# and saved a snapshot: 143, whichever signal it was (the launcher's failure report knows it).
STOPPED_EXIT_CODE = REQUEUE_EXIT_CODE
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # Ctrl-C outside the training loop: nothing saved
MISTAKE_WAIT_S = 10.0  # how long a rank waits for the others to find the same ConfigError
# DISK_FULL_EXIT_CODE (74): stopped at its last committed snapshot, the run directory was full.


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


def _under_agent() -> bool:
    """torch's elastic agent (`ringtrain run`, torchrun) started this process."""
    return "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def _outside_job() -> tuple[int, int] | None:
    """(rank, world_size) when a launcher started this process as one of several: the agent,
    or one that starts every process itself (`srun -n N`, `mpirun`, a PyTorchJob); else None.
    A broken environment is None here: `init_distributed` says what is wrong with it."""
    from ringtrain.errors import ConfigError
    from ringtrain.launch.environments import detect
    from ringtrain.runtime import DistributedInitError

    try:
        env = detect(os.environ)
    except (DistributedInitError, ConfigError, ValueError):
        return None
    return (env.rank, env.world_size) if env.world_size > 1 or _under_agent() else None


def _in_launched_worker() -> bool:
    """One of the job's processes, started by a launcher (not the command a user typed)."""
    return _under_agent() or _outside_job() is not None


def _bf16_supported(device) -> bool:
    import torch

    if not torch.amp.autocast_mode.is_autocast_available(device.type):
        return False
    if device.type == "cuda":  # only asked on a CUDA device: never a torch.cuda call on CPU
        return torch.cuda.is_bf16_supported()
    return True


def run_job(opts: TrainOptions, started_at: float, mistake: ValueError | None = None) -> int:
    """One worker: start the process group, train, print the summary on rank 0.

    `mistake`: what `check_args` found wrong in this worker only (where the launcher could not
    know the number of ranks); it is reported like a `ConfigError`, once the ranks have met.
    """
    import torch

    from ringtrain.launch.launcher import record
    from ringtrain.launch.process_group import destroy_distributed, init_distributed
    from ringtrain.strategies import make_strategy
    from ringtrain.training.progress import format_summary, setup_logging, write_json
    from ringtrain.training.trainer import Trainer

    def job() -> int:
        if _under_agent():
            from ringtrain.launch.parent import die_with_parent

            die_with_parent()  # a SIGKILLed launcher must not leave this worker running
        job_rank = (_outside_job() or (0, 1))[0]
        setup_logging(job_rank)  # before init: rank 0 says which launcher it found
        launch, run = opts.launch, opts.run
        rt = init_distributed(launch.backend, device=launch.device)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", rt.world_size))
        # Workers of one machine share its cores: more threads than cores makes every op wait.
        torch.set_num_threads(launch.threads or max(1, (os.cpu_count() or 1) // local_world))
        log = setup_logging(rt.rank)
        try:
            if mistake is not None:
                raise ConfigError(str(mistake))
            step_hook = load_step_hook(os.environ.get(STEP_HOOK_ENV))  # before any work is done
            config = opts.trainer
            if config.dtype == "bf16" and not _bf16_supported(rt.device):
                log.warning("warning: bf16 autocast is not supported on %s; training in fp32",
                            rt.device)
                config.dtype = "fp32"
            if rt.world_size > 1:  # under an outside launcher only rank 0 named a run dir
                holder = [run.run_dir]
                torch.distributed.broadcast_object_list(holder, src=0, group=rt.process_group)
                run.run_dir = holder[0]
            job = build_job(opts)  # --data FILE.txt: prepared into the run directory
            if rt.rank == 0:
                os.makedirs(run.run_dir, exist_ok=True)
                unless_full(write_json, os.path.join(run.run_dir, "config.json"), {
                    "task": opts.task, "world_size": rt.world_size, "args": opts.flat(),
                    "model": asdict(job["model_config"]), "trainer": asdict(config.resolved())})
            resume = _resume_or_clear(opts, rt.rank, log)
            strategy = make_strategy(run.strategy, runtime=rt, **opts.strategy.kwargs())
            stop_when = None
            if run.stop_at_accuracy is not None:
                def stop_when(rec):
                    return rec.get("eval_accuracy", 0.0) >= run.stop_at_accuracy
            trainer = Trainer(strategy, rt, job["model_fn"], job["train_set"], job["eval_set"],
                              job["loss_fn"], config, eval_metrics=job["eval_metrics"],
                              run_dir=run.run_dir, sample_fn=job["sample_fn"],
                              stop_when=stop_when, started_at=started_at,
                              snapshot_every=run.snapshot_every, keep=run.keep, resume=resume,
                              run_config=run_config(opts), trace_steps=run.trace_steps)
            n_params = sum(p.numel() for p in trainer.model.parameters())
            log.info("%s: GPT %.2fM parameters, %s strategy, world_size %d, global batch %d, "
                     "%d steps", opts.task, n_params / 1e6, run.strategy, rt.world_size,
                     config.batch_size * config.grad_accum * strategy.data_world_size, config.steps)
            with contextlib.ExitStack() as stack:
                if rt.world_size > 1 and launch.watchdog_timeout:
                    from ringtrain.launch.watchdog import Watchdog

                    # A rank that dies or hangs stops the others within the timeout, naming it;
                    # one the strategy can lose (an async parameter-server worker) is dropped.
                    tolerate = strategy.tolerated_ranks
                    watchdog = stack.enter_context(Watchdog(
                        name="train", timeout_s=launch.watchdog_timeout,
                        interval_s=min(1.0, launch.watchdog_timeout / 3),
                        tolerate=tolerate, on_departed=_departed(strategy) if tolerate else None))
                    trainer.on_step = watchdog.set_step
                if step_hook is not None:  # RINGTRAIN_STEP_HOOK: the user's, or the tests' faults
                    trainer.on_step = step_hook(trainer.on_step, rt.rank)
                try:
                    summary = trainer.fit()
                except (ConfigError, KeyboardInterrupt) as e:
                    # Handled here, not by the watchdog (which would stop every peer with a
                    # line of its own): every rank meets the same mistake, or the same Ctrl-C.
                    return _explain_once(e, rt) if isinstance(e, ConfigError) else _interrupted()
            strategy.close()
            if summary.get("disk_full") and summary.get("stopped_by"):  # every rank, same save
                return _explain_once(summary["disk_full"], rt, DISK_FULL_EXIT_CODE)
            if summary.get("disk_full"):  # rank 0 alone, writing summary.json at the end
                print(f"ringtrain train: error: {summary['disk_full']}", file=sys.stderr,
                      flush=True)
                return DISK_FULL_EXIT_CODE
            if summary.get("stopped_by"):
                if rt.rank == 0:
                    print(f"stopped at step {summary['steps']} on {summary['stopped_by']}; "
                          f"snapshot of step {summary['snapshot_step']} in "
                          f"{run.run_dir}/snapshots: run the same command again to resume",
                          flush=True)
                if _in_launched_worker():
                    return STOPPED_EXIT_CODE
                # Ctrl-C: the user stopped it (130); SIGTERM, SIGUSR1: a scheduler did, requeue.
                return (INTERRUPTED_EXIT_CODE if summary["stopped_by"] == "SIGINT"
                        else REQUEUE_EXIT_CODE)
            if rt.rank == 0:
                export_final(trainer.model, job, run.run_dir)  # model.safetensors + its config
                print(format_summary(summary), flush=True)
            return 0
        except ConfigError as e:
            return _explain_once(e, rt)
        except KeyboardInterrupt:
            return _interrupted()
        finally:
            destroy_distributed()

    if _under_agent():
        job = record(job)  # the launcher's failure report then shows this worker's traceback
    try:
        return job()
    except KeyboardInterrupt:  # Ctrl-C while the process group was starting
        return _interrupted()


def _explain_once(error: ConfigError | str, rt, exit_code: int = USAGE_EXIT_CODE) -> int:
    """Rank 0 prints `error`; every rank returns `exit_code` once all have found it (bounded wait).

    Every rank finds the same mistake (same options, same files) at about the same time. No
    rank exits before rank 0 has printed: the launcher stops the others as soon as one exits,
    which could cut rank 0 off. A rank left waiting (rank 0 never found it) says it itself.
    Also used for a disk that filled up: every rank stops at the same failed save.
    """
    if rt.rank == 0:
        print(f"ringtrain train: error: {error}", file=sys.stderr, flush=True)
    if rt.world_size == 1:
        return exit_code
    keys = [f"ringtrain/config_error/{r}" for r in range(rt.world_size)]
    try:
        rt.store.set(keys[rt.rank], "1")
        rt.store.wait(keys, timedelta(seconds=MISTAKE_WAIT_S))
    except RuntimeError:  # a rank went on, or the store's host (rank 0) has exited
        told = True
        with contextlib.suppress(RuntimeError):
            told = rt.store.check(keys[:1])
        if not told:
            print(f"ringtrain train: error: rank {rt.rank}: {error}", file=sys.stderr, flush=True)
    return exit_code


def _interrupted() -> int:
    """Ctrl-C outside the training loop (snapshots off, or while starting): a quiet exit.

    A launched worker says nothing: the launcher, interrupted too, says it stopped the workers.
    """
    if not _in_launched_worker():
        print("ringtrain train: interrupted (SIGINT); nothing saved since the last snapshot",
              file=sys.stderr, flush=True)
    return INTERRUPTED_EXIT_CODE


def _departed(strategy):
    """The watchdog's `on_departed`: tell the strategy a tolerated rank died."""
    def departed(failure) -> None:
        why = failure.reason if failure.kind == "died" else f"raised {failure.reason}"
        strategy.rank_departed(failure.rank, why)
    return departed


def _resume_or_clear(opts: TrainOptions, rank: int, log) -> bool:
    """Whether to resume; with --no-resume (first attempt only) rank 0 deletes old snapshots.

    A restarted worker resumes even under --no-resume: it must continue the run it belongs to.
    """
    if opts.run.resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        return True
    old = os.path.join(opts.run.run_dir, "snapshots")
    if rank == 0 and os.path.isdir(old):
        import shutil

        log.info("--no-resume: deleting the snapshots in %s", old)
        shutil.rmtree(old)
    return False


def main(argv: list[str] | None = None) -> int:
    """`ringtrain train ARGS`; returns the exit code (0, 2 for a mistake, 128 + a signal)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before any worker started (importing torch takes seconds)
        return _interrupted()


def _known_world_size(opts: TrainOptions) -> int | None:
    """The job's number of ranks if known here: what the launcher that started this process
    says (torchrun's WORLD_SIZE, Slurm's SLURM_NTASKS, ...), else --nnodes N x --nproc-per-node
    (None for an elastic --nnodes MIN:MAX)."""
    job = _outside_job()
    if job is not None:
        return job[1]
    if _under_agent():  # the agent's variables, even where the rest is incomplete
        return int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE", "").isdigit() else None
    launch = opts.launch
    return int(launch.nnodes) * launch.nproc_per_node if launch.nnodes.isdigit() else None


def _main(argv: list[str] | None) -> int:
    started_at = float(os.environ.get("RINGTRAIN_STARTED_AT", time.time()))
    parser = build_parser()
    try:
        given, from_file = given_options(parser, sys.argv[1:] if argv is None else argv,
                                         launched=_in_launched_worker())
    except SystemExit as e:  # --help (0) or a bad option (2): argparse has printed why
        return int(e.code or 0)
    try:
        opts = options_from(given, parse_text=from_file)
        warnings = check_args(opts, world_size=_known_world_size(opts))
    except ValueError as e:
        if _in_launched_worker():  # every rank finds it: said once, by rank 0, once they meet
            if "opts" not in locals():  # not even the options could be built: say it here
                print(f"ringtrain train: error: {e}", file=sys.stderr)
                return USAGE_EXIT_CODE
            return run_job(opts, started_at, mistake=e)
        parser.print_usage(sys.stderr)
        print(f"ringtrain train: error: {e}", file=sys.stderr)
        return USAGE_EXIT_CODE
    launch, run = opts.launch, opts.run
    if not _in_launched_worker():  # said once, where the command was typed
        for warning in warnings:
            print(f"ringtrain train: warning: {warning}", file=sys.stderr, flush=True)
    try:
        if run.run_dir is None and (_outside_job() or (0, 1))[0] == 0:
            # Decided once, before any relaunch, so all workers agree; under an outside launcher
            # only rank 0 (the one that writes) makes one.
            run.run_dir = new_run_dir()
        if run.run_dir is not None and not _in_launched_worker():
            # Before any worker starts: an unusable directory is one line, not a traceback per
            # worker. Launched workers skip it (their launcher checked; one failing alone would
            # leave the others waiting for it).
            check_run_dir(run.run_dir)
    except RunDirError as e:
        print(f"ringtrain train: error: {e}", file=sys.stderr)
        return 2
    # One worker with --max-restarts also goes through the launcher: its agent does the restarts.
    multinode = launch.nnodes != "1"
    if (launch.nproc_per_node > 1 or launch.max_restarts > 0 or multinode or launch.memory_limit) \
            and not _in_launched_worker():
        from ringtrain.launch.cgroup import CgroupUnavailable, worker_memory_limit
        from ringtrain.launch.launcher import launch as launch_job

        os.environ["RINGTRAIN_STARTED_AT"] = str(started_at)  # wall_s includes the start-up
        run_id = launch.rdzv_id or (os.path.basename(os.path.normpath(run.run_dir))
                                    if multinode else None)
        try:  # --memory-limit: a memory cgroup per worker, OOM kills named (launch/cgroup.py)
            with worker_memory_limit(launch.memory_limit, launch.nproc_per_node) as limit:
                os.environ[CONFIG_ENV] = write_options(opts)  # the workers' options
                try:
                    return limit.report(launch_job(
                        limit.entrypoint, ["train"], module=limit.module,
                        nproc_per_node=launch.nproc_per_node, max_restarts=launch.max_restarts,
                        nnodes=launch.nnodes, node_rank=launch.node_rank,
                        rdzv_endpoint=launch.rdzv_endpoint, run_id=run_id,
                        tolerate_ranks=tolerated_ranks(opts),
                        shutdown_timeout=launch.shutdown_timeout))
                finally:  # for the workers only: this process (a test's) may run another job
                    os.environ.pop(CONFIG_ENV, None)
        except CgroupUnavailable as e:
            print(f"ringtrain train: error: --memory-limit {launch.memory_limit}: {e}",
                  file=sys.stderr)
            return USAGE_EXIT_CODE
    return run_job(opts, started_at)


if __name__ == "__main__":
    sys.exit(main())
