"""torch DDP's private members that its own tests call, against torch's DDP on the same calls.

    .venv/bin/pytest -q tests/test_ddp_private_members.py

2 gloo ranks on the CPU run every case once with torch's `DistributedDataParallel` and once with
ringtrain's, in one spawn (the cases are independent: each builds its own wrappers), and each
test compares one member's results: `reducer._get_local_used_map()`, `reducer._ddp_graph_static()`,
`_register_buffer_comm_hook` (where it runs, futures waited at the end of backward),
`_build_params_for_reducer` / `_build_debug_param_to_name_mapping`, `_set_ddp_sink_clone`, and
torch's rule for when buckets are rebuilt (`has_rebuilt_buckets`). torch's own tests of the same
members run in tests/test_torch_ddp_suite.py; ringtrain/ddp/torch_members.py lists the members.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel.distributed import _BufferCommHookLocation
from torch.utils._python_dispatch import TorchDispatchMode

import ringtrain
from ringtrain.ddp.ctor_args import BROADCAST_BUFFERS_DEPRECATED
from ringtrain.testing import run_workers

IMPLS = {"torch": torch.nn.parallel.DistributedDataParallel,
         "ringtrain": ringtrain.DistributedDataParallel}


def _input(rank: int, step: int, rows: int = 3) -> torch.Tensor:
    return torch.randn(rows, 4, generator=torch.Generator().manual_seed(10 * rank + step))


# --- reducer._get_local_used_map(), reducer._ddp_graph_static() ------------------------------

class _Branches(nn.Module):
    """lin1 always; lin2 only when the step asks for it (an unused parameter otherwise)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin1, self.lin2 = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)

    def forward(self, x, use2: bool):
        h = F.relu(self.lin1(x))
        return self.lin2(h) if use2 else h


def _used_maps(rank, cls):
    """After each synced backward: the used map and whether the graph stayed static."""
    out = {}
    # Which ranks use lin2 changes between steps: on none, rank 1, none, both; then a step whose
    # lin2 gradient came only from a no_sync micro-step on rank 0.
    plan = [False, rank == 1, False, True]
    ddp = cls(_Branches(), find_unused_parameters=True)
    # torch's is one tensor, updated in place by each synced backward (uninitialised before).
    live = ddp.reducer._get_local_used_map()
    maps, static = [], []
    for step, use2 in enumerate(plan):
        ddp(_input(rank, step), use2).sum().backward()
        maps.append(ddp.reducer._get_local_used_map().tolist())
        static.append(ddp.reducer._ddp_graph_static())
    with ddp.no_sync():
        ddp(_input(rank, 7), rank == 0).sum().backward()
    ddp(_input(rank, 8), False).sum().backward()
    maps.append(ddp.reducer._get_local_used_map().tolist())
    out["changing"] = {"maps": maps, "static": static, "dtype": str(live.dtype),
                       "live": live.tolist()}
    for find_unused in (True, False):  # the same parameters every step
        ddp = cls(_Branches(), find_unused_parameters=find_unused)
        maps, static = [], []
        for step in range(3):
            ddp(_input(rank, step), not find_unused).sum().backward()
            used = ddp.reducer._get_local_used_map()
            maps.append(None if used is None else used.tolist())
            static.append(ddp.reducer._ddp_graph_static())
        out[f"steady find_unused={find_unused}"] = {"maps": maps, "static": static}
    return out


# --- _register_buffer_comm_hook --------------------------------------------------------------

class _Counting(nn.Module):
    """A buffer each rank moves by its own input in forward, and the output depends on it: where
    and how the buffers are synced shows in the buffers, the outputs and the gradients."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)
        self.register_buffer("seen", torch.zeros(2))

    def forward(self, x):
        self.seen.add_(x.detach().abs().sum(0)[:2])
        return self.lin(x) * (1 + self.seen)  # the output depends on the buffer's value


def _all_reduce_hook(ddp, named_buffers):
    for buffer in named_buffers.values():
        dist.all_reduce(buffer, group=ddp.process_group)


def _all_reduce_futures_hook(ddp, named_buffers):
    return [dist.all_reduce(b, group=ddp.process_group, async_op=True).get_future()
            for b in named_buffers.values()]


def _broadcast_hook(ddp, named_buffers):
    ddp._default_broadcast_coalesced(list(named_buffers.values()))


BUFFER_CASES = {
    "all_reduce pre": (_all_reduce_hook, "PRE_FORWARD", True),
    "all_reduce post": (_all_reduce_hook, "POST_FORWARD", True),
    "futures post": (_all_reduce_futures_hook, "POST_FORWARD", True),
    "broadcast post": (_broadcast_hook, "POST_FORWARD", True),
    "all_reduce post, forward_sync_buffers=False": (_all_reduce_hook, "POST_FORWARD", False),
}


# torch before 2.13 has only `broadcast_buffers`; the buffers start equal on every rank, so
# the construction sync the two names treat differently changes nothing here.
_SYNC_KWARG = ("forward_sync_buffers" if BROADCAST_BUFFERS_DEPRECATED else "broadcast_buffers")


def _buffer_hooks(rank, cls):
    out = {}
    for case, (hook, where, sync) in BUFFER_CASES.items():
        ddp = cls(_Counting(), **{_SYNC_KWARG: sync})
        ddp._register_buffer_comm_hook(ddp, hook, _BufferCommHookLocation[where])
        steps = []
        for step in range(3):
            y = ddp(_input(rank, step))
            # A hook's futures may still be writing the buffer now: read it after backward.
            after_forward = None if hook is _all_reduce_futures_hook else ddp.module.seen.clone()
            y.sum().backward()
            steps.append({"out": y.detach(), "after_forward": after_forward,
                          "after_backward": ddp.module.seen.clone(),
                          "grads": [p.grad.clone() for p in ddp.parameters()]})
        out[case] = steps
    try:
        ddp._register_buffer_comm_hook(ddp, "not a function")
        out["non-callable"] = "accepted"
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        out["non-callable"] = [c.__name__ for c in (AssertionError, TypeError) if isinstance(e, c)]
    return out


# --- _build_params_for_reducer, _build_debug_param_to_name_mapping ---------------------------

class _Mixed(nn.Module):
    """A root parameter, a module registered twice, a frozen bias and an ignored layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.ones(1))
        self.lin = nn.Linear(4, 4)
        self.tied = self.lin
        self.frozen = nn.Linear(4, 4)
        self.frozen.bias.requires_grad_(False)
        self.ignored = nn.Linear(4, 1)

    def forward(self, x):
        return self.ignored(self.frozen(self.tied(x))) * self.scale


def _param_mapping(rank, cls):
    model = _Mixed()
    cls._set_params_and_buffers_to_ignore_for_model(model, ["ignored.weight", "ignored.bias"])
    ddp = cls(model)
    params, sparse = ddp._build_params_for_reducer()
    index = {p: i for i, p in enumerate(model.parameters())}
    out = {"params": [index[p] for p in params], "sparse": sparse,
           "mapping": ddp._build_debug_param_to_name_mapping(params)}
    for case, bad in (("extra", params + [nn.Parameter(torch.ones(1))]), ("missing", params[:-1])):
        try:
            ddp._build_debug_param_to_name_mapping(bad)
            out[case] = "accepted"
        except ValueError as e:
            out[case] = str(e).split(":")[0].split(".")[0]
        logged = ddp._get_ddp_logging_data()  # torch logs the error it raised (_log_and_throw)
        out[f"{case} logged"] = (logged.get("has_error"), logged.get("error", ""))
    return out


# --- errors raised after construction, in _get_ddp_logging_data() ----------------------------

def _errors_logged(rank, cls):
    ddp = cls(nn.Linear(4, 4))
    before = ddp._get_ddp_logging_data()
    try:
        ddp.register_comm_hook({}, {})  # torch's test_ddp_python_error_logged
        raised = None
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        raised = type(e).__name__
    after = ddp._get_ddp_logging_data()
    return {"before": (before.get("has_error"), before.get("error")), "raised": raised,
            "after": (after.get("has_error"), after.get("error", "")),
            "iteration": after.get("iteration")}


# --- _set_ddp_sink_clone ----------------------------------------------------------------------

class _CountClones(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.clones = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.clones += func._overloadpacket == torch.ops.aten.clone
        return func(*args, **(kwargs or {}))


def _sink_clone(rank, cls):
    out = {}
    for clone in (True, False):
        torch.manual_seed(0)
        ddp = cls(nn.Linear(4, 4), find_unused_parameters=True)
        if not clone:
            ddp._set_ddp_sink_clone(False)
        with _CountClones() as mode:
            ddp(_input(rank, 0)).sum().backward()
        out[f"clones, sink_clone={clone}"] = mode.clones
    # What the clone is for in torch: the loss may be edited in place.
    torch.manual_seed(0)
    ddp = cls(nn.Linear(4, 4), find_unused_parameters=True)
    y = ddp(_input(rank, 1))
    y.mul_(3)
    y.sum().backward()
    out["in-place edit grads"] = [p.grad.clone() for p in ddp.parameters()]
    return out


# --- when buckets are rebuilt -----------------------------------------------------------------

def _rebuilt(rank, cls):
    out = {}
    for kwargs in ({}, {"find_unused_parameters": True}, {"static_graph": True}):
        ddp = cls(_Branches(), **kwargs)
        for step in range(5):  # torch's static graph rebuilds after its second iteration
            ddp(_input(rank, step), True).sum().backward()
        out[str(kwargs)] = ddp._get_ddp_logging_data().get("has_rebuilt_buckets", 0)
    return out


CASES = {"used_maps": _used_maps, "buffer_hooks": _buffer_hooks, "param_mapping": _param_mapping,
         "sink_clone": _sink_clone, "rebuilt": _rebuilt, "errors_logged": _errors_logged}


def _every_case(rank, world_size):
    torch.set_num_threads(1)
    results = {}
    for name, case in CASES.items():
        for impl, cls in IMPLS.items():
            try:
                results[name, impl] = case(rank, cls)
            except Exception:  # noqa: BLE001 - reported by the test of that case, with its stack
                results[name, impl] = f"raised:\n{traceback.format_exc()}"
            dist.barrier()  # a case that failed on one rank must not shift the next one's calls
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_workers(_every_case, 2, timeout_s=180)


def _both(ranks, case):
    for rank, result in enumerate(ranks):
        mine, torchs = result[case, "ringtrain"], result[case, "torch"]
        assert not isinstance(torchs, str), torchs
        assert not isinstance(mine, str), mine
        yield rank, dict(mine), dict(torchs)  # copies: a test may take keys out


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_local_used_map_counts_the_ranks_that_used_each_parameter_as_torch(ranks):
    for _, mine, torchs in _both(ranks, "used_maps"):
        assert mine == torchs
        # Not vacuous: the counts follow the plan (lin2 on no rank, rank 1, none, both; then
        # only through rank 0's no_sync micro-step), int32 as torch's.
        assert mine["changing"]["maps"] == [[2, 0], [2, 1], [2, 0], [2, 2], [2, 1]]
        assert mine["changing"]["dtype"] == "torch.int32"
        assert mine["changing"]["live"] == [2, 1]
        assert mine["steady find_unused=False"]["maps"] == [None] * 3  # torch keeps none


def test_ddp_graph_static_says_whether_the_unused_parameters_changed_as_torch(ranks):
    for _, mine, torchs in _both(ranks, "used_maps"):
        assert [mine[k]["static"] for k in sorted(mine)] == [
            torchs[k]["static"] for k in sorted(torchs)]
        assert mine["changing"]["static"][-1] is False
        assert mine["steady find_unused=True"]["static"] == [True] * 3


@pytest.mark.parametrize("case", BUFFER_CASES)
def test_buffer_comm_hook_syncs_buffers_where_and_when_torchs_does(ranks, case):
    for _, mine, torchs in _both(ranks, "buffer_hooks"):
        assert _equal(mine[case], torchs[case]), case
    # Not vacuous: after a POST_FORWARD hook the ranks' buffers agree; before the next forward
    # moves them apart again (PRE_FORWARD), or with the hook off, they differ.
    _, where, sync = BUFFER_CASES[case]
    ours = [r["buffer_hooks", "ringtrain"][case] for r in ranks]
    synced = [torch.equal(a["after_backward"], b["after_backward"])
              for a, b in zip(*ours, strict=True)]
    assert synced == [where == "POST_FORWARD" and sync] * 3


def test_a_non_callable_buffer_hook_raises_torchs_assertion_error_and_a_type_error(ranks):
    for _, mine, torchs in _both(ranks, "buffer_hooks"):
        assert torchs["non-callable"] == ["AssertionError"]
        assert mine["non-callable"] == ["AssertionError", "TypeError"]


def test_param_to_name_mapping_and_its_errors_as_torch(ranks):
    for _, mine, torchs in _both(ranks, "param_mapping"):
        said = "<class 'ValueError'>: Param with name frozen.weight found in module parameters"
        for result in (mine, torchs):
            assert result.pop("extra logged")[0] == 1
            has_error, error = result.pop("missing logged")
            assert has_error == 1 and error.startswith(said), error
        assert mine == torchs
        assert mine["mapping"] == {0: ".scale", 1: "lin.weight", 2: "lin.bias",
                                   3: "frozen.weight"}
        assert (mine["extra"], mine["missing"]) == ("Expected param to name mapping to cover all "
                                                    "parameters, but got conflicting lengths",
                                                    "Param with name frozen")


def test_an_error_raised_after_construction_is_in_the_logging_data_as_torchs(ranks):
    for _, mine, torchs in _both(ranks, "errors_logged"):
        # torch's message ends there; ringtrain's goes on with the fix.
        said = "<class 'TypeError'>: Communication hook must be callable."
        assert (mine["after"][0], torchs["after"][0]) == (1, 1)
        assert mine["after"][1].startswith(said) and torchs["after"][1].startswith(said)
        del mine["after"], torchs["after"]
        assert mine == torchs  # no error before, TypeError raised, iteration 0


def test_outputs_are_never_cloned_and_can_be_edited_in_place(ranks):
    for _, mine, torchs in _both(ranks, "sink_clone"):
        assert torchs["clones, sink_clone=False"] == mine["clones, sink_clone=False"] == 0
        assert torchs["clones, sink_clone=True"] > 0  # what the switch saves in torch
        assert mine["clones, sink_clone=True"] == 0
        assert _equal(mine["in-place edit grads"], torchs["in-place edit grads"])


def test_buckets_are_rebuilt_when_torch_rebuilds_them(ranks):
    for _, mine, torchs in _both(ranks, "rebuilt"):
        assert mine == torchs == {"{}": 1, "{'find_unused_parameters': True}": 0,
                                  "{'static_graph': True}": 1}
