"""TensorBoard event files next to metrics.jsonl, for the dashboard people already use.

    pip install 'ringtrain[tensorboard]'          # or: pip install tensorboard
    ringtrain train --steps 200
    tensorboard --logdir runs/                     # one run per run directory

The event files go to RUN_DIR/tensorboard/. Optional: on when the `tensorboard` package can be
imported, off otherwise; the log says which, once, at the start. Only rank 0 writes (the trainer
opens it where it opens metrics.jsonl), the same reduced records as metrics.jsonl:

    loss/train, loss/eval           cross-entropy
    lr                              the learning rate of the step
    throughput/tokens_per_s         all ranks together
    time/step_s, time/compute_s, time/comm_s    a step, and its compute / communication split
    eval/<metric>                   the eval metrics (eval/accuracy for addition)

The records are written and flushed as each metrics line is (a few per hundred steps), in the
calling thread, with tensorboard's own protobuf messages and record framing: unlike
`torch.utils.tensorboard.SummaryWriter`, whose writer thread dies with a traceback of its own
on a full disk, a disk error here is one warning and the end of the event files (metrics.jsonl
keeps every line); nothing raises into the training loop. A resumed run writes a "session
start" at the snapshot's step (what SummaryWriter's `purge_step` does): TensorBoard then hides
what the interrupted run wrote after that step (it is trained again), as metrics.jsonl is cut.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from typing import Any

from ringtrain.training.state import RATES

log = logging.getLogger("ringtrain")

# metrics.jsonl key -> TensorBoard tag; eval_<name> -> eval/<name>; time_s (wall) is left out.
TAGS = {"loss": "loss/train", "eval_loss": "loss/eval", "lr": "lr",
        **{key: f"throughput/{key}" for key, _ in RATES.values()}, "step_s": "time/step_s",
        "compute_s": "time/compute_s", "comm_s": "time/comm_s"}
SUBDIR = "tensorboard"  # RUN_DIR/tensorboard/events.out.tfevents.*: the run dir's listing is fixed


def tag(key: str) -> str | None:
    """The TensorBoard tag of a metrics.jsonl key; None for keys not drawn."""
    if key in TAGS:
        return TAGS[key]
    if key.startswith("eval_"):
        return "eval/" + key[len("eval_"):]
    return None


class EventFile:
    """One tfevents file of scalars (the name TensorBoard looks for), written synchronously.

    Args:
        directory: where the file goes (created).
        purge_step: a resumed run's first step: earlier runs' events from there on are hidden.
    """

    def __init__(self, directory: str, purge_step: int | None = None):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._summary = event_pb2, summary_pb2
        os.makedirs(directory, exist_ok=True)
        base = os.path.join(directory, f"events.out.tfevents.{int(time.time())}."
                                       f"{socket.gethostname()}.{os.getpid()}")
        n = 0
        while os.path.exists(f"{base}.{n}"):  # a second file of this process in this second
            n += 1
        self.path = f"{base}.{n}"  # TensorBoard reads a directory's files in name order
        self._records = RecordWriter(open(self.path, "wb"))  # noqa: SIM115 - closed by close()
        self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step:
            self._write(event_pb2.Event(wall_time=time.time(), step=purge_step,
                                        session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))

    def _write(self, event: Any) -> None:
        self._records.write(event.SerializeToString())
        self._records.flush()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """One event holding `values` (tag -> value) at `step`."""
        summary = self._summary.Summary(value=[self._summary.Summary.Value(tag=k, simple_value=v)
                                               for k, v in values.items()])
        self._write(self._event.Event(wall_time=time.time(), step=step, summary=summary))

    def close(self) -> None:
        self._records.close()


def open_event_file(run_dir: str, purge_step: int | None = None) -> EventFile | None:
    """An `EventFile` in `run_dir`/tensorboard, or None (said in the log) when it cannot be."""
    try:
        import tensorboard  # noqa: F401 - is it installed?
    except ImportError as e:
        log.info("TensorBoard: off (%s); `pip install tensorboard` to get event files", e)
        return None
    path = os.path.join(run_dir, SUBDIR)
    try:
        writer = EventFile(path, purge_step)
    except OSError as e:  # a full or read-only disk: the run goes on without it
        log.warning("warning: TensorBoard: off, cannot write %s (%s)", path, e)
        return None
    log.info("TensorBoard: event files in %s (tensorboard --logdir %s)", path, run_dir)
    return writer


class TensorBoardLog:
    """A `MetricsLog` that also writes each record to TensorBoard (when it is installed).

    Args:
        metrics: the log it stands in for (metrics.jsonl); `records`, `write` and `close` go
            through to it, and anything else it has.
        run_dir: where the event files go (under `tensorboard/`).
        resume_step: the snapshot step a resumed run starts from (0: a new run).
    """

    def __init__(self, metrics: Any, run_dir: str, resume_step: int = 0):
        self.metrics = metrics
        self.writer = open_event_file(run_dir, purge_step=resume_step + 1 if resume_step else None)

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.metrics.records

    def write(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        if self.writer is None:
            return
        values = {tag(k): float(v) for k, v in record.items() if tag(k) is not None
                  and isinstance(v, (int, float)) and math.isfinite(v)}
        try:
            self.writer.scalars(record["step"], values)
        except OSError as e:  # a full disk: never raise into the training loop
            self._give_up(e)

    def close(self) -> None:
        try:
            self.metrics.close()
        finally:
            if self.writer is not None:
                try:
                    self.writer.close()
                except OSError as e:
                    self._give_up(e)
                self.writer = None

    def _give_up(self, e: OSError) -> None:
        log.warning("warning: TensorBoard: stopped writing %s (%s); metrics.jsonl has every line",
                    self.writer.path if self.writer else SUBDIR, e.strerror or e)
        self.writer = None

    def __getattr__(self, name: str) -> Any:  # `unwritten`, `error`, `path` of metrics.jsonl
        return getattr(self.metrics, name)
