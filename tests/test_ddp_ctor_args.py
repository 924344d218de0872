"""Every constructor argument of torch's DistributedDataParallel, with torch's meaning.

    .venv/bin/pytest -q tests/test_ddp_ctor_args.py

One test per argument torch added after the classic ones (torch 2.11 to 2.15), each against
torch's DDP on the same inputs where torch's runs on a CPU (gloo, 2 ranks, one spawn for all
the scenarios of `_GROUPS`), or against a reference written out where it does not (torch's
mixed precision needs CUDA streams).
"""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
import torch.distributed as dist
from support.scenarios import scenario_session
from torch import nn

from ringtrain.ddp.distributed import DistributedDataParallel as Ours
from ringtrain.ddp.mixed_precision import MixedPrecision, mixed_precision_hook

TorchDDP = torch.nn.parallel.DistributedDataParallel
_TORCH_ARGS = list(inspect.signature(TorchDDP.__init__).parameters)


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))


def _data(rank: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)


def _train(model: nn.Module, params, rank: int, steps: int = 3) -> list[torch.Tensor]:
    opt = torch.optim.SGD(params, lr=0.1)
    for step in range(steps):
        x, y = _data(rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in params]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _caught(fn) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return caught


# ---- single rank -------------------------------------------------------------------------------


def test_signature_is_torchs_in_torchs_order():
    ours = inspect.signature(Ours.__init__).parameters
    names = [n for n, p in ours.items() if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert names[:len(_TORCH_ARGS)] == _TORCH_ARGS  # this torch's, in its positional order
    theirs = inspect.signature(TorchDDP.__init__).parameters
    for name in _TORCH_ARGS:
        if name not in ("self", "module", "broadcast_buffers"):  # 2.11: True, 2.13: None
            assert ours[name].default == theirs[name].default, name
    # The newest torch we support (2.15) has these; ringtrain takes them on every torch.
    assert names[-9:] == [
        "delay_all_reduce_named_params", "param_to_hook_all_reduce", "mixed_precision",
        "device_mesh", "skip_all_reduce_unused_params", "bucket_cap_mb_list",
        "batched_grad_copy", "forward_sync_buffers", "lazy_bucket_allocation"]


def _future_warnings(cls, **kwargs) -> list[str]:
    caught = _caught(lambda: cls(nn.Linear(2, 2), **kwargs))
    return [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


@pytest.mark.skipif("forward_sync_buffers" not in _TORCH_ARGS,
                    reason="this torch has no forward_sync_buffers (2.13 added it)")
def test_broadcast_buffers_warns_as_torch_does(single_process):
    for kwargs in ({"broadcast_buffers": True}, {"broadcast_buffers": False},
                   {"broadcast_buffers": False, "forward_sync_buffers": True}):
        ours, theirs = _future_warnings(Ours, **kwargs), _future_warnings(TorchDDP, **kwargs)
        assert ours == theirs[:1] and "`broadcast_buffers` is deprecated" in ours[0], kwargs
    for kwargs in ({}, {"forward_sync_buffers": False}):
        assert _future_warnings(Ours, **kwargs) == [] == _future_warnings(TorchDDP, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ddp = Ours(nn.Linear(2, 2), broadcast_buffers=False, forward_sync_buffers=True)
    assert ddp.forward_sync_buffers is True and ddp.broadcast_buffers is True


@pytest.mark.skipif("forward_sync_buffers" in _TORCH_ARGS,
                    reason="this torch deprecates broadcast_buffers (2.13+): the test above")
def test_broadcast_buffers_says_nothing_where_torch_has_no_forward_sync_buffers(single_process):
    for kwargs in ({"broadcast_buffers": True}, {"broadcast_buffers": False}):
        assert _future_warnings(Ours, **kwargs) == [] == _future_warnings(TorchDDP, **kwargs)


def test_check_reduction_warns_as_torch_does(single_process):
    ours = _future_warnings(Ours, check_reduction=True)
    assert ours == _future_warnings(TorchDDP, check_reduction=True)
    assert "`check_reduction` argument" in ours[0]


@pytest.mark.parametrize("flag", ["batched_grad_copy", "lazy_bucket_allocation"])
def test_speed_flags_say_they_change_nothing(single_process, flag):
    grads = {}
    for value in (False, True):
        model = _net()
        caught = _caught(lambda model=model, value=value: Ours(model, **{flag: value}))
        said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        assert said == ([] if not value else [said[0]]) and (not value or flag in said[0])
        nn.functional.mse_loss(model(_data(0)[0]), _data(0)[1]).backward()
        grads[value] = [p.grad for p in model.parameters()]
    assert _equal(grads[False], grads[True])


def test_bucket_cap_mb_list_sizes_each_bucket_as_torch(single_process):
    # 12 parameters of 64 KiB, produced last-first: caps of 128 KiB, then 256 KiB repeating.
    model = nn.Sequential(*[nn.Linear(128, 128, bias=False) for _ in range(12)])
    caps_mb = [0.125, 0.25]
    ddp = Ours(model, bucket_cap_mb_list=caps_mb)
    theirs = TorchDDP(copy.deepcopy(model), bucket_cap_mb_list=caps_mb)
    assert ddp.bucket_bytes_cap_list == theirs.bucket_bytes_cap_list == [131072, 262144]
    assert ddp.bucket_bytes_cap == theirs.bucket_bytes_cap == 262144
    assert [b.members for b in ddp.reducer.buckets] == [
        [11, 10], [9, 8, 7, 6], [5, 4, 3, 2], [1, 0]]
    assert Ours(_net(), bucket_cap_mb=25).bucket_bytes_cap_list == []
    with pytest.raises(ValueError, match=r"bucket_cap_mb_list=\[1, 0\]: every size must be pos"):
        Ours(_net(), bucket_cap_mb_list=[1, 0])


# ---- two ranks ---------------------------------------------------------------------------------


class _Buffered(nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3, bias=False)
        self.register_buffer("coeff", torch.full((3,), float(rank)))

    def forward(self, x):
        return self.fc(x) + self.coeff


def _forward_sync_buffers(rank, world_size):
    out = {}
    # torch 2.11 has no forward_sync_buffers: there ours is checked alone.
    compared = [("ours", Ours)] + ([("torch", TorchDDP)] if "forward_sync_buffers" in _TORCH_ARGS
                                   else [])
    for name, cls in compared:
        for kwargs in ({"forward_sync_buffers": False}, {"broadcast_buffers": False}, {}):
            model = _Buffered(rank)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                ddp = cls(model, **kwargs)
            after_init = model.coeff.clone()
            if rank == 0:
                model.coeff += 1
            ddp(_data(rank)[0]).sum().backward()
            out[f"{name}/{sorted(kwargs)}"] = (after_init, model.coeff.clone())
    return out


def test_forward_sync_buffers_as_torch(sessions):
    r0, r1 = sessions("forward_sync_buffers")
    for key in r0:
        if key.replace("ours", "torch") in r0:
            assert torch.equal(r0[key][1], r0[key.replace("ours", "torch")][1]), key
    for rank, out in enumerate((r0, r1)):
        # Construction syncs them (only the deprecated broadcast_buffers=False skips it) ...
        assert out["ours/['forward_sync_buffers']"][0].tolist() == [0.0] * 3
        assert out["ours/['broadcast_buffers']"][0].tolist() == [float(rank)] * 3
        assert out["ours/[]"][1].tolist() == [1.0] * 3  # ... the default follows rank 0 ...
    # ... forward_sync_buffers=False leaves rank 0's later change on rank 0.
    assert r0["ours/['forward_sync_buffers']"][1].tolist() == [1.0] * 3
    assert r1["ours/['forward_sync_buffers']"][1].tolist() == [0.0] * 3


def _device_mesh(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for name, cls in (("ours", Ours), ("torch", TorchDDP)):
        model = _net()
        ddp = cls(model, device_mesh=mesh)
        out[f"{name}/mesh"] = ddp.device_mesh is mesh
        out[f"{name}/params"] = _train(ddp, list(model.parameters()), rank)
        for what, kwargs in (("both", {"device_mesh": mesh, "process_group": dist.group.WORLD}),
                             ("2d", {"device_mesh": init_device_mesh("cpu", (world_size, 1))})):
            try:
                cls(_net(), **kwargs)
                out[f"{name}/{what}"] = None
            except Exception as e:  # noqa: BLE001 - compared in the test
                out[f"{name}/{what}"] = (type(e), str(e))
    return out


def test_device_mesh_as_torch(sessions):
    for out in sessions("device_mesh"):
        assert out["ours/mesh"] and out["torch/mesh"]
        assert _equal(out["ours/params"], out["torch/params"])
        for what, text in (("both", "Cannot specify both process_group and device_mesh"),
                           ("2d", "Only 1D device mesh is supported")):
            (ours_type, ours_msg), (torch_type, _) = out[f"ours/{what}"], out[f"torch/{what}"]
            assert issubclass(ours_type, torch_type) and text in ours_msg, (what, ours_msg)


class _LargeNet(nn.Module):  # distributed_test.py's, smaller: fc2 is never used
    def __init__(self):
        super().__init__()
        torch.manual_seed(31415)
        self.fc1 = nn.Linear(100, 3000, bias=False)
        self.fc2 = nn.Linear(100, 100, bias=False)

    def forward(self, x):
        return self.fc1(x)


def _skip_unused(rank, world_size):
    from ringtrain import collectives

    calls = []
    original = collectives.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    collectives.all_reduce = counting
    out = {}
    try:
        for name, cls in (("ours", Ours), ("torch", TorchDDP)):
            for skip in (False, True):
                model = _LargeNet()
                ddp = cls(model, find_unused_parameters=True, bucket_cap_mb=1.5,
                          skip_all_reduce_unused_params=skip)
                calls.clear()
                x = torch.randn(20, 100, generator=torch.Generator().manual_seed(rank))
                for _ in range(3):
                    ddp(x).sum().backward()
                out[f"{name}/{skip}"] = ([p.grad for p in model.parameters()], list(calls))
    finally:
        collectives.all_reduce = original
    return out


def test_skip_all_reduce_unused_params_as_torch(sessions):
    for out in sessions("skip_unused"):
        for skip in (False, True):
            grads, _ = out[f"ours/{skip}"]
            torch_grads, _ = out[f"torch/{skip}"]
            assert grads[1] is None and torch_grads[1] is None  # fc2: unused everywhere
            assert torch.equal(grads[0], torch_grads[0])
        # Without the flag fc2's bucket (10000 gradients, and the unused-parameter status of 2
        # parameters and 2 ranks riding along as the last bucket) is sent every step; with it,
        # never.
        fc2 = {10000, 10004}
        assert fc2 & set(out["ours/False"][1]) and not fc2 & set(out["ours/True"][1])
        # Fewer elements sent (the status then travels alone: as many collectives as without).
        assert sum(out["ours/True"][1]) < sum(out["ours/False"][1])


class _MPNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.m = nn.Linear(4, 5)
        self.register_buffer("buffer", torch.randn(1, 5))
        self.p = nn.Parameter(torch.randn(5), requires_grad=False)
        self.seen: list = []

    def forward(self, x):
        self.seen.append((self.m.weight.dtype, self.p.dtype, self.buffer.dtype, x.dtype))
        return self.m(x) + self.p + self.buffer


def _mixed_precision(rank, world_size):
    config = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16,
                            buffer_dtype=torch.float16)
    model = _MPNet()
    ddp = Ours(model, mixed_precision=config)
    half = copy.deepcopy(model).half()  # the reference: the whole step in fp16
    x = _data(rank)[0]
    ddp(x).float().sum().backward()
    half(x.half()).float().sum().backward()
    expected = []
    for p in (half.m.weight, half.m.bias):
        both = [torch.empty_like(p.grad) for _ in range(world_size)]
        dist.all_gather(both, p.grad)
        expected.append((both[0] + both[1]).div_(world_size).float())  # sum, then divide
    try:
        ddp.register_comm_hook(None, mixed_precision_hook)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    copied = copy.deepcopy(ddp)
    return {"seen": model.seen, "dtypes": [(p.dtype, p.grad.dtype) for p in model.m.parameters()],
            "grads": [p.grad for p in model.m.parameters()], "expected": expected,
            "refused": refused, "copy_hook": copied.reducer.comm_hook is mixed_precision_hook,
            "buffer": model.buffer.dtype}


def test_mixed_precision_computes_and_reduces_in_low_precision(sessions):
    for out in sessions("mixed_precision"):
        fp16, fp32 = torch.float16, torch.float32
        assert out["seen"] == [(fp16, fp16, fp16, fp16)]  # inside forward: torch's checks
        assert out["dtypes"] == [(fp32, fp32)] * 2 and out["buffer"] == fp16
        assert _equal(out["grads"], out["expected"])  # bit for bit: fp16 sum, fp16 division
        assert "can only be called once" in out["refused"]
        assert out["copy_hook"]  # a copy reduces in fp16 too


def _delayed(rank, world_size):
    model = _net()
    delayed = [("2.weight", model[2].weight), ("2.bias", model[2].bias)]
    # The last layer's gradients come first in backward; the first layer's weight comes last.
    ddp = Ours(model, delay_all_reduce_named_params=delayed,
               param_to_hook_all_reduce=model[0].weight)
    reference = _net()
    ours = _train(ddp, list(model.parameters()), rank)
    theirs = _train(TorchDDP(reference), list(reference.parameters()), rank)
    views = all(p.grad.data_ptr() != 0 and p.grad.untyped_storage().data_ptr()
                == ddp._delayed.buffer.untyped_storage().data_ptr() for _, p in delayed)
    reduced = [n for n in ddp.reducer.names]
    copied = copy.deepcopy(ddp)
    copy_params = list(copied.module.parameters())
    return {"ours": ours, "torch": theirs, "views": views, "reduced": reduced,
            "copy": _train(copied, copy_params, rank), "copy_of_torch": _train(
                TorchDDP(copy.deepcopy(reference)), list(reference.parameters()), rank)}


def test_delay_all_reduce_named_params_averages_them_apart(sessions):
    for out in sessions("delayed"):
        assert _equal(out["ours"], out["torch"])  # averaged all the same, later
        assert out["views"] and out["reduced"] == ["0.weight", "0.bias"]
        assert len(out["copy"]) == 4



# ---- one spawn for everything ------------------------------------------------------------------

_GROUPS = {"forward_sync_buffers": _forward_sync_buffers, "device_mesh": _device_mesh,
           "skip_unused": _skip_unused, "mixed_precision": _mixed_precision,
           "delayed": _delayed}


@pytest.fixture(scope="module")
def sessions():
    return scenario_session(_GROUPS)
