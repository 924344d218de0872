"""benchmarks/tp_vs_torch.py at its quick size: torch's DTensor tensor parallelism, built from
the same GPT, trains exactly as ours (the same loss at every step), with and without sequence
parallelism; no timing is asserted. It also keeps the benchmark working on the torch versions
ringtrain supports (DTensor's API moves between them).

    .venv/bin/pytest -q tests/test_tp_vs_torch_bench.py
"""

from __future__ import annotations

from support.bench_json import bench_json


def test_quick_run_trains_both_the_same_and_reports_their_ratio():
    result = bench_json("tp_vs_torch.py", "--quick", "--steps", "2", timeout_s=300)
    assert [r["layout"] for r in result["rows"]] == ["tp 2", "tp 2 +SP"]
    for row in result["rows"]:
        assert row["loss_max_diff"] <= 1e-5, row
        assert row["loss_last"] < row["loss_first"], row  # it trained
        assert row["ratio"] == round(row["ours_ms"] / row["torch_ms"], 3)
