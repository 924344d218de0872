"""A writer process: a snapshot's files serialised, hashed and fsynced outside the training process.

    writer = WriterProcess()                       # started at its first write, then kept
    files = writer.write(tmp / "shared.pt", staged) # as files.write_durably, in the process
    writer.close()

Why a process and not the writer thread: a thread shares the interpreter, and a training
thread releases the GIL around every op it runs and must take it back after; with a writer
thread wanting it too (pickling the state's structure, the hashing file wrapper's calls), every
op may wait for a hand-over. Measured (docs/train.md): training steps took 1.85x as long while a
thread wrote 400 MB (also with that thread at nice 10), and 1.0-1.1x while this process did. This is
torch.distributed.checkpoint's `AsyncCheckpointerType.PROCESS`: the staged state lives in
shared memory (`HostCopy(shared=True)`), and only its handles cross the pipe
(torch.multiprocessing's reductions: one file descriptor per storage, a storage shared by
several tensors rebuilt once), so nothing is copied on the way. The process runs one torch
thread at the normal priority: at nice 10 on a loaded machine its write was starved past the
next snapshot (30 s for 230 MB), and the step then waits for it, which costs more than sharing
the CPU.
`SnapshotManager.background_saves.writer` chooses ("auto": this process from 64 MB).

The thread still runs the save's handshake and rank 0's commit (`snapshot.py`), so the
crash-safety argument is unchanged: this process only writes files into the temp directory.
When the training process dies (SIGKILL), the pipe closes: the process finishes at most the file
it is writing, into a temp directory no reader takes for a snapshot, and exits.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from pathlib import Path
from typing import Any

__all__ = ["CannotStartWriter", "WriterProcess"]


class CannotStartWriter(RuntimeError):
    """No writer process can start in this process (it is a multiprocessing daemon)."""


def _serve(conn) -> None:
    """The process: `write_durably` each (seq, path, obj) received; reply (seq, ok, value)."""
    import torch

    from ringtrain.checkpoint.files import write_durably

    torch.set_num_threads(1)
    while True:
        try:
            seq, path, obj = conn.recv()
        except (EOFError, OSError):  # the training process is gone (or closed us): stop
            return
        try:
            reply = (seq, True, write_durably(Path(path), obj))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            reply = (seq, False, e)
        del obj  # drop the shared buffers' mappings before waiting for the next save
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return
        except Exception as e:  # noqa: BLE001 - an error that does not pickle: its words
            conn.send((seq, False, RuntimeError(repr(e))))


class WriterProcess:
    """One long-lived process that writes snapshot files for this rank (see the module).

    `write` may be called from any thread; calls are served one at a time. A call abandoned at
    its deadline (a stuck disk) leaves its reply behind: the next call skips it by number.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn = None
        self._process: mp.process.BaseProcess | None = None
        self._seq = 0

    def _start(self) -> None:
        if self._process is not None and self._process.is_alive():
            return
        # Never a plain fork of this process (it holds a process group, threads, perhaps CUDA):
        # a forkserver's child (a clean server; ~0.1 s where one runs already, as under
        # `ringtrain.testing`, and it imports torch once for every writer after), else spawn.
        ctx = mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods()
                             else "spawn")
        mine, theirs = ctx.Pipe()
        process = ctx.Process(target=_serve, args=(theirs,), daemon=True,
                              name="ringtrain-snapshot-writer")
        try:
            process.start()
        except AssertionError as e:  # multiprocessing's words for "a daemon has no children"
            mine.close()
            theirs.close()
            raise CannotStartWriter(f"the snapshot writer process cannot start here ({e}: "
                                    "this process is a multiprocessing daemon)") from None
        self._process = process  # only once started: `close` joins it
        theirs.close()
        self._conn = mine

    def start(self) -> None:
        """Start the process now (`write` does at its first call); raises `CannotStartWriter`
        where none can start (a multiprocessing daemon, as `ringtrain.testing`'s workers)."""
        with self._lock:
            self._start()

    def write(self, path: Path, obj: Any) -> dict[str, Any]:
        """`files.write_durably(path, obj)` in the process: its checksum and size, or its error.

        Tensors in `obj` should be in shared memory (`HostCopy(shared=True)`); others are moved
        there by torch's reductions on the way (a copy).
        """
        # torch.multiprocessing registers the reductions that send tensors as handles.
        import torch.multiprocessing  # noqa: F401

        with self._lock:
            self._start()
            self._seq += 1
            seq = self._seq
            try:
                self._conn.send((seq, str(path), obj))
                while True:
                    got, ok, value = self._conn.recv()
                    if got == seq:
                        break
            except (EOFError, ConnectionError) as e:  # not a pickling error: those are the state's
                self._process.join(1.0)
                code = self._process.exitcode
                self._process = None  # the next write starts a new one
                raise OSError(f"the snapshot writer process ended (exit code {code}) while "
                              f"writing {path} ({e!r})") from None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """Stop the process (it ends when its pipe closes); wait briefly for it."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            if self._process is not None:
                self._process.join(5.0)
                if self._process.is_alive():
                    self._process.kill()
                self._process = None
