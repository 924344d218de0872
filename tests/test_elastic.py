"""Resuming on another number of workers: 2 -> 1 and 2 -> 3 ranks, the same global batch,
every remaining sample of the epoch seen exactly once; a 2-stage pipeline's snapshot on 1 rank.

    .venv/bin/pytest -q tests/test_elastic.py

A run of 72 samples, 12 per step (2 ranks x 6), stops on SIGTERM after step 2 of its 6-step
epoch; the rest (48 samples, 4 steps) is then trained on 1 rank (6 x 2 accumulated) or on 3
(4 each). A dataset wrapper records which samples each rank reads.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset, Subset

from ringtrain.checkpoint.resume import config_differences, elastic_batch
from ringtrain.data.addition import AdditionDataset
from ringtrain.models import GPT, GPTConfig, loss_fn
from ringtrain.runtime import get_runtime
from ringtrain.strategies import make_strategy
from ringtrain.testing import run_workers
from ringtrain.training.trainer import Trainer, TrainerConfig

# No dropout: with it, the fresh per-rank RNG of an elastic resume changes the masks, and the
# comparison with the uninterrupted run below could not be this tight.
MODEL = GPTConfig(vocab_size=10, block_size=3, n_layer=1, n_head=2, n_embd=16, dropout=0.0)
N, GLOBAL_BATCH, STOP = 72, 12, 2
STEPS = N // GLOBAL_BATCH  # one epoch


class Recording(Dataset):
    """The first N sums of 1-digit addition; remembers every index read, in order."""

    def __init__(self):
        self.data = Subset(AdditionDataset("train", 1), range(N))
        self.seen: list[int] = []

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        self.seen.append(int(i))
        return self.data[i]


def make_trainer(runtime, run_dir, *, strategy="ddp", stop_at=None, **options):
    cfg = TrainerConfig(steps=STEPS, batch_size=6, lr=3e-3, seed=0, progress=False, log_every=1,
                        eval_every=STEPS, eval_batch_size=4)
    test = Subset(AdditionDataset("test", 1), range(4))
    trainer = Trainer(make_strategy(strategy, runtime=runtime, **options), runtime,
                      lambda: GPT(MODEL), Recording(), test, loss_fn, cfg, run_dir=str(run_dir),
                      snapshot_every=100)
    if stop_at is not None:
        def on_step(step):
            if step == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)
        trainer.on_step = on_step
    return trainer


def _two_ranks(rank, world_size, root):
    """The uninterrupted run and the stopped ones (DDP, and a 2-stage pipeline)."""
    import ringtrain.training.report

    ringtrain.training.report.write_report = lambda *args, **kwargs: None
    rt, root = get_runtime(), Path(root)
    reference = make_trainer(rt, root / "reference").fit()
    stopped = make_trainer(rt, root / "ddp", stop_at=STOP if rank == 0 else None).fit()
    assert stopped["stopped_by"] == "SIGTERM" and stopped["steps"] == STOP
    make_trainer(rt, root / "pipeline", strategy="pipeline", pp=2, stop_at=STOP).fit()
    # The pipeline resumes exactly on the same topology.
    pipeline_ref = make_trainer(rt, root / "pipeline_ref", strategy="pipeline", pp=2).fit()
    if rank == 0:
        shutil.copytree(root / "pipeline", root / "pipeline_same")
    torch.distributed.barrier()
    pipeline_resumed = make_trainer(rt, root / "pipeline_same", strategy="pipeline", pp=2).fit()
    return reference, pipeline_ref, pipeline_resumed


def _resume(rank, world_size, run_dir):
    import ringtrain.training.report

    ringtrain.training.report.write_report = lambda *args, **kwargs: None
    trainer = make_trainer(get_runtime(), run_dir)
    summary = trainer.fit()
    return summary, trainer.train_set.seen, (trainer.config.batch_size, trainer.config.grad_accum)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic")
    outs = run_workers(_two_ranks, 2, args=(str(root),), timeout_s=120)
    return root, outs


def _epoch_order() -> list[int]:
    g = torch.Generator()
    g.manual_seed(0)  # the sampler's order of epoch 0 for seed 0
    return torch.randperm(N, generator=g).tolist()


def _check_rest_of_epoch(per_rank_seen: list[list[int]], per_rank_step: int):
    """Each step after the resume reads the same 12 samples as without it; each exactly once."""
    order = _epoch_order()
    for step in range(STOP, STEPS):
        got = sorted(i for seen in per_rank_seen
                     for i in seen[(step - STOP) * per_rank_step:(step - STOP + 1) * per_rank_step])
        expected = sorted(order[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH])
        assert got == expected, f"step {step + 1}"
    everything = sorted(i for seen in per_rank_seen for i in seen)
    assert everything == sorted(order[STOP * GLOBAL_BATCH:]), "not every remaining sample once"


def _close_to_reference(summary, reference):
    """Same samples per step, same global batch: the weights differ only by rounding."""
    assert summary["global_batch_size"] == GLOBAL_BATCH and summary["steps"] == STEPS
    assert summary["resumed_from_step"] == [STOP]
    assert abs(summary["train_loss"] - reference["train_loss"]) < 1e-4


def test_two_ranks_to_three(stopped):
    root, outs = stopped
    shutil.copytree(root / "ddp", root / "to3")
    results = run_workers(_resume, 3, args=(str(root / "to3"),), timeout_s=120)
    assert [r[2] for r in results] == [(4, 1)] * 3  # 12 = 3 ranks x 4: micro-batch made smaller
    _check_rest_of_epoch([r[1] for r in results], per_rank_step=4)
    _close_to_reference(results[0][0], outs[0][0])
    assert len({r[0]["param_sha256"] for r in results}) == 1


def test_two_ranks_to_one(stopped, single_process, caplog):
    root, outs = stopped
    shutil.copytree(root / "ddp", root / "to1")
    trainer = make_trainer(single_process, root / "to1")
    with caplog.at_level(logging.INFO, logger="ringtrain"):
        summary = trainer.fit()
    assert (trainer.config.batch_size, trainer.config.grad_accum) == (6, 2)  # kept the batch size
    _check_rest_of_epoch([trainer.train_set.seen], per_rank_step=12)
    _close_to_reference(summary, outs[0][0])
    assert ("keeping the global batch of 12 on 1 data ranks: batch_size 6 x grad_accum 2"
            in caplog.text)
    # A fresh RNG, said once.
    assert "written by world_size=2, this run has world_size=1" in caplog.text
    assert caplog.text.count("seeded afresh") == 1


def test_pipeline_resumes_exactly_on_the_same_topology(stopped):
    _, outs = stopped
    for rank in range(2):
        _, pipeline_ref, resumed = outs[rank]
        assert resumed["param_sha256"] == pipeline_ref["param_sha256"]
        assert resumed["resumed_from_step"] == [STOP]


def test_a_two_stage_pipeline_resumes_on_one_rank_through_the_layout_free_form(
    stopped, single_process, caplog
):
    root, outs = stopped
    shutil.copytree(root / "pipeline", root / "pipeline_to1")
    trainer = make_trainer(single_process, root / "pipeline_to1", strategy="pipeline", pp=1)
    with caplog.at_level(logging.INFO, logger="ringtrain"):
        summary = trainer.fit()
    assert summary["resumed_from_step"] == [STOP] and summary["steps"] == STEPS
    assert abs(summary["train_loss"] - outs[0][1]["train_loss"]) < 1e-4
    assert ("resuming a snapshot of pipeline, 1 data ranks, pp=2, virtual_stages=1 "
            "(world_size=2) in pipeline, 1 data ranks, pp=1, virtual_stages=1") in caplog.text


# ---- the rules, without processes -------------------------------------------------------------


@pytest.mark.parametrize("global_batch, world_size, batch_size, expected", [
    (12, 1, 6, (6, 2)),  # keep the micro-batch, accumulate more
    (12, 3, 6, (4, 1)),  # 4 per rank: the largest micro-batch up to 6 that divides it
    (64, 2, 8, (8, 4)),
    (48, 4, 16, (12, 1)),
    (30, 4, 5, None),  # 30 is not a multiple of 4
])
def test_elastic_batch_keeps_the_global_batch(global_batch, world_size, batch_size, expected):
    if expected is None:
        with pytest.raises(ValueError, match=r"global batch of 30 .*on 2 data ranks\) "
                                             r"on 4 data ranks.*e\.g\. 1, 2, 3, 5"):
            elastic_batch(global_batch, world_size, batch_size, saved_data_world_size=2)
        return
    b, a = elastic_batch(global_batch, world_size, batch_size, saved_data_world_size=2)
    assert (b, a) == expected and b * a * world_size == global_batch


def test_config_differences_name_each_option():
    saved = {"lr": 0.003, "n_layer": 2, "data": None}
    assert config_differences(saved, {"lr": 0.003, "n_layer": 2, "data": None}) == []
    diffs = config_differences(saved, {"lr": 0.001, "n_layer": 2, "data": None, "seed": 1})
    assert diffs == ["--lr 0.003 in the snapshot, 0.001 now",
                     "--seed (the default) in the snapshot, 1 now"]
    # Floats as typed where that tells them apart (--min-lr is --lr / 10), in full where not.
    assert config_differences({"min_lr": 0.003 / 10}, {"min_lr": 0.001}) == [
        "--min-lr 0.0003 in the snapshot, 0.001 now"]
    assert config_differences({"lr": 0.1 + 0.2}, {"lr": 0.3}) == [
        "--lr 0.30000000000000004 in the snapshot, 0.3 now"]
