"""benchmarks/pipeline_vs_torch.py at its quick size: torch's pipelining (Schedule1F1B,
ScheduleGPipe, ScheduleInterleaved1F1B), built from the same GPT stages, computes the same loss
and gradients as ours and trains the same under AdamW; no timing is asserted. It also keeps the
benchmark working on the torch versions ringtrain supports (torch's pipelining API moves).

    .venv/bin/pytest -q tests/test_pipeline_vs_torch_bench.py

CPU, two gloo ranks (the conftest sets RINGTRAIN_DEVICE=cpu, which the subprocess inherits).
"""

from __future__ import annotations

from support.bench_json import bench_json


def test_quick_run_trains_both_the_same_and_reports_their_ratio():
    result = bench_json("pipeline_vs_torch.py", "--quick", "--steps", "2", timeout_s=120)
    assert result["benchmark"] == "pipeline_vs_torch" and result["pp"] == 2
    assert result["backend"] == "gloo" and result["threads"] == 1
    assert result["steps"] == 2 and result["torch"]
    assert {"load_before", "load_after", "config", "batch", "optimizer"} <= result.keys()
    assert [(r["schedule"], r["microbatches"]) for r in result["rows"]] == [
        ("1f1b", 4), ("gpipe", 4), ("interleaved", 4)]
    for row in result["rows"]:
        assert row["ours_ms"] > 0 and row["torch_ms"] > 0
        assert row["ratio"] == round(row["ours_ms"] / row["torch_ms"], 3)
        assert abs(row["loss_ours"] - row["loss_torch"]) <= 1e-5, row
        assert row["loss_max_diff"] <= 1e-5, row  # every step, under AdamW updates
        assert row["grad_max_diff"] <= 1e-6, row
        assert row["loss_last"] < row["loss_ours"], row  # it trained
