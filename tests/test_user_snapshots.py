"""`ringtrain.SnapshotManager` in a user's own script (examples/ddp_snapshots.py) under
`ringtrain run`: a rank killed mid-run, the job restarted, the script resumed from its newest
committed snapshot, and the final weights those of the run nothing interrupted; a finished run
extended by running it again with more steps; a SIGTERM to the launcher, every rank saving the
same step (`ringtrain.StopSignal`), and the run resumed from there.

    .venv/bin/pytest -q tests/test_user_snapshots.py
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "ddp_snapshots.py"
FAULTS = REPO / "tests" / "scripts" / "user_snapshots_faults.py"


def _run(script: Path, run_dir: Path, *args: str, restarts: int = 0,
         env: dict[str, str] | None = None) -> tuple[str, str]:
    """(param_sha256, output) of `ringtrain run --nproc-per-node 2 script --run-dir run_dir`."""
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain", "run", "--nproc-per-node", "2", "--max-restarts",
         str(restarts), str(script), "--run-dir", str(run_dir), *args],
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, capture_output=True,
        text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return re.findall(r"param_sha256 ([0-9a-f]{64})", out)[-1], out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """The param_sha256 of 40 steps nothing interrupted, on 2 ranks."""
    run_dir = tmp_path_factory.mktemp("straight")
    digest, out = _run(EXAMPLE, run_dir, "--steps", "40")
    assert "resumed" not in out
    assert _committed(run_dir) == ["snap-00000030", "snap-00000040"]  # keep=2
    return digest


def _committed(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.glob("snap-*") if (p / "COMMITTED").exists())


def test_a_killed_rank_restarts_from_the_newest_snapshot_to_the_same_weights(tmp_path, reference):
    crashed, out = _run(FAULTS, tmp_path / "crashed", "--steps", "40", restarts=1,
                        env={"CRASH_AT_STEP": "25"})
    # Steps 10 and 20 were saved before the kill in step 25 (20 perhaps still being written in
    # the background: then 10 is the newest committed one); never a step past the kill.
    # The launcher said which rank failed and why before it restarted them (not torch's
    # "Worker group FAILED. 1/1 attempts left"), once.
    assert out.count("ringtrain run: rank 1 failed (local_rank 1, ") == 1, out
    assert "exit code 17" in out and "attempts left" not in out
    assert out.count("ringtrain run: restarting every worker (restart 1 of --max-restarts 1)") == 1
    resumed = re.findall(r"resumed from \S+ \(step (\d+)\)", out)
    assert resumed in (["20"], ["10"]), out
    assert crashed == reference


def test_a_finished_run_run_again_with_more_steps_goes_on_to_the_same_weights(tmp_path, reference):
    _run(EXAMPLE, tmp_path / "extended", "--steps", "20")
    extended, out = _run(EXAMPLE, tmp_path / "extended", "--steps", "40")
    assert re.findall(r"resumed from \S+ \(step (\d+)\)", out) == ["20"]
    assert extended == reference


def test_a_sigterm_saves_the_same_step_on_every_rank_and_the_run_resumes_from_it(tmp_path,
                                                                                reference):
    run_dir, ready = tmp_path / "stopped", tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ringtrain", "run", "--nproc-per-node", "2", str(FAULTS),
         "--run-dir", str(run_dir), "--steps", "40"],
        env={**os.environ, "PYTHONPATH": str(REPO), "STEP_SLEEP": "0.05",
             "READY_FILE": str(ready)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # as a scheduler's preemption: to the launcher
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, out
    stopped = re.findall(r"stopped at step (\d+) on a signal; saved", out)
    assert len(stopped) == 1 and 5 <= int(stopped[0]) < 40, out
    # One snapshot of that step, holding every rank's agreement (rank 0 wrote it, all waited).
    assert f"snap-{int(stopped[0]):08d}" in _committed(run_dir), out
    resumed, out = _run(EXAMPLE, run_dir, "--steps", "40")
    assert re.findall(r"resumed from \S+ \(step (\d+)\)", out) == stopped
    assert resumed == reference


def test_stop_signal_alone_answers_for_this_process():
    import ringtrain

    delivered = []
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: delivered.append(signum))
    try:
        with pytest.raises(SystemExit):
            with ringtrain.StopSignal((signal.SIGUSR1,)) as stop:  # no group: no collective
                assert stop.agreed() is False
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(0.05)  # the handler runs between bytecodes of the main thread
                assert stop.agreed() is True and stop.received == signal.SIGUSR1
                raise SystemExit(143)  # the script's exit after saving: not delivered again
        assert delivered == []
        with pytest.raises(ValueError):  # an error on the way out: the signal goes on
            with ringtrain.StopSignal((signal.SIGUSR1,)):
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(0.05)
                raise ValueError("failed before it could save")
        time.sleep(0.05)
        assert delivered == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_stop_signal_takes_names_and_refuses_what_is_not_a_signal():
    import ringtrain

    assert ringtrain.StopSignal(("SIGTERM", "usr1", 2)).signals == (
        signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    for wrong in ("SIGFOO", 999, 1.5):
        with pytest.raises(ValueError, match=rf"{wrong!r} is not a signal of this system; give "
                                             r"signal\.SIGTERM or a name such as 'SIGTERM'"):
            ringtrain.StopSignal((wrong,))


def test_a_manager_takes_rank_and_world_size_from_the_default_group(clean_env, tmp_path):
    import ringtrain
    from ringtrain.runtime import DistributedInitError

    with pytest.raises(DistributedInitError, match=r"call ringtrain\.init_distributed\(\) first"):
        ringtrain.SnapshotManager(tmp_path)
    ringtrain.init_distributed()
    try:
        manager = ringtrain.SnapshotManager(tmp_path)
        assert (manager.rank, manager.world_size) == (0, 1)
        assert ringtrain.SnapshotManager(tmp_path / "b", rank=0, world_size=1).rank == 0
    finally:
        ringtrain.destroy_distributed()


def test_a_rank_that_never_calls_save_is_named_with_the_rule():
    """nanoGPT's habit, `if rank == 0: save(...)`: rank 0 waits for the others' parts until
    timeout_s, then names them and says that save() is every rank's call."""
    import torch.distributed as dist

    from ringtrain.checkpoint.handshake import gather_parts

    parts, errors = gather_parts(dist.HashStore(), "snap/1", time.monotonic(), 1, world_size=2,
                                 timeout_s=60)
    assert parts == [] and [str(e) for e in errors] == [
        "ranks [1] did not finish their part of snapshot step 1 within timeout_s=60: late to call "
        "save(), or not calling it (every rank calls save() at the same step, not rank 0 alone), "
        "or a slow disk; snapshot not committed"]
