"""`state_dict()` / `load_state_dict()` of the wrappers, as a user's script calls them.

    .venv/bin/pytest -q tests/test_wrapper_state_dict.py

`DistributedDataParallel` and `ZeroDataParallel` (stages 1-3) save torch's form (`module.` keys)
and load it, or the plain model's keys (`ringtrain.ddp.state_keys`). ZeRO stage 3 holds only a
shard of each parameter between forwards: nn.Module's own state_dict read freed storage and its
load_state_dict wrote into it (a segfault, found in session 35); now both gather first (a
collective), and a load reaches the shards, so the next forward computes with the loaded weights.
On 2 gloo ranks on the CPU, after two AdamW steps, against a plain GPT holding other weights. And
`ZeroDataParallel.optimizer` under torch's LR schedulers, which take only a torch Optimizer.
"""

from __future__ import annotations

import pytest
import torch

from ringtrain.ddp.distributed import DistributedDataParallel
from ringtrain.models import GPT, GPTConfig, loss_fn
from ringtrain.testing import run_workers
from ringtrain.training.config import adamw
from ringtrain.zero import ZeroDataParallel

MODEL = GPTConfig(vocab_size=10, block_size=6, n_layer=2, n_head=2, n_embd=16)
B = 4


def _batch(rank):
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, MODEL.vocab_size, (2 * B, MODEL.block_size), generator=g)
    return x[rank * B:(rank + 1) * B], torch.roll(x, 1, dims=1)[rank * B:(rank + 1) * B]


def _wrapped(kind):
    torch.manual_seed(0)
    if kind == "ddp":
        model = DistributedDataParallel(GPT(MODEL))
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)
    z = ZeroDataParallel(GPT(MODEL), adamw(0.1), stage=int(kind[-1]))
    return z, z.optimizer


def _check(rank, world_size):
    torch.manual_seed(5)
    other = GPT(MODEL)  # the weights to load: not the wrappers'
    x, y = _batch(rank)
    out = {}
    for kind in ("ddp", "zero1", "zero2", "zero3"):
        model, opt = _wrapped(kind)
        for _ in range(2):
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        saved = model.state_dict()
        trained = model.module.state_dict() if kind == "ddp" else model.full_state_dict()
        r = {"keys": set(saved) == {"module." + k for k in trained},
             "saved_is_trained": all(torch.equal(saved["module." + k], v)
                                     for k, v in trained.items())}
        for form in ("plain", "module."):
            sd = {("" if form == "plain" else form) + k: v for k, v in other.state_dict().items()}
            model.load_state_dict(sd)
            with torch.no_grad():
                r[form] = torch.equal(model(x), other(x))  # the next forward: loaded weights
        parent = torch.nn.ModuleDict({"inner": model})  # a parent's load reaches it too
        torch.manual_seed(6)
        third = GPT(MODEL)
        parent.load_state_dict({"inner." + k: v for k, v in third.state_dict().items()})
        with torch.no_grad():
            r["nested"] = torch.equal(model(x), third(x))
        model.load_state_dict(other.state_dict())
        loss_fn(model(x), y).backward()  # and it trains on from them
        opt.step()
        opt.zero_grad()
        r["trains"] = bool(torch.isfinite(loss_fn(model(x), y)))
        if kind != "ddp":
            try:
                model.load_state_dict(other.state_dict(), assign=True)
            except ValueError as e:
                r["assign"] = str(e)
            r.update(_with_a_scheduler(model, opt, x, y))
        out[kind] = r
    return out


def _with_a_scheduler(model, opt, x, y):
    """ZeroOptimizer to torch's LR schedulers (which take only a torch.optim.Optimizer), step
    hooks and its own state dict: the rebuilt optimizer's learning rate is the scheduled one."""
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(o is opt))
    for group in opt.param_groups:  # the trainer sets it each step (adamw's factory: 0)
        group["lr"] = 0.1
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    for _ in range(2):
        loss_fn(model(x), y).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
    return {"lr": [g["lr"] for g in opt.optimizer.param_groups], "hooked": seen,
            "is_optimizer": isinstance(opt, torch.optim.Optimizer)}


@pytest.fixture(scope="module")
def results():
    return run_workers(_check, 2, timeout_s=90)


@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero2", "zero3"])
def test_saved_in_torchs_form_and_loaded_in_either(results, kind):
    for rank, got in enumerate(results):
        r = got[kind]
        assert r["keys"] and r["saved_is_trained"], (rank, r)
        assert r["plain"] and r["module."] and r["nested"] and r["trains"], (rank, r)
        if kind != "ddp":
            assert "assign=True" in r["assign"] and "assign=False" in r["assign"]
            assert r["is_optimizer"] and r["hooked"] == [True, True]
            assert r["lr"] == pytest.approx([0.1 * 0.25] * len(r["lr"]))


def test_a_mistaken_dict_fails_as_in_torch():
    """Keys of neither form: the plain-key rename is not applied, torch's error names them."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    from ringtrain.ddp.state_keys import accept_unwrapped_keys

    wrapper = torch.nn.Module()
    wrapper.module = model
    accept_unwrapped_keys(wrapper)
    with pytest.raises(RuntimeError, match=r'(?s)Missing key\(s\).*"module\.0\.weight".*Unexpected '
                                           r'key\(s\).*"zz\.weight"'):
        wrapper.load_state_dict({"zz.weight": torch.zeros(2, 2)})
    wrapper.load_state_dict({"0.weight": torch.ones(2, 2), "0.bias": torch.zeros(2)})
    assert torch.equal(model[0].weight, torch.ones(2, 2))
