"""Synchronised data parallel trains the same model as one device: 2 ranks x B against 1 x 2B.

    .venv/bin/python examples/concepts/same_weights.py           # 4 short runs, ~40 s

Runs `ringtrain train` (the default task and GPT, 150 steps, a snapshot every 25) four times
into a temporary directory: one process with batch 32; two processes with batch 16 each (the
same 32 samples per step, split by the sampler, gradients averaged by all-reduce), twice; and,
for scale, one process with batch 16 (half the data: what a rank would learn alone). It reads
the weights of every snapshot and prints their largest difference from the 1 x 32 run's at the
same step, then each run's held-out loss and param_sha256.

2 x 16 and 1 x 32 compute the same gradient, but not bit for bit: the mean of two half-batch
means rounds differently from one full-batch mean, in the last bits. Training amplifies such
differences step by step (Adam divides by the square root of small second moments), so the gap
grows, yet it stays orders of magnitude below the gap to a run that sees other data. The same
command twice gives the same hash: on CPU the runs are deterministic.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ringtrain.checkpoint.snapshot import SnapshotManager

STEPS, EVERY = 150, 25
RUNS = {"1 rank  x 32": (1, 32), "2 ranks x 16": (2, 16), "2 ranks x 16 again": (2, 16),
        "1 rank  x 16": (1, 16)}


def train(run_dir: Path, nproc: int, batch: int) -> tuple[dict, dict[int, dict[str, torch.Tensor]]]:
    """(summary, {step: weights}) of one `ringtrain train` run."""
    subprocess.run([sys.executable, "-m", "ringtrain", "train", "--nproc-per-node", str(nproc),
                    "--batch-size", str(batch), "--steps", str(STEPS), "--snapshot-every",
                    str(EVERY), "--keep", str(STEPS // EVERY), "--threads", "1", "--no-progress",
                    "--run-dir", str(run_dir)], check=True, capture_output=True, timeout=300)
    manager = SnapshotManager(run_dir / "snapshots", rank=0, world_size=1)
    weights = {snap.step: manager.load(snap)[0]["strategy"]["model"]
               for snap in manager.snapshots()}
    return json.loads((run_dir / "summary.json").read_text()), weights


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: train(Path(tmp) / str(i), *cfg) for i, (name, cfg) in enumerate(RUNS.items())}
    reference = runs["1 rank  x 32"][1]
    print(f"largest |w - w(1 rank x 32)| at each snapshot (largest weight "
          f"{max(float(t.abs().max()) for t in reference[STEPS].values()):.2f}):")
    print(f"{'step':>6}{'2 ranks x 16':>15}{'1 rank x 16':>14}")
    for step in sorted(reference):
        print(f"{step:>6}{max_diff(runs['2 ranks x 16'][1][step], reference[step]):>15.1e}"
              f"{max_diff(runs['1 rank  x 16'][1][step], reference[step]):>14.1e}")
    for name, (summary, _) in runs.items():
        print(f"{name:<20} eval_loss {summary['eval_loss']:.4f}  param_sha256 "
              f"{summary['param_sha256'][:16]}")


if __name__ == "__main__":
    main()
