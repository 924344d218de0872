"""One worker of a `ringtrain train` job: start the process group, train, report, exit.

    run_job(opts, started_at)   # -> exit code (ringtrain.cli.exits)

Every process of the job runs it: the one typed command of a one-process run, each worker the
launcher started, each task under `srun -n N`. It builds what is trained (`cli/job.py`) and the
strategy, hands both to the `Trainer`, sets the watchdog and the user's step hook around it,
and turns how the run ended (finished, stopped on a signal, a mistake, a full disk) into one
message and an exit code. Rank 0 writes RUN_DIR/config.json with what only the job knows (world
size, model, resolved trainer), exports the final model and prints the summary.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from dataclasses import asdict

from ringtrain.checkpoint.run_lock import release_run_dir
from ringtrain.cli.exits import explain_once, interrupted, stopped
from ringtrain.cli.job import build_job, export_final
from ringtrain.cli.options import TrainOptions
from ringtrain.cli.relaunch import job_rank, under_agent
from ringtrain.cli.run_dir_setup import resume_or_clear, take_run_dir, when_started
from ringtrain.cli.step_hook import STEP_HOOK_ENV, load_step_hook
from ringtrain.cli.train_args import run_config
from ringtrain.errors import DISK_FULL_EXIT_CODE, ConfigError


def run_job(opts: TrainOptions, started_at: float, mistake: ValueError | None = None) -> int:
    """One worker: start the process group, train, print the summary on rank 0.

    `mistake`: what `check_args` found wrong in this worker only (where the launcher could not
    know the number of ranks); it is reported like a `ConfigError`, once the ranks have met.
    """
    def job() -> int:
        if under_agent():
            from ringtrain.launch.parent import die_with_parent

            die_with_parent()  # a SIGKILLed launcher must not leave this worker running
        return _train(opts, started_at, mistake)

    if under_agent():
        job = _reported(job)  # the launcher's failure report then names what this worker raised
    try:
        return job()
    except KeyboardInterrupt:  # Ctrl-C while the process group was starting
        return interrupted()


def _reported(job: Callable[[], int]) -> Callable[[], int]:
    """`job`, telling the launcher what it raised: torch's error file with the message only
    (the worker prints its traceback itself on the way out, `ringtrain/launch/ending.py`; torch's
    `@record` put it in the file too, and the report printed it a second time)."""
    from ringtrain.launch.peer_failure import describe_error, write_error_file

    def run() -> int:
        try:
            return job()
        except Exception as e:
            write_error_file(describe_error(e), replace=False)
            raise

    return run


def _train(opts: TrainOptions, started_at: float, mistake: ValueError | None) -> int:
    import torch

    from ringtrain.launch.process_group import destroy_distributed, init_distributed
    from ringtrain.live import LiveMemberLostError
    from ringtrain.strategies import make_strategy
    from ringtrain.training.progress import format_summary, setup_logging
    from ringtrain.training.trainer import Trainer

    setup_logging(job_rank())  # before init: rank 0 says which launcher it found
    launch, run = opts.launch, opts.run
    if launch.live:  # no default group: the members form one per generation (training/live.py)
        from ringtrain.launch.process_group import init_live

        rt = init_live(device=launch.device)
    else:
        rt = init_distributed(launch.backend, device=launch.device)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", rt.world_size))
    # Workers of one machine share its cores: more threads than cores makes every op wait.
    torch.set_num_threads(launch.threads or max(1, (os.cpu_count() or 1) // local_world))
    log = setup_logging(rt.rank)
    held = None
    try:
        if mistake is not None:
            raise ConfigError(str(mistake))
        step_hook = load_step_hook(os.environ.get(STEP_HOOK_ENV))  # before any work is done
        config = opts.trainer
        if config.dtype == "bf16" and not _bf16_supported(rt.device):
            log.warning("warning: bf16 autocast is not supported on %s; training in fp32",
                        rt.device)
            config.dtype = "fp32"
        if rt.world_size > 1 and not launch.live:  # under an outside launcher only rank 0
            # named a run dir (--live runs under our own launcher, which named it)
            holder = [run.run_dir]
            torch.distributed.broadcast_object_list(holder, src=0, group=rt.process_group)
            run.run_dir = holder[0]
        held = take_run_dir(run.run_dir, rt)  # one run per directory, before it is written
        job = build_job(opts)  # --data FILE.txt: prepared into the run directory
        resume = resume_or_clear(opts, rt, log)  # first: --no-resume sets the old config aside
        placed = _one_replica(rt) if launch.live else rt  # live: generations give the rest
        strategy = make_strategy(run.strategy, runtime=placed, **opts.strategy.kwargs())
        stop_when = None
        if run.stop_at_accuracy is not None:
            def stop_when(rec):
                return rec.get("eval_accuracy", 0.0) >= run.stop_at_accuracy
        trainer = Trainer(strategy, placed, job["model_fn"], job["train_set"], job["eval_set"],
                          job["loss_fn"], config, eval_metrics=job["eval_metrics"],
                          run_dir=run.run_dir, sample_fn=job["sample_fn"],
                          stop_when=stop_when, started_at=started_at,
                          snapshot_every=run.snapshot_every, keep=run.keep, resume=resume,
                          sync_snapshots=run.sync_snapshots,
                          run_config=run_config(opts, job), trace_steps=run.trace_steps,
                          live=_live_settings(opts, rt))
        trainer.on_start = when_started(opts, rt, {  # once its resume is accepted
            "task": opts.task, "world_size": rt.world_size, "args": opts.flat(),
            "model": asdict(job["model_config"]), "trainer": asdict(config.resolved())}, log)
        n_params = sum(p.numel() for p in trainer.model.parameters())
        log.info("%s: GPT %.2fM parameters, %s strategy, world_size %d, global batch %d, "
                 "%d steps", opts.task, n_params / 1e6, run.strategy, rt.world_size,
                 config.batch_size * config.grad_accum * trainer.data_world_size, config.steps)
        with contextlib.ExitStack() as stack:
            if rt.world_size > 1 and launch.watchdog_timeout and not launch.live:
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
            except LiveMemberLostError as e:  # the peers went on without this process: be replaced
                log.error("error: %s", e)
                from ringtrain.launch.live_agent import LEFT_OUT_EXIT_CODE

                return LEFT_OUT_EXIT_CODE
            except (ConfigError, KeyboardInterrupt) as e:
                # Handled here, not by the watchdog (which would stop every peer with a
                # line of its own): every rank meets the same mistake, or the same Ctrl-C.
                return explain_once(e, rt) if isinstance(e, ConfigError) else interrupted()
        strategy.close()
        if summary.get("live_admitted") is False:  # a replacement the job ended without
            return 0
        rt = trainer.runtime  # live: this member's place at the end (rank 0 reports)
        if summary.get("disk_full") and summary.get("stopped_by"):  # every rank, same save
            return explain_once(summary["disk_full"], rt, DISK_FULL_EXIT_CODE)
        if summary.get("disk_full"):  # rank 0 alone, writing summary.json at the end
            print(f"ringtrain train: error: {summary['disk_full']}", file=sys.stderr,
                  flush=True)
            return DISK_FULL_EXIT_CODE
        if summary.get("stopped_by"):
            if rt.rank == 0:
                print(f"stopped at step {summary['steps']} on {summary['stopped_by']}; "
                      f"snapshot of step {summary['snapshot_step']} in "
                      f"{run.run_dir}/snapshots: run the same command again"
                      f"{'' if run.resume_from is None else ' without --resume-from'} to resume",
                      flush=True)
            return stopped(summary["stopped_by"])
        if rt.rank == 0:
            # model.safetensors + its config: the whole model (tp's ranks hold slices)
            export_final(trainer.final_model(), job, run.run_dir)
            print(format_summary(summary), flush=True)
        return 0
    except ConfigError as e:
        return explain_once(e, rt)
    except KeyboardInterrupt:
        return interrupted()
    except Exception as e:  # a bug, the user's step hook: after the watchdog's word (a lost peer
        _print_traceback_once(e, rt)  # ends there), every rank's same traceback printed once,
        raise  # while the store is still up
    finally:
        release_run_dir(held)
        destroy_distributed()


def _print_traceback_once(e: Exception, rt) -> None:
    """Print `e`'s traceback, or one line where a rank printed the same (launch/traceback_once.py),
    and mark `e` printed: the worker's exit (launch/ending.py) then does not print it again."""
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    from ringtrain.launch.peer_failure import describe_error
    from ringtrain.launch.traceback_once import print_once

    store = getattr(rt, "store", None)
    if rt.world_size == 1 or store is None:
        return  # printed on the way out, as any error
    with contextlib.suppress(AttributeError, RuntimeError):  # its own connection, a short
        store = store.clone()  # timeout: a store whose host froze must not hold the exit
        store.set_timeout(timedelta(seconds=10))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
    store = dist.PrefixStore(f"ringtrain/train/{restart}", store)
    print_once(store, rt.rank, e, describe_error(e), lambda: traceback.print_exception(e),
               prefix="[rank {rank}] ")
    e.ringtrain_printed = True  # type: ignore[attr-defined]


def _one_replica(rt):
    """--live: the trainer and strategy start as one replica; each generation of the live
    group gives them their rank and group (`ringtrain.training.live`)."""
    from ringtrain.strategies.live_step import one_replica_view

    return one_replica_view(rt)


def _live_settings(opts: TrainOptions, rt):
    """--live: the agent's store and the bounds, or None. A member silent for
    --live-dead-after (0.5 s; a SIGSTOP, a lost host) is lost: its heartbeat thread beats every
    0.1 s whatever its step does, so 0.5 s is five missed beats (no false loss in 1200
    member-steps of a fault-free benchmark run at load 12 on 2 cores, session 15; it was 1 s,
    whose detection made a stop's or a lost link's stall 2.1-2.5 s); a member that beats but
    does not take part (stuck) is found after --watchdog-timeout."""
    if not opts.launch.live:
        return None
    from ringtrain.launch.live_agent import SPARE_ENV
    from ringtrain.runtime import DEFAULT_COLLECTIVE_TIMEOUT_S
    from ringtrain.training.live import DEFAULT_DEAD_AFTER_S, LiveSettings

    timeout = opts.launch.watchdog_timeout or DEFAULT_COLLECTIVE_TIMEOUT_S
    return LiveSettings(rt.store, rt.world_size, timeout_s=timeout,
                        replace_wait_s=opts.launch.live_wait,
                        dead_after_s=min(opts.launch.live_dead_after or DEFAULT_DEAD_AFTER_S,
                                         timeout / 2), launcher_rank=rt.rank,
                        spare=bool(os.environ.get(SPARE_ENV)),
                        snapshot_every=opts.run.snapshot_every)


def _bf16_supported(device) -> bool:
    import torch

    if not torch.amp.autocast_mode.is_autocast_available(device.type):
        return False
    if device.type == "cuda":  # only asked on a CUDA device: never a torch.cuda call on CPU
        return torch.cuda.is_bf16_supported()
    return True


def _departed(strategy):
    """The watchdog's `on_departed`: tell the strategy a tolerated rank died."""
    def departed(failure) -> None:
        why = failure.reason if failure.kind == "died" else f"raised {failure.reason}"
        strategy.rank_departed(failure.rank, why)
    return departed
