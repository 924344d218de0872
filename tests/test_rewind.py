"""Going back to an earlier snapshot on purpose (`ringtrain.checkpoint.rewind`,
`ringtrain train --resume-from STEP`).

    .venv/bin/pytest -q tests/test_rewind.py

The later snapshots are set aside, never deleted; a run resumed from an earlier step is
bit-identical to the run that first went past it (the same `param_sha256` at the end); a
restarted or requeued job goes on from the newest instead of going back again; a missing or
damaged snapshot of that step is one message before anything moves, on one rank or two.
CPU and gloo (tests/conftest.py sets the device for every test not marked cuda).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.faults import fault_env

from ringtrain.checkpoint.files import COMMITTED
from ringtrain.checkpoint.rewind import check_step, committed_steps, set_aside_after
from ringtrain.checkpoint.snapshot import SnapshotManager
from ringtrain.cli.explain import explain, load_run
from ringtrain.cli.train import main

pytestmark = pytest.mark.usefixtures("clean_env")  # in-process runs leave no trace

TINY = ["--steps", "6", "--snapshot-every", "2", "--keep", "10", "--n-layer", "1",
        "--n-embd", "32", "--batch-size", "16", "--eval-every", "6", "--no-progress", "--no-report",
        "--dropout", "0.1"]  # dropout: the resumed RNG state matters


def _saved(root: Path, steps) -> SnapshotManager:
    mgr = SnapshotManager(root, rank=0, world_size=1, keep=10)
    for step in steps:
        mgr.save(step, shared={"w": torch.full((4,), float(step))}, per_rank={})
    mgr.wait()
    return mgr


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_later_snapshots_and_named_files_are_set_aside_whole(tmp_path):
    root, into = tmp_path / "snapshots", tmp_path / "aside"
    mgr = _saved(root, (2, 4, 6, 8))
    (root / "snap-00000010").mkdir()  # a save of step 10 that never committed: aside too
    summary, metrics = tmp_path / "summary.json", tmp_path / "metrics.jsonl"
    summary.write_text("{}")
    metrics.write_text("line\n")
    assert committed_steps(root) == [2, 4, 6, 8]
    moved = set_aside_after(root, 4, into=into, move=[summary, tmp_path / "absent.json"],
                            copy=[metrics])
    assert [p.name for p in moved] == ["snap-00000010", "snap-00000008", "snap-00000006"]
    assert all(p.parent == into for p in moved)
    assert committed_steps(root) == [2, 4] and mgr.latest().step == 4
    assert sorted(os.listdir(into)) == ["metrics.jsonl", "snap-00000006", "snap-00000008",
                                        "snap-00000010", "summary.json"]
    assert not summary.exists() and metrics.read_text() == "line\n"  # moved; copied
    with pytest.warns(UserWarning, match="snap-00000010 has no COMMITTED marker"):
        assert SnapshotManager(into, rank=0, world_size=1).latest().step == 8  # intact
    mgr.save(6, shared={"w": torch.zeros(4)}, per_rank={})  # the new run saves past 4
    mgr.wait()
    assert committed_steps(root) == [2, 4, 6]
    assert set_aside_after(root, 6, into=tmp_path / "none") == []  # the newest: nothing moves
    assert not (tmp_path / "none").exists()
    mgr.close()


def test_a_missing_or_damaged_step_is_refused_naming_the_steps_and_moving_nothing(tmp_path):
    root = tmp_path / "snapshots"
    _saved(root, (2, 4, 6)).close()
    with pytest.raises(ValueError, match=r"--resume-from 3: .* has no committed snapshot of step "
                                         r"3; its committed snapshots are of steps 2, 4, 6 "):
        check_step(root, 3)
    with pytest.raises(ValueError, match="it holds no committed snapshot"):
        check_step(tmp_path / "empty", 0)
    _flip_byte(root / "snap-00000004" / "shared.pt")
    with pytest.raises(ValueError, match=r"snap-00000004 is damaged \(snap-00000004/shared\.pt: "
                                         r"sha256 .*choose another"):
        set_aside_after(root, 4, into=tmp_path / "aside")
    assert committed_steps(root) == [2, 4, 6] and not (tmp_path / "aside").exists()
    (root / "snap-00000006" / COMMITTED).unlink()  # uncommitted: not one to go back to
    with pytest.raises(ValueError, match="steps 2, 4 "):
        check_step(root, 6)


def _train(run_dir: Path, *extra: str) -> dict:
    assert main([*TINY, "--run-dir", str(run_dir), *extra]) == 0
    return json.loads((run_dir / "summary.json").read_text())


def _losses(path: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r["train_loss"] for r in rows if "train_loss" in r}


def test_resume_from_an_earlier_step_is_bit_identical_and_keeps_the_later_run(tmp_path):
    run = tmp_path / "run"
    first = _train(run)
    losses = _losses(run / "metrics.jsonl")
    again = _train(run, "--resume-from", "2")
    assert again["param_sha256"] == first["param_sha256"]
    assert _losses(run / "metrics.jsonl") == losses  # trimmed at 2, then the same losses
    (aside,) = (run / "set-aside").iterdir()
    assert aside.name.startswith("after-2-")
    assert sorted(os.listdir(aside)) == ["metrics.jsonl", "model.safetensors", "model_config.json",
                                         "snap-00000004", "snap-00000006", "summary.json"]
    assert json.loads((aside / "summary.json").read_text()) == first
    assert _losses(aside / "metrics.jsonl") == losses
    assert committed_steps(run / "snapshots") == [2, 4, 6]  # the new run's 4 and 6
    said = explain(load_run(str(run)))  # its resume command goes on from the newest
    command = said[said.index("ringtrain train --nproc-per-node 1 "):].splitlines()[0]
    assert "--resume-from" not in command
    assert re.search(r"or go back to an earlier snapshot with --resume-from STEP, one of 2, 4\b",
                     " ".join(said.split())), said
    assert f"set aside by --resume-from: {aside} (steps 4, 6)" in " ".join(said.split())


def test_no_resume_sets_the_earlier_run_aside_whole_and_trains_it_again(tmp_path):
    run = tmp_path / "run"
    first = _train(run)
    again = _train(run, "--no-resume")
    assert again["param_sha256"] == first["param_sha256"]  # afresh: the same run again
    (aside,) = (run / "set-aside").iterdir()
    assert aside.name.startswith("fresh-")
    assert sorted(os.listdir(aside)) == ["config.json", "metrics.jsonl", "model.safetensors",
                                         "model_config.json", "snapshots", "summary.json",
                                         "tensorboard"]
    assert json.loads((aside / "summary.json").read_text()) == first
    assert committed_steps(aside / "snapshots") == committed_steps(run / "snapshots") == [2, 4, 6]
    said = " ".join(explain(load_run(str(run))).split())
    assert f"set aside by --no-resume: {aside} (steps 2, 4, 6)" in said, said


@pytest.mark.parametrize("restart", ["TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"])
def test_a_restarted_or_requeued_job_goes_on_from_the_newest(restart, tmp_path, monkeypatch):
    """The launcher's restart, or Slurm's requeue (the same command again), of a job started
    with --resume-from: going back again would lose what it trained since."""
    run = tmp_path / "run"
    _train(run, "--steps", "4")
    monkeypatch.setenv(restart, "1")
    assert _train(run, "--steps", "6", "--resume-from", "2")["steps"] == 6
    assert not (run / "set-aside").exists()
    assert committed_steps(run / "snapshots") == [2, 4, 6]


@pytest.mark.parametrize("argv,message", [
    (["--resume-from", "3"], r"--resume-from 3: .*snapshots has no committed snapshot of step 3; "
                             r"its committed snapshots are of steps 2, 4"),
    (["--resume-from", "2", "--no-resume"], r"--resume-from 2 with --no-resume: one resumes "),
    (["--resume-from", "9"], r"--resume-from 9 is after --steps 4: .*use --steps 9 or more"),
])
def test_bad_resume_from_is_one_message_before_launch(argv, message, tmp_path, capsys):
    run = tmp_path / "run"
    assert main([*TINY, "--steps", "4", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert main([*TINY, "--steps", "4", "--run-dir", str(run), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1
    assert re.search(message, err), err
    assert not (run / "set-aside").exists()
    assert main([*TINY, "--resume-from", "2"]) == 2
    assert "--resume-from 2 needs --run-dir" in capsys.readouterr().err


def test_two_ranks_go_back_together_or_refuse_together(tmp_path):
    """Rank 0 sets aside, rank 1 waits for its word through the store; a worker killed after
    that restarts the job, which goes on from the new run's snapshot, not from STEP again: the
    same final model as the first run. A damaged snapshot of STEP is one message, exit 2."""
    run = tmp_path / "run"

    def launch(*extra: str, env=None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "ringtrain", "train", "--nproc-per-node", "2", *TINY,
             "--run-dir", str(run), *extra], capture_output=True, text=True, timeout=180,
            cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    first = launch()
    assert first.returncode == 0, first.stderr[-3000:]
    sha = json.loads((run / "summary.json").read_text())["param_sha256"]
    again = launch("--resume-from", "2", "--max-restarts", "1", env=fault_env("kill:1:5"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("the 2 later snapshots (steps 4, 6)") == 1, again.stderr[-3000:]
    assert "resumed from" in again.stderr and "snap-00000004: step 4 of 6" in again.stderr
    assert json.loads((run / "summary.json").read_text())["param_sha256"] == sha
    _flip_byte(run / "snapshots" / "snap-00000004" / "rank1.pt")
    bad = launch("--resume-from", "4")
    assert bad.returncode == 2, bad.stderr[-3000:]
    out = bad.stdout + bad.stderr
    assert out.count("snap-00000004 is damaged (snap-00000004/rank1.pt") == 1, out[-3000:]
    assert committed_steps(run / "snapshots") == [2, 4, 6]
    assert len(list((run / "set-aside").iterdir())) == 1


def test_a_stopped_rewound_run_says_to_leave_out_resume_from(tmp_path, monkeypatch, capsys):
    """Run again as it was typed, the command would go back once more: the stop says so."""
    run = tmp_path / "run"
    _train(run, "--steps", "4")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent / "support"))
    monkeypatch.setenv("RINGTRAIN_STEP_HOOK", "faults:hook")
    monkeypatch.setenv("RINGTRAIN_TEST_FAULT", "term:0:3")
    capsys.readouterr()
    assert main([*TINY, "--steps", "4", "--run-dir", str(run), "--resume-from", "2"]) == 143
    out = capsys.readouterr().out
    assert "stopped at step 3 on SIGTERM" in out and "run the same command again without " \
           "--resume-from to resume" in out, out
