"""`ringtrain train`: train a GPT on the embedded addition task or on your own text.

    ringtrain train                                  # 2-digit addition, one process
    ringtrain train --nproc-per-node 2               # the same on 2 processes (`make demo`)
    ringtrain train --data input.txt --steps 3000    # character-level LM on your text

With `--nproc-per-node N` > 1 it relaunches itself through `ringtrain run` (the elastic
launcher), minus the launcher's flags; each worker then starts the process group, trains, and
rank 0 prints the progress bar and the summary. Each run writes `runs/<timestamp>/` (or
`--run-dir`): config.json, metrics.jsonl, summary.json, report.png, and snapshots/ every
`--snapshot-every` steps and on SIGTERM.

    ringtrain train --run-dir runs/a --nproc-per-node 2 --max-restarts 3   # a dead worker: restart, resume
    ringtrain train --run-dir runs/a --nproc-per-node 3                    # resume runs/a on 3 workers

A run directory with a committed snapshot is resumed by itself (`--no-resume` starts afresh).
After SIGTERM every worker saves the same step and exits with 143 (128 + SIGTERM).

    ringtrain train --strategy ps --servers 1 --ps-mode async --nproc-per-node 4

With `--strategy ps --ps-mode async|ssp`, a worker other than rank 0 that dies is dropped with
a warning and the others finish the run (`tolerated_ranks`); any other death ends the job.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import asdict
from typing import Any

# Re-exported (the `as` says so): tests, benchmarks and docs/ps.md find it here.
from ringtrain.train_args import ASYNC_BETA1 as ASYNC_BETA1
from ringtrain.train_args import (
    LAUNCHER_FLAGS,
    build_parser,
    check_args,
    run_config,
    strategy_options,
    task_name,
    tolerated_ranks,
    trainer_config,
    worker_argv,
)

STOPPED_EXIT_CODE = 143  # 128 + SIGTERM: stopped on a signal, after saving a snapshot


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


def _in_launched_worker() -> bool:
    return "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def build_job(args: argparse.Namespace) -> dict[str, Any]:
    """Datasets, model factory, loss, eval metrics and sample function for the chosen task."""
    from ringtrain.models import GPT, GPTConfig, loss_fn

    if args.data:
        from ringtrain.data.chars import load_text, sample_text

        text = load_text(args.data, args.block_size)
        train_set, eval_set, vocab, block = text.train_set, text.eval_set, text.vocab_size, args.block_size
        metrics: dict[str, Any] = {}

        def sample_fn(model):
            return sample_text(model, text, args.sample_length, seed=args.seed)
    else:
        from ringtrain.data.addition import AdditionDataset, exact_match, show_sums

        train_set, eval_set = AdditionDataset("train", args.digits), AdditionDataset("test", args.digits)
        vocab, block, metrics = train_set.vocab_size, train_set.block_size, {"accuracy": exact_match}

        def sample_fn(model):
            return show_sums(model, eval_set)
    model_config = GPTConfig(vocab_size=vocab, block_size=block, n_layer=args.n_layer,
                             n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout,
                             tie_embeddings=args.tie_embeddings)
    return {"train_set": train_set, "eval_set": eval_set, "loss_fn": loss_fn,
            "eval_metrics": metrics, "sample_fn": sample_fn, "model_config": model_config,
            "model_fn": lambda: GPT(model_config)}


def _bf16_supported(device) -> bool:
    import torch

    if not torch.amp.autocast_mode.is_autocast_available(device.type):
        return False
    if device.type == "cuda":  # only asked on a CUDA device: never a torch.cuda call on CPU
        return torch.cuda.is_bf16_supported()
    return True


def run_job(args: argparse.Namespace, started_at: float) -> int:
    """One worker: start the process group, train, print the summary on rank 0."""
    import torch

    from ringtrain.launcher import record
    from ringtrain.progress import format_summary, setup_logging, write_json
    from ringtrain.resume import with_test_fault
    from ringtrain.runtime import destroy_distributed, init_distributed
    from ringtrain.strategies import make_strategy
    from ringtrain.trainer import Trainer

    def job() -> int:
        if _in_launched_worker():
            from ringtrain.launcher import die_with_parent

            die_with_parent()  # a SIGKILLed launcher must not leave this worker running
        rt = init_distributed()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", rt.world_size))
        # Workers of one machine share its cores: more threads than cores makes every op wait.
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
        log = setup_logging(rt.rank)
        try:
            if args.dtype == "bf16" and not _bf16_supported(rt.device):
                log.warning("warning: bf16 autocast is not supported on %s; training in fp32", rt.device)
                args.dtype = "fp32"
            job = build_job(args)
            config = trainer_config(args)
            if rt.rank == 0:
                os.makedirs(args.run_dir, exist_ok=True)
                write_json(os.path.join(args.run_dir, "config.json"), {
                    "task": task_name(args), "world_size": rt.world_size, "argv": worker_argv(args),
                    "args": {k: v for k, v in vars(args).items() if k not in LAUNCHER_FLAGS},
                    "model": asdict(job["model_config"]), "trainer": asdict(config.resolved())})
            if rt.world_size > 1:  # under an outside launcher only rank 0 named a run dir
                holder = [args.run_dir]
                torch.distributed.broadcast_object_list(holder, src=0, group=rt.process_group)
                args.run_dir = holder[0]
            resume = _resume_or_clear(args, rt.rank, log)
            strategy = make_strategy(args.strategy, runtime=rt, **strategy_options(args))
            stop_when = None
            if args.stop_at_accuracy is not None:
                def stop_when(rec):
                    return rec.get("eval_accuracy", 0.0) >= args.stop_at_accuracy
            trainer = Trainer(strategy, rt, job["model_fn"], job["train_set"], job["eval_set"],
                              job["loss_fn"], config, eval_metrics=job["eval_metrics"],
                              run_dir=args.run_dir, sample_fn=job["sample_fn"],
                              stop_when=stop_when, started_at=started_at,
                              snapshot_every=args.snapshot_every, keep=args.keep, resume=resume,
                              run_config=run_config(args))
            n_params = sum(p.numel() for p in trainer.model.parameters())
            log.info("%s: GPT %.2fM parameters, %s strategy, world_size %d, global batch %d, %d steps",
                     task_name(args), n_params / 1e6, args.strategy, rt.world_size,
                     config.batch_size * config.grad_accum * strategy.data_world_size, config.steps)
            with contextlib.ExitStack() as stack:
                if rt.world_size > 1 and args.watchdog_timeout:
                    from ringtrain.watchdog import Watchdog

                    # A rank that dies or hangs stops the others within the timeout, naming it;
                    # one the strategy can lose (an async parameter-server worker) is dropped.
                    tolerate = getattr(strategy, "tolerated_ranks", frozenset())
                    watchdog = stack.enter_context(Watchdog(
                        timeout_s=args.watchdog_timeout, interval_s=min(1.0, args.watchdog_timeout / 3),
                        tolerate=tolerate, on_departed=_dropper(strategy) if tolerate else None))
                    trainer.on_step = watchdog.set_step
                trainer.on_step = with_test_fault(trainer.on_step, rt.rank)
                summary = trainer.fit()
            strategy.close()
            if summary.get("stopped_by"):
                if rt.rank == 0:
                    print(f"stopped at step {summary['steps']} on {summary['stopped_by']}; snapshot "
                          f"of step {summary['snapshot_step']} in {args.run_dir}/snapshots: run "
                          "the same command again to resume", flush=True)
                return STOPPED_EXIT_CODE
            if rt.rank == 0:
                print(format_summary(summary), flush=True)
            return 0
        finally:
            destroy_distributed()

    if _in_launched_worker():
        job = record(job)  # the launcher's failure report then shows this worker's traceback
    return job()


def _dropper(strategy):
    """The watchdog's `on_departed`: hand a dead tolerated worker to the strategy."""
    def drop(failure) -> None:
        why = failure.reason if failure.kind == "died" else f"raised {failure.reason}"
        strategy.drop_worker(failure.rank, why)
    return drop


def _resume_or_clear(args: argparse.Namespace, rank: int, log) -> bool:
    """Whether to resume; with --no-resume (first attempt only) rank 0 deletes old snapshots.

    A restarted worker resumes even under --no-resume: it must continue the run it belongs to.
    """
    if not args.no_resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        return True
    old = os.path.join(args.run_dir, "snapshots")
    if rank == 0 and os.path.isdir(old):
        import shutil

        log.info("--no-resume: deleting the snapshots in %s", old)
        shutil.rmtree(old)
    return False


def main(argv: list[str] | None = None) -> int:
    started_at = float(os.environ.get("RINGTRAIN_STARTED_AT", time.time()))
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # --help (0) or a bad option (2): argparse has printed why
        return int(e.code or 0)
    try:
        check_args(args)
    except ValueError as e:
        parser.print_usage(sys.stderr)
        print(f"ringtrain train: error: {e}", file=sys.stderr)
        return 2
    if args.run_dir is None and os.environ.get("RANK", "0") == "0":
        # Decided once, before any relaunch, so all workers agree; under an outside launcher
        # only rank 0 (the one that writes) makes one.
        args.run_dir = new_run_dir()
    # One worker with --max-restarts also goes through the launcher: its agent does the restarts.
    multinode = args.nnodes != "1"
    if (args.nproc_per_node > 1 or args.max_restarts > 0 or multinode) and not _in_launched_worker():
        from ringtrain.launcher import launch

        os.environ["RINGTRAIN_STARTED_AT"] = str(started_at)  # wall_s includes the start-up
        run_id = args.rdzv_id or (os.path.basename(os.path.normpath(args.run_dir)) if multinode else None)
        return launch("ringtrain", ["train", *worker_argv(args)], module=True,
                      nproc_per_node=args.nproc_per_node, max_restarts=args.max_restarts,
                      nnodes=args.nnodes, node_rank=args.node_rank,
                      rdzv_endpoint=args.rdzv_endpoint, run_id=run_id,
                      tolerate_ranks=tolerated_ranks(args))
    return run_job(args, started_at)

if __name__ == "__main__":
    sys.exit(main())
