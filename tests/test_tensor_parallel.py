"""ringtrain.tensor_parallel against one process: 2 gloo ranks on the CPU, a tiny GPT, dropout 0.

    .venv/bin/pytest -q tests/test_tensor_parallel.py

Every rank also runs the unsplit model on the same batch: logits, loss, each parameter's
gradient (against the slice this rank holds) and 20 AdamW steps must agree to 1e-5 in fp32,
with and without sequence parallelism. The bytes each collective moves in one step are counted
by wrapping torch.distributed's calls and compared with `volumes.expected_bytes`.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from functools import partial

import pytest
import torch
import torch.distributed as dist
from support.scenarios import scenario_session
from torch import nn

from ringtrain import rings
from ringtrain.models import GPT, GPTConfig
from ringtrain.models.gpt import loss_fn
from ringtrain.tensor_parallel import (
    ColwiseParallel,
    HeadParallel,
    RowwiseParallel,
    VocabParallel,
    comm,
    expected_bytes,
    gpt_plan,
    naive,
    parallelize,
    ring_bytes_per_rank,
    shard_rows,
    vocab_parallel_cross_entropy,
)
from ringtrain.tensor_parallel.plan import _matches
from ringtrain.testing import run_workers

FULL = os.environ.get("RINGTRAIN_FULL") == "1"
CFG = GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
B, T = 2, 8
TOL = 1e-5


def _batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, CFG.vocab_size, (B, T), generator=g)
    targets[0, 0] = -1  # ignore_index: left out of the mean on both sides
    return idx, targets


def _models(sp: bool, config: GPTConfig = CFG, rg: bool = False):
    torch.manual_seed(0)
    full = GPT(config)
    return full, parallelize(copy.deepcopy(full), gpt_plan(sequence_parallel=sp,
                                                           recompute_gather=rg),
                             dist.group.WORLD)


def _my_slice(name: str, full: torch.Tensor, r: int, t: int) -> torch.Tensor:
    """What rank r of t should hold of the full tensor `name`, written out independently of
    the package's shard_rows."""
    C = CFG.n_embd
    if ".attn.c_attn." in name:  # q, k, v rows, each cut to this rank's heads
        q, k, v = full.split(C, dim=0)
        return torch.cat([m.chunk(t, dim=0)[r] for m in (q, k, v)])
    if name.endswith(("embed.wte.weight", "mlp.0.weight", "mlp.0.bias", "lm_head.weight")):
        return full.chunk(t, dim=0)[r]  # column-parallel / vocab rows
    if name.endswith(("attn.c_proj.weight", "mlp.2.weight")):
        return full.chunk(t, dim=1)[r]  # row-parallel: input columns
    return full  # replicated


def _errors(full: nn.Module, tp: nn.Module, rank: int, world_size: int, grads: bool) -> dict:
    want = dict(full.named_parameters())
    out = {}
    for name, p in tp.named_parameters():
        ref = want[name].grad if grads else want[name].detach()
        mine = p.grad if grads else p.detach()
        expect = _my_slice(name, ref, rank, world_size)
        assert mine.shape == expect.shape, (name, mine.shape, expect.shape)
        out[name] = (mine - expect).abs().max().item()
    assert set(out) == set(want), set(want) ^ set(out)
    return out


def _forward_backward(rank: int, world_size: int, sp: bool, rg: bool = False) -> dict:
    full, tp = _models(sp, rg=rg)
    idx, targets = _batch()
    logits = full(idx)
    loss = loss_fn(logits, targets)
    loss.backward()
    tp_logits = tp(idx)  # (B, T, V/t)
    tp_loss = vocab_parallel_cross_entropy(tp_logits, targets, dist.group.WORLD)
    tp_loss.backward()
    return {"logits": (tp_logits - logits.chunk(world_size, dim=-1)[rank]).abs().max().item(),
            "loss": abs(tp_loss.item() - loss.item()), "loss_value": tp_loss.item(),
            "grads": _errors(full, tp, rank, world_size, grads=True)}


def _adamw(rank: int, world_size: int, sp: bool, rg: bool = False) -> dict:
    # Without biases: the key projection's bias has a gradient of exactly 0 in exact arithmetic
    # (softmax is shift-invariant along a row), ~1e-11 of rounding noise in practice, which
    # Adam's normalisation turns into steps of random sign that differ between any two
    # summation orders. The gradient test above covers the biases.
    full, tp = _models(sp, dataclasses.replace(CFG, bias=False), rg=rg)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (full, tp)]
    losses = []
    for step in range(20):
        idx, targets = _batch(seed=100 + step % 2)  # two batches: it can learn them
        pair = (loss_fn(full(idx), targets),
                vocab_parallel_cross_entropy(tp(idx), targets, dist.group.WORLD))
        for loss, opt in zip(pair, opts, strict=True):
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append((pair[0].item(), pair[1].item()))
    return {"losses": losses, "params": _errors(full, tp, rank, world_size, grads=False)}


def _counted_bytes(rank: int, world_size: int, sp: bool, rg: bool = False) -> dict:
    """One step's bytes by collective, counted by wrapping torch.distributed's functions and
    the send/recv ring that replaces gloo's reduce-scatter (`ringtrain.rings`; its input is the
    whole, as `reduce_scatter_tensor`'s is)."""
    _, tp = _models(sp, rg=rg)
    idx, targets = _batch()
    counted = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    kinds = {(dist, "all_reduce"): ("all_reduce", 0),  # (what it counts, which argument: the whole)
             (dist, "all_gather_into_tensor"): ("all_gather", 0),
             (dist, "all_gather_single"): ("all_gather", 0),
             (dist, "reduce_scatter_tensor"): ("reduce_scatter", 1),
             (dist, "reduce_scatter_single"): ("reduce_scatter", 1),
             (rings, "reduce_scatter"): ("reduce_scatter", 1)}
    real = {(m, n): getattr(m, n) for m, n in kinds if hasattr(m, n)}

    def count(key, fn, which):
        def wrapper(*args, **kwargs):
            counted[key] += args[which].numel() * args[which].element_size()
            return fn(*args, **kwargs)
        return wrapper

    for (module, name), fn in real.items():
        setattr(module, name, count(kinds[module, name][0], fn, kinds[module, name][1]))
    try:
        vocab_parallel_cross_entropy(tp(idx), targets, dist.group.WORLD).backward()
    finally:
        for (module, name), fn in real.items():
            setattr(module, name, fn)
    return counted


def _reduce_scatter_equals_naive(rank: int, world_size: int) -> dict:
    """comm.reduce_scatter along the sequence (dim 1 of (B, T, C), fp32) against every rank's
    input summed here and sliced; on gloo it must have gone through the ring."""
    ring_calls = []
    real = rings.reduce_scatter
    rings.reduce_scatter = lambda *a, **k: ring_calls.append(1) or real(*a, **k)
    errors = {}
    try:
        for shape in [(2, 6, 4), (3, 12, 5), (1, 6, 1), (4, 24, 16)]:
            xs = [torch.randn(*shape, generator=torch.Generator().manual_seed(10 * r + shape[0]))
                  for r in range(world_size)]  # every rank's input, made on each rank
            want = torch.stack(xs).sum(0).chunk(world_size, dim=1)[rank]
            got = comm.reduce_scatter(xs[rank], 1, dist.group.WORLD)
            same = got.shape == want.shape
            errors[shape] = (got - want).abs().max().item() if same else float("inf")
        # A non-contiguous input (a transposed view): the front-moved copy is what travels.
        x = torch.randn(6, 3, 4, generator=torch.Generator().manual_seed(rank)).transpose(0, 1)
        xs = [torch.randn(6, 3, 4, generator=torch.Generator().manual_seed(r)).transpose(0, 1)
              for r in range(world_size)]
        got = comm.reduce_scatter(x, 1, dist.group.WORLD)
        errors["transposed"] = (got - sum(xs).chunk(world_size, dim=1)[rank]).abs().max().item()
    finally:
        rings.reduce_scatter = real
    return {"errors": errors, "ring_calls": len(ring_calls)}


def _versus_dtensor(rank: int, world_size: int) -> dict:
    """Our column-then-row MLP next to torch's DTensor parallelize_module on the same weights."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    theirs = parallelize_module(copy.deepcopy(mlp), DeviceMesh.from_group(dist.group.WORLD, "cpu"),
                                {"0": TorchColwise(), "2": TorchRowwise()})
    ours = parallelize(copy.deepcopy(mlp), {"0": ColwiseParallel(), "2": RowwiseParallel()},
                       dist.group.WORLD)
    x = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(3))
    y_ours, y_theirs = ours(x), theirs(x)
    y_ours.square().sum().backward()
    y_theirs.square().sum().backward()
    local = theirs[0].weight.grad.to_local()  # DTensor's shard of the column weight's gradient
    return {"out": (y_ours - y_theirs).abs().max().item(),
            "grad": (ours[0].weight.grad - local).abs().max().item()}


def _checkpointed_accumulated(rank: int, world_size: int) -> dict:
    """SP + recompute_gather inside activation-checkpointed blocks (the recompute repeats the
    forward's collectives on every rank), gradients accumulated over two backwards."""
    full, tp = _models(True, dataclasses.replace(CFG, activation_checkpointing=True), rg=True)
    idx, targets = _batch()
    for _ in range(2):
        loss_fn(full(idx), targets).backward()
        vocab_parallel_cross_entropy(tp(idx), targets, dist.group.WORLD).backward()
    return _errors(full, tp, rank, world_size, grads=True)


def _uneven_sequence(rank: int, world_size: int) -> str:
    """A sequence of 7 tokens on 2 sequence-parallel ranks: every rank raises, none hangs."""
    _, tp = _models(sp=True)
    idx, _ = _batch()
    try:
        tp(idx[:, :7])
    except ValueError as e:
        return str(e)
    return "no error"


MODES = ["tp", "sp", "sp_rg"]  # sp_rg: sequence parallel, the input gathered again in backward
SCENARIOS = {
    "tp": partial(_forward_backward, sp=False),
    "sp": partial(_forward_backward, sp=True),
    "adamw_tp": partial(_adamw, sp=False),
    "adamw_sp": partial(_adamw, sp=True),
    "bytes_tp": partial(_counted_bytes, sp=False),
    "bytes_sp": partial(_counted_bytes, sp=True),
    "sp_rg": partial(_forward_backward, sp=True, rg=True),
    "bytes_sp_rg": partial(_counted_bytes, sp=True, rg=True),
    "dtensor": _versus_dtensor,
    "uneven_sequence": _uneven_sequence,
    "checkpointed_accumulated": _checkpointed_accumulated,
    "reduce_scatter": _reduce_scatter_equals_naive,
}


@pytest.fixture(scope="module")
def sessions():
    return scenario_session(SCENARIOS, world_size=2)


# tp 4: every split is 4-way (heads 4, vocab 16, hidden 128, T 8); the 20 steps only in full.
FOUR = ["tp", "sp", "sp_rg", "bytes_sp_rg"] + (["adamw_sp"] if FULL else [])


@pytest.fixture(scope="module")
def sessions4():
    return scenario_session({name: SCENARIOS[name] for name in FOUR}, world_size=4)


@pytest.mark.slow
@pytest.mark.parametrize("name", FOUR)
def test_four_ranks_equal_one_process(sessions4, name):
    """gloo, CPU, 4 ranks (reduced unless RINGTRAIN_FULL=1): gradients, bytes and (full) 20
    AdamW steps as on 2 ranks."""
    for rank, res in enumerate(sessions4(name)):
        if name.startswith("bytes"):
            assert res == expected_bytes(n_layer=CFG.n_layer, n_embd=CFG.n_embd, batch=B, seq=T,
                                         sequence_parallel=True, recompute_gather=True)
            continue
        errors = res["params"] if name.startswith("adamw") else res["grads"]
        bad = {n: e for n, e in errors.items() if not e < TOL}
        assert bad == {} and res.get("logits", 0) < TOL, (rank, bad, res.get("logits"))


@pytest.mark.parametrize("mode", MODES)
def test_forward_and_every_gradient_equal_one_process(sessions, mode):
    """gloo, CPU, 2 ranks: logits (this rank's vocab slice), loss, and each parameter's gradient
    (this rank's slice) equal the single-process GPT's on the same batch."""
    for rank, res in enumerate(sessions(mode)):
        assert res["logits"] < TOL, (rank, res["logits"])
        assert res["loss"] < TOL, (rank, res["loss"])
        bad = {n: e for n, e in res["grads"].items() if not e < TOL}
        assert bad == {}, (rank, bad)
    assert len(res["grads"]) == len(list(GPT(CFG).parameters()))


@pytest.mark.parametrize("mode", ["tp", "sp"])  # sp_rg: its gradients are equal (above)
def test_twenty_adamw_steps_match_one_process(sessions, mode):
    """gloo, CPU, 2 ranks: after 20 AdamW steps every parameter slice equals one process's."""
    for rank, res in enumerate(sessions(f"adamw_{mode}")):
        bad = {n: e for n, e in res["params"].items() if not e < TOL}
        assert bad == {}, (rank, bad)
        first, last = res["losses"][0], res["losses"][-1]
        assert last[0] < first[0] - 0.1, res["losses"]  # it trained: a test of something
        assert all(abs(a - b) < TOL for a, b in res["losses"]), res["losses"]


@pytest.mark.parametrize("mode", MODES)
def test_counted_bytes_equal_the_textbook_formula(sessions, mode):
    """gloo, CPU, 2 ranks: per layer 2 + 2 all-reduces of b*s*h (tp), or as many all-gathers and
    reduce-scatters (sp; sp_rg: 2 more all-gathers in backward); counted on torch.distributed's
    calls."""
    want = expected_bytes(n_layer=CFG.n_layer, n_embd=CFG.n_embd, batch=B, seq=T,
                          sequence_parallel=mode != "tp", recompute_gather=mode == "sp_rg")
    for counted in sessions(f"bytes_{mode}"):
        assert counted == want


def test_same_result_as_torch_dtensor_tensor_parallel(sessions):
    """gloo, CPU, 2 ranks: our ColwiseParallel/RowwiseParallel MLP equals DTensor's."""
    for res in sessions("dtensor"):
        assert res["out"] < TOL and res["grad"] < TOL, res


def test_checkpointed_blocks_and_accumulated_gradients_equal_one_process(sessions):
    """gloo, CPU, 2 ranks: activation checkpointing and two accumulated backwards under SP."""
    for rank, errors in enumerate(sessions("checkpointed_accumulated")):
        bad = {n: e for n, e in errors.items() if not e < TOL}
        assert bad == {}, (rank, bad)


def test_a_sequence_that_does_not_split_fails_on_every_rank_with_the_fix(sessions):
    """gloo, CPU, 2 ranks: T=7 under sequence parallelism is refused before any collective."""
    for message in sessions("uneven_sequence"):
        assert "into 2 equal parts" in message and "use T=6" in message, message


@pytest.mark.parametrize("world_size", [2, 3])
def test_sequence_reduce_scatter_on_gloo_is_the_ring_and_equals_sum_then_slice(sessions,
                                                                             world_size):
    """gloo, CPU, 2 and 3 ranks: comm.reduce_scatter of (B, T, C) along T, fp32, several
    shapes, equals the sum of every rank's input sliced to this rank's T / t, through the
    send/recv ring (gloo's reduce_scatter_tensor is ~4x slower)."""
    results = (sessions("reduce_scatter") if world_size == 2 else
               run_workers(_reduce_scatter_equals_naive, world_size, timeout_s=60))
    for rank, res in enumerate(results):
        assert res["ring_calls"] == 5, (rank, res)
        bad = {k: e for k, e in res["errors"].items() if not e < 1e-6}
        assert bad == {}, (rank, bad)


# ---- in-process: no ranks -------------------------------------------------------------------

@pytest.mark.parametrize("tp", [2, 4])
def test_naive_reference_equals_the_unsplit_computation(tp):
    """The one-process simulation of t ranks (naive.py) against the plain math."""
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = (torch.randn(*s, generator=g) for s in ((2, 8, 16), (64, 16), (16, 64)))
    full = torch.nn.functional.gelu(x @ w1.T) @ w2.T
    assert torch.allclose(naive.mlp(x, w1, w2, tp), full, atol=TOL)
    assert torch.allclose(torch.cat(naive.mlp_sequence_parallel(x, w1, w2, tp), dim=1), full,
                          atol=TOL)
    logits, targets = torch.randn(10, 32, generator=g), torch.randint(0, 32, (10,), generator=g)
    want = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    assert torch.allclose(naive.cross_entropy(logits, targets, tp), want, atol=TOL)


def test_shard_rows_splits_each_fused_block():
    w = torch.arange(12.0).reshape(12, 1)  # q = 0..3, k = 4..7, v = 8..11
    assert shard_rows(w, 1, 2, chunks=3).flatten().tolist() == [2, 3, 6, 7, 10, 11]
    assert shard_rows(w, 0, 3).flatten().tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="cannot be split evenly across tp=5"):
        shard_rows(w, 0, 5)


def test_plan_patterns_match_one_name_part_per_star():
    assert _matches("blocks.*.attn", "blocks.3.attn")
    assert not _matches("blocks.*.attn", "blocks.3.inner.attn")
    assert not _matches("blocks.*", "blocks.3.attn")


def test_plan_errors_name_the_entry_and_the_fix():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="'blocks.*.mlp.9' matches no module of GPT"):
        parallelize(GPT(CFG), {"blocks.*.mlp.9": ColwiseParallel()}, group=None)
    with pytest.raises(TypeError,
                       match="ColwiseParallel takes nn.Linear modules, but 'blocks.0.ln_1'"):
        parallelize(GPT(CFG), {"blocks.0.ln_1": ColwiseParallel()}, group=None)
    with pytest.raises(TypeError, match="HeadParallel needs an attention module"):
        parallelize(GPT(CFG), {"blocks.0.mlp": HeadParallel()}, group=None)


def test_a_tied_parameter_is_split_alike_for_every_user_or_refused(single_process):
    """The GPT's tied embeddings: one slice of rows, the vocab-parallel embedding's and the
    column-parallel lm_head's (the 2-rank equality: tests/test_tp_strategy.py)."""
    tied = GPT(GPTConfig(vocab_size=16, block_size=8, n_embd=32, tie_embeddings=True))
    whole = tied.embed.wte.weight.detach().clone()
    model = parallelize(tied, gpt_plan(), group=None)
    assert model.head.lm_head.weight is model.embed.wte.weight
    assert torch.equal(model.embed.wte.weight, whole)
    assert len(list(model.parameters())) == len(list(GPT(CFG).parameters())) - 1
    tied = GPT(GPTConfig(vocab_size=16, block_size=8, n_embd=32, tie_embeddings=True))
    with pytest.raises(ValueError, match=r"\['embed.wte.weight', 'head.lm_head.weight'\] are one "
                       r"parameter \(tied embeddings\?\), and the plan splits it for some"):
        parallelize(tied, {"embed.wte": VocabParallel()}, group=None)


def test_sequence_parallel_moves_the_same_activation_bytes():
    """A ring all-reduce is a reduce-scatter plus an all-gather: SP's activation traffic per rank
    equals TP's (the difference is the small, parameter-sized gradient sums)."""
    kw = dict(n_layer=3, n_embd=64, batch=4, seq=16)
    tp, sp = expected_bytes(**kw, sequence_parallel=False), expected_bytes(**kw,
                                                                          sequence_parallel=True)
    a = 4 * 16 * 64 * 4
    assert tp["all_reduce"] == a * (4 * 3 + 2) + 3 * 4 * 16 * 4
    ring = {k: sum(ring_bytes_per_rank(op, n, 4) for op, n in d.items())
            for k, d in (("tp", tp), ("sp", sp))}
    sp_params = (3 * 6 * 64 + 2 * 64) * 4
    # SP: one extra all-gather of a (the embedding's split, backward) against the embedding's
    # all-reduce that SP keeps as well; and the parameter-gradient sums.
    assert ring["sp"] - ring["tp"] == pytest.approx(ring_bytes_per_rank("all_gather", a, 4)
                                                    + ring_bytes_per_rank("all_reduce",
                                                                          sp_params, 4))
