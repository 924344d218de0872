"""TorchX, for real: `torchx run -s local_cwd dist.ddp -j 1x2 --script examples/ddp_train.py` ends
with the same weights as `ringtrain run --nproc-per-node 2` of the same script.

    pip install -e '.[torchx]'                  # or `make torchx`
    .venv/bin/pytest -q tests/test_torchx.py    # skips with the reason when torchx is absent

TorchX's `dist.ddp` component wraps torchrun (found on PATH: the virtual environment's bin),
so the workers see torchrun's variables and TORCHX_*; its logs go to the test's directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

from same_weights import ENV, SCRIPT, read_digest, reference_digest  # noqa: E402

BIN = Path(sys.executable).parent
TORCHX_S = 240.0  # torchx's start, torchrun's agent and two workers on a busy 2-core machine


@pytest.mark.skipif(not (BIN / "torchx").exists(),
                    reason="torchx is not installed: pip install -e '.[torchx]' (or `make torchx`)")
def test_torchx_dist_ddp_runs_the_script_to_the_same_weights(request, tmp_path):
    out, logs = tmp_path / "torchx.json", tmp_path / "logs"
    proc = subprocess.run(
        [str(BIN / "torchx"), "run", "-s", "local_cwd", "-cfg", f"log_dir={logs}", "dist.ddp",
         "-j", "1x2", "--script", str(SCRIPT), "--", "--out", str(out)],
        env=ENV | {"PATH": f"{BIN}{os.pathsep}{ENV.get('PATH', '')}"}, capture_output=True,
        text=True, timeout=TORCHX_S, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert "ringtrain: torchx: rank 0 of world_size 2 (local_rank 0)" in proc.stdout + proc.stderr
    assert read_digest(out) == reference_digest(request.config, tmp_path)
