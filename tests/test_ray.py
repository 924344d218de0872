"""Ray Train, for real: examples/ray_train.py on a local Ray cluster (2 CPU workers) ends with the
same weights as `ringtrain run --nproc-per-node 2 examples/ddp_train.py`.

    pip install -e '.[ray]'                     # or `make ray`
    .venv/bin/pytest -q tests/test_ray.py       # skips with the reason when ray is not importable

The example runs in a subprocess with its own Ray temp directory (RAY_TMPDIR); every process
whose command line names that directory is killed and the directory removed at the end, so a
failed run leaves no raylet or GCS server behind.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

from same_weights import ENV, REPO, read_digest, reference_digest  # noqa: E402

RAY_S = 300.0  # a local Ray cluster's start, two workers and its shutdown on a busy 2-core machine
WHY = "ray is not installed: pip install -e '.[ray]' (or `make ray`)"


def _kill_named(word: str) -> None:
    """SIGKILL every process whose command line contains `word` (the run's own temp dir)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if word in (entry / "cmdline").read_bytes().decode(errors="replace"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason=WHY)
def test_ray_train_runs_the_script_to_the_same_weights(request, tmp_path):
    temp = tempfile.mkdtemp(prefix="rt-ray-")  # short: Ray's socket paths must fit 107 bytes
    out = tmp_path / "ray.json"
    try:
        proc = subprocess.run([sys.executable, str(REPO / "examples" / "ray_train.py"),
                               "--out", str(out)],
                              env=ENV | {"RAY_TMPDIR": temp, "RAY_USAGE_STATS_ENABLED": "0"},
                              capture_output=True, text=True, timeout=RAY_S, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
        logs = proc.stdout + proc.stderr
        assert "ringtrain: ray train: rank 0 of world_size 2 (local_rank 0)" in logs, logs[-5000:]
        assert "device cpu" in logs
    finally:
        _kill_named(temp)
        shutil.rmtree(temp, ignore_errors=True)
    assert read_digest(out) == reference_digest(request.config, tmp_path)
