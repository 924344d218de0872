"""When an unused parameter (find_unused_parameters=False) is raised: as torch's DDP, and one step
earlier in `optimizer.step()`.

    .venv/bin/pytest -q tests/test_ddp_unused_timing.py

torch's DDP lets the backward that left a parameter without a gradient return, and raises
"Expected to have finished reduction in the prior iteration ..." at the next forward with grad
enabled (torch's test_ddp_unused_params_rebuild_buckets_exception runs that first backward
outside its `try`). ringtrain raises at the same point with torch's phrases and its own names,
and also in an optimizer step before it (`unused_params.StepGuard`), where torch's DDP lets the
step run. gloo, CPU, world size 2, both classes in the same ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ringtrain.ddp.distributed import DistributedDataParallel
from ringtrain.ddp.unused_params import UnusedParametersError, unused_message
from ringtrain.testing import run_workers

CLASSES = {"ours": DistributedDataParallel, "torch": torch.nn.parallel.DistributedDataParallel}

# torch's phrases, as torch's own tests look for them (distributed_test.py, near line 237).
TORCH_PHRASES = (
    "Expected to have finished reduction in the prior iteration",
    "passing the keyword argument `find_unused_parameters=True`",
    "`forward` function outputs participate in calculating loss",
    "set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL",
)
FIND_UNUSED_ENABLED = "Since `find_unused_parameters=True` is enabled"


class _Skips(nn.Module):
    """net2 (weight: index 1, bias: index 2) never takes part."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net1 = nn.Linear(10, 10, bias=False)
        self.net2 = nn.Linear(10, 10)

    def forward(self, x):
        return self.net1(x)


def _raised(fn, *args) -> tuple[str, str] | None:
    try:
        fn(*args)
    except RuntimeError as e:
        return type(e).__name__, str(e)
    return None


def _timing(rank, world_size):
    x = torch.rand(3, 10, generator=torch.Generator().manual_seed(rank))
    out = {}
    for which, cls in CLASSES.items():
        model = _Skips()
        ddp = cls(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        other = nn.Linear(2, 2)  # an optimizer of other parameters is none of DDP's business
        other(torch.ones(1, 2)).sum().backward()
        ddp(x).sum().backward()  # returns, as in torch
        out[which, "other_step"] = _raised(torch.optim.SGD(other.parameters(), lr=0.1).step)
        before = [p.detach().clone() for p in model.parameters()]
        out[which, "step"] = _raised(opt.step)
        out[which, "moved"] = not all(torch.equal(a, p) for a, p in zip(
            before, model.parameters(), strict=True))
        out[which, "params"] = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():  # evaluation: no raise, in torch either
            out[which, "eval"] = _raised(ddp, x)
        out[which, "forward"] = _raised(ddp, x)
        out[which, "again"] = _raised(ddp, x)  # it stays, as torch's
        out[which, "logged"] = ddp._get_ddp_logging_data().get("error")
        dist.barrier()  # every rank got here: nothing waits for a collective
    return out


@pytest.fixture(scope="module")
def timing():
    return run_workers(_timing, 2, timeout_s=120)


def test_the_backward_returns_and_the_next_forward_raises_as_torchs(timing):
    for rank, out in enumerate(timing):
        for which in CLASSES:
            assert out[which, "eval"] is None, (which, out[which, "eval"])
            kind, message = out[which, "forward"]
            for phrase in (*TORCH_PHRASES,
                           f"Parameter indices which did not receive grad for rank {rank}: 1 2"):
                assert phrase in message, (which, phrase, message)
            assert FIND_UNUSED_ENABLED not in message
            assert out[which, "again"] == out[which, "forward"]
            assert message in out[which, "logged"]  # torch's verify_ddp_error_logged
        kind, message = out["ours", "forward"]
        assert kind == UnusedParametersError.__name__ and issubclass(UnusedParametersError,
                                                                   RuntimeError)
        # ringtrain names the parameters at every debug level (torch only at INFO/DETAIL).
        assert f"did not receive grad for rank {rank}: net2.weight, net2.bias" in message
        assert "(ranks [" in message and "find_unused_parameters=True);" in message


def test_ringtrains_optimizer_step_raises_before_a_parameter_changes(timing):
    for rank, out in enumerate(timing):
        assert out["ours", "step"] == out["ours", "forward"], rank
        assert not out["ours", "moved"]
        assert out["torch", "step"] is None and out["torch", "moved"]  # torch lets it step
        assert out["ours", "other_step"] is None and out["torch", "other_step"] is None
    for a, b in zip(timing[0]["ours", "params"], timing[1]["ours", "params"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_message_forms():
    names = ["a.weight", "b.weight", "b.bias"]
    own = unused_message(0, names, [1, 2], [0], [1, 2], debug_off=True)
    assert own.startswith("rank 0: 2 parameter(s) got no gradient in the previous synced "
                          "backward. Expected to have finished")
    assert "Parameters which did not receive grad for rank 0: b.weight, b.bias\n" in own
    assert "Parameter indices which did not receive grad for rank 0: 1 2\n" in own
    assert TORCH_PHRASES[-1] in own
    detail = unused_message(0, names, [1, 2], [0], [1, 2], debug_off=False)
    assert TORCH_PHRASES[-1] not in detail and detail in own  # torch's DETAIL form
    other = unused_message(1, names, [], [0], [1, 2])
    assert other.startswith("rank 1: ranks [0] had parameters that got no gradient")
    assert "did not receive grad on ranks [0]: b.weight, b.bias" in other
    assert "for rank 1" not in other  # rank 1 had none of its own
