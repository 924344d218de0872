"""The contract every registered strategy keeps, and one end-to-end `Trainer` run of each.

    .venv/bin/pytest -q tests/test_strategy_contract.py

Over every strategy `ringtrain.strategies.registered()` finds (a new module in
`ringtrain/strategies/` is picked up without editing this file), on 2 gloo ranks with the
strategy's default options, plus the variants below (and tp 2 x pp 2 on 4 ranks, through
`Trainer`):
- the seam: build, a few steps (the reduced sample count is the batch), `state_dict` round trip
  (steps after the save are undone by loading it), `model_state_dict` equal on every rank,
  `eval_logits` on the ranks that produce output, `stats`, `close`, all under
  RINGTRAIN_DEBUG=collectives (no strategy's collectives differ across ranks);
- through `Trainer`: a run with snapshots, then the same run resumed from its first snapshot
  ends with the same `param_sha256` (strategies whose ranks drift apart, such as the async
  parameter server, are not deterministic: there the resumed run must finish, from the
  snapshot's step).
"""

from __future__ import annotations

import hashlib
import io
import math
import shutil
from typing import Any
from unittest import mock

import pytest
import torch
from torch.utils.data import Subset

from ringtrain.checkpoint.snapshot import SnapshotManager
from ringtrain.data.addition import AdditionDataset, exact_match
from ringtrain.models import GPT, GPTConfig, loss_fn
from ringtrain.runtime import get_runtime
from ringtrain.strategies import make_strategy, registered
from ringtrain.testing import run_workers
from ringtrain.training.config import adamw, param_sha256
from ringtrain.training.trainer import Trainer, TrainerConfig

WORLD = 2
MODEL = GPTConfig(vocab_size=10, block_size=3, n_layer=2, n_head=2, n_embd=16)  # 2 blocks: pp=2
STEPS, EVERY, BATCH = 6, 2, 4
# Variants beyond each strategy's defaults: (strategy, options, deterministic).
VARIANTS = [("ps", {"mode": "async"}, False), ("ddp", {"grad_compress": "powersgd:2"}, True),
            ("diloco", {"sync_every": 2, "outer_compress": "int8"}, True),
            ("pipeline", {"schedule": "interleaved", "virtual_stages": 2}, True),
            # zb-v, not zb-h1: its split backward on two chunks in a V covers zb-h1's one
            # chunk, for the same suite time (zb-h1 is checked against one process in
            # test_pipeline.py)
            ("pipeline", {"schedule": "zb-v"}, True),
            # tp's state under ZeRO (its shards of the slices); 2 ranks: dp 2 x tp 1, so ZeRO
            # shards (dp 2 x tp 2 is tests/test_tp_zero.py's, against one process)
            ("tp", {"tp": 1, "zero_stage": 2}, True)]
CASES = [(name, {}, True) for name in registered()] + VARIANTS
# Through Trainer: every strategy, and the variants whose state differs (not int8's codec),
# and the dp x pp x tp grid as tp 2 x pp 2 on 4 ranks (its seam and equality with one process:
# tests/test_grid_equivalence.py, which checks every rank's model_state_dict).
TRAINER_CASES = [c for c in CASES if c[1].get("outer_compress") is None] + [
    ("pipeline", {"pp": 2, "tp": 2}, True)]
DEBUG_COLLECTIVES = {"RINGTRAIN_DEBUG": "collectives", "RINGTRAIN_DEBUG_TIMEOUT": "60"}


def _world(case) -> int:
    """WORLD ranks, or the ranks one model needs where that is more (pp x tp)."""
    options = case[1]
    return max(WORLD, options.get("pp", 1) * options.get("tp", 1))


def _ids(case):
    name, options, _ = case
    return name + "".join(f"-{v}" for v in options.values())


def _micro_batches(strategy, data, step):
    """This rank's micro-batch of global step `step` (data rank r takes every r-th sample)."""
    if strategy.data_rank is None:
        return []
    n = strategy.data_world_size
    idx = [(step * BATCH * n + strategy.data_rank + n * i) % len(data) for i in range(BATCH)]
    x, y = zip(*(data[i] for i in idx), strict=True)
    return [(torch.stack(x), torch.stack(y))]


def _digest(obj: Any) -> str:
    """A hash of a (nested) state dict's contents: tensors by their bytes, the rest by repr."""
    h = hashlib.sha256()

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            h.update(o.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(o, dict):
            for k in sorted(o, key=repr):
                h.update(repr(k).encode())
                walk(o[k])
        elif isinstance(o, list | tuple):
            for v in o:
                walk(v)
        else:
            h.update(repr(o).encode())
    walk(obj)
    return h.hexdigest()


def _on_disk(state: dict[str, Any]) -> dict[str, Any]:
    """`state` as a snapshot keeps it: serialised now, so later steps cannot change it."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _seam(rank, world_size, name, options):
    rt = get_runtime()
    data = AdditionDataset("train", 1)
    s = make_strategy(name, runtime=rt, **options)
    torch.manual_seed(0)
    s.setup(GPT(MODEL), adamw(0.1), loss_fn)
    assert 0 < s.data_world_size <= world_size
    assert s.data_rank is None or 0 <= s.data_rank < s.data_world_size
    agree = s.agreement(rt, "contract")
    counts = []
    for step in range(2):
        res = s.train_step(_micro_batches(s, data, step), lr=1e-2, grad_clip=1.0)
        assert res.count >= 0 and math.isfinite(res.loss_sum)
        counts.append(agree.sum([float(res.count)])[0])
    saved = _on_disk(s.state_dict())  # collective for some strategies: every rank calls it
    s.train_step(_micro_batches(s, data, 2), lr=1e-2, grad_clip=1.0)
    moved = _digest(s.state_dict()) != _digest(saved)
    s.load_state_dict(saved)
    restored = _digest(s.state_dict()) == _digest(saved)
    x = torch.stack([data[i][0] for i in range(3)])
    logits = s.eval_logits(x)
    after = s.model_state_dict()  # once: the end of a run (a parameter server gathers its shards)
    out = {"counts": counts, "moved": moved, "restored": restored,
           "logits": None if logits is None else tuple(logits.shape),
           "digests": agree.gather(param_sha256(after)), "stats": s.stats(),
           "tolerated": sorted(s.tolerated_ranks), "shard": s.eval_shard()}
    s.close()
    return out


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_the_seam(case):
    name, options, _ = case
    # Under RINGTRAIN_DEBUG=collectives: every strategy's collectives agree across ranks (a
    # false mismatch would raise); the Trainer runs below go without it.
    out = run_workers(_seam, WORLD, args=(name, options), timeout_s=120, env=DEBUG_COLLECTIVES)
    cls = registered()[name]
    data_ranks = cls.Config(**options).plan(WORLD, BATCH)  # the pre-launch check agrees
    for r in out:
        # Every sample of a step counted once: data ranks x batch, whoever computes the loss.
        assert r["counts"] == [data_ranks * BATCH] * 2
        assert r["moved"], "a step changed nothing in state_dict()"
        assert r["restored"], "load_state_dict did not restore the saved state"
        assert len(set(r["digests"].values())) == 1, "model_state_dict differs across ranks"
        assert isinstance(r["stats"], dict) and isinstance(r["tolerated"], list)
    shapes = [r["logits"] for r in out if r["logits"] is not None]
    assert shapes and all(s == (3, MODEL.block_size, MODEL.vocab_size) for s in shapes)
    shards = [r["shard"] for r in out if r["shard"] is not None and r["shard"].index is not None]
    assert shards, "nobody evaluates"


def _trainer(rt, run_dir, name, options):
    train, test = AdditionDataset("train", 1), AdditionDataset("test", 1)
    cfg = TrainerConfig(steps=STEPS, batch_size=BATCH, lr=3e-3, seed=0, progress=False,
                        log_every=1, eval_every=3, eval_batch_size=4)
    return Trainer(make_strategy(name, runtime=rt, **options), rt, lambda: GPT(MODEL), train,
                   Subset(test, range(6)), loss_fn, cfg, eval_metrics={"accuracy": exact_match},
                   run_dir=str(run_dir), snapshot_every=EVERY, keep=STEPS, snapshot_timeout_s=30)


def _fit(rank, world_size, run_dir, name, options):
    trainer = _trainer(get_runtime(), run_dir, name, options)
    # No report.png: drawing it is ~1 s of CPU on rank 0 of each of the file's 30 runs, and
    # nothing here reads it (tests/test_trainer.py checks it). Put back on the way out, in
    # case the function ever runs in the test process.
    with mock.patch("ringtrain.training.report.write_report"):
        summary = trainer.fit()
    trainer.strategy.close()
    # What `ringtrain train` exports: the whole final model (not tp's slices, not ZeRO 3's
    # freed parameters), the one the ranks agreed on.
    assert param_sha256(trainer.final_model().state_dict()) == summary["param_sha256"]
    return summary


@pytest.mark.parametrize("case", TRAINER_CASES, ids=_ids)
def test_a_trainer_run_and_its_resume(case, tmp_path):
    name, options, deterministic = case
    full = run_workers(_fit, _world(case), args=(str(tmp_path / "full"), name, options),
                       timeout_s=120)
    summary = full[0]
    assert summary["steps"] == STEPS and summary["strategy"] == name
    assert math.isfinite(summary["train_loss"]) and math.isfinite(summary["eval_loss"])
    assert 0.0 <= summary["eval_accuracy"] <= 1.0
    assert summary["snapshots_saved"] == STEPS // EVERY
    assert len({s["param_sha256"] for s in full}) == 1
    # Resume the same run from its first snapshot: the later ones are gone.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full", resumed_dir)
    snaps = sorted(SnapshotManager(resumed_dir / "snapshots", rank=0, world_size=1).snapshots(),
                   key=lambda s: s.step)
    assert [s.step for s in snaps] == list(range(EVERY, STEPS + 1, EVERY))
    for s in snaps[1:]:
        shutil.rmtree(s.path)
    again = run_workers(_fit, _world(case), args=(str(resumed_dir), name, options),
                        timeout_s=120)
    assert again[0]["steps"] == STEPS and again[0]["resumed_from_step"] == [EVERY]
    if deterministic:
        assert again[0]["param_sha256"] == summary["param_sha256"]
        assert again[0]["train_loss"] == summary["train_loss"]
