"""Pipeline x tensor x data parallelism on one grid (`--strategy pipeline --tp`), against one
process.

    .venv/bin/pytest -q tests/test_grid_equivalence.py

CPU, gloo, a tiny GPT (2 layers, n_embd 16, dropout 0), fp32, the same global batch, gradient
clipping small enough to act on every step. On 4 ranks (one worker start for all scenarios):
tp 2 x pp 2 under 1F1B, under GPipe and ZB-H1 with sequence parallelism, ZB-H1 with it and
`recompute_gather` (with RINGTRAIN_FULL=1
also interleaved 1F1B, 2 chunks per rank, with it, ZB-H1 and ZB-V, ZB-V with it): 3 AdamW
steps (RINGTRAIN_FULL=1: 20, the GPT without biases) equal one process's (allclose 1e-5);
the 1F1B run's snapshot in the layout-free form equals the one-process run's parameters and
AdamW moments, and resumes on one process (tp 2 x pp 2 -> ddp) and back (ddp -> tp 2 x pp 2),
both going on equal to one process.
On 8 ranks over two network-namespace hosts (4 ranks each, `tests/netns.py`): dp 2 x pp 2 x
tp 2 with sequence parallelism, the GPT without biases, equal to one process (2 steps; 20 with
RINGTRAIN_FULL=1); skipped, with the reason, where
namespaces cannot be made. The grid's index math: tests/test_grid.py; the bit-identical resume
through `Trainer`: tests/test_strategy_contract.py.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ringtrain.data.addition import AdditionDataset
from ringtrain.models import GPT, GPTConfig, loss_fn
from ringtrain.runtime import get_runtime
from ringtrain.strategies import make_strategy
from ringtrain.strategies.pipeline import PipelineStrategy
from ringtrain.testing import run_workers
from ringtrain.training.config import adamw

FULL = os.environ.get("RINGTRAIN_FULL") == "1"
DIGITS = 2  # block_size 6: the sequence splits over tp 2 (sequence parallelism)
MODEL = GPTConfig(vocab_size=10, block_size=6, n_layer=2, n_head=2, n_embd=16)
LR, CLIP, BATCH = 1e-2, 0.05, 8  # global batch; a clip small enough to act on every step
# Issue 27's 20 steps with RINGTRAIN_FULL=1, the GPT then without biases (the 8-rank test's
# HOST_MODEL: Adam turns the rounding noise of an exactly-zero bias gradient into steps of
# random sign); 3 steps in the suite.
STEPS = 20 if FULL else 3
GRID_MODEL = dataclasses.replace(MODEL, bias=False) if FULL else MODEL
REPO = Path(__file__).resolve().parent.parent

# name -> the pipeline strategy's options on 4 ranks (tp 2 x pp 2)
# (the other schedules: with RINGTRAIN_FULL=1, out of the suite's time)
SCENARIOS = {
    "1f1b": {"pp": 2, "tp": 2, "schedule": "1f1b", "microbatches": 4},
    "gpipe-sp": {"pp": 2, "tp": 2, "schedule": "gpipe", "microbatches": 2,
                 "sequence_parallel": True},
    # The split backward's weight pass with sequence parallelism's hooks (the norms' gradient
    # sum over tp): run once each, not twice (tests/test_pipeline_backward.py counts them).
    "zb-h1-sp": {"pp": 2, "tp": 2, "schedule": "zb-h1", "microbatches": 2,
                 "sequence_parallel": True},
    # --recompute-gather: the column layers' input all-gathered again in the split backward
    # (gpipe, 1F1B, interleaved and ZB-V with it too, checked once by hand in session 33), on
    # every torch: 2.11 and 2.12 refused the weight pass's hook on the regathering layer's
    # node until the pass held the stage's output (pipeline.backward.WeightPass.root).
    "zb-h1-sp-regather": {"pp": 2, "tp": 2, "schedule": "zb-h1", "microbatches": 2,
                          "sequence_parallel": True, "recompute_gather": True},
} | (
    {"interleaved-sp": {"pp": 2, "tp": 2, "schedule": "interleaved", "virtual_stages": 2,
                        "sequence_parallel": True},
     "zb-h1": {"pp": 2, "tp": 2, "schedule": "zb-h1"},
     "zb-v": {"pp": 2, "tp": 2, "schedule": "zb-v"},
     "zb-v-sp": {"pp": 2, "tp": 2, "schedule": "zb-v", "sequence_parallel": True}}
    if FULL else {})


def _batches(steps):
    data = AdditionDataset("train", DIGITS)
    return [(torch.stack([data[i][0] for i in range(s * BATCH, (s + 1) * BATCH)]),
             torch.stack([data[i][1] for i in range(s * BATCH, (s + 1) * BATCH)]))
            for s in range(steps)]


def _train(options, steps, model=MODEL):
    """This rank's strategy after `steps` clipped AdamW steps; replica d reads every dp-th
    sample of each global batch (the mean of equal parts' means is the global mean)."""
    torch.manual_seed(0)
    s = make_strategy("pipeline", runtime=get_runtime(), **options)
    s.setup(GPT(model), adamw(0.1), loss_fn)
    d, dp = s.data_rank, s.data_world_size
    batches = [(x[d::dp], y[d::dp]) for x, y in _batches(steps + 1)]
    for x, y in batches[:steps]:
        s.train_step([(x, y)], lr=LR, grad_clip=CLIP)
    return s, batches


def _grid_worker(rank, world_size, reference_portable):
    out = {}
    for name, options in SCENARIOS.items():
        s, batches = _train(options, STEPS, GRID_MODEL)
        out[name] = {"after": s.model_state_dict()}
        if name == "1f1b":
            out[name]["state"] = copy.deepcopy(s.state_dict())  # a snapshot, as written
            s.load_portable_state_dict(reference_portable)  # one process's, after STEPS
            s.train_step([batches[STEPS]], lr=LR, grad_clip=CLIP)
            out[name]["one_more"] = s.model_state_dict()
        s.close()
    return out


def _close(a, b, what):
    assert a.keys() == b.keys(), what
    for k in a:
        # 1e-5 (issue 27's bound): AdamW's step is sign-like where a moment is near 0, so a
        # sum in another order moves a weight by up to ~lr * 1e-4 there.
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, k=k: f"{what}: {k}: {m}")


def _one_process(runtime, steps, model=MODEL):
    torch.manual_seed(0)
    one = make_strategy("ddp", runtime=runtime)
    one.setup(GPT(model), adamw(0.1), loss_fn)
    for x, y in _batches(steps):
        one.train_step([(x, y)], lr=LR, grad_clip=CLIP)
    return one


def test_tp2_x_pp2_equals_one_process_and_resumes_on_another_tp_degree(single_process):
    one = _one_process(single_process, STEPS, GRID_MODEL)
    one_after = {k: v.clone() for k, v in one.model_state_dict().items()}
    one_state = copy.deepcopy(one.state_dict())
    reference = one.to_portable(lambda r: {}, one_state, {"world_size": 1})
    # Under RINGTRAIN_DEBUG=collectives: the tp, pp and dp groups' collectives agree across
    # ranks (the contract test's seam check, for this layout).
    out = run_workers(_grid_worker, 4, args=(reference,), timeout_s=150,
                      env={"RINGTRAIN_DEBUG": "collectives", "RINGTRAIN_DEBUG_TIMEOUT": "60"})
    for name in SCENARIOS:
        for r in out:  # model_state_dict: every rank holds the whole model, gathered
            _close(r[name]["after"], one_after, f"tp 2 x pp 2 {name}, {STEPS} steps")
    one.train_step([_batches(STEPS + 1)[STEPS]], lr=LR, grad_clip=CLIP)
    one_more = one.model_state_dict()
    for r in out:
        _close(r["1f1b"]["one_more"], one_more, "ddp -> tp 2 x pp 2, one more step")

    # tp 2 x pp 2's snapshot, layout-free: one process's parameters and AdamW moments ...
    portable = PipelineStrategy.to_portable(
        lambda ranks: {r: out[r]["1f1b"]["state"] for r in ranks}, None, {"world_size": 4})
    _close(portable["model"], {k: one_after[k] for k in portable["model"]},
           "tp 2 x pp 2 -> portable model")
    assert portable["optimizer"]["state"].keys() == reference["optimizer"]["state"].keys()
    for name, entry in reference["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(portable["optimizer"]["state"][name][key], entry[key],
                                       rtol=1e-4, atol=1e-7, msg=f"{name}.{key}")
    # ... which resumes on tp 1 (one process) and goes on equal to it.
    torch.manual_seed(1)  # another init: the load must replace every parameter
    again = make_strategy("ddp", runtime=single_process)
    again.setup(GPT(GRID_MODEL), adamw(0.1), loss_fn)
    again.load_portable_state_dict(portable)
    again.train_step([_batches(STEPS + 1)[STEPS]], lr=LR, grad_clip=CLIP)
    _close(again.model_state_dict(), one_more, "tp 2 x pp 2 -> ddp, one more step")


# -- 8 ranks over two hosts: dp 2 x pp 2 x tp 2 -------------------------------------------------

HOST_STEPS = 20 if FULL else 2
# Without biases: the key projection's bias has a gradient of exactly 0 in exact arithmetic
# (softmax is shift-invariant along a row), rounding noise in practice, which Adam turns into
# steps of random sign that differ between summation orders (4e-5 after 20 steps; as
# tests/test_tensor_parallel.py's 20 steps). The 4-rank test above keeps them in the suite.
HOST_MODEL = dataclasses.replace(MODEL, bias=False)
GRID8 = {"pp": 2, "tp": 2, "schedule": "1f1b", "microbatches": 2, "sequence_parallel": True}


def _host_rank(local_rank, _local_world, node_rank, master, port, ifname):
    """One of a host's 4 ranks joining the 8-rank job at `master:port` (gloo over `ifname`:
    the namespaces' hostname resolves to 127.0.0.1, which the other host cannot reach)."""
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    rank = node_rank * 4 + local_rank
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank,
                            world_size=8)
    try:
        s, _ = _train(GRID8, HOST_STEPS, HOST_MODEL)
        c = s.grid.coords(rank)
        after = s.model_state_dict()
        s.close()
        return {"coords": tuple(c), "tp_ranks": s.groups.tp_ranks, "after": after}
    finally:
        dist.destroy_process_group()


def _host_child(local_rank, node_rank, master, port, ifname, out) -> None:
    torch.set_num_threads(1)
    try:
        buf = io.BytesIO()  # bytes, not tensors: torch would pass those as fds of this process
        torch.save(_host_rank(local_rank, 4, node_rank, master, port, ifname), buf)
        out.put((local_rank, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - the host reports it, naming the rank
        import traceback

        out.put((local_rank, traceback.format_exc()))


def host_main(node_rank: int, master: str, port: int, ifname: str, out: str) -> None:
    """`python tests/test_grid_equivalence.py NODE MASTER PORT IFNAME OUT`: a host's 4 ranks,
    forked from this process (torch imported once per host, no worker server to start)."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_host_child, args=(r, node_rank, master, port, ifname, results),
                         daemon=True) for r in range(4)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < 4:
            r, value = results.get(timeout=150)
            if isinstance(value, str):
                raise RuntimeError(f"host {node_rank}, local rank {r} raised:\n{value}")
            got[r] = torch.load(io.BytesIO(value))
    except queue.Empty:
        raise RuntimeError(f"host {node_rank}: ranks {sorted(set(range(4)) - set(got))} did "
                           "not finish within 150 s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    torch.save([got[r] for r in range(4)], out)


@pytest.mark.multinode
def test_dp2_x_pp2_x_tp2_on_two_hosts_equals_one_process(single_process, tmp_path):
    from netns import two_hosts, unavailable

    why = unavailable()
    if why:
        pytest.skip(f"two hosts need network namespaces: {why}")
    port = 29000 + uuid.uuid4().int % 2000
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}",
           "PYTHONUNBUFFERED": "1"}
    with two_hosts() as (a, b):
        procs = [h.popen([sys.executable, __file__, str(n), a.addr, str(port), h.ifname,
                          str(tmp_path / f"host{n}.pt")], env=env, cwd=str(tmp_path),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for n, h in enumerate((a, b))]
        logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-4000:]
    results = [r for n in (0, 1) for r in torch.load(tmp_path / f"host{n}.pt")]
    # tp innermost: a tp group never leaves its host; the replicas (dp) are the two hosts.
    assert [r["coords"] for r in results][:4] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert all(len({q // 4 for q in r["tp_ranks"]}) == 1 for r in results)
    one = _one_process(single_process, HOST_STEPS, HOST_MODEL)
    for r in results:
        _close(r["after"], one.model_state_dict(), f"dp 2 x pp 2 x tp 2, {HOST_STEPS} steps")


if __name__ == "__main__":
    host_main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])


def _tied_worker(rank, world_size, reference_portable):
    s, batches = _train({"pp": 2, "tp": 2, "schedule": "1f1b", "microbatches": 4,
                         "sequence_parallel": True}, STEPS, TIED)
    out = {"after": s.model_state_dict(), "state": copy.deepcopy(s.state_dict())}
    s.load_portable_state_dict(reference_portable)  # one process's, after STEPS
    s.train_step([batches[STEPS]], lr=LR, grad_clip=CLIP)
    out["one_more"] = s.model_state_dict()
    s.close()
    return out


TIED = dataclasses.replace(MODEL, tie_embeddings=True)


def test_tied_embeddings_on_tp2_x_pp2_equal_one_process_and_resume_both_ways(single_process):
    """GPT-2's tie under --pp 2 --tp 2: the embedding (stage 0) and the lm_head (stage 1) hold
    one slice of rows each on tp rank t, summed by the tie's group of those two ranks."""
    one = _one_process(single_process, STEPS, TIED)
    one_after = {k: v.clone() for k, v in one.model_state_dict().items()}
    reference = one.to_portable(lambda r: {}, copy.deepcopy(one.state_dict()), {"world_size": 1})
    one.train_step([_batches(STEPS + 1)[STEPS]], lr=LR, grad_clip=CLIP)
    out = run_workers(_tied_worker, 4, args=(reference,), timeout_s=150)
    for r in out:
        _close(r["after"], one_after, "tied, pp 2 x tp 2")
        _close(r["one_more"], one.model_state_dict(), "tied, one process -> pp 2 x tp 2")
    portable = PipelineStrategy.to_portable(lambda ranks: {k: out[k]["state"] for k in ranks},
                                            None, {"world_size": 4})
    ddp = make_strategy("ddp", runtime=single_process)
    ddp.setup(GPT(TIED), adamw(0.1), loss_fn)
    ddp.load_portable_state_dict(portable)
    _close(ddp.model_state_dict(), one_after, "tied, pp 2 x tp 2 -> one process")
