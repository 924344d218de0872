"""Helpers for the launcher tests: run examples/ddp_train.py and compare its final weights.

    from same_weights import reference_digest, run_with_envs
    ref = reference_digest(request.config, tmp_path)          # under `ringtrain run`
    digest, outputs = run_with_envs([{"OMPI_COMM_WORLD_RANK": "0", ...}, {...}], tmp_path)

Every launcher test (Slurm, Ray, TorchX, MPI, Kubernetes) compares against the same 2-process
`ringtrain run` of the same script. That run is made once and kept in pytest's cache, keyed by
the bytes of ringtrain's sources, the script and the torch version: any change reruns it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "ddp_train.py"
ARGS = ["--steps", "30"]
START_S = 120.0  # two processes importing torch and meeting, on a busy 2-core machine
ENV = {k: v for k, v in os.environ.items() if k != "LOGLEVEL"} | {"PYTHONUNBUFFERED": "1"}


def _sources_key() -> str:
    h = hashlib.sha256(torch.__version__.encode())
    for path in sorted([SCRIPT, *(REPO / "ringtrain").rglob("*.py")]):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def read_digest(out: Path) -> str:
    return json.loads(out.read_text())["param_sha256"]


def reference_digest(config, tmp_path: Path) -> str:
    """The digest of `ringtrain run --nproc-per-node 2 examples/ddp_train.py` (cached).

    Args:
        config: pytest's `request.config` (its cache, where the cache plugin is on).
    """
    cache = getattr(config, "cache", None)
    key = f"ringtrain/ddp_train_digest/{_sources_key()}"
    cached = cache.get(key, None) if cache is not None else None
    if cached:
        return cached
    out = tmp_path / "reference.json"
    proc = subprocess.run([sys.executable, "-m", "ringtrain", "run", "--nproc-per-node", "2",
                           str(SCRIPT), *ARGS, "--out", str(out)], capture_output=True, text=True,
                          timeout=START_S, env=ENV, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    digest = read_digest(out)
    if cache is not None:
        cache.set(key, digest)
    return digest


def run_with_envs(envs: list[dict[str, str]], tmp_path: Path) -> tuple[str, list[str]]:
    """Start one process of the script per environment (as a launcher would); their digest and
    output.

    Variables that would tell another launcher's story (torchrun's, Slurm's) are removed first.
    """
    base = {k: v for k, v in ENV.items()
            if not k.startswith(("SLURM_", "OMPI_", "PMI_", "PET_", "TORCHELASTIC_", "TORCHX_"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                          "KUBERNETES_SERVICE_HOST", "RINGTRAIN_LAUNCHER_PID")}
    out = tmp_path / "digest.json"
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), *ARGS, "--out", str(out)],
                              env=base | env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=tmp_path) for env in envs]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=START_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    assert all(p.returncode == 0 for p in procs), "\n---\n".join(outputs)
    return read_digest(out), outputs
