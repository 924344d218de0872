"""report.png: a run's curves on one page, drawn from its metrics.jsonl.

    python -m ringtrain.training.report runs/<timestamp>  # (re)draw runs/<timestamp>/report.png

Panels: train and eval loss; eval accuracy (or the learning rate when there is none);
throughput in tokens/s across all ranks; step time split into compute and communication wait
(`comm_s`: 0 in a one-process run, where nothing is communicated; the legend says "none").
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from ringtrain.training.state import RATES


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def write_report(records: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Draw the four panels of `records` (metrics.jsonl lines) into the PNG file `path`."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a training node
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    (ax_loss, ax_acc), (ax_tput, ax_time) = axes

    steps, loss = _series(records, "loss")
    ax_loss.plot(steps, loss, label="train", color="tab:blue")
    es, eloss = _series(records, "eval_loss")
    if es:
        ax_loss.plot(es, eloss, "o-", label="eval", color="tab:orange")
    if loss and min(v for v in loss + eloss) > 0:
        ax_loss.set_yscale("log")
    ax_loss.set(title="loss", xlabel="step", ylabel="cross-entropy")
    ax_loss.legend()

    acc_keys = [k for r in records for k in r if k.startswith("eval_") and k != "eval_loss"]
    if acc_keys:
        key = acc_keys[0]
        s, v = _series(records, key)
        ax_acc.plot(s, [100 * x for x in v], "o-", color="tab:green")
        ax_acc.set(title=f"{key.replace('_', ' ')} (held out)", xlabel="step", ylabel="%",
                   ylim=(0, 101))
        if v:
            ax_acc.annotate(f"{100 * v[-1]:.1f} %", (s[-1], 100 * v[-1]),
                            textcoords="offset points", xytext=(-40, -15))
    else:
        s, v = _series(records, "lr")
        ax_acc.plot(s, v, color="tab:purple")
        ax_acc.set(title="learning rate", xlabel="step", ylabel="lr")
    ax_acc.grid(alpha=0.3)

    unit = next((u for u, (key, _) in RATES.items() if records and key in records[0]), "tokens")
    s, v = _series(records, RATES[unit][0])
    ax_tput.plot(s, v, color="tab:red")
    ax_tput.set(title="throughput (all ranks)", xlabel="step", ylabel=f"{unit}/s", ylim=(0, None))
    ax_tput.grid(alpha=0.3)

    s, compute = _series(records, "compute_s")
    _, comm = _series(records, "comm_s")
    if s and len(comm) == len(compute):
        ms = [1000 * c for c in compute], [1000 * c for c in comm]
        # A run without communication (one process) says so instead of drawing an empty band.
        waited = any(c > 0 for c in comm)
        ax_time.stackplot(s, *ms, labels=["compute", "communication wait" if waited else
                                          "communication wait: none"],
                          colors=["tab:blue", "tab:orange"], alpha=0.8)
        ax_time.legend(loc="upper right")
    ax_time.set(title="step time per rank", xlabel="step", ylabel="ms", ylim=(0, None))
    ax_time.grid(alpha=0.3)

    if title:
        fig.suptitle(title)
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m ringtrain.training.report RUN_DIR", file=sys.stderr)
        return 2
    run_dir = argv[0]
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(metrics):
        print(f"{metrics}: no such file; give a run directory written by `ringtrain train`",
              file=sys.stderr)
        return 2
    write_report(read_metrics(metrics), os.path.join(run_dir, "report.png"), title=run_dir)
    print(os.path.join(run_dir, "report.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
