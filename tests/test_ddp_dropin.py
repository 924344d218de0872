"""ringtrain's DistributedDataParallel where code written for torch's relies on torch's behaviour.

    .venv/bin/pytest -q tests/test_ddp_dropin.py

Issue 25: saving and copying the wrapped model, `None` gradients for parameters that got none,
parameters and buffers kept out of DDP, and the exception types torch raises for the same
mistakes. Every scenario runs torch's DDP and ours on the same inputs (gloo, CPU, 2 ranks, a
few spawns for everything; see `_GROUPS`) or, for the single-rank checks, on a one-rank gloo group.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
from support.scenarios import scenario_session
from torch import nn

from ringtrain.ddp.buckets import CommHookError
from ringtrain.ddp.ctor_args import DDPArgumentError
from ringtrain.ddp.distributed import DistributedDataParallel as Ours
from ringtrain.ddp.init_sync import ReplicaMismatchError

TorchDDP = torch.nn.parallel.DistributedDataParallel
_CLASSES = (("ours", Ours), ("torch", TorchDDP))


def _pg1() -> dist.ProcessGroup:
    # A one-rank gloo group that leaves the pytest process's default group alone.
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1)


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))


def _data(rank: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)


def _step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = _data(rank, step)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _assert_equal(a: list, b: list, what: str) -> None:
    assert len(a) == len(b), what
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        if x is None or y is None:
            assert x is None and y is None, f"{what} #{k}: {x} vs {y}"
        else:
            torch.testing.assert_close(x, y, rtol=0, atol=0, msg=lambda m, k=k: f"{what} #{k}: {m}")


# ---- 1. torch.save / copy.deepcopy of the wrapped model ----------------------------------------


def _pickle(rank, world_size):
    out = {}
    for as_view in (False, True):
        for name, cls in _CLASSES:
            ddp = cls(_net(), gradient_as_bucket_view=as_view)
            _step(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), rank, 0)
            buf = io.BytesIO()
            torch.save(ddp, buf)
            buf.seek(0)
            loaded = torch.load(buf, weights_only=False)
            copied = copy.deepcopy(ddp)
            out[f"{name}/{as_view}/state"] = all(
                torch.equal(v, loaded.state_dict()[k]) and torch.equal(v, copied.state_dict()[k])
                for k, v in ddp.state_dict().items())
            if name == "ours":  # the copies use the lanes this process has: no new group
                out[f"lanes/{as_view}"] = [len(m.reducer.lanes) for m in (ddp, loaded, copied)]
            # Each copy trains on its own (a reducer of its own on the default group).
            for which, model in (("loaded", loaded), ("copied", copied), ("original", ddp)):
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                for step in (1, 2):
                    _step(model, opt, rank, step)
                out[f"{name}/{as_view}/{which}"] = _params(model)
    # A copy on one rank only issues no collective: the next step still pairs up.
    ddp = Ours(_net())
    if rank == 0:
        copy.deepcopy(ddp)
    _step(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), rank, 0)
    out["one_rank_copy"] = _params(ddp)
    # As torch: only a DDP on the default group can be pickled.
    sub = dist.new_group([0, 1])
    for name, cls in _CLASSES:
        try:
            copy.deepcopy(cls(_net(), process_group=sub))
            out[f"subgroup/{name}"] = None
        except Exception as e:  # noqa: BLE001 - compared below
            out[f"subgroup/{name}"] = (type(e), str(e))
    return out


def test_save_and_deepcopy_work_and_train_as_torchs(sessions):
    for rank, out in enumerate(sessions("pickle")):
        for as_view in (False, True):
            assert out[f"ours/{as_view}/state"] and out[f"torch/{as_view}/state"]
            assert out[f"lanes/{as_view}"] == [3, 3, 3]  # gloo world group: 3 lanes, reused
            for which in ("loaded", "copied", "original"):
                _assert_equal(out[f"ours/{as_view}/{which}"], out[f"torch/{as_view}/{which}"],
                              f"rank {rank} as_view={as_view} {which}")
        assert out["one_rank_copy"]
        ours_type, ours_msg = out["subgroup/ours"]
        torch_type, _ = out["subgroup/torch"]
        assert issubclass(ours_type, torch_type), (ours_type, torch_type)
        assert "only supported when using DDP with the default process group" in ours_msg


# ---- 2. None gradients where no rank computed one ----------------------------------------------


class _Gate(torch.autograd.Function):
    """Identity on a weight whose backward gives the weight no gradient when `on` is False
    (what a custom op that is not differentiable in some input does)."""

    @staticmethod
    def forward(ctx, w, on):
        ctx.on = on
        return w.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.on else None), None


class _Gated(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)
        self.gated = nn.Linear(4, 3)

    def forward(self, x, on):
        w = _Gate.apply(self.gated.weight, on)
        return self.lin(x) + nn.functional.linear(x, w, self.gated.bias)


class _TorchNet(nn.Module):  # distributed_test.py's Net, for its undefined-grad test
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=False)
        self.fc3 = nn.Linear(50, 4, bias=False)

    def forward(self, x):
        x = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return torch.softmax(self.fc3(x), dim=1)


def _none_grads(rank, world_size):
    out = {}
    for name, cls in _CLASSES:
        # torch's test_undefined_grad_parity_unused_parameters.
        net = _TorchNet()
        ddp = cls(net, find_unused_parameters=True)
        torch._C._functions.UndefinedGrad()(ddp(torch.ones(1, 2)).sum()).backward()
        out[f"{name}/undefined"] = [p.grad for p in net.parameters()]
        # Several AdamW steps (weight decay moves any parameter that has a .grad, zero or not):
        # the gated weight gets no gradient on any rank, then on rank 0 only, then everywhere.
        model = _Gated()
        ddp = cls(model, find_unused_parameters=True)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
        for step, on in enumerate((False, False, rank == 0, True)):
            x, y = _data(rank, step)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x, on), y).backward()
            out[f"{name}/grads{step}"] = [None if p.grad is None else p.grad.clone()
                                          for p in model.parameters()]
            opt.step()
            out[f"{name}/params{step}"] = _params(model)
    return out


def test_no_gradient_on_any_rank_leaves_grad_none_as_torch(sessions):
    for rank, out in enumerate(sessions("none_grads")):
        assert out["torch/undefined"] == [None, None, None]
        assert out["ours/undefined"] == [None, None, None]
        for step in range(4):
            _assert_equal(out[f"ours/grads{step}"], out[f"torch/grads{step}"],
                          f"rank {rank} grads of step {step}")
            _assert_equal(out[f"ours/params{step}"], out[f"torch/params{step}"],
                          f"rank {rank} params after step {step}")
        assert out["ours/grads0"][2] is None  # gated.weight: no rank computed a gradient
        assert out["ours/grads2"][2] is not None  # rank 0 did: averaged with rank 1's nothing


# ---- 4. parameters and buffers kept out of DDP ------------------------------------------------


class _WithIgnored(nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        torch.manual_seed(rank)  # different on every rank: only what DDP syncs becomes equal
        self.shared = nn.Linear(3, 3)
        self.local = nn.Linear(3, 3)
        self.register_buffer("stats", torch.full((2,), float(rank)))
        # A different size on each rank: broadcasting it would fail.
        self.register_buffer("local_stats", torch.full((2 + rank,), float(rank)))

    def forward(self, x):
        self.stats.add_(1.0)
        return self.shared(x) + self.local(x) + self.stats.sum() + self.local_stats.sum()


_IGNORED = ["local.weight", "local.bias", "local_stats"]
_IGNORE_VARIANTS = {"plain": {}, "find_unused": {"find_unused_parameters": True},
                    "static_graph": {"static_graph": True}}


def _ignored(rank, world_size):
    out = {}
    for variant, kwargs in _IGNORE_VARIANTS.items():
        for name, cls in _CLASSES:
            model = _WithIgnored(rank)
            cls._set_params_and_buffers_to_ignore_for_model(model, _IGNORED)
            local_before = _params(model.local)
            ddp = cls(model, **kwargs)
            out[f"{variant}/{name}/kept_local"] = all(
                torch.equal(a, b) for a, b in zip(local_before, _params(model.local), strict=True))
            out[f"{variant}/{name}/dp_params"] = [
                n for n, _ in cls._get_data_parallel_params(model, named_params=True)]
            out[f"{variant}/{name}/ignore_set"] = sorted(ddp.parameters_to_ignore)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(3):
                x, _ = _data(rank, step)
                opt.zero_grad()
                ddp(x[:, :3]).sum().backward()
                out[f"{variant}/{name}/grads{step}"] = [p.grad.clone() for p in model.parameters()]
                opt.step()
            out[f"{variant}/{name}/state"] = [t.clone() for t in model.state_dict().values()]
    return out


def test_ignored_parameters_and_buffers_are_left_alone_as_torch(sessions):
    r0, r1 = sessions("ignored")
    for variant in _IGNORE_VARIANTS:
        for rank, out in enumerate((r0, r1)):
            assert out[f"{variant}/ours/kept_local"] and out[f"{variant}/torch/kept_local"]
            assert out[f"{variant}/ours/dp_params"] == ["shared.weight", "shared.bias"]
            assert out[f"{variant}/ours/ignore_set"] == out[f"{variant}/torch/ignore_set"]
            for step in range(3):
                _assert_equal(out[f"{variant}/ours/grads{step}"],
                              out[f"{variant}/torch/grads{step}"],
                              f"rank {rank} {variant} grads of step {step}")
            _assert_equal(out[f"{variant}/ours/state"], out[f"{variant}/torch/state"],
                          f"rank {rank} {variant} state")
        # state_dict order: stats, local_stats, shared.weight/bias, local.weight/bias.
        # stats and shared.* follow rank 0 (broadcast, averaged); local* stay rank-local.
        s0, s1 = r0[f"{variant}/ours/state"], r1[f"{variant}/ours/state"]
        assert torch.equal(s0[0], s1[0]) and torch.equal(s0[2], s1[2])
        assert s0[1].tolist() == [0.0, 0.0] and s1[1].tolist() == [1.0, 1.0, 1.0]
        assert not torch.equal(s0[4], s1[4])


# ---- 5. the exception types torch raises, for the same mistakes --------------------------------


def _bad_hook_annotation(state, bucket: int) -> torch.futures.Future[torch.Tensor]:
    raise AssertionError("never called")


def _int_hook(state, bucket):
    return 1


def _mistakes() -> dict:
    def twice(cls):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        ddp = cls(nn.Linear(2, 2), process_group=None)
        ddp.register_comm_hook(None, allreduce_hook)
        ddp.register_comm_hook(None, allreduce_hook)

    def bad_future(cls):
        ddp = cls(nn.Linear(2, 2), process_group=None)
        ddp.register_comm_hook(None, _int_hook)
        ddp(torch.ones(1, 2)).sum().backward()

    def mixed_devices(cls):
        model = nn.Linear(2, 2)
        model.extra = nn.Linear(2, 2, device="meta")
        cls(model, process_group=None)

    def all_ignored(cls):
        model = nn.Linear(2, 2)
        cls._set_params_and_buffers_to_ignore_for_model(model, ["weight", "bias"])
        cls(model, process_group=None)

    pg = None  # the default group: a world of one (the single_process fixture)
    return {
        "no trainable parameter": lambda cls: cls(nn.Module(), process_group=pg),
        "all parameters ignored": all_ignored,
        "uninitialized parameter": lambda cls: cls(nn.LazyLinear(2), process_group=pg),
        "mixed device types": mixed_devices,
        "device_ids on CPU": lambda cls: cls(nn.Linear(2, 2), device_ids=[0], process_group=pg),
        "output_device on CPU": lambda cls: cls(nn.Linear(2, 2), output_device=1,
                                                process_group=pg),
        "one delay argument": lambda cls: cls(nn.Linear(2, 2), process_group=pg,
                                              delay_all_reduce_named_params=[]),
        "hook not callable": lambda cls: cls(nn.Linear(2, 2),
                                             process_group=pg).register_comm_hook({}, {}),
        "hook annotation": lambda cls: cls(nn.Linear(2, 2), process_group=pg).register_comm_hook(
            None, _bad_hook_annotation),
        "hook registered twice": twice,
        "hook returns no Future": bad_future,
    }


@pytest.mark.parametrize("mistake", list(_mistakes()))
def test_exception_subclasses_what_torch_raises(mistake, single_process):
    caught = {}
    for name, cls in _CLASSES:
        try:
            _mistakes()[mistake](cls)
        except Exception as e:  # noqa: BLE001 - compared below
            caught[name] = e
    assert set(caught) == {"ours", "torch"}, f"{mistake}: raised only by {sorted(caught)}"
    assert isinstance(caught["ours"], type(caught["torch"])), (
        f"{mistake}: ours raised {type(caught['ours']).__mro__}, torch "
        f"{type(caught['torch']).__name__}: {caught['torch']}")
    if mistake == "hook not callable":
        assert str(caught["ours"]).startswith("Communication hook must be callable.")
    if mistake.startswith("hook annotation"):
        assert str(caught["ours"]) == str(caught["torch"])


def test_error_classes_keep_ringtrains_types_too():
    # ringtrain raised ValueError / TypeError for these before; code catching those still does.
    assert issubclass(DDPArgumentError, ValueError) and issubclass(DDPArgumentError, RuntimeError)
    assert issubclass(ReplicaMismatchError, ValueError)
    assert issubclass(ReplicaMismatchError, RuntimeError)  # torch: _verify_params_across_processes
    assert issubclass(CommHookError, TypeError) and issubclass(CommHookError, RuntimeError)
    with pytest.raises(ValueError, match="no parameter that requires a gradient"):
        Ours(nn.Module(), process_group=_pg1())


# ---- a few spawns for everything ---------------------------------------------------------------

_GROUPS = {"pickle": _pickle, "none_grads": _none_grads, "ignored": _ignored}


@pytest.fixture(scope="module")
def sessions():
    return scenario_session(_GROUPS)
