"""What the user sees while a run goes: one progress bar, rank-prefixed messages, the run files.

    python -c "from ringtrain.training.progress import Progress; import time; p = Progress(50); \
[(time.sleep(0.02), p.update(i + 1)) for i in range(50)]; p.close()"

Only rank 0 draws the bar and logs at INFO; every rank logs warnings and errors, prefixed
`[rank r]`, so one rank's trouble is visible and attributable without eight copies of the rest.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import sys
import time
import warnings
from typing import Any, TextIO

from tqdm import tqdm

from ringtrain.checkpoint.run_dir import describe_space
from ringtrain.training.state import RATES

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

    On a terminal it is a tqdm bar redrawn in place. When stderr is not a terminal (a log
    file, a pipe, a batch job's output) redrawing would write a line per refresh, so it prints
    one plain line per `log_every` steps instead (and at the last step), each once.

    Args:
        total: steps in the run.
        enabled: draw it (pass `rank == 0`).
        initial: first step (a resumed run starts past 0).
        log_every: steps between plain lines (default: total / 100).
        file: where it goes (default: sys.stderr).
    """

    def __init__(self, total: int, enabled: bool = True, initial: int = 0,
                 log_every: int | None = None, file: TextIO | None = None):
        self.file = sys.stderr if file is None else file
        self.total, self.initial, self.step = total, initial, initial
        self.log_every = log_every or max(1, total // 100)
        self.enabled = enabled
        self.plain = enabled and not _isatty(self.file)
        self.bar = None
        if enabled and not self.plain:
            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step",
                            dynamic_ncols=True, file=self.file, mininterval=0.5,
                            bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| "
                                       "[{elapsed}<{remaining}{postfix}]")
        self._started = time.perf_counter()
        self._printed = -1  # the last step a plain line was printed for

    def update(self, step: int) -> None:
        self.step = step
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def set_metrics(self, loss: float, rate: float, rate_label: str = "tok/s",
                    **extra: float) -> None:
        postfix = {"loss": f"{loss:.4f}", rate_label: f"{rate:,.0f}"}
        postfix.update({k: f"{v:.4g}" for k, v in extra.items()})
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
        elif self.plain and self._printed != self.step and (
                self.step % self.log_every == 0 or self.step == self.total):
            self._printed = self.step
            print(self._line(postfix), file=self.file, flush=True)

    def _line(self, postfix: dict[str, str]) -> str:
        """`train 120/2000 (6%) loss 2.3456 tok/s 12,345 elapsed 0:00:12 eta 0:03:10`."""
        elapsed = time.perf_counter() - self._started
        done = self.step - self.initial
        eta = elapsed / done * (self.total - self.step) if done > 0 else float("nan")
        metrics = " ".join(f"{k} {v}" for k, v in postfix.items())
        return (f"train {self.step}/{self.total} ({self.step / max(1, self.total):.0%}) {metrics} "
                f"elapsed {_clock(elapsed)} eta {_clock(eta)}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _isatty(file: TextIO) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream: not a terminal
        return False


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class MetricsLog:
    """`metrics.jsonl`: one JSON object per logged step, written (unbuffered) as it comes.

    A write that fails (a full disk) never raises into the training loop: the file is cut back
    to its last whole line, a warning names it and the free space, and the lines wait in
    `unwritten` for the next write or `close` to try again. `records` always holds them all.

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
        self.unwritten: list[str] = []  # lines a failed write left for the next try
        self.error: OSError | None = None  # why they are unwritten
        if path and resume_at is not None:
            self.records = _cut_after(path, resume_at)
            append = True
        self._file = open(path, "ab" if append else "wb", buffering=0) if path else None  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        record = {k: _finite(v) for k, v in record.items()}
        self.records.append(record)
        if self._file:
            self.unwritten.append(json.dumps(record) + "\n")
            self._write_unwritten()

    def _write_unwritten(self) -> None:
        assert self._file is not None
        fd = self._file.fileno()
        size = os.fstat(fd).st_size
        data = memoryview("".join(self.unwritten).encode())
        try:
            while data:
                n = self._file.write(data)  # a full disk: a short write, then ENOSPC
                if not n:
                    raise OSError(errno.EIO, f"write() returned {n}")
                data = data[n:]
        except OSError as e:
            # no torn line: readers and the next try see whole lines
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            if self.error is None:
                logging.getLogger(LOGGER_NAME).warning(
                    "warning: cannot write %s (%s; %s): its lines are kept and written when "
                    "there is room", self.path, e.strerror, describe_space(self.path))
            self.error = e
            return
        self.unwritten, self.error = [], None

    def close(self) -> None:
        if self._file:
            if self.unwritten:
                self._write_unwritten()  # a last try; what still fails stays in `unwritten`
            self._file.close()  # unbuffered: nothing left to flush, so nothing to fail
            self._file = None


def _cut_after(path: str, step: int) -> list[dict[str, Any]]:
    """The records of `path` up to `step`; the file is cut after them, where a later line starts.

    A torn line (a crash mid-write) ends the kept part too. Cutting in place needs no free
    space (a rewrite needs room for a copy) and is one step: a crash leaves either file.
    """
    if not os.path.exists(path):
        return []
    out, keep = [], 0
    with open(path, "rb") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                break
            if not line.endswith(b"\n") or record.get("step", 0) > step:
                break
            out.append(record)
            keep += len(line)
    os.truncate(path, keep)
    return out


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: str, obj: dict[str, Any]) -> None:
    """Write `obj` as indented JSON, atomically (temp file, then rename; no temp file left).

    The temp file is this process's own: the launchers of a job's nodes may write the same
    RUN_DIR/config.json at once (a shared run directory), and one's rename must not take the
    other's temp file away from under it.
    """
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({k: _finite(v) for k, v in obj.items()}, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def format_summary(summary: dict[str, Any]) -> str:
    """The few lines printed at the end of a run."""
    def fmt(key: str, v: Any) -> str:
        if key == "eval_accuracy":
            return f"{v:.1%}"
        if isinstance(v, float):
            return f"{v:,.0f}" if v >= 1000 else f"{v:.4g}"
        return str(v)

    first = ["steps", "world_size", "strategy", "train_loss", "eval_loss", "eval_accuracy",
             *(key for key, _ in RATES.values()), "wall_s", "restarts"]
    parts = [f"{k}={fmt(k, summary[k])}" for k in first if summary.get(k) is not None]
    lines = ["summary: " + "  ".join(parts)]
    if summary.get("sample"):
        lines.append("sample: " + str(summary["sample"]))
    lines.append(f"param_sha256: {summary.get('param_sha256')}")
    if summary.get("run_dir"):
        # The files that are there: no report.png with --no-report, no summary.json on a full disk.
        made = [name for name in ("config.json", "metrics.jsonl", "summary.json", "report.png",
                                  "model.safetensors")
                if os.path.exists(os.path.join(summary["run_dir"], name))]
        lines.append(f"run directory: {summary['run_dir']} ({', '.join(made)})")
    return "\n".join(lines)
