"""A snapshot saved in the background: the host copy (`host_copy.py`), then a writer.

    staged = HostCopy().copy(state, later=model_and_optimizer_tensors)
    staged.guard([optimizer])             # optimizer.step() waits until the copy has landed
    save = BackgroundSave(step, lambda: (staged.finish(), write(staged.state))[1])
    ...                                   # the next forward and backward run beside the copy
    result = save.result()                # joins the thread; raises what the write raised

`SnapshotManager` (`snapshot.py`) uses these through `BackgroundSaves` when its `background` is
on (the trainer's default, `--sync-snapshots` for the old behaviour). This is
torch.distributed.checkpoint's `async_save` in small: stage to host memory (pinned on CUDA),
then a background writer, a thread or a process (`writer.py`). Tests:
`.venv/bin/pytest -q tests/test_async_snapshots.py`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ringtrain.checkpoint.host_copy import HostCopy, StagedCopy, state_bytes
from ringtrain.checkpoint.writer import CannotStartWriter, WriterProcess

__all__ = ["BackgroundSave", "BackgroundSaves"]

log = logging.getLogger("ringtrain")

WRITERS = ("auto", "process", "thread")  # BackgroundSaves.writer
PROCESS_MIN_BYTES = 64 << 20  # "auto" has a writer process write a state at least this large


class BackgroundSave:
    """`fn()` (one snapshot's write, handshake and commit) on a thread of its own.

    Args:
        step: the step being saved (for the thread's name and the caller's messages).
        fn: the save; what it returns is `result()`, what it raises `result()` raises.

    A daemon thread: a process that ends (a crash, an exception in the step loop) does not
    wait for it, and leaves a temp directory that no reader takes for a snapshot. The trainer
    joins it before the run's end and before a stop, so no result is lost.
    """

    def __init__(self, step: int, fn: Callable[[], Any]):
        self.step = step
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True,
                                         name=f"snapshot-writer-{step}")
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller by result()
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> Any:
        """Wait for the save (bounded by its own deadlines); its result, or raise its error."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


class BackgroundSaves:
    """A `SnapshotManager`'s saves in the background: the host copy, who writes the files, and
    the one save in flight.

    `writer` says who serialises, hashes and fsyncs the files: "process" (a long-lived process
    reading shared memory: `writer.py`, DCP's PROCESS type), "thread" (the writer thread itself:
    the simple reference), or "auto" (the default): the process for a state of at least
    PROCESS_MIN_BYTES, the thread below. Measured (docs/train.md): a training thread ran 1.85x
    slower while a thread wrote 400 MB (1.1x beside the process), even with the writer thread
    at nice 10: the GIL, not the CPU, is what a thread takes from training. Below 64 MB a write
    is over in a fraction of a second, and starting a process costs a second or two of CPU.

    .. warning:: The process is started as multiprocessing starts any (forkserver, else spawn),
       which imports the main script again: a script calling the trainer must keep its top-level
       code under `if __name__ == "__main__":` once its state reaches 64 MB.
    """

    def __init__(self) -> None:
        self.writer = "auto"
        self.planned = True  # HostCopy's `planned`: False walks every save's state in full (A/B)
        self.using = "thread"  # the writer of the save in flight (or the last one)
        self._host = HostCopy()
        self._process: WriterProcess | None = None
        self._in_flight: BackgroundSave | None = None
        self._staged: StagedCopy | None = None
        self._no_process = False  # a process could not start here: the thread writes
        self._last_bytes: int | None = None  # the last save's state size (`HostCopy.bytes`)

    def stage(self, state: Any, updated: Any) -> StagedCopy:
        """Copy `state` (deferring `updated.tensors`, guarding `updated.optimizers`, see the
        module's rule) into buffers the chosen writer reads."""
        if self.writer not in WRITERS:
            raise ValueError(f"writer={self.writer!r}: use one of {', '.join(WRITERS)}")
        if self.writer == "auto":
            # The size of the last save's copy, from the second save on: a snapshot's state
            # keeps its storages from save to save, and `state_bytes` would walk it once more
            # in the step (~1.8 ms of Python for a 14-layer GPT and AdamW, beside a replayed
            # copy's ~4 ms). A state that crosses the line changes writer one save late (both
            # write the same files).
            size = self._last_bytes if self._last_bytes is not None else state_bytes(state)
            self.using = "process" if size >= PROCESS_MIN_BYTES else "thread"
        else:
            self.using = self.writer
        if self._no_process:  # no process can start here (found at an earlier save)
            self.using = "thread"
        if self._host.shared != (self.using == "process"):  # a process reads shared memory
            self._host = HostCopy(shared=self.using == "process")
        self._host.planned = self.planned
        staged = self._host.copy(state, later=updated.tensors if updated is not None else ())
        self._last_bytes = self._host.bytes  # every storage of the state, each once
        staged.guard(updated.optimizers if updated is not None else ())
        self._staged = staged
        return staged

    def start(self, step: int, fn: Callable[[], Any]) -> None:
        """Run the save `fn` (which calls the staged copy's `finish()` first) on a thread."""
        self._in_flight = BackgroundSave(step, fn)

    def write_file(self) -> Callable[[Any, Any], dict[str, Any]] | None:
        """The writer process's `write` for the save in flight, or None: the thread writes."""
        if self.using != "process":
            return None
        if self._process is None:
            process = WriterProcess()
            try:
                process.start()
            except CannotStartWriter as e:
                # The thread writes instead: the same files (it reads the shared buffers as
                # any), slower beside training (the GIL), but a save that fails every time
                # would leave the run with no snapshot at all. Said once, not tried again.
                log.warning("warning: %s; the writer thread writes this manager's snapshots "
                            "instead", e)
                self._no_process = True
                self.using = "thread"
                return None
            self._process = process
        return self._process.write

    def drop(self) -> None:
        """The staged copy will not be written (the caller stopped at its step): the
        optimizers step freely again; the buffers stay for the next save."""
        staged, self._staged = self._staged, None
        if staged is not None:
            staged.unguard()

    def wait(self) -> Any:
        """Join the save in flight: its result, or raise its error; None when none was."""
        save, self._in_flight = self._in_flight, None
        staged, self._staged = self._staged, None
        try:
            return save.result() if save is not None else None
        finally:
            if staged is not None:
                staged.unguard()  # the copy has landed: the optimizers step freely again

    @property
    def in_flight(self) -> int | None:
        return self._in_flight.step if self._in_flight is not None else None

    @property
    def writing(self) -> bool:
        return self._in_flight is not None and not self._in_flight.done()

    def close(self) -> None:
        """`wait()`, then stop the writer process, if one was started."""
        try:
            self.wait()
        finally:
            if self._process is not None:
                self._process.close()
                self._process = None
