"""The step timeline (`ringtrain.trace`, `--trace-steps`): spans, tracks, clocks, and a 2-rank DDP
run whose trace.json nests and shows bucket communication overlapping backward.

    .venv/bin/pytest -q tests/test_trace.py
"""

import argparse
import json
import os

import pytest
from torch.utils.data import Subset

from ringtrain.testing import run_workers
from ringtrain.trace import NO_TRACE, StepRange, Tracer, _pack, chrome_events, parse_steps


def test_parse_steps_is_a_half_open_range_from_1():
    assert parse_steps("10:13") == StepRange(10, 13) and str(parse_steps("10:13")) == "10:13"
    assert parse_steps("5") == StepRange(5, 6)
    for bad in ("0:3", "4:4", "5:2", "a:b", ":3"):
        with pytest.raises(argparse.ArgumentTypeError, match="10:13"):
            parse_steps(bad)


def test_an_untraced_tracer_records_nothing_and_hands_out_one_null_context():
    assert NO_TRACE.span("forward") is NO_TRACE.step(1) is NO_TRACE.span("x", "comm")
    with NO_TRACE.step(1), NO_TRACE.span("forward"):
        NO_TRACE.until_done("bucket 0", "comm", object())
    assert NO_TRACE.spans == [] and not NO_TRACE.active
    t = Tracer(0, (2, 3))
    with t.step(1), t.span("forward"):  # outside the window
        pass
    with t.step(2), t.span("forward"):
        assert t.active
    assert not t.active and [s[0] for s in t.spans] == ["forward", "step 2"]


def test_tracks_hold_spans_that_nest_or_follow_and_partial_overlaps_get_their_own():
    # step [0, 10] holding forward [1, 4] and backward [4, 9]; two buckets overlapping partly
    assert _pack([(0, 10), (1, 4), (4, 9)]) == [0, 0, 0]
    assert _pack([(2, 6), (3, 8), (7, 9)]) == [0, 1, 0]


def test_events_are_aligned_to_rank_0s_clock_with_a_track_per_lane():
    ranks = [{"rank": 0, "offset_ns": 0, "clock": {},
              "spans": [["step 1", "compute", 1000, 5000, None]]},
             {"rank": 1, "offset_ns": -500, "clock": {},  # rank 1's clock runs 500 ns ahead
              "spans": [["step 1", "compute", 1500, 5500, None],
                        ["bucket 0", "comm", 2000, 4000, {"bytes": 8}],
                        ["bucket 1", "comm", 3000, 6000, None]]}]
    events = chrome_events(ranks)
    x = [e for e in events if e["ph"] == "X"]
    assert [(e["pid"], e["tid"], e["ts"], e["dur"]) for e in x] == [
        (0, 0, 0.0, 4.0), (1, 0, 0.0, 4.0), (1, 1, 0.5, 2.0), (1, 2, 1.5, 3.0)]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {(0, 0): "compute", (1, 0): "compute", (1, 1): "comm", (1, 2): "comm 2"}


# -- a 2-rank DDP run -------------------------------------------------------------------------
def _traced_ddp_worker(rank, world_size, run_dir, zero_stage=None):
    from ringtrain.data.addition import AdditionDataset
    from ringtrain.models import GPT, GPTConfig, loss_fn
    from ringtrain.runtime import get_runtime
    from ringtrain.strategies.ddp import DDPStrategy
    from ringtrain.strategies.zero import ZeroStrategy
    from ringtrain.training.trainer import Trainer, TrainerConfig

    rt = get_runtime()
    model = GPTConfig(vocab_size=10, block_size=3, n_layer=2, n_head=2, n_embd=32)
    # Buckets of ~16 KiB: several per backward, the first leaving while backward goes on.
    strategy = (DDPStrategy(rt, bucket_cap_mb=1 / 64) if zero_stage is None
                else ZeroStrategy(rt, zero_stage=zero_stage))
    cfg = TrainerConfig(steps=4, batch_size=16, lr=3e-3, progress=False, eval_batch_size=8,
                        log_every=4, report=False)
    trainer = Trainer(strategy, rt, lambda: GPT(model), AdditionDataset("train", 1),
                      Subset(AdditionDataset("test", 1), range(4)), loss_fn, cfg,
                      run_dir=run_dir, trace_steps=(2, 4))
    return trainer.fit().get("trace")


def _nest_or_follow(spans):
    open_ends = []
    for s, e in sorted(spans, key=lambda p: (p[0], -p[1])):
        while open_ends and open_ends[-1] <= s:
            open_ends.pop()
        if open_ends and e > open_ends[-1]:
            return False
        open_ends.append(e)
    return True


def test_ddp_trace_nests_and_bucket_communication_overlaps_backward(tmp_path):
    got = run_workers(_traced_ddp_worker, 2, (str(tmp_path),), timeout_s=120)
    path = os.path.join(str(tmp_path), "trace.json")
    assert got == [path, None]  # rank 0 wrote the one file
    doc = json.loads(open(path).read())
    x = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in x} == {0, 1}
    assert set(doc["otherData"]["clock"]) == {"0", "1"} and doc["otherData"]["steps"] == "2:4"
    for track in {(e["pid"], e["tid"]) for e in x}:  # the format's rule: nest or follow
        assert _nest_or_follow([(e["ts"], e["ts"] + e["dur"])
                                for e in x if (e["pid"], e["tid"]) == track])
    for rank in (0, 1):
        mine = [e for e in x if e["pid"] == rank]
        steps = [e for e in mine if e["name"].startswith("step ")]
        assert sorted(e["name"] for e in steps) == ["step 2", "step 3"]

        def inside(e, outer):
            return outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"]

        for name in ("forward", "backward", "optimizer step", "finish gradient sync"):
            spans = [e for e in mine if e["name"] == name]
            assert len(spans) == 2 and all(any(inside(e, s) for s in steps) for e in spans), name
        backward = [e for e in mine if e["name"] == "backward"]
        finish = [e for e in mine if e["name"] == "finish gradient sync"]
        assert all(any(inside(f, b) for b in backward) for f in finish)  # the reducer's end
        buckets = [e for e in mine if e["cat"] == "comm"]
        assert len(buckets) >= 4 and all(e["name"].startswith("bucket ") for e in buckets)
        # Overlap: a bucket launched during backward, before its end-of-backward sync began.
        early = [e for e in buckets
                 for b, f in zip(sorted(backward, key=lambda e: e["ts"]),
                                 sorted(finish, key=lambda e: e["ts"]), strict=True)
                 if b["ts"] < e["ts"] < f["ts"]]
        assert early, buckets


def test_zero_3_trace_shows_each_units_gathers_and_reduces_inside_the_step(tmp_path):
    run_workers(_traced_ddp_worker, 2, (str(tmp_path), 3), timeout_s=120)
    events = json.loads(open(tmp_path / "trace.json").read())["traceEvents"]
    x = [e for e in events if e["ph"] == "X"]
    for rank in (0, 1):
        mine = [e for e in x if e["pid"] == rank]
        steps = [e for e in mine if e["name"].startswith("step ")]
        assert sorted(e["name"] for e in steps) == ["step 2", "step 3"]
        comm = [e for e in mine if e["cat"] == "comm"]
        # 3 units (the root, 2 blocks): gathered for forward and backward, reduced once.
        units = {e["args"]["unit"] for e in comm}
        assert units == {"0", "1", "2"}, units
        assert {e["name"] for e in comm} == {"all-gather", "reduce-scatter"}
        assert all(any(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"]
                       for s in steps)
                   for e in mine if e["name"] in ("forward", "backward", "optimizer step", *units))
        for track in {e["tid"] for e in mine}:
            assert _nest_or_follow([(e["ts"], e["ts"] + e["dur"])
                                    for e in mine if e["tid"] == track])


def test_no_trace_costs_nothing_measurable_in_a_hook():
    # The hot-path question an engine asks with tracing off: one attribute read.
    import timeit

    n = 20000
    off = timeit.timeit("t.active", globals={"t": NO_TRACE}, number=n)
    span = timeit.timeit("with t.span('forward'): pass", globals={"t": NO_TRACE}, number=n)
    assert off / n < 5e-6 and span / n < 2e-5  # generous bounds for a busy 2-core machine


def test_a_pipeline_stage_timeline_becomes_compute_and_comm_spans():
    from ringtrain.pipeline.engine import StepStats
    from ringtrain.pipeline.schedule import Backward, Forward, RecvGrad, SendActivation
    from ringtrain.strategies.pipeline import _trace_timeline

    stats = StepStats(start=1.0, end=1.009, timeline=[
        (Forward(0), 1.0, 1.002), (SendActivation(0), 1.002, 1.0021),
        (RecvGrad(0), 1.0021, 1.005), (Backward(0), 1.005, 1.008)])
    t = Tracer(0, (1, 2))
    _trace_timeline(t, stats)
    assert [(name, lane) for name, lane, *_ in t.spans] == [
        ("forward 0", "compute"), ("send activation 0", "comm"), ("recv grad 0", "comm"),
        ("backward 0", "compute"), ("wait for sends", "comm")]
    assert t.spans[2][2:4] == (1_002_100_000, 1_005_000_000)
