"""Universal resume: a snapshot of any strategy and layout resumed by any other (through the
layout-free form, `ringtrain.strategies.portable`), and a run extended with a larger --steps.

    .venv/bin/pytest -q tests/test_portable_resume.py
    RINGTRAIN_FULL=1 .venv/bin/pytest -q tests/test_portable_resume.py -k table  # every pair

CPU, gloo. In one process: the conversions are exact (ddp -> zero-3 -> pipeline -> ddp gives
back the same parameters and AdamW moments bit for bit, and the next step is bit-identical),
the rule of a changed --steps, the refusal of a strategy without a converter, and local SGD's
and DiLoCo's converters (their replicas at a meeting, their moments averaged). The resume
table (`tests/support/resume_pairs.py`): each pair resumes the source layout's snapshot in
the target layout and must train on as the target's uninterrupted run does (max difference
<= 1e-6 over the losses and the final parameters; `make test` runs 5 representative pairs,
RINGTRAIN_FULL=1 all 756 of world sizes 1-4 and prints the table of docs/train.md).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import pytest
import torch

from ringtrain.data.addition import AdditionDataset
from ringtrain.errors import ConfigError
from ringtrain.models import GPT, GPTConfig, loss_fn
from ringtrain.strategies import make_strategy, portable, registered
from ringtrain.strategies.base import Strategy
from ringtrain.training.config import adamw, lr_at
from ringtrain.training.trainer import Trainer, TrainerConfig
from tests.support import resume_pairs as rp

FULL = os.environ.get("RINGTRAIN_FULL") == "1"
MODEL = GPTConfig(vocab_size=10, block_size=3, n_layer=2, n_head=2, n_embd=16)


# -- the conversions, in one process ---------------------------------------------------------------
def _built(name: str, runtime, seed: int, **options):
    torch.manual_seed(seed)
    strategy = make_strategy(name, runtime=runtime, **options)
    strategy.setup(GPT(MODEL), adamw(0.1), loss_fn)
    return strategy


def _step(strategy, data, step: int) -> None:
    x = torch.stack([data[i][0] for i in range(8 * step, 8 * step + 8)])
    y = torch.stack([data[i][1] for i in range(8 * step, 8 * step + 8)])
    strategy.train_step([(x, y)], lr=1e-3, grad_clip=1.0)


def _portable(strategy) -> dict:
    """The strategy's own state, as its snapshot holds it, in the layout-free form."""
    state = strategy.state_dict()
    cls = registered()[strategy.name]
    return cls.to_portable(lambda ranks: {r: state for r in ranks},
                           state if strategy.replicated_state else None, {"world_size": 1})


def _assert_same(a: dict, b: dict) -> None:
    params = {n for n, _ in GPT(MODEL).named_parameters()}
    assert params <= a["model"].keys() and params <= b["model"].keys()
    for n in params:
        assert torch.equal(a["model"][n], b["model"][n]), n
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() == params
    for n in params:
        assert sa[n].keys() == sb[n].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in sa[n]:
            assert torch.equal(torch.as_tensor(sa[n][key]), torch.as_tensor(sb[n][key])), (n, key)


def test_unit_conversions_carry_parameters_and_adamw_state_exactly(single_process):
    data = AdditionDataset("train", 1)
    ddp = _built("ddp", single_process, seed=0)
    for step in range(2):
        _step(ddp, data, step)
    saved = _portable(ddp)
    assert float(saved["optimizer"]["state"]["blocks.0.attn.c_attn.weight"]["step"]) == 2.0
    chain = [_built("zero", single_process, seed=1, zero_stage=3),
             _built("pipeline", single_process, seed=2, pp=1),
             _built("ddp", single_process, seed=3)]
    state = saved
    for strategy in chain:  # other initial weights: every value must come from the snapshot
        strategy.load_portable_state_dict(state)
        state = _portable(strategy)
        _assert_same(saved, state)
    # The state is whole (moments, step count): the next step is the same, bit for bit.
    again = chain[-1]
    _step(ddp, data, 2)
    _step(again, data, 2)
    for (n, p), q in zip(ddp.model_state_dict().items(), again.model_state_dict().values(),
                         strict=True):
        assert torch.equal(p, q), n


def test_unit_another_model_is_refused_naming_the_parameter(single_process):
    saved = _portable(_built("ddp", single_process, seed=0))
    del saved["model"]["blocks.1.mlp.0.weight"]
    with pytest.raises(ValueError, match=r"no parameter 'blocks.1.mlp.0.weight'.*model "
                                         "options"):
        _built("pipeline", single_process, seed=0, pp=1).load_portable_state_dict(saved)
    with pytest.raises(ValueError, match=r"'blocks.1.mlp.0.weight' is missing in the snapshot"):
        _built("zero", single_process, seed=0, zero_stage=2).load_portable_state_dict(saved)


# -- a run extended with a larger --steps ----------------------------------------------------------
def _run(runtime, run_dir: Path, steps: int, **config) -> dict:
    cfg = TrainerConfig(steps=steps, batch_size=8, lr=1e-3, seed=0, progress=False, log_every=1,
                        eval_every=steps, **config)
    return Trainer(make_strategy("ddp", runtime=runtime), runtime, lambda: GPT(MODEL),
                   AdditionDataset("train", 1), None, loss_fn, cfg, run_dir=str(run_dir),
                   snapshot_every=5, run_config={"n_embd": MODEL.n_embd},
                   name=f"extend-{steps}").fit()


def test_a_larger_steps_extends_the_run_on_the_schedule_of_its_new_length(tmp_path,
                                                                          single_process, caplog):
    assert _run(single_process, tmp_path, 10)["steps"] == 10
    summary = _run(single_process, tmp_path, 20)  # the default warmup follows: 1 -> 2 steps
    assert summary["steps"] == 20 and summary["resumed_from_step"] == [10]
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21))
    short, long = TrainerConfig(steps=10, lr=1e-3).resolved(), TrainerConfig(steps=20,
                                                                              lr=1e-3).resolved()
    assert (short.warmup_steps, long.warmup_steps) == (1, 2)
    # Steps 1-10 ran on the 10-step schedule; from the snapshot on, the 20-step one's: its
    # cosine starts again from where a 20-step run stands at step 10 (above min_lr).
    assert [r["lr"] for r in records[:10]] == [lr_at(s, short) for s in range(10)]
    assert [r["lr"] for r in records[10:]] == [lr_at(s, long) for s in range(10, 20)]
    assert records[9]["lr"] < records[10]["lr"]
    # An explicit warmup must still match; fewer steps than the snapshot's is refused.
    with pytest.raises(ConfigError, match=r"--warmup-steps 2 in the snapshot, 4 now"):
        _run(single_process, tmp_path, 30, warmup_steps=4)
    with pytest.raises(ConfigError, match=r"--steps 15 is before the snapshot's step 20.*"
                                          r"--steps 20 or more"):
        _run(single_process, tmp_path, 15)
    # The same --steps again: nothing to train, and the log says how to go on.
    with caplog.at_level(logging.INFO, logger="ringtrain"):
        assert _run(single_process, tmp_path, 20)["resumed_from_step"] == [10, 20]
    said = [r.getMessage() for r in caplog.records if "resumed from" in r.getMessage()]
    assert said and said[-1].endswith("step 20 of 20 (saved by world_size 1); nothing left to "
                                      "train: a larger --steps extends the run (--no-resume "
                                      "starts afresh)"), said


def test_the_last_step_is_snapshotted_so_a_short_run_goes_on_from_its_end(tmp_path,
                                                                          single_process):
    """7 steps at snapshot_every=5: snapshots of steps 5 and 7 (the last), so the run goes on
    from step 7, not from 5 (steps redone) or from 0 over its results."""
    assert _run(single_process, tmp_path, 7)["steps"] == 7
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == [
        "snap-00000005", "snap-00000007"]
    assert _run(single_process, tmp_path, 12)["resumed_from_step"] == [7]
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))


# -- the resume table ----------------------------------------------------------------------------
def _representative() -> list[tuple[rp.Layout, rp.Layout]]:
    """Each converter (ddp, zero, pipeline) as a source and as a target, world sizes 1 -> 2
    and 2 -> 1, ZeRO's shards over 2 ranks and an interleaved pipeline's chunks taken apart."""
    by = {x.label: x for ws in (1, 2) for x in rp.layouts(ws)}
    names = [("ddp x1", "zero3 x1"), ("zero3 x1", "pp2-interleaved-v2 x2"),
             ("pp2-interleaved-v2 x2", "ddp x1"), ("pp2-interleaved-v2 x2", "zero2 x2"),
             ("zero2 x2", "ddp x1")]
    return [(by[a], by[b]) for a, b in names]


@pytest.fixture(scope="module")
def table():
    pairs = rp.full_pairs() if FULL else _representative()
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
            mp.delenv(v, raising=False)
        params = rp.run_table(Path(tmp), pairs, in_process=rp._in_process)
        rows = [rp.compare(Path(tmp), params, s, t) for s, t in pairs]
    print("\n" + rp.table(rows) + "\n\n" + rp.matrix(rows))
    return rows


@pytest.mark.slow
def test_table_every_pair_trains_on_as_the_targets_uninterrupted_run(table):
    for row in table:
        assert row.resumed_from == [rp.STOP], (row.source.label, row.target.label)
        assert row.loss_diff <= rp.TOLERANCE and row.param_diff <= rp.TOLERANCE, (
            f"{row.source.label} -> {row.target.label}: {row.result}")


def test_a_strategy_without_a_converter_is_refused_naming_both_layouts(tmp_path, single_process,
                                                                      monkeypatch):
    # Every strategy of ringtrain's has both halves (a strategy of one's own may not): local SGD
    # stands in for such a strategy here, as the source and then as the target.
    assert all(cls.to_portable.__func__ is not Strategy.to_portable.__func__
               and cls.load_portable_state_dict is not Strategy.load_portable_state_dict
               for cls in registered().values())
    cfg = TrainerConfig(steps=2, batch_size=8, lr=1e-3, seed=0, progress=False)

    def trainer(run_dir: Path, name: str, **options) -> Trainer:
        return Trainer(make_strategy(name, runtime=single_process, **options), single_process,
                       lambda: GPT(MODEL), AdditionDataset("train", 1), None, loss_fn, cfg,
                       run_dir=str(run_dir), snapshot_every=2, name=name)

    trainer(tmp_path / "a", "localsgd", sync_every=2).fit()
    trainer(tmp_path / "b", "ddp").fit()
    lsgd = registered()["localsgd"]
    monkeypatch.setattr(lsgd, "to_portable", classmethod(lambda cls, *args: None))
    with pytest.raises(ConfigError, match=r"saved by localsgd, 1 data ranks on world_size=1 and "
                                          r"cannot be resumed in ddp, 1 data ranks.*Resume with "
                                          r"--strategy localsgd on world_size=1"):
        trainer(tmp_path / "a", "ddp").fit()
    monkeypatch.setattr(lsgd, "load_portable_state_dict", Strategy.load_portable_state_dict)
    with pytest.raises(ConfigError, match=r"saved by ddp, 1 data ranks on world_size=1 and "
                                          r"cannot be resumed in localsgd, 1 data ranks.*"
                                          r"--strategy localsgd loads no other strategy's.*Resume "
                                          r"with --strategy ddp on world_size=1"):
        trainer(tmp_path / "b", "localsgd", sync_every=2).fit()


# -- local SGD and DiLoCo: their replicas at a meeting are one model ---------------------------
def _portable_at(strategy, step: int) -> dict:
    state = _portable(strategy)
    state["step"] = step  # the resume adds the snapshot's (`Checkpointer._load_portable`)
    return state


def test_unit_local_sgd_and_diloco_convert_exactly_at_a_meeting(single_process):
    data = AdditionDataset("train", 1)
    ddp = _built("ddp", single_process, seed=0)
    for step in range(2):
        _step(ddp, data, step)
    saved = _portable_at(ddp, 2)
    chain = [_built("localsgd", single_process, seed=1, sync_every=2),
             _built("diloco", single_process, seed=2, sync_every=2),
             _built("ddp", single_process, seed=3)]
    state = saved
    for strategy in chain:  # one replica: the moments' mean is its own, bit for bit
        strategy.load_portable_state_dict(state)
        state = _portable_at(strategy, 2)
        _assert_same(saved, state)
    local = chain[0]
    assert local.inner_steps == 2  # the meetings keep their places: the next at step 4
    assert all(torch.equal(s, p) for s, p in zip(local.synced.parameters(),
                                                 local.module.parameters(), strict=True))
    # The next step is ddp's, bit for bit (one replica's AdamW step is the same step).
    _step(ddp, data, 2)
    _step(local, data, 2)
    for (n, p), q in zip(ddp.module.named_parameters(), local.module.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_unit_two_replicas_files_are_read_one_at_a_time_and_their_moments_averaged(
        single_process):
    data = AdditionDataset("train", 1)
    replicas = [_built("localsgd", single_process, seed=0, sync_every=1) for _ in range(2)]
    for r, replica in enumerate(replicas):  # other batches: other moments
        _step(replica, data, r)
    files = {r: replica.state_dict() for r, replica in enumerate(replicas)}
    asked = []

    def read_parts(ranks):
        asked.append(list(ranks))
        return {r: files[r] for r in ranks}

    state = registered()["localsgd"].to_portable(read_parts, None, {"world_size": 2})
    assert asked == [[0], [1]]
    for name, p in replicas[0].module.named_parameters():
        assert torch.equal(state["model"][name], p), name
        own = [replica.optimizer.state[dict(replica.module.named_parameters())[name]]
               for replica in replicas]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state["optimizer"]["state"][name][key],
                               (own[0][key] + own[1][key]) / 2), (name, key)


def test_unit_the_replicas_moments_are_averaged_and_their_step_kept():
    a = {"state": {"w": {"step": torch.tensor(4.0), "exp_avg": torch.tensor([1.0, 2.0]),
                         "exp_avg_sq": torch.tensor([1.0, 4.0])}}}
    b = {"state": {"w": {"step": torch.tensor(4.0), "exp_avg": torch.tensor([3.0, 2.0]),
                         "exp_avg_sq": torch.tensor([9.0, 4.0])}}}
    mean = portable.mean([a, b])["state"]["w"]
    assert torch.equal(mean["exp_avg"], torch.tensor([2.0, 2.0]))
    assert torch.equal(mean["exp_avg_sq"], torch.tensor([5.0, 4.0]))
    assert float(mean["step"]) == 4.0
    assert portable.mean([a])["state"]["w"]["exp_avg"] is not a["state"]["w"]["exp_avg"]
    with pytest.raises(ValueError, match="no step"):
        portable.step_of({"format": portable.FORMAT})


def test_unit_a_snapshot_between_meetings_or_without_names_is_refused_naming_the_fix(
        single_process):
    local = _built("localsgd", single_process, seed=0, sync_every=4)
    _step(local, AdditionDataset("train", 1), 0)
    state = local.state_dict()
    cls = registered()["localsgd"]
    with pytest.raises(ConfigError, match=r"localsgd snapshot \(step 1\) was written between two "
                                          r"meetings \(--sync-every 4\).*--strategy localsgd on "
                                          r"world_size=1.*--snapshot-every 4"):
        cls.to_portable(lambda ranks: {r: state for r in ranks}, None, {"world_size": 1})
    del state["param_names"]  # a snapshot of a ringtrain before the converter
    with pytest.raises(ConfigError, match=r"did not name the optimizer's parameters"):
        cls.to_portable(lambda ranks: {r: state for r in ranks}, None, {"world_size": 1})


def test_a_ddp_snapshot_resumed_by_local_sgd_keeps_its_meetings_places(tmp_path, single_process):
    def fit(name: str, steps: int, **options) -> dict:
        cfg = TrainerConfig(steps=steps, batch_size=8, lr=1e-3, seed=0, progress=False)
        return Trainer(make_strategy(name, runtime=single_process, **options), single_process,
                       lambda: GPT(MODEL), AdditionDataset("train", 1), None, loss_fn, cfg,
                       run_dir=str(tmp_path), snapshot_every=3, name=f"{name}-{steps}").fit()

    fit("ddp", 3)
    summary = fit("localsgd", 6, sync_every=2)  # from step 3: meetings after steps 4 and 6
    assert summary["resumed_from_step"] == [3] and summary["meetings"] == 2
    summary = fit("ddp", 9)  # its snapshot at step 6, a meeting, goes back to ddp
    assert summary["resumed_from_step"] == [3, 6]
