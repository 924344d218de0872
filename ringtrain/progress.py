"""What the user sees while a run goes: one progress bar, rank-prefixed messages, the run files.

    python -c "from ringtrain.progress import Progress; import time; p = Progress(50); \
[(time.sleep(0.02), p.update(i + 1)) for i in range(50)]; p.close()"

Only rank 0 draws the bar and logs at INFO; every rank logs warnings and errors, prefixed
`[rank r]`, so one rank's trouble is visible and attributable without eight copies of the rest.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import warnings
from typing import Any

from tqdm import tqdm

LOGGER_NAME = "ringtrain"


class _TqdmHandler(logging.Handler):
    """Writes through tqdm so a message does not tear the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never raise into the training loop
            self.handleError(record)


def setup_logging(rank: int) -> logging.Logger:
    """The `ringtrain` logger for this rank: INFO on rank 0, WARNING elsewhere, `[rank r]` prefix.

    Python warnings (`warnings.warn`) go through it too, so they carry the rank as well.
    Calling it again replaces the previous set-up (tests run several trainers in one process).
    """
    logger = logging.getLogger(LOGGER_NAME)
    for h in list(logger.handlers):
        if isinstance(h, _TqdmHandler):
            logger.removeHandler(h)
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False

    def showwarning(message, category, filename, lineno, file=None, line=None):
        logger.warning("warning: %s (%s, %s:%d)", message, category.__name__,
                       os.path.basename(filename), lineno)

    warnings.showwarning = showwarning
    return logger


class Progress:
    """A step progress bar on rank 0 (nothing elsewhere): step, loss, tokens/s, ETA.

    Args:
        total: steps in the run.
        enabled: draw it (pass `rank == 0`).
        initial: first step (a resumed run starts past 0).
    """

    def __init__(self, total: int, enabled: bool = True, initial: int = 0):
        self.bar = tqdm(total=total, initial=initial, disable=not enabled, desc="train",
                        unit="step", dynamic_ncols=True, file=sys.stderr, mininterval=0.5,
                        bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| [{elapsed}<{remaining}{postfix}]")

    def update(self, step: int) -> None:
        self.bar.update(step - self.bar.n)

    def set_metrics(self, loss: float, tokens_per_s: float, **extra: float) -> None:
        postfix = {"loss": f"{loss:.4f}", "tok/s": f"{tokens_per_s:,.0f}"}
        postfix.update({k: f"{v:.4g}" for k, v in extra.items()})
        self.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        self.bar.close()


class MetricsLog:
    """`metrics.jsonl`: one JSON object per logged step, flushed as it is written.

    Args:
        path: the file; None keeps the records in memory only.
        append: add to an existing file instead of starting it afresh.
        resume_at: a run resumed from the snapshot of this step: keep the file's lines up to
            this step (and load them into `records`), drop later ones (written before the
            crash, they are trained again), then append. So every step appears once.
    """

    def __init__(self, path: str | None, append: bool = False, resume_at: int | None = None):
        self.path = path
        self.records: list[dict[str, Any]] = []
        if path and resume_at is not None:
            self.records = _records_up_to(path, resume_at)
            tmp = f"{path}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in self.records)
            os.replace(tmp, path)  # atomic: a crash here leaves the old file or the new one
            append = True
        self._file = open(path, "a" if append else "w", encoding="utf-8") if path else None  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        record = {k: _finite(v) for k, v in record.items()}
        self.records.append(record)
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None


def _records_up_to(path: str, step: int) -> list[dict[str, Any]]:
    """The records of `path` with step <= `step`; a torn last line (a crash mid-write) is dropped."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("step", 0) <= step:
                out.append(record)
    return out


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: str, obj: dict[str, Any]) -> None:
    """Write `obj` as indented JSON, atomically (temp file, then rename)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({k: _finite(v) for k, v in obj.items()}, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def format_summary(summary: dict[str, Any]) -> str:
    """The few lines printed at the end of a run."""
    def fmt(key: str, v: Any) -> str:
        if key == "eval_accuracy":
            return f"{v:.1%}"
        if isinstance(v, float):
            return f"{v:,.0f}" if v >= 1000 else f"{v:.4g}"
        return str(v)

    first = ["steps", "world_size", "strategy", "train_loss", "eval_loss", "eval_accuracy",
             "tokens_per_s", "wall_s", "restarts"]
    parts = [f"{k}={fmt(k, summary[k])}" for k in first if summary.get(k) is not None]
    lines = ["summary: " + "  ".join(parts)]
    if summary.get("sample"):
        lines.append("sample: " + str(summary["sample"]))
    lines.append(f"param_sha256: {summary.get('param_sha256')}")
    if summary.get("run_dir"):
        lines.append(f"run directory: {summary['run_dir']} (config.json, metrics.jsonl, summary.json, "
                     "report.png)")
    return "\n".join(lines)
