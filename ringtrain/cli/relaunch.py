"""Where a `ringtrain train` process stands, and whether it relaunches itself.

    ringtrain train --nproc-per-node 2     # typed: relaunches itself through `ringtrain run`
    srun -n 2 ringtrain train              # each task is already one of the job's processes

A process is either the command a user typed or one of a job's workers, started by a launcher:
torch's elastic agent (`ringtrain run`, torchrun: `under_agent`) or one that starts every process
itself (`srun -n N`, `mpirun`, a PyTorchJob: `outside_job`). The typed command checks the
options, says the warnings once and, when the job needs more than this one process
(`needs_launcher`), hands it to the launcher (`relaunch`); a worker runs its part of the job
(`ringtrain.cli.worker`).
"""

from __future__ import annotations

import os
import sys

from ringtrain.cli.options import LaunchOptions, TrainOptions
from ringtrain.cli.train_args import CONFIG_ENV, tolerated_ranks, write_options
from ringtrain.errors import USAGE_EXIT_CODE


def under_agent() -> bool:
    """torch's elastic agent (`ringtrain run`, torchrun) started this process."""
    return "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def outside_job() -> tuple[int, int] | None:
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
    return (env.rank, env.world_size) if env.world_size > 1 or under_agent() else None


def in_launched_worker() -> bool:
    """One of the job's processes, started by a launcher (not the command a user typed)."""
    return under_agent() or outside_job() is not None


def job_rank() -> int:
    """This process's rank as its launcher says it; 0 for a process alone (the typed command)."""
    return (outside_job() or (0, 1))[0]


def known_world_size(opts: TrainOptions) -> int | None:
    """The job's number of ranks if known here: what the launcher that started this process
    says (torchrun's WORLD_SIZE, Slurm's SLURM_NTASKS, ...), else --nnodes N x --nproc-per-node
    (None for an elastic --nnodes MIN:MAX)."""
    job = outside_job()
    if job is not None:
        return job[1]
    if under_agent():  # the agent's variables, even where the rest is incomplete
        world = os.environ.get("WORLD_SIZE", "")
        return int(world) if world.isdigit() else None
    launch = opts.launch
    return int(launch.nnodes) * launch.nproc_per_node if launch.nnodes.isdigit() else None


def needs_launcher(launch: LaunchOptions) -> bool:
    """Whether the typed command starts the job through `ringtrain run` rather than being it.

    More than one process, or more than one machine, needs the launcher; so does one worker
    with --max-restarts (the agent does the restarts) or --memory-limit (a cgroup per worker).
    A launched worker never relaunches itself.
    """
    several = launch.nproc_per_node > 1 or launch.nnodes != "1"
    return (several or launch.max_restarts > 0 or bool(launch.memory_limit)) \
        and not in_launched_worker()


def relaunch(opts: TrainOptions, started_at: float) -> int:
    """Start the job's workers through the elastic launcher and return its exit code.

    The workers read their options from RUN_DIR/.options.json (`RINGTRAIN_CONFIG`), written
    here first: they run exactly what was checked (config.json is rank 0's, once it started).
    """
    from ringtrain.launch.cgroup import CgroupUnavailable, worker_memory_limit
    from ringtrain.launch.launcher import launch as launch_job

    launch, run = opts.launch, opts.run
    os.environ["RINGTRAIN_STARTED_AT"] = str(started_at)  # wall_s includes the start-up
    multinode = launch.nnodes != "1"
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
                    shutdown_timeout=launch.shutdown_timeout, live=launch.live,
                    live_spares=launch.live_spares, memory=limit.cgroups,
                    cold_starts=launch.cold_starts))
            finally:  # for the workers only: this process (a test's) may run another job
                os.environ.pop(CONFIG_ENV, None)
    except CgroupUnavailable as e:
        print(f"ringtrain train: error: --memory-limit {launch.memory_limit}: {e}",
              file=sys.stderr)
        return USAGE_EXIT_CODE
