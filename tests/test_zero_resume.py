"""ZeRO snapshots resumed on another number of ranks, through `ringtrain train`.

    .venv/bin/pytest -q tests/test_zero_resume.py

A 2-rank ZeRO-3 run (with activation checkpointing) saves every step; its snapshot of step 2
resumes on 3 ranks, whose snapshot of step 3 resumes on 2 again. Each rank of a resumed run
reads the saved ranks' files it needs and re-slices the flat units (`ringtrain.zero.reshard`),
so the run goes on with the same parameters and AdamW moments: its snapshot of step 4,
gathered into the full state, matches the uninterrupted run's (allclose: 3 ranks add the
gradients in another order). The exact equality of the state right after loading, 2 -> 3 -> 2,
is `tests/test_zero.py -k reshard`; the bit-identical resume on the same number of ranks is the
contract test (`tests/test_strategy_contract.py -k zero`). `--strategy ddp` on one rank
resumes the ZeRO-3 snapshot too, through the layout-free form (every pair of strategies and
world sizes: `tests/test_portable_resume.py`). Each run is the CLI's `main` on every rank, as
`srun -n N ringtrain train` runs it (tests/support/train_ranks.py): the resume is the workers'
business, and the launcher's restarts are tests/test_restart.py's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from support.train_ranks import train_ranks

from ringtrain.checkpoint.snapshot import SnapshotManager
from ringtrain.zero import reshard

FLAGS = ["--digits", "1", "--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--steps", "4",
         "--batch-size", "6", "--snapshot-every", "1", "--keep", "4", "--eval-every", "4",
         "--eval-batch-size", "16", "--threads", "1", "--no-progress", "--seed", "0",
         "--no-report"]


def _train(run_dir: Path, nproc: int, *extra: str) -> None:
    """`ringtrain train` on `nproc` ranks, each one task as under `srun -n N` (no launcher:
    what is tested is the workers' resume; tests/support/train_ranks.py says what it saves)."""
    train_ranks(["--run-dir", str(run_dir), *FLAGS, *extra], nproc)


def _full_state(run_dir: Path, step: int) -> dict:
    """The snapshot of `step`, every rank's shard put together: parameters and AdamW moments."""
    snap = next(s for s in SnapshotManager(run_dir / "snapshots", rank=0, world_size=1).snapshots()
                if s.step == step)
    parts = [torch.load(snap.path / f"rank{r}.pt", weights_only=True)["strategy"]["zero"]
             for r in range(snap.metadata["world_size"])]
    return {"world_size": snap.metadata["world_size"], **reshard.consolidate(parts)}


def _keep_until(src: Path, dst: Path, step: int) -> None:
    shutil.copytree(src, dst)
    for p in (dst / "snapshots").glob("snap-*"):
        if int(p.name[5:]) > step:
            shutil.rmtree(p)


def _close(a: dict, b: dict) -> None:
    for x, y in zip(a["params"], b["params"], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    for m, n in zip(a["moments"], b["moments"], strict=True):
        assert m.keys() == n.keys() == {"exp_avg", "exp_avg_sq"}
        for k in m:
            torch.testing.assert_close(m[k], n[k], rtol=1e-3, atol=1e-7)
    assert float(a["scalars"]["step"]) == float(b["scalars"]["step"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero_resume")
    _train(root / "two", 2, "--strategy", "zero", "--zero-stage", "3", "--activation-checkpointing")
    _keep_until(root / "two", root / "to3", 2)
    _train(root / "to3", 3, "--strategy", "zero", "--zero-stage", "3", "--activation-checkpointing")
    _keep_until(root / "to3", root / "back2", 3)
    _train(root / "back2", 2, "--strategy", "zero", "--zero-stage", "3")
    return root


def test_two_ranks_to_three_and_back_go_on_with_the_same_state(runs):
    reference = _full_state(runs / "two", 4)
    to3, back2 = _full_state(runs / "to3", 4), _full_state(runs / "back2", 4)
    assert (reference["world_size"], to3["world_size"], back2["world_size"]) == (2, 3, 2)
    assert _full_state(runs / "to3", 3)["world_size"] == 3
    _close(to3, reference)
    _close(back2, reference)
    summaries = {n: json.loads((runs / n / "summary.json").read_text())
                 for n in ("two", "to3", "back2")}
    assert summaries["to3"]["resumed_from_step"] == [2]
    assert summaries["back2"]["resumed_from_step"] == [2, 3]  # the run's resumes, in order
    for n in ("to3", "back2"):
        assert abs(summaries[n]["train_loss"] - summaries["two"]["train_loss"]) < 1e-4


def test_switching_to_ddp_on_one_rank_goes_on_from_the_zero_snapshot(runs):
    _keep_until(runs / "two", runs / "as_ddp", 2)
    _train(runs / "as_ddp", 1, "--strategy", "ddp")
    summary, reference = (json.loads((runs / n / "summary.json").read_text())
                          for n in ("as_ddp", "two"))
    assert summary["resumed_from_step"] == [2] and summary["strategy"] == "ddp"
    assert abs(summary["train_loss"] - reference["train_loss"]) < 1e-4
    ddp = torch.load(runs / "as_ddp" / "snapshots" / "snap-00000004" / "shared.pt",
                     weights_only=True)["strategy"]
    full = _full_state(runs / "two", 4)  # the uninterrupted ZeRO run, put together
    names = [n for unit in full["names"] for n in unit]  # the units' order
    flat = torch.cat([ddp["model"][n].reshape(-1) for n in names])
    torch.testing.assert_close(flat, torch.cat(full["params"]), rtol=1e-4, atol=1e-5)
