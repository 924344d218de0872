"""The private DDP members Lightning and accelerate call, against torch's DDP on the same calls.

    .venv/bin/pytest -q tests/test_framework_members.py

No framework needed: each test replays, in plain torch, the exact calls a framework makes
(quoted from lightning 2.6 and accelerate 1.15 next to each), on 2 gloo ranks on the CPU, once
with torch's `DistributedDataParallel` and once with ringtrain's, and compares gradients and
flags. Also the members torch's own tests call (`_get_ddp_logging_data`'s keys, the sample
rate, built-in comm hooks, `_remove_autograd_hooks`). tests/test_frameworks.py runs the
frameworks themselves (an optional extra). ringtrain/ddp/framework_members.py lists the members.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ringtrain
from ringtrain.testing import run_workers

IMPLS = {"torch": torch.nn.parallel.DistributedDataParallel,
         "ringtrain": ringtrain.DistributedDataParallel}


class _Heads(nn.Module):
    """A trunk and two heads; `use_b` picks whether head b takes part (an unused parameter)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x, use_b: bool = True):
        h = torch.tanh(self.trunk(x))
        return self.a(h) + (self.b(h) if use_b else 0)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _lightning_step(ddp, x, y, rebuilt: list) -> None:
    """One step of Lightning's manual optimization, as its DDP strategy makes the calls.

    The training step runs inside DDP's forward (_DDPForwardRedirection swaps the module's
    forward), manual_backward first runs prepare_for_backward(model, loss) from
    lightning/pytorch/overrides/distributed.py, and require_backward_grad_sync is cleared after
    the inner forward and set again after the outer one.
    """
    module = ddp.module
    original = module.forward

    def training_step(x, y):
        module.forward = original
        loss = F.mse_loss(module(x), y)
        if torch.is_grad_enabled() and ddp.require_backward_grad_sync:  # prepare_for_backward
            ddp.require_forward_param_sync = True
            rebuilt.append(ddp.reducer._rebuild_buckets())
            ddp.reducer.prepare_for_backward([loss])
        else:
            ddp.require_forward_param_sync = False
        loss.backward()
        ddp.require_backward_grad_sync = False  # on_after_inner_forward
        return loss.detach()

    module.forward = training_step
    ddp(x, y)
    ddp.require_backward_grad_sync = True  # on_after_outer_forward


def _lightning_manual(rank, world_size):
    out = {}
    for impl, cls in IMPLS.items():
        ddp = cls(_Heads())
        x, y = _batch(rank, 9)
        F.mse_loss(ddp(x), y).backward()  # a plain first step: it records the gradients' order
        ddp.module.zero_grad()
        rebuilt, grads = [ddp.reducer._rebuild_buckets()], []  # rebuilds here, from that order
        for step in range(3):
            _lightning_step(ddp, *_batch(rank, step), rebuilt)
            grads.append(_grads(ddp.module))
            ddp.module.zero_grad()
        out[impl] = {"rebuilt": rebuilt, "grads": grads}
    return out


def _accelerate_trigger(rank, world_size):
    """accelerate's Accelerator.trigger_sync_in_backward docstring example: two forwards under
    no_sync, a local backward, then a backward that syncs everything accumulated."""
    out = {}
    for impl, cls in IMPLS.items():
        ddp = cls(_Heads())
        (xa, ya), (xb, yb) = _batch(rank, 0), _batch(rank, 1)
        with ddp.no_sync():
            loss_a = F.mse_loss(ddp(xa), ya)
            loss_b = F.mse_loss(ddp(xb), yb)
        local = ddp.require_forward_param_sync  # False after a no_sync forward, as in torch
        loss_a.backward()
        # trigger_sync_in_backward (accelerate/accelerator.py):
        old = ddp.require_backward_grad_sync, ddp.require_forward_param_sync
        ddp.require_backward_grad_sync = True
        ddp.require_forward_param_sync = True
        ddp.reducer.prepare_for_backward([])
        try:
            loss_b.backward()
        finally:
            ddp.require_backward_grad_sync, ddp.require_forward_param_sync = old
        synced = ddp.require_forward_param_sync
        loss = F.mse_loss(ddp(xa), ya)  # a plain synced forward sets it again
        out[impl] = {"grads": _grads(ddp.module), "flags": (local, synced,
                                                            ddp.require_forward_param_sync)}
        loss.backward()
    return out


def _logging_data(rank, world_size, case):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    find_unused, changing = case.startswith("find_unused"), case.endswith("changing_graph")
    out = {}
    for impl, cls in IMPLS.items():
        ddp = cls(_Heads(), find_unused_parameters=find_unused)
        steps = 3
        if case == "builtin_comm_hook":
            ddp._register_builtin_comm_hook(torch.distributed.BuiltinCommHookType.FP16_COMPRESS)
        if case == "comm_hook_sample_rate":
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
            ddp._set_ddp_runtime_logging_sample_rate(4)
            steps = 14  # sampled last at 12 rounds done: 1..10, then every 4th
        before = ddp._get_ddp_logging_data()
        for step in range(steps):
            x, y = _batch(rank, step)
            F.mse_loss(ddp(x, use_b=not (changing and step == 1)), y).backward()
        with torch.no_grad():
            ddp(x)  # not counted: no synced backward follows
        out[impl] = {"before": before, "after": ddp._get_ddp_logging_data(),
                     "grads": _grads(ddp.module)}
    return out


def _remove_hooks(rank, world_size):
    """torch's test_ddp_remove_autograd_hooks: a backward fails after some gradient hooks ran;
    the wrapper's hooks are removed and a new wrapper trains the same module."""

    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("simulated failure in backward")

    out = {}
    for impl, cls in IMPLS.items():
        model = _Heads()
        first = cls(model)
        x, y = _batch(rank, 0)
        try:
            F.mse_loss(first(Fails.apply(x.requires_grad_())), y).backward()
            raise AssertionError("the backward did not fail")
        except RuntimeError as e:
            assert "simulated failure" in str(e), e
        first._remove_autograd_hooks()
        model.zero_grad()
        second = cls(model)
        F.mse_loss(second(x.detach()), y).backward()
        out[impl] = _grads(model)
    return out


def test_lightning_manual_optimization_calls_give_torchs_gradients():
    for result in run_workers(_lightning_manual, 2, timeout_s=120):
        assert result["ringtrain"]["rebuilt"] == result["torch"]["rebuilt"] == [True] + [False] * 3
        for got, want in zip(result["ringtrain"]["grads"], result["torch"]["grads"], strict=True):
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_accelerate_trigger_sync_in_backward_gives_torchs_gradients_and_flags():
    for result in run_workers(_accelerate_trigger, 2, timeout_s=120):
        assert result["ringtrain"]["flags"] == result["torch"]["flags"] == (False, False, True)
        got, want = result["ringtrain"]["grads"], result["torch"]["grads"]
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


# Keys ringtrain gives with torch's values. torch's timing keys and its bucket-rebuild details
# (rebuilt_bucket_sizes, prev_iteration_grad_ready_order_indices, ...) are absent.
SAME = ["backend_name", "module_name", "device_ids", "dtypes", "bucket_sizes", "master_addr",
        "master_port", "torch_distributed_debug", "cuda_visible_devices", "gloo_socket_ifname",
        "gloo_device_transport", "world_size", "rank", "output_device", "broadcast_buffers",
        "bucket_cap_bytes", "find_unused_parameters", "gradient_as_bucket_view",
        "is_multi_device_module", "has_sync_bn", "num_parameter_tensors",
        "total_parameter_size_bytes", "iteration", "unused_parameter_size",
        "can_set_static_graph", "comm_hook", "num_buckets_reduced"]


@pytest.mark.parametrize("case", ["default", "find_unused", "find_unused_changing_graph",
                                  "comm_hook_sample_rate", "builtin_comm_hook"])
def test_get_ddp_logging_data_matches_torch(case):
    for rank, result in enumerate(run_workers(_logging_data, 2, args=(case,), timeout_s=120)):
        mine, torchs = result["ringtrain"], result["torch"]
        for when in ("before", "after"):
            assert {k: mine[when].get(k) for k in SAME} == {k: torchs[when].get(k) for k in SAME}
            assert set(mine[when]) - set(torchs[when]) == set(), when  # nothing torch lacks
        after = mine["after"]
        assert (after["rank"], after["world_size"], after["module_name"]) == (rank, 2, "_Heads")
        # Lightning's teardown: the key only appears, as 0, once the graph changed.
        assert after.get("can_set_static_graph") == (0 if case.endswith("changing_graph") else None)
        if case == "comm_hook_sample_rate":
            assert (after["comm_hook"], after["iteration"]) == ("allreduce_hook", 12)
        if case == "builtin_comm_hook":  # fp16 in transit, torch's C++ hook and its Python twin
            assert after["comm_hook"] == "BuiltinCommHookType.FP16_COMPRESS"
            got, want = result["ringtrain"]["grads"], result["torch"]["grads"]
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        if not case.startswith("find_unused"):  # torch rebuilds only without find_unused
            assert after["has_rebuilt_buckets"] == torchs["after"]["has_rebuilt_buckets"] == 1


def test_remove_autograd_hooks_lets_a_new_wrapper_train_the_module():
    for result in run_workers(_remove_hooks, 2, timeout_s=120):
        assert all(torch.equal(g, w) for g, w in zip(result["ringtrain"], result["torch"],
                                                     strict=True))
