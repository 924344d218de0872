"""`ringtrain train` on N local ranks without its launcher, each rank a task as `srun -n N` runs.

    train_ranks(["--run-dir", str(d), "--steps", "4", "--no-report"], nproc=2)  # asserts exit 0
    results = train_ranks([...], nproc=2, check=False)   # each rank's exit code and output

Each rank runs the CLI's own `main(argv)` with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
set (`ringtrain.cli.relaunch.outside_job`: a task of a launcher that starts every process
itself), in a process forked by `ringtrain.testing.run_workers` from a forkserver that has
imported torch and ringtrain's trainer. A `python -m ringtrain train --nproc-per-node 2` costs a
launcher process and two fresh interpreters importing torch and the trainer; here the ranks
start in ~0.1 s (tests/test_zero_resume.py's four runs: 41.1 -> 10.4 s of CPU, session 13).

For tests whose subject is the job (a resume, a reshard, the run's weights as a reference), not
the launcher: restarts, signals to the launcher and memory limits need `ringtrain run` and stay
a subprocess. What each rank printed comes back with its exit code (Python's sys.stdout and
sys.stderr; the launcher adds nothing to a job's output that these tests read).
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass

from ringtrain.testing import run_workers

# What an outer launcher or an earlier test may have left; each rank sets its own.
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


@dataclass
class RankResult:
    """One rank's `main(argv)`: its exit code and what it printed."""

    code: int
    out: str
    err: str


def _rank(rank: int, world_size: int, argv: list[str], port: int) -> RankResult:
    for v in _LAUNCH_VARS:
        os.environ.pop(v, None)
    if world_size > 1:  # one rank alone is the typed command: no launcher, no group to join
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    from ringtrain.cli.train import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return RankResult(code, out.getvalue(), err.getvalue())


def train_ranks(argv: list[str], nproc: int, *, check: bool = True,
                timeout_s: float = 150) -> list[RankResult]:
    """`ringtrain train ARGV` on `nproc` ranks of this machine; each rank's result, by rank.

    With `check`, a rank's exit code other than 0 fails the test with every rank's stderr. A
    rank that raises (rather than returning an exit code) fails the call with its traceback
    (`ringtrain.testing.WorkerError`); one that outlives `timeout_s` is killed and named.
    """
    from ringtrain.launch.network import reserve_port

    with reserve_port() as port:  # held until the run ends: no other process takes it first
        results = run_workers(_rank, nproc, args=(list(argv), port), init=False,
                              timeout_s=timeout_s)
    if check and any(r.code != 0 for r in results):
        said = "".join(f"\n--- rank {i} ---\n{r.err[-3000:]}" for i, r in enumerate(results))
        raise AssertionError(f"ringtrain train {' '.join(argv)}: exit codes "
                             f"{[r.code for r in results]}{said}")
    return results
