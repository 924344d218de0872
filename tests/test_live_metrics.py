"""Who writes a live run's metrics lines when its rank 0 is lost: in process, no workers, CPU.

    .venv/bin/pytest -q tests/test_live_metrics.py

A live member lost between a step's commit and that step's metrics sum leaves each survivor
with its own sums (`Agreement.try_sum` says None): the line is held (`HeldLine`), carried in the
next logged step's one sum (a replacement adds zeros) and written then, before that step's line,
by whoever is rank 0 of then (`RankZeroMetrics`), which takes metrics.jsonl over where its first
line goes: every logged step once, in order. Generation 0's ranks follow the launcher's
(`generation0`), so the original rank 0 is the launcher's rank 0. The end-to-end run that kills
the original rank 0 is tests/test_live_train.py's spare run.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch.distributed as dist

from ringtrain.live.roster import generation0
from ringtrain.training.metrics_file import RankZeroMetrics
from ringtrain.training.progress import MetricsLog
from ringtrain.training.record import HeldLine, log_step
from ringtrain.training.state import LoopState, WindowSums


class _Members:
    """Several live members in one process: each hands its values to one sum, which fails
    (None on every member) while `failing` (a member lost)."""

    def __init__(self, n: int):
        self.n, self.failing = n, False


class _Agreed:
    """A member's agreement that answers the one total (or None) for everyone."""

    def __init__(self, total: list[float] | None):
        self.total = total

    def sum(self, values: list[float]) -> list[float]:
        raise AssertionError("a live trainer asks try_sum")

    def try_sum(self, values: list[float]) -> list[float] | None:
        return None if self.total is None else list(self.total)


def _window(loss: float, count: float) -> WindowSums:
    return WindowSums(loss_sum=loss, count=count, tokens=count * 4, compute_s=0.1, comm_s=0.01,
                      worker_steps=2)


def _round(states, helds, metrics, members: _Members, step: int, windows):
    """One logged step on every member (`log_step`); the sum is the elementwise sum of what
    every member hands in (its held slot, then its window), as an all-reduce's."""
    assert len(states) == members.n
    handed = []
    for state, held, w in zip(states, helds, windows, strict=True):
        state.add(w, 1.0)
        handed.append(held.slot() + w.flat())
    total = None if members.failing else [sum(col) for col in zip(*handed, strict=True)]
    return [log_step(state, _Agreed(total), log, step, 0.01, started=0.0, evaluate=None,
                     eval_names=[], held=held)
            for state, held, log in zip(states, helds, metrics, strict=True)]


def test_a_line_whose_sum_failed_is_written_once_in_order_by_the_rank_0_of_then(tmp_path):
    """Three members log step 2; member 0 (the writer) is lost before step 4's sum, which fails
    on the two survivors; a replacement joins as rank 0 and writes 4 (the survivors' sums) and
    then 6 (everyone's), after the line 2 that the lost writer wrote."""
    path = tmp_path / "metrics.jsonl"
    rank = {0: 0, 1: 1, 2: 2, 3: -1}  # uid -> rank; uid 3 waits as a replacement
    logs = [RankZeroMetrics(str(tmp_path), rank=lambda i=i: rank[i]) for i in range(4)]
    logs[0].open()
    states = [LoopState() for _ in range(4)]
    helds = [HeldLine([]) for _ in range(4)]
    members = _Members(3)
    _round(states[:3], helds[:3], logs[:3], members, 2, [_window(6.0, 3)] * 3)
    # Member 0 is lost after step 4 committed: the survivors' sum of step 4 fails.
    members.failing, members.n = True, 2
    local = _round(states[1:3], helds[1:3], logs[1:3], members, 4,
                   [_window(3.0, 3), _window(9.0, 3)])
    assert [r["loss"] for r in local] == [1.0, 3.0]  # each survivor's own view, not written
    assert [h.step for h in helds[1:3]] == [4, 4]
    # The next generation: the replacement (uid 3) takes rank 0; the survivors keep theirs.
    members.failing, members.n = False, 3
    rank[0], rank[3] = -1, 0
    recs = _round([states[3], states[1], states[2]], [helds[3], helds[1], helds[2]],
                  [logs[3], logs[1], logs[2]], members, 6, [_window(3.0, 3)] * 3)
    assert [r["step"] for r in recs] == [6, 6, 6]
    for log in logs:
        log.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["step"] for x in lines] == [2, 4, 6]
    assert lines[1]["loss"] == (3.0 + 9.0) / 6  # the survivors' sums, agreed
    assert lines[2]["loss"] == 9.0 / 9
    assert all(h.step is None for h in helds)
    # The new writer read the lines before its first back: its report plots the whole run.
    assert [r["step"] for r in logs[3].records] == [2, 4, 6]
    # Tokens: every agreed line's, counted once on every member (the held line's included).
    assert states[1].tokens == 36 + 24 + 36 and states[3].tokens == 24 + 36


def test_a_new_rank_0_cuts_stale_lines_and_a_former_one_writes_no_more(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # Lines 6 and 8 from before a whole-job restart at the snapshot of step 4 (trained again):
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (2, 4, 6, 8)))
    rank = {"a": 0, "b": 1}
    a = RankZeroMetrics(str(tmp_path), rank=lambda: rank["a"])
    b = RankZeroMetrics(str(tmp_path), rank=lambda: rank["b"])
    a.open(resume_at=4)
    a.write({"step": 5, "loss": 0.5})
    rank["a"], rank["b"] = 1, 0  # a was left out (slow), b is rank 0 now
    a.write({"step": 6, "loss": 0.4})  # never written: a closes the file
    assert not a.writing
    b.write({"step": 6, "loss": 0.3})
    b.close()
    a.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [2, 4, 5, 6]
    assert json.loads(path.read_text().splitlines()[-1])["loss"] == 0.3


def test_held_lines_that_disagree_or_pile_up_are_dropped_with_a_warning(caplog):
    held = [HeldLine(["accuracy"]) for _ in range(2)]
    caplog.set_level(logging.WARNING, logger="ringtrain")
    rec = {"step": 4, "lr": 0.01, "time_s": 1.0}
    held[0].hold(rec, _window(1.0, 1).flat(), window_s=1.0, window_steps=2)
    held[0].hold({**rec, "step": 6}, _window(1.0, 1).flat(), window_s=1.0, window_steps=2)
    assert held[0].step == 4 and "line of step 6 is dropped" in caplog.text
    held[1].hold({**rec, "step": 6}, _window(1.0, 1).flat() + [2.0, 4, 1.0, 4],
                 window_s=1.0, window_steps=2)
    total = [x + y for x, y in zip(held[0].slot(), held[1].slot(), strict=True)]
    assert held[0].release(total) is None and held[1].release(total) is None
    assert "disagree on their step" in caplog.text and held[0].step is None
    # Agreeing holders with eval sums: the line carries the eval means of both.
    for h in held:
        h.hold({**rec, "step": 8}, _window(1.0, 1).flat() + [2.0, 4, 1.0, 4],
               window_s=1.0, window_steps=2)
    line, tokens = held[0].release([x + y for x, y in zip(held[0].slot(), held[1].slot(),
                                                          strict=True)])
    assert line["step"] == 8 and line["eval_loss"] == 0.5 and line["eval_accuracy"] == 0.25
    assert line["loss"] == 1.0 and tokens == 8 and line["step_s"] == 0.5


def test_generation_0_ranks_follow_the_launchers_ranks():
    store = dist.HashStore()
    for uid, slot in enumerate([2, 0, 1]):  # registered in another order than their RANK
        store.set(f"slot/{uid}", str(slot))
    assert generation0(store, 3, timeout_s=5) == [1, 2, 0]
    tied = dist.HashStore()
    for uid in range(3):  # LiveGroup without a slot writes its uid: the order of registration
        tied.set(f"slot/{uid}", str(uid))
    assert generation0(tied, 3, timeout_s=5) == [0, 1, 2]


@pytest.mark.parametrize("failing", [False, True])
def test_without_a_held_line_a_metrics_log_gets_every_agreed_line(tmp_path: Path, failing):
    """One member alone (a one-member generation): its sums are the total; a failed one is held
    and written before the next line."""
    log = MetricsLog(str(tmp_path / "m.jsonl"))
    state, held, members = LoopState(), HeldLine([]), _Members(1)
    members.failing = failing
    _round([state], [held], [log], members, 2, [_window(2.0, 2)])
    members.failing = False
    _round([state], [held], [log], members, 4, [_window(4.0, 2)])
    log.close()
    assert [x["step"] for x in log.records] == [2, 4]
    assert [x["loss"] for x in log.records] == [1.0, 2.0]
