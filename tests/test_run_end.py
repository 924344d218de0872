"""A run's end waits for no snapshot write (`ringtrain.training.ending`, issue 26).

    .venv/bin/pytest -q tests/test_run_end.py

ZeRO stage 3 with --live, 2 members on threads of this process (gloo, CPU, a TCP store hosted
here, as `ringtrain train --live` has them: one-replica runtimes, one store), a tiny GPT. The
members' rank 0 writes the last snapshot alone, in the background, and here that write ends
only once the other member has returned from `fit` (bounded). To return, that member gathers
the final model with rank 0 (stage 3: a collective), compares the digest and gathers the
summary's figures with it: a rank 0 that joined its write first (the old order) kept it waiting
in the gather until the group's timeout, and the run's end failed. Both members end with the
same `param_sha256`; rank 0's summary counts the snapshot, committed after the others finished.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ringtrain.checkpoint.snapshot import SnapshotManager
from ringtrain.data.addition import AdditionDataset
from ringtrain.models import GPT, GPTConfig, loss_fn
from ringtrain.runtime import Runtime
from ringtrain.strategies import make_strategy
from ringtrain.strategies.live_step import one_replica_view
from ringtrain.training.live import LiveSettings
from ringtrain.training.trainer import Trainer, TrainerConfig

STEPS, WORLD = 2, 2
MODEL = GPTConfig(vocab_size=10, block_size=3, n_layer=1, n_head=2, n_embd=32, dropout=0.0)
# The group's collective timeout (--watchdog-timeout): the old order failed after it; the new
# one never waits for it, so it is generous (a loaded machine's steps stay far below it). So is
# the heartbeat bound: both members' heartbeat threads share this process's GIL with pytest.
TIMEOUT_S, DEAD_AFTER_S = 20.0, 10.0
BOUND_S = 60.0  # how long rank 0's write waits for the other member at most


def _member(rank: int, port: int, run_dir: Path, others_done: threading.Event,
            out: dict) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=timedelta(seconds=30))
        rt = Runtime(rank, WORLD, rank, "gloo", torch.device("cpu"), None, store)
        placed = one_replica_view(rt)  # as the CLI's --live: each generation gives the rest
        config = TrainerConfig(steps=STEPS, batch_size=4, seed=0, progress=False, report=False,
                               log_every=1, eval_every=STEPS)
        live = LiveSettings(store, WORLD, timeout_s=TIMEOUT_S, dead_after_s=DEAD_AFTER_S,
                            launcher_rank=rank, snapshot_every=STEPS)
        trainer = Trainer(make_strategy("zero", runtime=placed, zero_stage=3), placed,
                          lambda: GPT(MODEL), AdditionDataset("train", 1), None, loss_fn, config,
                          run_dir=str(run_dir), snapshot_every=STEPS, live=live)
        out[rank] = (trainer.fit(), trainer.runtime.rank)
    except Exception as e:  # noqa: BLE001 - the test names it
        out[rank] = e
    finally:
        if rank != 0:
            others_done.set()


def test_rank_0s_last_write_ends_after_the_others_have_finished_the_run(tmp_path, monkeypatch):
    others_done, waited, out = threading.Event(), [], {}
    save_now = SnapshotManager._save_now

    def slow_write(self, *args):  # on the writer thread, once the state's host copy landed
        waited.append(others_done.wait(BOUND_S))  # rank 0's only save (--snapshot-every STEPS)
        return save_now(self, *args)

    monkeypatch.setattr(SnapshotManager, "_save_now", slow_write)
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30))  # outlives both members
    threads = [threading.Thread(target=_member, args=(r, host.port, tmp_path, others_done, out),
                                daemon=True) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=BOUND_S + 60)
    assert sorted(out) == [0, 1], f"a member hung: {out}"
    errors = {r: v for r, v in out.items() if isinstance(v, BaseException)}
    assert not errors, errors  # the old order: rank 1's gather timed out waiting for rank 0
    (first, rank_of_first), (second, rank_of_second) = out[0], out[1]
    assert (rank_of_first, rank_of_second) == (0, 1)  # generation 0 in launcher-rank order
    assert waited == [True], "rank 0's write did not wait for the other member's end"
    assert first["steps"] == second["steps"] == STEPS
    assert first["param_sha256"] == second["param_sha256"]
    assert first["snapshots_saved"] == 1 and second["snapshots_saved"] == 0
    assert (tmp_path / "snapshots" / f"snap-{STEPS:08d}").is_dir()
    assert (tmp_path / "summary.json").exists()
