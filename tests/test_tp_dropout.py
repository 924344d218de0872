"""Dropout under `--strategy tp`: what the tp ranks hold whole is masked alike, what each holds a
part of (its heads, its tokens under sequence parallelism) by a stream of its own, and a
recomputed block (activation checkpointing) draws its forward's masks again.

    .venv/bin/pytest -q tests/test_tp_dropout.py

CPU, gloo, 2 ranks (tp 2), one worker start for the plain and the sequence-parallel layout; 4
ranks for `--pp 2 --tp 2` (a stage's tp ranks, under 1F1B, with SP). A
mask that differed between tp ranks where they hold one activation whole would part the copies:
the parameters every tp rank holds whole (norms, position embedding, row biases) would differ
after a step. Dropout never equals one process's masks; the equality to one process without
dropout is tests/test_tp_strategy.py's.
"""

from __future__ import annotations

import pytest
import torch

from ringtrain.data.addition import AdditionDataset
from ringtrain.models import GPT, GPTConfig, loss_fn
from ringtrain.runtime import get_runtime
from ringtrain.strategies import make_strategy
from ringtrain.tensor_parallel.rng import ShardedDropout, sharded_rng
from ringtrain.testing import run_workers
from ringtrain.training.config import adamw, rank_seed

MODEL = GPTConfig(vocab_size=10, block_size=6, n_layer=2, n_head=2, n_embd=16, dropout=0.3)


def _steps(rank, options, config, steps=3, strategy="tp"):
    data = AdditionDataset("train", 2)
    torch.manual_seed(0)
    s = make_strategy(strategy, runtime=get_runtime(), tp=2, **options)
    s.setup(GPT(config), adamw(0.1), loss_fn)
    torch.manual_seed(rank_seed(1, s.seed_rank(rank)))  # as the Trainer seeds it
    losses = []
    for i in range(steps):
        x = torch.stack([data[j][0] for j in range(8 * i, 8 * i + 8)])
        y = torch.stack([data[j][1] for j in range(8 * i, 8 * i + 8)])
        losses.append(s.train_step([(x, y)], lr=1e-2, grad_clip=1.0).loss_sum)
    module = s.stage if strategy == "pipeline" else s.module
    whole = {n: p.detach().clone() for n, p in module.named_parameters()
             if getattr(p, "tp_shard_dim", None) is None}
    held = {n: p.detach().clone() for n, p in module.named_parameters()}
    s.close()
    return {"losses": losses, "whole": whole, "held": held}


def _worker(rank, world_size):
    group = torch.distributed.group.WORLD
    with sharded_rng(group):
        own = torch.rand(8)
    shared = torch.rand(8)
    out = {"own": own, "shared": shared}
    for name, options in (("tp", {}), ("sp", {"sequence_parallel": True})):
        out[name] = _steps(rank, options, MODEL)
        recomputed = GPTConfig(**{**MODEL.__dict__, "activation_checkpointing": True})
        out[name + "-recompute"] = _steps(rank, options, recomputed)
    out["no-dropout"] = _steps(rank, {}, GPTConfig(**{**MODEL.__dict__, "dropout": 0.0}))
    out["heads"] = _heads(rank)
    out["sp_masks"] = _sp_masks()
    return out


def _sp_masks():
    """Under SP the residual branches' dropouts mask each rank's own tokens: the masks (where
    the output is 0) of the attention's and the MLP's, for comparison across ranks."""
    from ringtrain.tensor_parallel import gpt_plan, parallelize

    torch.manual_seed(0)
    model = parallelize(GPT(MODEL), gpt_plan(sequence_parallel=True),
                        torch.distributed.group.WORLD)
    masks = []
    for drop in (model.blocks[0].attn.resid_drop, model.blocks[0].mlp[3]):
        drop.register_forward_hook(lambda _m, _a, out: masks.append(out.detach() == 0))
    torch.manual_seed(7)
    model.train()(torch.zeros(2, 6, dtype=torch.long))
    return masks


def _heads(rank):
    """The attention's output before its projection when both ranks' heads are equal (the same
    slice of weights on each): equal on both ranks only if their masks were."""
    from ringtrain.tensor_parallel import gpt_plan, parallelize

    torch.manual_seed(0)
    model = parallelize(GPT(MODEL), gpt_plan(), torch.distributed.group.WORLD)
    attn = model.blocks[0].attn
    with torch.no_grad():
        for p in attn.c_attn.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    seen = []
    attn.c_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    torch.manual_seed(7)  # the replica's one stream
    model.train()(torch.zeros(2, 6, dtype=torch.long))
    return seen[0]


def test_unit_sharded_dropout_keeps_what_drops_nothing(single_process):
    group = torch.distributed.group.WORLD
    same = torch.nn.Dropout(0.0)
    assert ShardedDropout.from_dropout(same, group) is same
    norm = torch.nn.LayerNorm(4)
    assert ShardedDropout.from_dropout(norm, group) is norm
    drop = ShardedDropout.from_dropout(torch.nn.Dropout(0.5), group)
    x = torch.ones(1000)
    assert torch.equal(drop.eval()(x), x)  # no draw in eval
    kept = drop.train()(x)
    assert 400 < int((kept > 0).sum()) < 600 and torch.all((kept == 0) | (kept == 2))


@pytest.mark.parametrize("layout", ["tp", "sp"])
def test_tp_ranks_mask_what_they_hold_whole_alike_and_their_parts_apart(layout, tp_dropout_runs):
    r0, r1 = tp_dropout_runs
    assert torch.equal(r0["shared"], r1["shared"])  # one stream for the replica
    assert not torch.equal(r0["own"], r1["own"])  # a stream of its own per tp rank
    a, b = r0[layout], r1[layout]
    # The copies every tp rank holds stay one: the same masks where they hold it whole.
    assert a["whole"].keys() == b["whole"].keys() and a["whole"]
    for name in a["whole"]:
        assert torch.equal(a["whole"][name], b["whole"][name]), name
    # Dropout acted (tp rank 0 counts the replica's loss): not the losses without it.
    assert a["losses"][0] != r0["no-dropout"]["losses"][0] and b["losses"] == [0.0] * 3
    # Equal heads on the two ranks are masked apart (one stream would drop them alike), and
    # so are the ranks' tokens under SP.
    assert not torch.equal(r0["heads"], r1["heads"])
    for m0, m1 in zip(r0["sp_masks"], r1["sp_masks"], strict=True):
        assert m0.any() and not torch.equal(m0, m1)
    # The recompute draws the forward's masks: the same parameters, step for step.
    for name, t in a["held"].items():
        torch.testing.assert_close(r0[layout + "-recompute"]["held"][name], t, rtol=1e-6,
                                   atol=1e-7, msg=name)


@pytest.fixture(scope="module")
def tp_dropout_runs():
    return run_workers(_worker, 2, timeout_s=120)


def test_nanogpts_shakespeare_recipe_trains_under_tp(tmp_path):
    """`--recipe shakespeare_char` (dropout 0.2, tied embeddings) with `--strategy tp --tp 2`
    through the launcher: the Trainer seeds the tp ranks of the replica alike, so the
    parameters both hold whole are one in their snapshots."""
    import json
    import os
    import subprocess
    import sys

    (tmp_path / "t.txt").write_text("the quick brown fox jumps over a lazy dog.\n" * 60)
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain", "train", "--recipe", "shakespeare_char", "--data",
         str(tmp_path / "t.txt"), "--strategy", "tp", "--tp", "2", "--nproc-per-node", "2",
         "--pad-vocab", "2", "--steps", "4", "--snapshot-every", "4", "--n-layer", "1",
         "--n-embd", "24", "--block-size", "16", "--batch-size", "4", "--eval-every", "4",
         "--no-progress", "--no-report", "--sample-length", "20", "--run-dir", str(run)],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    config = json.loads((run / "config.json").read_text())["args"]
    assert (config["dropout"], config["tie_embeddings"]) == (0.2, True)
    snap = run / "snapshots" / "snap-00000004"
    parts = [torch.load(snap / f"rank{r}.pt", weights_only=False)["strategy"] for r in (0, 1)]
    whole = [n for n, (dim, _) in parts[0]["splits"].items() if dim is None]
    assert "head.ln_f.weight" in whole and "embed.wpe.weight" in whole
    for name in whole:
        assert torch.equal(parts[0]["model"][name], parts[1]["model"][name]), name


def _pipeline_worker(rank, world_size):
    return _steps(rank, {"pp": 2, "schedule": "1f1b", "microbatches": 2,
                         "sequence_parallel": True}, MODEL, strategy="pipeline")


def test_a_pipeline_stages_tp_ranks_mask_what_they_hold_whole_alike():
    out = run_workers(_pipeline_worker, 4, timeout_s=120)
    for a, b in ((out[0], out[1]), (out[2], out[3])):  # each stage's tp pair (tp innermost)
        assert a["whole"] and a["whole"].keys() == b["whole"].keys()
        for name in a["whole"]:
            assert torch.equal(a["whole"][name], b["whole"][name]), name
