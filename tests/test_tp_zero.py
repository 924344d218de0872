"""`--strategy tp --zero-stage 1|2|3`: ZeRO on the dp axis of dp x tp, against one process.

    .venv/bin/pytest -q tests/test_tp_zero.py

CPU, gloo. On 4 ranks (dp 2 x tp 2), one worker start for every stage: 1; 2 with sequence
parallelism; 3 with it and activation checkpointing; each 3 AdamW steps with clipping equal to
one process's (ddp, allclose 1e-5, the same global batch, dropout 0), and so are its eval
logits; its state saved and loaded again replays step 4 bit for bit; its snapshot in the
layout-free form equals the one-process run's (parameters and AdamW moments) and loads into
ddp; ddp's snapshot loads into it and step 4 equals one process's. The Trainer's resume
through snapshots (bit-identical) is tests/test_strategy_contract.py's variant `tp-1-2` (dp 2
x tp 1 under ZeRO 2).
"""

from __future__ import annotations

import copy

import pytest
import torch

from ringtrain.data.addition import AdditionDataset
from ringtrain.models import GPT, GPTConfig, loss_fn
from ringtrain.runtime import get_runtime
from ringtrain.strategies import make_strategy
from ringtrain.strategies.tp import TPConfig, TPStrategy
from ringtrain.testing import run_workers
from ringtrain.training.config import adamw

DIGITS = 2  # block_size 6: the sequence splits over tp 2 (sequence parallelism)
MODEL = GPTConfig(vocab_size=10, block_size=6, n_layer=2, n_head=2, n_embd=16)
LR, CLIP, BATCH = 1e-2, 0.05, 8  # a clip small enough to act on every step
# (zero_stage, strategy options, model options): 2 with SP, 3 with SP and recomputed blocks.
RUNS = [(1, {}, {}), (2, {"sequence_parallel": True}, {}),
        (3, {"sequence_parallel": True}, {"activation_checkpointing": True})]


def test_unit_zero_stage_is_off_by_default_and_checked_as_zero_checks_it():
    assert TPConfig().zero_stage == 0  # off unless asked for
    assert TPConfig(tp=2, zero_stage=3).plan(4, 8) == 2  # data ranks: the dp replicas
    with pytest.raises(ValueError, match="zero_stage"):
        TPConfig(zero_stage=4)


def _batches(data, steps):
    return [(torch.stack([data[i][0] for i in range(s * BATCH, (s + 1) * BATCH)]),
             torch.stack([data[i][1] for i in range(s * BATCH, (s + 1) * BATCH)]))
            for s in range(steps)]


def _worker(rank, world_size, reference_portable):
    data = AdditionDataset("train", DIGITS)
    out = []
    for stage, options, model_options in RUNS:
        torch.manual_seed(0)
        s = make_strategy("tp", runtime=get_runtime(), tp=2, zero_stage=stage, **options)
        s.setup(GPT(GPTConfig(**{**MODEL.__dict__, **model_options})), adamw(0.1), loss_fn)
        d, dp = s.data_rank, s.data_world_size
        batches = [(x[d::dp], y[d::dp]) for x, y in _batches(data, 4)]
        for x, y in batches[:3]:
            s.train_step([(x, y)], lr=LR, grad_clip=CLIP)
        saved = copy.deepcopy(s.state_dict())  # a snapshot: the live tensors move on below
        r = {"after_3": s.model_state_dict(), "state": saved, "stats": s.stats(),
             "logits": s.eval_logits(batches[0][0])}  # (stage 3: frees, the step re-gathers)
        s.train_step([batches[3]], lr=LR, grad_clip=CLIP)
        r["after_4"] = s.model_state_dict()
        s.load_state_dict(saved)  # resume in the same layout: step 4 again, bit for bit
        s.train_step([batches[3]], lr=LR, grad_clip=CLIP)
        r["after_4_resumed"] = s.model_state_dict()
        s.load_portable_state_dict(reference_portable)  # ddp's snapshot after 3 steps
        s.train_step([batches[3]], lr=LR, grad_clip=CLIP)
        r["after_4_from_ddp"] = s.model_state_dict()
        s.close()
        out.append(r)
    return out


def _close(a, b, what):
    assert a.keys() == b.keys(), what
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, k=k: f"{what}: {k}: {m}")


def test_dp2_tp2_with_zero_equals_one_process_resumes_bit_identical_and_to_ddp(single_process):
    data = AdditionDataset("train", DIGITS)
    torch.manual_seed(0)
    one = make_strategy("ddp", runtime=single_process)
    one.setup(GPT(MODEL), adamw(0.1), loss_fn)
    batches = _batches(data, 4)
    for x, y in batches[:3]:
        one.train_step([(x, y)], lr=LR, grad_clip=CLIP)
    ddp_state = copy.deepcopy(one.state_dict())
    reference = one.to_portable(lambda r: {}, ddp_state, {"world_size": 1})
    one_after_3 = {k: v.clone() for k, v in one.model_state_dict().items()}
    one_logits = one.eval_logits(batches[0][0][0::2])  # replica 0's half of the first batch
    one.train_step([batches[3]], lr=LR, grad_clip=CLIP)
    one_after_4 = one.model_state_dict()

    out = run_workers(_worker, 4, args=(reference,), timeout_s=180)
    for i, (stage, _, _) in enumerate(RUNS):
        what = f"dp 2 x tp 2, ZeRO {stage}"
        # Replica 0's tp rank 0 gathers the vocab-sharded logits (the other tp ranks: None).
        assert out[1][i]["logits"] is None
        torch.testing.assert_close(out[0][i]["logits"], one_logits, rtol=1e-5, atol=1e-5)
        for r in (o[i] for o in out):
            _close(r["after_3"], one_after_3, f"{what}, after 3 steps")
            _close(r["after_4"], one_after_4, f"{what}, after 4 steps")
            for k, v in r["after_4"].items():
                assert torch.equal(v, r["after_4_resumed"][k]), f"{what}: resume moved {k}"
            _close(r["after_4_from_ddp"], one_after_4, f"ddp -> {what}, one more step")
            # What ZeRO holds of a rank's slices: 1/dp of the moments (the formula; AdamW's
            # `step` per part, 4 bytes each, above it).
            held = r["stats"]
            assert held["zero_stage"] == stage
            assert held["zero_optimizer_bytes"] == pytest.approx(
                held["zero_expected_optimizer_bytes"], rel=0.02)
        portable = TPStrategy.to_portable(lambda ranks, i=i: {k: out[k][i]["state"]
                                                              for k in ranks},
                                          None, {"world_size": 4})
        own = {k: v for k, v in one_after_3.items() if k in portable["model"]}
        _close(portable["model"], own, f"{what} -> portable model")
        for name, entry in reference["optimizer"]["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(portable["optimizer"]["state"][name][key], entry[key],
                                           rtol=1e-4, atol=1e-7, msg=f"{what}: {name}.{key}")
        # ... and it resumes as ddp on one process.
        torch.manual_seed(1)
        ddp = make_strategy("ddp", runtime=single_process)
        ddp.setup(GPT(MODEL), adamw(0.1), loss_fn)
        ddp.load_portable_state_dict(portable)
        _close({k: v for k, v in ddp.model_state_dict().items() if k in own}, own,
               f"{what} -> ddp")
