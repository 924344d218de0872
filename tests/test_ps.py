"""The parameter server end to end on local gloo ranks (workers first, servers last).

    .venv/bin/pytest -q tests/test_ps.py

Every multi-process test goes through `run_workers` (bounded; a rank's traceback is re-raised).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from support.faults import fault_env
from torch import nn

from ringtrain.ps.protocol import PSError, PSTopology
from ringtrain.runtime import Runtime, get_runtime
from ringtrain.strategies import make_strategy
from ringtrain.strategies.ps import PSStrategy
from ringtrain.strategies.ps_config import ASYNC_BETA1  # what `--ps-mode async` uses
from ringtrain.testing import run_workers

BATCH = 4


def _trains(s) -> bool:
    """A worker rank (not a parameter server): it reads data and steps."""
    return not s.topology.is_server(s.runtime.rank)


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(),
                         nn.Linear(24, 3))


def batch(step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)


def mse(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(logits, targets)


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.0, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.0, weight_decay=0.1),
}
LRS = [0.05, 0.1, 0.02, 0.08, 0.05]


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def reference(optimizer: str, workers: int, steps: int, grad_clip: float | None) -> dict:
    """One process on the concatenated global batch."""
    model = tiny_model()
    opt = OPTIMIZERS[optimizer](model.parameters())
    for step in range(steps):
        xs, ys = zip(*(batch(step, w) for w in range(workers)), strict=True)
        opt.zero_grad()
        mse(model(torch.cat(xs)), torch.cat(ys)).backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        for g in opt.param_groups:
            g["lr"] = LRS[step % len(LRS)]
        opt.step()
    return params_of(model)


def ps_strategy(mode: str, servers: int, optimizer: str = "sgd", **options) -> PSStrategy:
    strategy = make_strategy("ps", runtime=get_runtime(), servers=servers, mode=mode, **options)
    strategy.setup(tiny_model(), OPTIMIZERS[optimizer], mse)
    return strategy


# -- sync equals data parallel -------------------------------------------------------------------
def _sync_vs_ddp(rank, world_size, servers, steps, grad_clip):
    workers = world_size - servers
    worker_group = dist.new_group(list(range(workers)))  # every rank creates it, in order
    out = {}
    for optimizer in OPTIMIZERS:
        # split_numel splits the 24x24 matrix across servers; bucket_numel=64 makes many push
        # buckets, so gradients leave from the hooks while backward still runs.
        s = ps_strategy("sync", servers, optimizer, split_numel=100, bucket_numel=64)
        for step in range(steps):
            micro = [batch(step, rank)] if _trains(s) else []
            s.train_step(micro, lr=LRS[step % len(LRS)], grad_clip=grad_clip)
        out[optimizer] = s.model_state_dict()
        s.close()
        out["stats"] = s.stats()
        if _trains(s):  # torch's DDP on the workers alone, same batches
            model = tiny_model()
            ddp = nn.parallel.DistributedDataParallel(model, process_group=worker_group)
            opt = OPTIMIZERS[optimizer](model.parameters())
            for step in range(steps):
                opt.zero_grad()
                mse(ddp(batch(step, rank)[0]), batch(step, rank)[1]).backward()
                if grad_clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
                for g in opt.param_groups:
                    g["lr"] = LRS[step % len(LRS)]
                opt.step()
            out[f"ddp_{optimizer}"] = params_of(model)
    # The naive reference path: push everything after backward (no hooks, one bucket each).
    s = ps_strategy("sync", servers, "sgd", split_numel=100)
    for step in range(steps):
        if _trains(s):
            s.module.zero_grad()
            mse(s.module(batch(step, rank)[0]), batch(step, rank)[1]).backward()
            s.worker.push_pull(lr=LRS[step % len(LRS)], grad_clip=grad_clip)
    out["naive_sgd"] = s.model_state_dict()
    s.close()
    return out


@pytest.mark.parametrize("servers, grad_clip", [(2, 0.5)])
def test_sync_equals_ddp_and_single_process(servers, grad_clip):
    workers, steps = 2, 5
    results = run_workers(_sync_vs_ddp, workers + servers, args=(servers, steps, grad_clip),
                          timeout_s=90)
    for optimizer in OPTIMIZERS:
        ref = reference(optimizer, workers, steps, grad_clip)
        for rank, res in enumerate(results):  # servers too: the state is equal on every rank
            for name, value in ref.items():
                where = f"{optimizer} rank {rank} {name}"
                torch.testing.assert_close(res[optimizer][name], value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, where=where: f"{where}: {m}")
            if rank < workers:
                for name, value in res[f"ddp_{optimizer}"].items():
                    torch.testing.assert_close(res[optimizer][name], value, rtol=1e-5, atol=1e-6)
        for res in results:
            assert all(torch.equal(res[optimizer][n], results[0][optimizer][n]) for n in ref)
    for res in results:  # buckets sent from hooks during backward change nothing
        assert all(torch.equal(res["naive_sgd"][n], res["sgd"][n]) for n in res["sgd"])
    assert results[0]["stats"]["staleness_max"] == 0
    assert results[0]["stats"]["ps_updates"] == steps


# -- a slow worker: SSP bounds how far ahead the fast one runs, async does not stall it -----------
def _straggler(rank, world_size, steps, delay_s, staleness):
    out = {}
    for mode in ("ssp", "async"):
        s = ps_strategy(mode, 1, staleness=staleness, scope=mode)  # two in one process group
        log = []  # (step, start, push): push is just before the gradient left
        if _trains(s):
            for step in range(steps):
                start = time.monotonic()
                if rank == 1:
                    time.sleep(delay_s)  # the slow worker
                s.train_step([batch(step, rank)], lr=0.01, grad_clip=None)
                log.append((step, start, s.worker.pushed_at))
            done = time.monotonic()
        s.close()
        out[mode] = {"log": log, "end": done if _trains(s) else None,
                     "stats": s.server.stats() if s.server else None}
    return out


def _max_lead(logs: list[list[tuple]], staleness: int) -> int:
    """Worker-side check of SSP: when p starts step c, has q at least begun pushing step c-k-1?

    Returns how many steps past the bound the worst start was (0 when none broke it): a start
    before q even began that push is a violation whatever the network latency.
    """
    worst = 0
    for p, log_p in enumerate(logs):
        for q, log_q in enumerate(logs):
            if p == q:
                continue
            for step, start, _ in log_p:
                pushed = sum(1 for _, _, push in log_q if push < start)  # q's pushes begun by then
                worst = max(worst, step - pushed - staleness)
    return worst


def test_ssp_never_exceeds_k_and_async_does_not_wait_for_a_slow_worker():
    steps, delay, k = 16, 0.05, 2
    results = run_workers(_straggler, 3, args=(steps, delay, k), timeout_s=90)
    ssp, asyn = (results[2][m]["stats"] for m in ("ssp", "async"))
    # SSP: the fast worker used its whole allowance and never more (server-side instrument) ...
    assert ssp["staleness_max"] == k, ssp
    assert ssp["updates"] == 2 * steps
    # ... and no worker started a step more than k ahead of what the other had pushed.
    assert _max_lead([results[r]["ssp"]["log"] for r in (0, 1)], k) <= 0
    # async: nothing holds the fast worker back; it finishes while the slow one is not halfway.
    assert asyn["staleness_max"] > k, asyn
    fast, slow = (results[r]["async"] for r in (0, 1))
    slow_start = slow["log"][0][1]
    assert fast["end"] - slow_start < 0.5 * (slow["end"] - slow_start), (fast["end"], slow["end"])
    # SSP: the fast worker ends within k slow steps of the slow one, not earlier.
    fast, slow = (results[r]["ssp"] for r in (0, 1))
    assert fast["end"] > slow["log"][steps - k - 1][2]


# -- a worker dies --------------------------------------------------------------------------------
def _dead_worker(rank, world_size, mode, steps, die_at):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = ps_strategy(mode, 1)
        if rank == 1:  # returns mid-run without leaving: its process exits, connections close
            for step in range(die_at):
                s.train_step([batch(step, rank)], lr=0.01, grad_clip=None)
            return {"died": time.monotonic()}
        if rank == 0:
            done, dropped_at = 0, None
            try:
                for step in range(steps):
                    time.sleep(0.02)
                    s.train_step([batch(step, rank)], lr=0.01, grad_clip=None)
                    done += 1
                    if step == steps // 3 and s.membership is not None:
                        # Train on only once the server has dropped rank 1 (its process exit
                        # takes a while on a loaded machine): the rest is after the death.
                        deadline = time.monotonic() + 30
                        while not s.membership.is_departed(1) and time.monotonic() < deadline:
                            time.sleep(0.02)
                        dropped_at = done if s.membership.is_departed(1) else None
                error = None
            except PSError as e:
                error = str(e)
            s.close()
            return {"end": time.monotonic(), "steps": done, "error": error,
                    "dropped_at": dropped_at}
        try:
            s.close()
            error = None
        except PSError as e:
            error = str(e)
        return {"lost": dict(s.server.lost), "stats": s.server.stats(), "error": error,
                "server_error": str(s.server.error) if s.server.error else None,
                "warnings": [str(w.message) for w in caught]}


def test_a_dead_worker_is_dropped_in_async_and_training_goes_on():
    steps, die_at = 30, 3
    worker0, worker1, server = run_workers(_dead_worker, 3, args=("async", steps, die_at),
                                           timeout_s=60)
    assert list(server["lost"]) == [1]
    assert any("worker rank 1 died" in w and "training goes on with workers [0]" in w
               for w in server["warnings"])
    assert worker0["error"] is None and worker0["steps"] == steps
    assert worker0["dropped_at"] == steps // 3 + 1  # 20 of its 30 steps came after the drop
    assert worker0["end"] > worker1["died"] + 0.1
    assert server["stats"]["updates"] == steps + die_at


def test_a_dead_worker_in_sync_mode_fails_cleanly_naming_it():
    worker0, _, server = run_workers(_dead_worker, 3, args=("sync", 30, 3), timeout_s=60)
    assert worker0["error"] is not None and "aborted" in worker0["error"]
    assert worker0["steps"] == 3
    assert "worker rank 1 was lost" in server["server_error"]
    assert "--ps-mode async" in server["server_error"]


def _dead_server(rank, world_size):
    if rank == 2:  # the server leaves after set-up: its process exits, connections close
        ps_strategy("async", 1)
        return None
    start = time.monotonic()
    try:
        s = ps_strategy("async", 1)
        for step in range(50):
            time.sleep(0.02)
            s.train_step([batch(step, rank)], lr=0.01, grad_clip=None)
    except PSError as e:
        return {"error": str(e), "after_s": time.monotonic() - start}
    return {"error": None}


def test_a_dead_server_is_named_by_every_worker():
    for res in run_workers(_dead_server, 3, timeout_s=60)[:2]:
        assert res["error"] is not None and "lost server rank 2" in res["error"], res
        assert res["after_s"] < 30


# -- server state survives a snapshot ----------------------------------------------------------
def _snapshot_restore(rank, world_size, root):
    from ringtrain.checkpoint.snapshot import SnapshotManager

    s = ps_strategy("sync", 1, "adamw")
    manager = SnapshotManager(root, rank=rank, world_size=world_size, timeout_s=30)

    def train(first, last):
        for step in range(first, last):
            s.train_step([batch(step, rank)] if _trains(s) else [], lr=LRS[step % len(LRS)],
                         grad_clip=None)

    train(0, 3)
    manager.save(3, per_rank=s.state_dict(), metadata={"topology": {"servers": 1}})
    train(3, 6)
    straight = s.model_state_dict()
    train(6, 8)  # move on, then go back to the snapshot
    _, per_rank, meta = manager.load(manager.latest())
    s.load_state_dict(per_rank)
    train(3, 6)
    resumed = s.model_state_dict()
    s.close()
    return straight, resumed, meta["step"]


def test_server_state_snapshot_and_restore(tmp_path):
    results = run_workers(_snapshot_restore, 3, args=(str(tmp_path),), timeout_s=60)
    ref = reference("adamw", 2, 6, None)
    for straight, resumed, step in results:
        assert step == 3
        for name in ref:  # sync mode is deterministic: the resumed run repeats bit for bit
            assert torch.equal(straight[name], resumed[name]), name
            torch.testing.assert_close(resumed[name], ref[name], rtol=1e-5, atol=1e-6)


# -- errors that name the fix (no processes) -----------------------------------------------------
def _runtime(world_size: int) -> Runtime:
    return Runtime(0, world_size, 0, "gloo", torch.device("cpu"),
                   None, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("options, match", [
    (dict(world_size=1), "at least one worker and one server"),
    (dict(world_size=2, servers=2), "leaves no worker"),
    (dict(world_size=3, servers=0), "at least 1 server"),
    (dict(world_size=3, mode="bsp"), "--ps-mode 'bsp'"),
    (dict(world_size=3, mode="ssp", staleness=-1), "--staleness -1"),
])
def test_bad_options_say_what_to_do(options, match):
    world_size = options.pop("world_size")
    with pytest.raises(ValueError, match=match):
        PSStrategy(_runtime(world_size), **options)


def test_topology_puts_workers_first():
    topo = PSTopology(world_size=5, servers=2)
    assert topo.worker_ranks == [0, 1, 2] and topo.server_ranks == [3, 4]
    assert [topo.is_server(r) for r in range(5)] == [False, False, False, True, True]


# -- async on the default task learns it within twice DDP's steps, and applies every push once ----


def _async_vs_ddp(rank, world_size, ddp_steps, eval_every, target):
    """DDP for `ddp_steps`, then async PS for up to twice as many, each with the trainer's
    schedule, until async's held-out exact match reaches `target` (evaluated every
    `eval_every` global steps)."""
    from ringtrain.data.addition import AdditionDataset, exact_match
    from ringtrain.ddp.distributed import DistributedDataParallel
    from ringtrain.models import GPT, GPTConfig, loss_fn
    from ringtrain.training.trainer import TrainerConfig, adamw, lr_at

    train, test = AdditionDataset("train"), AdditionDataset("test")
    config = GPTConfig(vocab_size=train.vocab_size, block_size=train.block_size)  # the default GPT
    workers = world_size - 1
    worker_group = dist.new_group(list(range(workers)))

    def model() -> nn.Module:
        torch.manual_seed(1337)
        return GPT(config)

    def data(step: int, worker: int):
        idx = torch.randint(len(train), (64,),
                            generator=torch.Generator().manual_seed(step * 97 + worker))
        return train.x[idx], train.y[idx]

    def evaluate(m: nn.Module) -> tuple[float, float]:
        """Held-out (exact-match accuracy, loss)."""
        m.eval()
        with torch.no_grad():
            logits = m(test.x)
            acc, loss = float(exact_match(logits, test.y).mean()), float(loss_fn(logits, test.y))
        m.train()
        return acc, loss

    ddp = None
    if rank < workers:  # all-reduce data parallel: the reference
        # the task default: warmup, cosine
        schedule = TrainerConfig(steps=ddp_steps, lr=3e-3).resolved()
        m = model()
        ddp_model = DistributedDataParallel(m, process_group=worker_group)
        opt = adamw(0.1)(m.parameters())
        for step in range(ddp_steps):
            opt.zero_grad()
            x, y = data(step, rank)
            loss_fn(ddp_model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, schedule)
            opt.step()
        ddp = evaluate(m)
    s = make_strategy("ps", runtime=get_runtime(), servers=1, mode="async")
    # Asynchrony begets momentum (Mitliagkas et al., 2016): W async workers add an implicit
    # momentum of about 1 - 1/W, so async takes Adam's beta1 down from 0.9 to ASYNC_BETA1.
    s.setup(model(), adamw(0.1, betas=(ASYNC_BETA1, 0.95)), loss_fn)
    schedule = TrainerConfig(steps=2 * ddp_steps, lr=3e-3).resolved()
    store, reached, best = get_runtime().store, None, (0.0, float("inf"))
    step, due = 0, eval_every
    while _trains(s) and not store.check(["test_ps/reached"]):
        # Steps of the global batch, as DDP counts them: gradients applied / workers. The
        # budget is global, so a worker that gets less CPU does not shrink it.
        global_step = s.worker.applied // workers
        last = global_step >= 2 * ddp_steps - 1
        s.train_step([data(step, rank)], lr=lr_at(min(global_step, 2 * ddp_steps - 1), schedule),
                     grad_clip=1.0)
        step += 1
        # Every `eval_every` global steps, not rank 0's own: when rank 0 gets little CPU, the
        # other worker's pushes move the model on between rank 0's evaluations.
        if rank == 0 and (s.worker.applied / workers >= due or last):
            due = (s.worker.applied // workers // eval_every + 1) * eval_every
            acc, loss = evaluate(s.module)
            best = (max(best[0], acc), min(best[1], loss))
            if acc >= target or last:
                reached = s.worker.applied / workers if acc >= target else None
                store.set("test_ps/reached", "1")
        if last and rank != 0:
            break
    if not _trains(s):
        # The server's close waits at most 60 s for the workers: on a loaded machine training
        # takes longer than that (it closed under them at push 380 of 500 with load 10).
        store.wait(["test_ps/reached"], timedelta(seconds=200))
    s.close()
    return {"ddp": ddp, "reached": reached, "best": best,
            "pushes": s.worker.clock if s.worker is not None else None, "stats": s.stats()}


@pytest.mark.slow
def test_async_learns_the_task_within_twice_ddps_steps():
    """DDP trains 250 steps (0.68 held-out exact match); async, 2 workers + 1 server, gets
    twice as many (the trainer's warmup + cosine over its own run) and must reach 0.1 held-out
    exact match, ten times the plateau's 0.01. The server must have applied every push exactly
    once, each against parameters at most one other update old on average (W - 1 = 1), as an
    async PS answers at once.

    Not a fraction of DDP's accuracy: async's curve is not one curve. The order in which pushes
    interleave changes each run, and the pace of the rise after the plateau with it: DDP's full
    accuracy was missed in about 1 CI run of 10-20, and half of it (0.342) came at steps 198-315
    in 27 runs but once only at step 500. 0.1 comes where the curves still lie together: at
    steps 129.5-230.5 in 28 full curves (5 under two CPU burners) and 150-240 in 10 runs of this
    test, under half the budget (figures in docs/ps.md). A server that loses pushes or answers
    with parameters older than its last update breaks the counts (one answer behind: update lag
    2.99); one that applies gradients to the wrong parameters stays on the plateau (each
    gradient shifted by one element: at most 0.014 in 500 steps). The server rank waits for the
    workers' stop before its close, which waits at most 60 s for them: under load the workers
    can train longer than that.
    """
    ddp_steps, target = 250, 0.1  # DDP ends near 0.7 exact-match, on the steep part
    results = run_workers(_async_vs_ddp, 3, args=(ddp_steps, 10, target), timeout_s=240)
    ddp_accuracy, ddp_loss = results[0]["ddp"]
    assert ddp_accuracy > 0.5, (
        f"DDP itself did not learn: held-out accuracy {ddp_accuracy:.3f}, loss {ddp_loss:.3f}")
    reached, server = results[0]["reached"], results[2]["stats"]
    pushes = [r["pushes"] for r in results[:2]]
    print(f"async reached {target} held-out exact match at step {reached} of {2 * ddp_steps}; "
          f"server {server}")
    best_accuracy, best_loss = results[0]["best"]
    assert reached is not None and reached <= 2 * ddp_steps, (
        f"async reached {best_accuracy:.3f} held-out exact match (loss {best_loss:.3f}), not "
        f"{target}, in {2 * ddp_steps} steps (DDP: {ddp_accuracy:.3f} in {ddp_steps})")
    # async: one update per gradient, each worker's every push applied
    assert server["updates"] == server["gradients"] == sum(pushes), (server, pushes)
    # Each of a worker's pushes is read after the server's answer to its last one, so the other
    # worker's pushes in between are its lag: the mean is W - 1, less the last few pushes.
    assert 0.95 <= server["update_lag_mean"] <= 1.0, server


# -- the main job ------------------------------------------------------------------------------
def test_ringtrain_train_with_ssp_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                        "TORCHELASTIC_RUN_ID")}
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain", "train", "--strategy", "ps", "--servers", "1",
         "--ps-mode", "ssp", "--staleness", "1", "--nproc-per-node", "3", "--steps", "20",
         "--n-layer", "1", "--n-embd", "32", "--batch-size", "16", "--eval-every", "10",
         "--no-progress", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=150, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["strategy"], summary["world_size"], summary["steps"]) == ("ps", 3, 20)
    assert summary["global_batch_size"] == 2 * 16  # two workers read data, the server does not
    assert summary["ps_mode"] == "ssp" and summary["ps_updates"] == 2 * 20
    assert 0 <= summary["staleness_mean"] <= summary["staleness_max"] <= 1  # the bound held
    assert "param_sha256 differs" not in proc.stderr
    assert (run_dir / "report.png").exists()


def _ringtrain_train(run_dir, mode: str, fault: str, steps: int, workers: int = 3):
    """`ringtrain train --strategy ps` on `workers` workers + 1 server (ranks 0..workers-1 are
    the workers), with a test fault (`fault_env`).

    Returns (returncode, stderr lines as (unix time read, line), stdout, seconds it ran).
    """
    import threading

    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                        "TORCHELASTIC_RUN_ID")}
    env.update(fault_env(fault), PYTHONUNBUFFERED="1")
    start = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ringtrain", "train", "--strategy", "ps", "--servers", "1",
         "--ps-mode", mode, "--nproc-per-node", str(workers + 1), "--steps", str(steps),
         "--n-layer", "1", "--n-embd", "32", "--batch-size", "16", "--eval-every", "20",
         "--no-progress", "--threads", "1", "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=run_dir.parent, env=env)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.time(), line.rstrip())
                                                          for line in proc.stderr), daemon=True)
    reader.start()
    try:
        out = proc.stdout.read()
        proc.wait(timeout=150)
    finally:
        proc.kill()
    reader.join(timeout=5)
    return proc.returncode, lines, out, time.time() - start


def _left_behind(marker: str) -> list[str]:
    """Command lines of live processes that mention `marker` (the run dir), zombies aside."""
    from pathlib import Path

    found = []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(cmdline)
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="scans /proc")
def test_ringtrain_train_async_goes_on_when_a_worker_is_killed(tmp_path):
    """Worker rank 2 of 3 is SIGKILLed after step 15 of 40: the others finish, exit 0."""
    run_dir = tmp_path / "run"
    code, lines, out, took = _ringtrain_train(run_dir, "async", "kill:2:15", steps=40)
    err = "\n".join(line for _, line in lines)
    assert code == 0, out[-2000:] + err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["ps_workers_lost"] == 1
    assert summary["departed_ranks"] == [2]
    steps = [json.loads(line)["step"]
             for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 41))  # every step trained and logged, by the survivors
    assert (run_dir / "report.png").exists()
    # One warning from the job (the rank that first saw the death) and one from the launcher.
    died = [(t, line) for t, line in lines if "worker rank 2 died" in line]
    assert len(died) == 1 and "training goes on with workers [0, 1]" in died[0][1], err
    assert sum("rank 2 (local_rank 2" in line and "SIGKILL" in line for _, line in lines) == 1, err
    killed_at = next(float(line.rsplit(" ", 1)[1]) for _, line in lines
                     if "test fault: kill" in line)
    print(f"kill -> warning {died[0][0] - killed_at:.2f} s, whole run {took:.1f} s")
    assert died[0][0] - killed_at < 10
    assert _left_behind(str(run_dir)) == []


def test_ringtrain_train_sync_fails_naming_a_killed_worker(tmp_path):
    """sync needs every worker's gradient: a killed worker ends the job, named. Two workers
    show it as three would (async's test keeps three: one warning from two survivors)."""
    run_dir = tmp_path / "run"
    code, lines, out, _ = _ringtrain_train(run_dir, "sync", "kill:1:5", steps=40, workers=2)
    report = [line for _, line in lines if line.startswith("ringtrain run:")]
    assert code == 1, out
    assert report and "rank 1 failed" in report[0] and "SIGKILL" in report[0], report
    assert not (run_dir / "summary.json").exists()
    assert _left_behind(str(run_dir)) == []
