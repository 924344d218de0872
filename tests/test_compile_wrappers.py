"""ringtrain's DistributedDataParallel and ZeroDataParallel under torch.compile, both ways.

    .venv/bin/pytest -q tests/test_compile_wrappers.py

gloo and the CPU: one-rank groups in this process, two ranks through `run_workers`.
`torch.compile(DDP(model))` is torch's own spelling of a compiled DDP (and FSDP's); nanoGPT
writes `DDP(torch.compile(model))`. Compiled with a counting backend (dynamo only, no C++
compiler): every graph is built in the first steps and never again, and the parameters equal
the eager wrapper's. Before the wrappers' bookkeeping ran eagerly (`ringtrain.ddp.eager`), the
outer DDP recompiled at every step up to dynamo's limit (8), and the outer ZeRO 3's backward
called the module with no input (a traced tensor hook rebuilt wrong).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ringtrain.ddp.distributed import DistributedDataParallel as Ours
from ringtrain.models import GPT, GPTConfig
from ringtrain.testing import run_workers
from ringtrain.zero.sharded import ZeroDataParallel

STEPS = 12  # past dynamo's recompile limit (8)


class _Counting:
    """A torch.compile backend that runs each graph as traced and counts the graphs."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        return gm.forward


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))


def _train(wrap: str, group, rank: int, cls=Ours) -> tuple[list[torch.Tensor], list[int]]:
    """STEPS SGD steps; the parameters and the graphs compiled so far after each step."""
    net, backend = _net(), _Counting()
    if wrap == "outer":
        model = torch.compile(cls(net, process_group=group), backend=backend)
    elif wrap == "inner":
        model = cls(torch.compile(net, backend=backend), process_group=group)
    else:
        model = cls(net, process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    graphs = []
    for _ in range(STEPS):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        opt.step()
        graphs.append(backend.graphs)
    return [p.detach().clone() for p in net.parameters()], graphs


@pytest.mark.parametrize("wrap", ["outer", "inner"])
def test_compiled_once_and_the_same_parameters_as_eager(wrap, caplog):
    torch._dynamo.reset()  # no graph of another test's model in the cache
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
        params, graphs = _train(wrap, group, 0)
    eager, _ = _train("eager", group, 0)
    assert graphs[0] >= 1 and graphs[-1] == graphs[2], graphs  # nothing compiled after step 3
    assert not [r for r in caplog.records if "recompile" in r.getMessage()]
    assert all(torch.equal(a, b) for a, b in zip(params, eager, strict=True))


def _two_ranks(rank: int, world_size: int, wrap: str):
    torch.set_num_threads(1)
    ours, graphs = _train(wrap, dist.group.WORLD, rank)
    theirs, _ = _train(wrap, dist.group.WORLD, rank, cls=nn.parallel.DistributedDataParallel)
    return ours, theirs, graphs


def test_compiled_wrapper_averages_as_torchs_compiled_ddp_on_two_ranks():
    out = run_workers(_two_ranks, 2, ("outer",), timeout_s=120)
    (ours0, theirs0, graphs), (ours1, _, _) = out
    assert graphs[-1] == graphs[2], graphs
    assert all(torch.equal(a, b) for a, b in zip(ours0, ours1, strict=True))  # replicas agree
    for a, b in zip(ours0, theirs0, strict=True):  # each rank's batch differs: averaged alike
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _zero(rank: int, world_size: int, stage: int, wrap: str):
    """A GPT under ZeroDataParallel, compiled `wrap` and eager: parameters and graph counts."""
    torch.set_num_threads(1)
    out = {}
    for how in (wrap, "eager"):
        torch.manual_seed(0)
        net, backend = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2,
                                     n_embd=16)), _Counting()
        def sgd(ps):
            return torch.optim.SGD(ps, lr=0.1)
        inner = torch.compile(net, backend=backend) if how == "inner" else net
        zero = ZeroDataParallel(inner, sgd, stage=stage)
        model = torch.compile(zero, backend=backend) if how == "outer" else zero
        gen, graphs = torch.Generator().manual_seed(rank), []
        for _ in range(STEPS):
            zero.optimizer.zero_grad()
            logits = model(torch.randint(0, 16, (4, 8), generator=gen))
            logits.pow(2).mean().backward()
            zero.optimizer.step()
            graphs.append(backend.graphs)
        out[how] = (zero.full_state_dict(), graphs)
    return out


@pytest.mark.parametrize("stage, wrap", [(1, "outer"), (3, "outer"), (3, "inner")])
def test_zero_compiled_equals_eager_on_two_ranks(stage, wrap):
    for rank_out in run_workers(_zero, 2, (stage, wrap), timeout_s=120):
        (compiled, graphs), (eager, _) = rank_out[wrap], rank_out["eager"]
        assert graphs[0] >= 1 and graphs[-1] == graphs[2], graphs
        # (inner: the keys of torch's compiled module, `_orig_mod.` first, as torch names them)
        assert [k.removeprefix("_orig_mod.") for k in compiled] == list(eager)
        assert all(torch.equal(a, b) for a, b in zip(compiled.values(), eager.values(),
                                                      strict=True))
