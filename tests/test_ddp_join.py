"""Uneven inputs: ringtrain's `DistributedDataParallel.join()` against torch's DDP under `Join`.

    .venv/bin/pytest -q tests/test_ddp_join.py

gloo, CPU, world size 2. Every scenario runs in the same two ranks twice, once with ringtrain's
DDP and once with torch's, on the same model, data and number of batches per rank; the test
compares gradients step by step and the final model (ringtrain_ddp/join.py, uneven.py). The
scenarios follow torch's own tests (distributed_test.py: test_ddp_join_model_equivalence,
test_ddp_grad_div_uneven_inputs, test_ddp_uneven_inputs, test_ddp_uneven_input_exception,
test_ddp_uneven_input_join_disable).
"""

from __future__ import annotations

import traceback
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from support.gpu_box import TORCH_POWERSGD_LEFT_OUT, TORCH_POWERSGD_ON_CPU
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.join import Join

from ringtrain.data.sampler import DistributedSampler
from ringtrain.ddp.ctor_args import DDPArgumentError
from ringtrain.ddp.distributed import DistributedDataParallel
from ringtrain.testing import run_workers

CLASSES = {"ours": DistributedDataParallel, "torch": torch.nn.parallel.DistributedDataParallel}


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.clone() for t in model.state_dict().values()]


# ---- scenarios: fn(rank, world_size, cls) -> comparable values ---------------------------------


def _equivalence(rank, world_size, cls):
    # torch's test_ddp_join_model_equivalence: rank r trains 2 * (r + 1) steps on the same input;
    # with lr * world_size and the default divide_by_initial_world_size the result equals one
    # process training on every step of every rank.
    torch.manual_seed(0)
    model = nn.Linear(10, 10, bias=False)
    local = nn.Linear(10, 10, bias=False)
    local.load_state_dict(model.state_dict())
    inp = torch.rand(3, 10, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(local.parameters(), lr=0.03)
    for _ in range(sum(2 * (r + 1) for r in range(world_size))):
        opt.zero_grad()
        local(inp).sum().backward()
        opt.step()
    net = cls(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.03 * world_size)
    with net.join():
        for _ in range(2 * (rank + 1)):
            opt.zero_grad()
            net(inp).sum().backward()
            opt.step()
    logged = net._get_ddp_logging_data().get("join_uneven_inputs")
    return {"ddp": _state(model), "local": _state(local), "source": net._authoritative_rank,
            "logged": bool(logged)}


def _grad_div(rank, world_size, cls):
    # torch's test_ddp_grad_div_uneven_inputs: rank 1 trains 2 steps more than rank 0.
    torch.manual_seed(0)
    net = cls(nn.Linear(5, 5, bias=False), bucket_cap_mb=1)
    inp = torch.ones(1, 5) * 50
    grads = {}
    for divide in (False, True):
        grads[divide] = []
        with net.join(divide_by_initial_world_size=divide):
            for _ in range(3 + 2 * (rank > 0)):
                net(inp).sum().backward()
                grads[divide].append(net.module.weight.grad.clone())
                net.zero_grad()
    return grads


class _Normed(nn.Module):
    """Linear, BatchNorm over (N, 8, 2) (buffers; fine with one sample), Linear."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(6, 16), nn.BatchNorm1d(8), nn.Linear(16, 3)

    def forward(self, x):
        h = self.bn(self.fc1(x).view(-1, 8, 2)).flatten(1)  # (B, 16)
        return self.fc2(torch.relu(h))


def _sampler(rank, world_size, cls):
    # ringtrain's DistributedSampler(exact=True): 13 samples, batch 2: rank 0 gets 4 batches,
    # rank 1 gets 3. Two epochs, each under its own join(); buffers synced from the highest rank
    # still training; a small bucket cap for several buckets.
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(13, 6, generator=g), torch.randn(13, 3, generator=g)
    data = torch.utils.data.TensorDataset(x, y)
    sampler = DistributedSampler(data, exact=True, seed=3)
    loader = torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler)
    torch.manual_seed(0)
    model = _Normed()
    net = cls(model, bucket_cap_mb=0.0002)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = {"grads": [], "batches": []}
    for epoch in range(2):
        sampler.set_epoch(epoch)
        n = 0
        with net.join():
            for x, y in loader:
                opt.zero_grad()
                nn.functional.mse_loss(net(x), y).backward()
                out["grads"].append(_grads(model))
                opt.step()
                n += 1
        out["batches"].append(n)
    out["state"], out["source"] = _state(model), net._authoritative_rank
    return out


class _SometimesUnused(nn.Module):
    """torch's UnusedParamModule: `t0` is skipped on `unused_rank`."""

    def __init__(self, unused_rank: int):
        super().__init__()
        self.t0, self.t1 = nn.Linear(2, 2), nn.Linear(2, 2)
        self.unused_rank = unused_rank

    def forward(self, x, rank):
        return self.t1(x if rank == self.unused_rank else self.t0(x))


def _many_buckets(rank, world_size, cls):
    # Rank 0 first trains nothing at all (its shadow must match rank 1's one-time bucket rebuild
    # broadcast), then 2 steps against rank 1's 5; a 1 MiB weight (a solo bucket, reduced in
    # place) among small ones; no_sync every third step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                          nn.Linear(512, 3))
    net = cls(model, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    grads = []
    for steps in ((0, 4), (2, 5)):
        with net.join():
            for i in range(steps[rank]):
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * i + rank))
                with net.no_sync() if i % 3 == 1 else nullcontext():
                    net(x).square().mean().backward()
                if i % 3 != 1:
                    grads.append(_grads(model))
                    opt.step()
                    opt.zero_grad()
    return {"grads": grads, "state": _state(model)}


def _unused_and_hooks(rank, world_size, cls):
    # find_unused_parameters=True with the early-joining rank (0) or the late one (1) leaving
    # t0 unused; then torch's allreduce and PowerSGD comm hooks under join.
    out = {}
    cases = ("unused_joined", "unused_training", "allreduce_hook",
             *(["powersgd_hook"] if TORCH_POWERSGD_ON_CPU else []))
    for case in cases:
        torch.manual_seed(0)
        unused_rank = 1 if case == "unused_training" else 0
        model = _SometimesUnused(unused_rank)
        net = cls(model, find_unused_parameters=case.startswith("unused"))
        if case == "allreduce_hook":
            net.register_comm_hook(None, default_hooks.allreduce_hook)
        elif case == "powersgd_hook":
            net.register_comm_hook(powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=1,
                warm_start=False, use_error_feedback=False), powerSGD_hook.powerSGD_hook)
        out[case] = []
        with net.join():
            for i in range(2 + 3 * rank):
                x = torch.randn(3, 2, generator=torch.Generator().manual_seed(i + 100 * rank))
                net(x, rank if case.startswith("unused") else -1).sum().backward()
                out[case].append(_grads(model))
                for p in model.parameters():
                    if p.grad is not None:
                        with torch.no_grad():
                            p -= 0.1 * p.grad
                        p.grad = None
        out[case].append(_state(model))
    return out


def _throw(rank, world_size, cls):
    # throw_on_early_termination: every rank raises as soon as one runs out (Join's messages);
    # the model is still the same everywhere.
    torch.manual_seed(0)
    net = cls(nn.Linear(2, 4))
    done, error = 0, None
    try:
        with net.join(throw_on_early_termination=True):
            for _ in range(3 if rank == 1 else 6):
                net(torch.ones(5, 2)).sum().backward()
                done += 1
    except RuntimeError as e:
        error = str(e)
    return {"done": done, "error": error, "state": _state(net.module)}


class _Raises(nn.Module):
    def __init__(self):
        super().__init__()
        self.param = nn.Parameter(torch.ones(1))

    def forward(self, _):
        raise ValueError("Intentional error")


def _errors_and_disable(rank, world_size, cls):
    # torch's test_ddp_uneven_input_exception and test_ddp_uneven_input_join_disable.
    out = {}
    net = cls(_Raises())
    try:
        with net.join():
            net(torch.ones(1)).sum().backward()
    except ValueError as e:
        out["raised"] = str(e)
    torch.manual_seed(rank)
    net = cls(nn.Linear(1, 1))
    out["grads"] = []
    with net.join(enable=False):
        for _ in range(3):
            net.module.weight.grad = None
            net(torch.ones(1) * rank).sum().backward()
            out["grads"].append(net.module.weight.grad.item())
    out["enabled"] = net._join_config.enable
    # Join itself, with the wrapper as one of its joinables (as with a ZeRO optimizer).
    with Join([net]):
        for _ in range(1 + rank):
            net(torch.ones(1)).sum().backward()
    out["state"] = _state(net.module)
    return out


SCENARIOS = {
    "equivalence": _equivalence,
    "grad_div": _grad_div,
    "sampler": _sampler,
    "many_buckets": _many_buckets,
    "unused_and_hooks": _unused_and_hooks,
    "throw": _throw,
    "errors_and_disable": _errors_and_disable,
}


def _refused(rank, world_size):
    # Arguments whose collectives a joined rank cannot know: refused when the Join is built, on
    # every rank, before any collective (torch's DDP shadows neither and hangs).
    out = {}
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for arg, value in (("skip_all_reduce_unused_params", True),
                       ("delay_all_reduce_named_params", [("0.weight", model[0].weight)])):
        extra = {"param_to_hook_all_reduce": model[1].weight} if arg.startswith("delay") else {}
        net = DistributedDataParallel(model, **{arg: value}, **extra)
        try:
            with net.join():
                pass
            out[arg] = None
        except DDPArgumentError as e:
            out[arg] = str(e)
    return out


def _eval_inside(rank, world_size):
    # A no_grad forward through the wrapper after each step, inside the Join: the joined rank
    # learns that no backward follows (torch's would shadow one and hang), and buffers (synced
    # only after a synced forward) match; the first steps also cross the bucket rebuild.
    torch.manual_seed(0)
    model = _Normed()
    net = DistributedDataParallel(model, bucket_cap_mb=0.0002)
    evals = []
    with net.join():
        for i in range(1 + 3 * rank):
            x = torch.randn(2, 6, generator=torch.Generator().manual_seed(i))
            net(x).sum().backward()
            with torch.no_grad():
                evals.append(net(x).sum().item())
            model.zero_grad()
    return {"evals": evals, "state": _state(model)}


def _session(rank, world_size):
    out = {"refused": _refused(rank, world_size), "eval_inside": _eval_inside(rank, world_size)}
    for name, fn in SCENARIOS.items():
        for which, cls in CLASSES.items():
            try:
                out[name, which] = ("ok", fn(rank, world_size, cls))
            except Exception:  # noqa: BLE001 - reported by the test of this scenario
                out[name, which] = ("error", traceback.format_exc())
            dist.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    per_rank = run_workers(_session, 2, timeout_s=180)

    def get(name: str) -> list[dict]:
        if name in ("refused", "eval_inside"):
            return [out[name] for out in per_rank]
        values = []
        for rank, out in enumerate(per_rank):
            for which in CLASSES:
                status, value = out[name, which]
                if status == "error":
                    pytest.fail(f"rank {rank}, {which} DDP, scenario {name!r}:\n{value}")
            values.append({which: out[name, which][1] for which in CLASSES})
        return values

    return get


def _same(a, b, what: str) -> None:
    """Equal nested lists/dicts of tensors (None where torch leaves a gradient None)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _same(a[k], b[k], f"{what}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} entries"
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{what}[{k}]")
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m: f"{what}: {m}")
    else:
        assert a == b, f"{what}: {a!r} vs {b!r}"


def test_join_model_equivalence_with_one_process(results):
    for rank, out in enumerate(results("equivalence")):
        _same(out["ours"], out["torch"], f"rank {rank} vs torch")
        _same(out["ours"]["ddp"], out["ours"]["local"], f"rank {rank} vs one process")
        assert out["ours"]["source"] == 1  # the last rank to join is the source of the model
        assert out["ours"]["logged"]  # torch's logging data says a Join was used


def test_grad_division_by_initial_or_remaining_world_size(results):
    r0, r1 = results("grad_div")
    for rank, out in enumerate((r0, r1)):
        _same(out["ours"], out["torch"], f"rank {rank} vs torch")
    # Rank 1 alone in its last 2 steps: divided by 1 (remaining ranks) or by 2 (initial).
    full, half = torch.full((5, 5), 50.0), torch.full((5, 5), 25.0)
    _same(r1["ours"][False], [full] * 5, "divide_by_initial_world_size=False")
    _same(r1["ours"][True], [full] * 3 + [half] * 2, "divide_by_initial_world_size=True")


def test_join_with_ringtrain_sampler_exact_shards(results):
    r0, r1 = results("sampler")
    assert r0["ours"]["batches"] == [4, 4] and r1["ours"]["batches"] == [3, 3]
    for rank, out in enumerate((r0, r1)):
        _same(out["ours"], out["torch"], f"rank {rank} vs torch")
    _same(r0["ours"]["state"], r1["ours"]["state"], "final model (buffers too) across ranks")
    assert r0["ours"]["source"] == r1["ours"]["source"] == 0  # rank 0 joined last


def test_join_shadows_rebuild_solo_buckets_and_no_sync(results):
    r0, r1 = results("many_buckets")
    for rank, out in enumerate((r0, r1)):
        _same(out["ours"], out["torch"], f"rank {rank} vs torch")
    _same(r0["ours"]["state"], r1["ours"]["state"], "final model across ranks")


def test_join_unused_parameters_and_comm_hooks(results):
    r0, r1 = results("unused_and_hooks")
    if TORCH_POWERSGD_ON_CPU:
        assert "powersgd_hook" in r0["ours"]
    else:
        print(f"powersgd_hook left out: {TORCH_POWERSGD_LEFT_OUT}")
    for rank, out in enumerate((r0, r1)):
        _same(out["ours"], out["torch"], f"rank {rank} vs torch")
    for case in r0["ours"]:
        _same(r0["ours"][case][-1], r1["ours"][case][-1], f"{case}: final model across ranks")


def test_throw_on_early_termination(results):
    r0, r1 = results("throw")
    for rank, out in enumerate((r0, r1)):
        _same(out["ours"], out["torch"], f"rank {rank} vs torch")
    assert r1["ours"]["done"] == r0["ours"]["done"] == 3
    assert r1["ours"]["error"] == "Rank 1 exhausted all inputs."
    assert r0["ours"]["error"] == ("Detected at least one rank that exhausted inputs. "
                                   "Throwing across all ranks.")
    _same(r0["ours"]["state"], r1["ours"]["state"], "model across ranks")


def test_exception_propagates_and_join_disabled(results):
    r0, r1 = results("errors_and_disable")
    for rank, out in enumerate((r0, r1)):
        _same(out["ours"], out["torch"], f"rank {rank} vs torch")
        assert out["ours"]["raised"] == "Intentional error"
        assert out["ours"]["enabled"] is False
        assert out["ours"]["grads"] == [0.5] * 3  # inputs 0 and 1: averaged over 2 ranks
    _same(r0["ours"]["state"], r1["ours"]["state"], "model across ranks after Join([ddp])")


def test_join_refuses_arguments_a_joined_rank_cannot_shadow(results):
    for out in results("refused"):
        assert out["skip_all_reduce_unused_params"] is not None
        assert "which buckets the training ranks skip" in out["skip_all_reduce_unused_params"]
        delayed = out["delay_all_reduce_named_params"]
        assert delayed is not None and "where in backward the delayed all-reduce goes" in delayed


def test_evaluation_forwards_inside_join(results):
    r0, r1 = results("eval_inside")
    assert len(r0["evals"]) == 1 and len(r1["evals"]) == 4
    _same(r0["state"], r1["state"], "final model across ranks")
