"""Test helper: run a function on N local gloo ranks (as `torch.testing` is torch's).

    results = run_workers(fn, world_size=2, args=(x,), timeout_s=60)

`fn(rank, world_size, *args)` must be a module-level function (the ranks import it). Ranks are
forked from a forkserver that has imported torch (where the platform has one; spawned
otherwise): a rank starts in ~0.1 s instead of the ~1.4 s of a fresh interpreter importing
torch, which over the suite's hundreds of worker starts is minutes. The server imports torch,
ringtrain's trainer and pyplot, nothing else (no CUDA, no threads), and each rank takes the
caller's environment and working directory as they are at the call, as a spawned process would.
Each rank runs with `torch.set_num_threads(1)`, an initialised gloo group on the CPU (or a
shared GPU with `device="cuda"`; unless `init=False`) that every rank has joined when `fn`
starts (one barrier after init: the group's sequence number is 1 there), and teardown in
`finally`. Results come back per rank, in rank order. The first rank that
raises stops the rest and its traceback is re-raised with its rank; a run that outlives
`timeout_s` is killed and the unfinished ranks are named: no test can hang.

Fault injection into `ringtrain train` is not here but in tests/support/faults.py, reached
through the generic RINGTRAIN_STEP_HOOK (`ringtrain/cli/step_hook.py`). Tests:
`.venv/bin/pytest -q tests/test_testing.py tests/test_store_keys.py`.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable, Collection
from typing import Any

import torch


class WorkerError(RuntimeError):
    """A rank raised; carries its rank and traceback."""

    def __init__(self, rank: int, tb: str):
        super().__init__(f"rank {rank} raised:\n{tb}")
        self.rank = rank
        self.traceback = tb


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _worker(fn, rank, world_size, port, args, init, env, cwd, threads, device, out):
    os.environ.clear()  # the caller's, not the forkserver's (which it had when the server started)
    os.environ.update(env)
    os.chdir(cwd)
    torch.set_num_threads(threads)
    from ringtrain.launch.process_group import destroy_distributed, init_distributed

    try:
        if init:
            init_distributed(
                "gloo", device=device, rank=rank, world_size=world_size, master_addr="127.0.0.1",
                master_port=port, rendezvous_timeout_s=30,
            )
            # gloo connects every pair of ranks inside init_process_group and a rank leaves it
            # once its own pairs are up: an `fn` that returns at once (no collective) could tear
            # the group down while a peer was still connecting ("Connection closed by peer").
            # One barrier: `fn` starts only once the whole group is up.
            torch.distributed.barrier()
        result = fn(rank, world_size, *args)
        out.put((rank, "ok", _dumps(result)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        out.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            destroy_distributed()
        except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
            pass


def worker_context():
    """The multiprocessing context of `run_workers` (and of a test's DataLoader workers): a
    forkserver that has imported torch, else spawn; never a fork of the caller's process."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Read when the server starts (the first call). torch._dynamo too: the first call of an
    # optimizer method imports it (torch._disable_dynamo), ~1.5 s of CPU in every worker.
    # ringtrain's trainer, strategies and CLI (155 modules, ~0.3 s of CPU) and pyplot (~0.45 s,
    # on every rank 0 that writes report.png) are imported by most ranks the suite starts; none
    # reads the environment or starts a thread at import, so a rank still sees only the
    # caller's. A module that is not installed is skipped (multiprocessing ignores its
    # ImportError) and imported, or not, by the rank as before.
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "ringtrain.cli.train",
                                "matplotlib.pyplot"])
    return ctx


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    timeout_s: float = 120.0,
    init: bool = True,
    env: dict[str, str] | None = None,
    threads: int = 1,
    device: str = "cpu",
    tolerate: Collection[int] = (),
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` local ranks; return results by rank.

    The group is gloo; `device="cuda"` gives every rank CUDA tensors on a shared GPU (rank i on
    cuda:(i mod GPUs)), the way to test multi-process code on a box with fewer GPUs than ranks.
    A rank in `tolerate` may die without a result (a fault test kills it): its result is None.
    Pair it with `init=False` and the test's own groups: a killed rank would break the others'
    default group.
    """
    from ringtrain.launch.network import reserve_port

    ctx = worker_context()
    out = ctx.Queue()
    # Rank 0's store port, held until the run ends: picked and let go here, it stayed free
    # while the ranks started and another test's process took it in between (EADDRINUSE).
    with reserve_port() as port:
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, r, world_size, port, args, init, {**os.environ, **(env or {})},
                      os.getcwd(), threads, device, out),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        return _gather(procs, out, timeout_s, tolerate)


def _gather(procs: list, out: Any, timeout_s: float, tolerate: Collection[int]) -> list[Any]:
    """Each rank's result from `out`, by rank; the first error raised; every process reaped."""
    world_size = len(procs)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:g} s")
            try:
                rank, status, payload = out.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    # Died without reporting (signal, os._exit): give its queue a moment to drain.
                    try:
                        rank, status, payload = out.get(timeout=2.0)
                    except queue.Empty:
                        lost = [r for r in dead if r not in tolerate]
                        if not lost:  # killed on purpose by the test: no result, no error
                            results.update((r, None) for r in dead)
                            continue
                        raise WorkerError(lost[0], f"exited with code {procs[lost[0]].exitcode} "
                                                   "without a result") from None
                else:
                    continue
            if status == "error":
                raise WorkerError(rank, payload)
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5 if len(results) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
