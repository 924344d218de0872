"""What a live run's committed sample history must be: the fault-free run's, step for step."""

from __future__ import annotations

import json
from pathlib import Path

from ringtrain.data.addition import train_size
from ringtrain.data.sample_log import SampleLog, check_history
from ringtrain.live import GlobalBatches


def assert_fault_free_history(history: SampleLog, reference: SampleLog, *, steps: int,
                              global_batch: int) -> None:
    """`history` equals the fault-free `reference`, passes `check_history` (every sample once
    per epoch, none skipped or repeated), and each step's global batch is torch's
    DistributedSampler layout (`GlobalBatches`), whoever was left to train it."""
    assert history.step_sets() == reference.step_sets()
    n = train_size(2)  # the addition task's default digits
    report = check_history(history, dataset_len=n, seed=1337, global_batch=global_batch,
                           steps=steps)
    assert report["errors"] == [] and report["samples"] == steps * global_batch
    batches = GlobalBatches(n, global_batch, seed=1337)
    assert history.step_sets() == {s + 1: sorted((0, i) for i in batches.batch(s))
                                   for s in range(steps)}


def wait_all(procs: dict, dirs: dict, timeout_s: float = 420) -> dict:
    """Each started `ringtrain train` (key -> Popen) waited for and checked to exit 0:
    key -> (its run directory, its stderr); any still running at a failure is killed."""
    out = {}
    try:
        for key, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=timeout_s)
            assert proc.returncode == 0, f"{key}: {stdout[-2000:]}{stderr[-4000:]}"
            out[key] = (dirs[key], stderr)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return out


def live_members(run_dir: Path) -> list[dict]:
    """The live members' records (RUN_DIR/live/PID.json), by file name."""
    return [json.loads(p.read_text()) for p in sorted((run_dir / "live").glob("*.json"))]
