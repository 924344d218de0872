"""Snapshots of the training loop and exact resume (`ringtrain.checkpoint.resume` through
`Trainer`).

    .venv/bin/pytest -q tests/test_resume.py

Every faulty run is compared with an uninterrupted one: the same `param_sha256` and the same
logged losses, step for step (CPU, fp32, dropout on so each rank's RNG state matters). The
two-rank scenarios share one process group (`run_workers` spawns are the slow part here); a
crash there is an exception raised on both ranks at the same step boundary, after which a new
`Trainer` resumes from disk with nothing kept in memory. `tests/test_restart.py` kills a real
worker with SIGKILL instead.
"""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest
import torch
from torch.utils.data import Subset

import ringtrain.checkpoint.snapshot as checkpoint
from ringtrain.data.addition import AdditionDataset, exact_match
from ringtrain.errors import ConfigError
from ringtrain.models import GPT, GPTConfig, loss_fn
from ringtrain.runtime import get_runtime
from ringtrain.strategies import make_strategy
from ringtrain.testing import run_workers
from ringtrain.training.trainer import Trainer, TrainerConfig

MODEL = GPTConfig(vocab_size=10, block_size=3, n_layer=1, n_head=2, n_embd=16, dropout=0.1)
STEPS, EVERY = 12, 3  # 80 samples, 8 per rank per step: 2 ranks end epochs at steps 5 and 10


class Crash(RuntimeError):
    """Raised on every rank at the same step boundary: the job dies, a new trainer resumes."""


def make_trainer(runtime, run_dir, *, lr=3e-3, fault=None, name="trainer", train=None,
                 **config):
    """A 1-layer GPT on 1-digit addition; `fault` = (action, step) for this rank.

    `name`: a second trainer of `run_dir` in one process group (the resumed one) needs another.
    `train`: another training set than the whole of 1-digit addition's.
    `config`: TrainerConfig fields over these.
    """
    train, test = train or AdditionDataset("train", 1), AdditionDataset("test", 1)
    cfg = TrainerConfig(**{"steps": STEPS, "batch_size": 8, "lr": lr, "seed": 0,
                           "progress": False, "log_every": 1, "eval_every": 6,
                           "eval_batch_size": 4, **config})
    trainer = Trainer(make_strategy("ddp", runtime=runtime), runtime, lambda: GPT(MODEL), train,
                      Subset(test, range(5)), loss_fn, cfg, eval_metrics={"accuracy": exact_match},
                      run_dir=str(run_dir), snapshot_every=EVERY,
                      run_config={"n_embd": MODEL.n_embd}, snapshot_timeout_s=10.0, name=name)
    if fault is not None:
        action, at_step = fault

        def on_step(step: int) -> None:
            if step == at_step and action == "crash":
                raise Crash(f"injected crash after step {step}")
            if step == at_step and action == "term":
                os.kill(os.getpid(), signal.SIGTERM)
        trainer.on_step = on_step
    return trainer


def _fails_writing(step: int) -> None:
    """This rank's file of the snapshot of `step` stops half-way (a failing disk, a dying rank).

    EIO, not ENOSPC: a full disk stops the run instead of training on (tests/test_disk.py).
    """
    real = checkpoint.write_durably

    def write(path: Path, obj):
        if path.name.startswith("rank") and f"-{step:08d}-" in path.parent.name:
            path.write_bytes(b"half a file")
            raise OSError(5, "Input/output error")
        return real(path, obj)
    checkpoint.write_durably = write


def _scenarios(rank, world_size, root, crash_step):
    """Every two-rank scenario, one after another in this process group; returns the summaries."""
    import ringtrain.training.report

    # matplotlib: not tested here
    ringtrain.training.report.write_report = lambda *args, **kwargs: None
    rt, root, out = get_runtime(), Path(root), {}
    out["reference"] = make_trainer(rt, root / "reference").fit()
    # SIGTERM to rank 1 alone after step 7: both ranks save step 7 and stop; then resume.
    out["term"] = make_trainer(rt, root / "term", fault=("term", 7) if rank == 1 else None).fit()
    snap = root / "term" / "snapshots" / "snap-00000007"
    out["term_manifest"] = json.loads((snap / "manifest.json").read_text())
    out["term_rank_steps"] = [torch.load(snap / f"rank{r}.pt", weights_only=True)["step"]
                              for r in range(2)]
    out["term_resumed"] = make_trainer(rt, root / "term", name="resumed").fit()
    # Rank 1's part of snapshot 6 is torn; the save fails on both ranks; the job dies at step 7.
    write = checkpoint.write_durably
    if rank == 1:
        _fails_writing(6)
    with pytest.raises(Crash):
        make_trainer(rt, root / "torn", fault=("crash", 7)).fit()
    checkpoint.write_durably = write
    out["torn_partial"] = sorted(p.name for p in (root / "torn" / "snapshots").iterdir())
    out["torn_resumed"] = make_trainer(rt, root / "torn", name="resumed").fit()
    # A crash at a random step.
    with pytest.raises(Crash):
        make_trainer(rt, root / "crash", fault=("crash", crash_step)).fit()
    out["crash_resumed"] = make_trainer(rt, root / "crash", name="resumed").fit()
    return out


def _losses(run_dir) -> dict[int, float]:
    records = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"steps logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_ranks")
    crash_step = random.randint(1, STEPS - 1)
    outs = run_workers(_scenarios, 2, args=(str(root), crash_step), timeout_s=120)
    return root, crash_step, outs


def _same_as_reference(two_ranks, name, resumed_from):
    root, _, outs = two_ranks
    ref = outs[0]["reference"]["param_sha256"]
    assert outs[0]["reference"]["steps"] == STEPS and outs[1]["reference"]["param_sha256"] == ref
    start = resumed_from[-1] if resumed_from else 0
    for r in range(2):
        summary = outs[r][f"{name}_resumed"]
        assert summary["param_sha256"] == ref, f"rank {r}"
        assert summary["resumed_from_step"] == resumed_from
        assert summary["snapshots_saved"] == STEPS // EVERY - start // EVERY  # none failed
    assert _losses(root / name) == _losses(root / "reference")  # every step once, same loss


def test_crash_at_a_random_step_then_bit_identical_resume(two_ranks):
    crash_step = two_ranks[1]
    # The crash comes after the step, before its snapshot: resume from the one before.
    newest = (crash_step - 1) // EVERY * EVERY
    _same_as_reference(two_ranks, "crash", [newest] if newest else [])


def test_sigterm_on_one_rank_makes_all_save_the_same_step_and_resume_from_it(two_ranks):
    _, _, outs = two_ranks
    assert [o["term"]["stopped_by"] for o in outs] == ["SIGTERM", "SIGTERM"]
    assert [o["term"]["steps"] for o in outs] == [7, 7] and outs[0]["term"]["snapshot_step"] == 7
    manifest = outs[0]["term_manifest"]  # the newest committed snapshot after the stop
    assert manifest["metadata"]["reason"] == "SIGTERM" and manifest["step"] == 7
    assert sorted(manifest["files"]) == ["rank0.pt", "rank1.pt", "shared.pt"]
    assert outs[0]["term_rank_steps"] == [7, 7]  # each rank's own file is of that step
    _same_as_reference(two_ranks, "term", [7])


def test_crash_while_writing_a_snapshot_uses_the_previous_one(two_ranks):
    _, _, outs = two_ranks
    # What the crash left: the failed save removed its temp directory, the one before stays.
    assert outs[0]["torn_partial"] == ["snap-00000003"]
    _same_as_reference(two_ranks, "torn", [3])
    assert not list((two_ranks[0] / "torn" / "snapshots").glob(".tmp-*")), "the next save clears it"


def test_the_snapshot_holds_every_rank_state(two_ranks):
    snap = two_ranks[0] / "reference" / "snapshots" / f"snap-{STEPS:08d}"
    shared = torch.load(snap / "shared.pt", weights_only=True)
    assert set(shared) == {"trainer", "strategy", "window_sum", "scaler"}
    model = shared["strategy"]["model"]  # unwrapped: no `module.` prefix
    assert model and not any(k.startswith("module.") for k in model)
    assert shared["strategy"]["optimizer"]["state"]  # AdamW's exp_avg, exp_avg_sq, step
    sampler = shared["trainer"]["sampler"]  # epochs end at steps 5 and 10: 2 steps into epoch 2
    assert shared["trainer"]["step"] == STEPS
    assert (sampler["epoch"], sampler["samples_consumed"]) == (2, 32)
    rng = [torch.load(snap / f"rank{r}.pt", weights_only=True)["rng"] for r in range(2)]
    assert set(rng[0]) >= {"python", "numpy", "torch"}
    assert not torch.equal(rng[0]["torch"], rng[1]["torch"])  # per rank: dropout differs
    meta = json.loads((snap / "manifest.json").read_text())["metadata"]
    assert (meta["world_size"], meta["global_batch"],
            meta["topology"]["data_world_size"]) == (2, 16, 2)


# ---- one process, in this process ---------------------------------------------------------


def test_flipped_byte_is_detected_and_the_previous_snapshot_used(tmp_path, single_process):
    rt = single_process
    reference = make_trainer(rt, tmp_path / "ref").fit()
    with pytest.raises(Crash):
        make_trainer(rt, tmp_path / "run", fault=("crash", 10)).fit()
    newest = tmp_path / "run" / "snapshots" / "snap-00000009"
    data = bytearray((newest / "shared.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (newest / "shared.pt").write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="snap-00000009/shared.pt: sha256"):
        summary = make_trainer(rt, tmp_path / "run").fit()
    assert summary["resumed_from_step"] == [6]
    assert summary["param_sha256"] == reference["param_sha256"]
    assert _losses(tmp_path / "run") == _losses(tmp_path / "ref")


def test_other_options_are_refused_naming_them(tmp_path, single_process):
    with pytest.raises(Crash):
        make_trainer(single_process, tmp_path, fault=("crash", 4)).fit()
    with pytest.raises(ValueError, match=r"--lr 0\.003 in the snapshot, 0\.001 now.*--no-resume"):
        make_trainer(single_process, tmp_path, lr=1e-3).fit()
    fresh = make_trainer(single_process, tmp_path, lr=1e-3)
    fresh.resume = False  # what --no-resume does, after deleting the snapshots
    assert fresh.fit()["resumed_from_step"] == []


def test_a_new_schedule_is_taken_from_the_snapshots_step_only_when_asked(tmp_path,
                                                                        single_process):
    """--lr, --min-lr, --warmup-steps and --lr-schedule changed on a resume: refused, the
    message offering --new-schedule; with it the run goes on from the snapshot's step at the
    new schedule's learning rates (lr_at of the new config, logged per step), while another
    option changed too is still refused."""
    from ringtrain.training.config import lr_at

    with pytest.raises(Crash):
        make_trainer(single_process, tmp_path, fault=("crash", 4)).fit()  # snapshot of step 3
    with pytest.raises(ValueError, match=r"--lr 0\.003 in the snapshot, 0\.001 now.*add "
                                         r"--new-schedule to train on with this command's "
                                         r"learning rates from step 3"):
        make_trainer(single_process, tmp_path, lr=1e-3).fit()
    changed = make_trainer(single_process, tmp_path, lr=1e-3, new_schedule=True, seed=1)
    with pytest.raises(ValueError, match=r"--seed 0 in the snapshot, 1 now\. Resume with the "
                                         r"snapshot's options, or start afresh"):
        changed.fit()
    lowered = make_trainer(single_process, tmp_path, lr=1e-3, new_schedule=True,
                           lr_schedule="constant")
    assert lowered.fit()["resumed_from_step"] == [3]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in lines if r["step"] > 3] == [
        pytest.approx(lr_at(k - 1, lowered.config)) for k in range(4, STEPS + 1)]
    assert all(r["lr"] == pytest.approx(1e-3) for r in lines if r["step"] > 3)  # constant


def test_data_of_another_size_is_one_message_naming_both_sizes(tmp_path, single_process):
    """A text edited or prepared again since the snapshot: where its epoch stood means nothing
    (was the sampler's ValueError, a traceback out of `ringtrain train`)."""
    with pytest.raises(Crash):
        make_trainer(single_process, tmp_path, fault=("crash", 4)).fit()
    fewer = Subset(AdditionDataset("train", 1), range(60))
    with pytest.raises(ConfigError, match=r"the snapshot of step 3 was trained on 80 samples and "
                                          r"the data has 60 now: it changed since .*--no-resume"):
        make_trainer(single_process, tmp_path, train=fewer).fit()


def test_summary_reports_snapshot_time_and_size(tmp_path, single_process):
    summary = make_trainer(single_process, tmp_path).fit()
    assert summary["snapshots_saved"] == STEPS // EVERY and summary["snapshot_every"] == EVERY
    assert 0 < summary["snapshot_s_last"] < 10 and summary["snapshot_bytes_last"] > 10_000
    assert summary["restarts"] == 0 and summary["resumed_from_step"] == []
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["snapshot_bytes_mean"] == summary["snapshot_bytes_mean"]
