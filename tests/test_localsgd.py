"""Local SGD, DiLoCo and PowerSGD against the math: equal where the algebra says so.

    .venv/bin/pytest -q tests/test_localsgd.py

- local SGD with H = 1 and plain SGD is DDP with SGD;
- DiLoCo with outer lr 1 and no momentum is local SGD with the same H (plain SGD inside);
- every rank holds the same weights after each outer step (digests), in every codec;
- the compressed averages stay close to the fp32 one;
- PowerSGD of full rank is the plain average; of low rank it sends fewer bytes and the
  replicas stay identical;
- a snapshot taken at a meeting resumes on another number of workers; one taken between
  meetings is refused there, with the fix.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn
from torch.utils.data import Subset

from ringtrain.data.addition import AdditionDataset, exact_match
from ringtrain.ddp.distributed import DistributedDataParallel
from ringtrain.ddp.powersgd import PowerSGDState, powersgd_hook
from ringtrain.errors import ConfigError
from ringtrain.localsgd.compress import average_
from ringtrain.models import GPT, GPTConfig, loss_fn
from ringtrain.runtime import get_runtime
from ringtrain.strategies import make_strategy
from ringtrain.testing import WorkerError, run_workers
from ringtrain.training import Trainer, TrainerConfig
from ringtrain.training.config import param_sha256

MODEL = GPTConfig(vocab_size=10, block_size=3, n_layer=1, n_head=2, n_embd=16)
BATCH = 4


def _batches(rank, world_size, steps):
    data = AdditionDataset("train", 1)
    out = []
    for step in range(steps):
        idx = [(step * BATCH * world_size + rank + world_size * i) % len(data)
               for i in range(BATCH)]
        x, y = zip(*(data[i] for i in idx), strict=True)
        out.append([(torch.stack(x), torch.stack(y))])
    return out


def _sgd(params):
    return torch.optim.SGD(list(params), lr=0.0)


def _run(rank, world_size, runs, steps):
    """Each (strategy, options, optimizer) from the same initial weights; final weights and the
    digests of every rank's weights after each step."""
    rt, out = get_runtime(), []
    for name, options, opt in runs:
        s = make_strategy(name, runtime=rt, **options)
        torch.manual_seed(0)
        s.setup(GPT(MODEL), _sgd if opt == "sgd" else (lambda p: torch.optim.AdamW(p, lr=0.0)),
                loss_fn)
        agree = s.agreement(rt, f"t{len(out)}")
        digests = []
        for micro in _batches(rank, world_size, steps):
            s.train_step(micro, lr=0.05, grad_clip=None)
            module = getattr(s, "module", None)
            digests.append(agree.gather(param_sha256(module.state_dict())))
        out.append(({k: v.clone() for k, v in s.model_state_dict().items()}, digests))
        s.close()
    return out


def test_local_sgd_every_step_is_ddp_and_diloco_without_momentum_is_local_sgd():
    runs = [("ddp", {}, "sgd"), ("localsgd", {"sync_every": 1}, "sgd"),
            ("localsgd", {"sync_every": 3}, "sgd"),
            ("diloco", {"sync_every": 3, "outer_lr": 1.0, "outer_momentum": 0.0}, "sgd"),
            ("diloco", {"sync_every": 3}, "adamw")]
    r0, r1 = run_workers(_run, 2, args=(runs, 6), timeout_s=120)
    (ddp, _), (local1, d1), (local3, d3), (diloco_plain, dp), (diloco, dn) = r0
    for k in ddp:
        torch.testing.assert_close(local1[k], ddp[k], rtol=1e-5, atol=1e-6, msg=k)
        torch.testing.assert_close(diloco_plain[k], local3[k], rtol=1e-5, atol=1e-6, msg=k)
    # (Plain SGD inside: with AdamW a rounding-level difference in a near-zero gradient flips
    # its update of size lr, so "equal" would only hold to ~1e-3.)
    assert any(not torch.equal(diloco[k], local3[k]) for k in diloco)  # momentum moves it
    # After every outer step the workers hold the same weights (and in between they differ).
    for digests in (d3, dp, dn):
        assert all(len(set(digests[i].values())) == 1 for i in (2, 5))
        assert len(set(digests[0].values())) == 2
    assert all(len(set(d.values())) == 1 for d in d1)
    for (a, _), (b, _) in zip(r0, r1, strict=True):  # the final models agree across ranks
        assert param_sha256(a) == param_sha256(b)


def _codecs(rank, world_size):
    torch.manual_seed(rank)
    base = [torch.randn(300), torch.randn(20, 7) * 1e-3]
    out = {}
    for codec in ("fp32", "bf16", "int8"):
        tensors = [t.clone() for t in base]
        sent = average_(tensors, codec, None, world_size)
        out[codec] = (tensors, sent)
    return out


def test_compressed_averages_are_close_and_identical_on_every_rank():
    results = run_workers(_codecs, 3, timeout_s=60)
    exact = results[0]["fp32"][0]
    for codec, tol in (("bf16", 1e-2), ("int8", 2e-2)):
        for r in results:
            for t, ref in zip(r[codec][0], exact, strict=True):
                assert (t - ref).abs().max() <= tol * ref.abs().max()
        for r in results[1:]:  # every rank adds the same numbers in the same order
            assert all(torch.equal(a, b)
                       for a, b in zip(r[codec][0], results[0][codec][0], strict=True))
    numel = 300 + 140
    assert results[0]["fp32"][1] == numel * 4 * 2 * 2 // 3
    assert results[0]["int8"][1] == (numel + 2 * 4) * 2 < results[0]["bf16"][1] == numel * 2 * 2


def _powersgd(rank, world_size, r, steps):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    ddp = DistributedDataParallel(model)
    state = PowerSGDState(None, rank=r, start_iter=0)
    ddp.register_comm_hook(state, powersgd_hook)
    g = torch.Generator().manual_seed(rank)
    grads = []
    for _ in range(steps):
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        model.zero_grad()
        local = [torch.autograd.grad(nn.functional.mse_loss(model(x), y), model.parameters())]
        nn.functional.mse_loss(ddp(x), y).backward()
        grads.append(([p.grad.clone() for p in model.parameters()], local[0]))
    return grads, state.bytes_sent


def test_powersgd_of_full_rank_is_the_average_and_low_rank_sends_less():
    full = run_workers(_powersgd, 2, args=(16, 1), timeout_s=60)
    (synced, local0), (synced1, local1) = full[0][0][0], full[1][0][0]
    for s0, s1, a, b in zip(synced, synced1, local0, local1, strict=True):
        torch.testing.assert_close(s0, (a + b) / 2, rtol=1e-4, atol=1e-6)
        assert torch.equal(s0, s1)
    low = run_workers(_powersgd, 2, args=(1, 3), timeout_s=60)
    for (g0, _), (g1, _) in zip(low[0][0], low[1][0], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))
    plain = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    plain_bytes = sum(p.numel() for p in plain.parameters()) * 4
    assert 0 < low[0][1] / 3 < plain_bytes / 2  # per step, well under a plain all-reduce


def _fit(rank, world_size, run_dir, name, options):
    """4 steps of 6 samples per rank (2 ranks: a global batch of 12), a snapshot every 2."""
    train, test = AdditionDataset("train", 1), AdditionDataset("test", 1)
    cfg = TrainerConfig(steps=4, batch_size=6, lr=3e-3, seed=0, progress=False, report=False,
                        log_every=1, eval_every=4, eval_batch_size=4)
    trainer = Trainer(make_strategy(name, runtime=get_runtime(), **options), get_runtime(),
                      lambda: GPT(MODEL), train, Subset(test, range(6)), loss_fn, cfg,
                      eval_metrics={"accuracy": exact_match}, run_dir=run_dir,
                      snapshot_every=2, keep=10, snapshot_timeout_s=30)
    summary = trainer.fit()
    trainer.strategy.close()
    return summary


def _first_snapshot_only(run_dir):
    """Drop the snapshot of step 4: the next run resumes from step 2."""
    shutil.rmtree(run_dir / "snapshots" / "snap-00000004")


@pytest.mark.parametrize("name", ["localsgd", "diloco"])
def test_resume_on_another_world_size_at_a_meeting(tmp_path, name):
    options = {"sync_every": 2, **({"outer_compress": "int8"} if name == "diloco" else {})}
    run_workers(_fit, 2, args=(str(tmp_path), name, options), timeout_s=120)
    _first_snapshot_only(tmp_path)
    again = run_workers(_fit, 3, args=(str(tmp_path), name, options), timeout_s=120)
    assert again[0]["resumed_from_step"] == [2] and again[0]["steps"] == 4
    assert again[0]["world_size"] == 3 and len({s["param_sha256"] for s in again}) == 1


def test_a_snapshot_between_meetings_is_refused_on_another_world_size(tmp_path):
    options = {"sync_every": 3}
    run_workers(_fit, 2, args=(str(tmp_path), "localsgd", options), timeout_s=120)
    _first_snapshot_only(tmp_path)
    with pytest.raises(WorkerError, match=r"between two meetings(.|\n)*--sync-every 3"):
        run_workers(_fit, 3, args=(str(tmp_path), "localsgd", options), timeout_s=120)


def test_bad_options_name_the_fix():
    from ringtrain.strategies.ddp import parse_grad_compress

    with pytest.raises(Exception, match="powersgd:R"):
        parse_grad_compress("powersgd:0")
    assert parse_grad_compress("powersgd:4") == "powersgd:4"
    rt = type("RT", (), {"world_size": 2, "rank": 0})()
    with pytest.raises(ConfigError, match="--sync-every 0"):
        make_strategy("localsgd", runtime=rt, sync_every=0)
    with pytest.raises(ConfigError, match="--outer-momentum 1"):
        make_strategy("diloco", runtime=rt, outer_momentum=1.0)
