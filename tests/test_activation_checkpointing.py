"""Activation checkpointing (`GPTConfig.activation_checkpointing`, `--activation-checkpointing`).

    .venv/bin/pytest -q tests/test_activation_checkpointing.py

Each GPT block keeps only its input in forward and is recomputed in backward
(`torch.utils.checkpoint`, non-reentrant). The gradients must not change: bit for bit in one
process (with dropout: the RNG is replayed), and through every registered strategy plus ZeRO
stage 3 (whose recompute runs while the block's parameters are gathered again for backward).
The memory it saves is measured by `benchmarks/activation_checkpointing.py` (docs/zero.md).
"""

from __future__ import annotations

import dataclasses

import torch

from ringtrain.data.addition import AdditionDataset
from ringtrain.models import GPT, GPTConfig, loss_fn
from ringtrain.runtime import get_runtime
from ringtrain.strategies import make_strategy, registered
from ringtrain.testing import run_workers
from ringtrain.training.config import adamw, param_sha256

MODEL = GPTConfig(vocab_size=10, block_size=3, n_layer=2, n_head=2, n_embd=16)


def _grads(cfg: GPTConfig, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(cfg)
    torch.manual_seed(1)  # the same dropout masks in both runs
    loss_fn(model(x), y).backward()
    return [p.grad for p in model.parameters()]


def test_same_gradients_in_one_process_with_dropout():
    cfg = dataclasses.replace(MODEL, block_size=6, dropout=0.1)
    x = torch.randint(0, cfg.vocab_size, (4, 6), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, 1, dims=1)
    plain = _grads(cfg, x, y)
    ckpt = _grads(dataclasses.replace(cfg, activation_checkpointing=True), x, y)
    assert all(torch.equal(a, b) for a, b in zip(plain, ckpt, strict=True))


def test_eval_and_no_grad_do_not_checkpoint():
    model = GPT(dataclasses.replace(MODEL, activation_checkpointing=True))
    with torch.no_grad():
        out = model(torch.zeros(2, 3, dtype=torch.long))
    assert out.grad_fn is None


def _every_strategy(rank, world_size, cases):
    """For each strategy: 2 steps without and with checkpointing, the final parameters' digest."""
    rt = get_runtime()
    data = AdditionDataset("train", 1)
    out = {}
    for name, options in cases:
        digests = []
        for ac in (False, True):
            torch.manual_seed(0)
            s = make_strategy(name, runtime=rt, **options)
            model = GPT(dataclasses.replace(MODEL, activation_checkpointing=ac))
            s.setup(model, adamw(0.1), loss_fn)
            for step in range(2):
                micro = []
                if s.data_rank is not None:
                    n = s.data_world_size
                    idx = [(step * 4 * n + s.data_rank + n * i) % len(data) for i in range(4)]
                    xs, ys = zip(*(data[i] for i in idx), strict=True)
                    micro = [(torch.stack(xs[:2]), torch.stack(ys[:2])),
                             (torch.stack(xs[2:]), torch.stack(ys[2:]))]  # accumulation too
                s.train_step(micro, lr=1e-2, grad_clip=1.0)
            digests.append(param_sha256(s.model_state_dict()))
            s.close()
        out[name + str(options)] = digests
    return out


def test_every_strategy_gives_the_same_parameters_with_checkpointing():
    cases = [(name, {}) for name in registered()] + [("zero", {"zero_stage": 3})]
    out = run_workers(_every_strategy, 2, args=(cases,), timeout_s=150)
    for r in out:
        for case, (plain, ckpt) in r.items():
            assert plain == ckpt, f"{case}: checkpointing changed the parameters after 2 steps"
