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

Each tensor crosses once (`_Known`): the copy plan hands out the same host views from save to
save, so after a tensor's first trip only a number stands for it, and the process keeps the
tensor it rebuilt. Sending ~700 tensors' handles again at every save cost the training process
40-58 ms of a thread's CPU per save (pickling with the GIL held, and a file descriptor handed
over per storage by multiprocessing's resource-sharer thread) in the steps after a snapshot;
6.1-6.4 ms with numbers (a 14-layer GPT and AdamW on the 2-core CPU box, session 22).
The training side holds a weak reference to a sent tensor and a strong one to its storage: a
tensor that is freed (a buffer replaced) or no longer views what it viewed when it was sent
(`set_`, checked by signature at every write, ~5 us a tensor) is forgotten on both sides and
sent again as new; numbers are never reused, so a number only ever means the tensor as sent.

The thread still runs the save's handshake and rank 0's commit (`snapshot.py`), so the
crash-safety argument is unchanged: this process only writes files into the temp directory.
When the training process dies (SIGKILL), the pipe closes: the process finishes at most the file
it is writing, into a temp directory no reader takes for a snapshot, and exits.
"""

from __future__ import annotations

import io
import itertools
import multiprocessing as mp
import pickle
import threading
import weakref
from pathlib import Path
from typing import Any

__all__ = ["CannotStartWriter", "WriterProcess"]


class CannotStartWriter(RuntimeError):
    """No writer process can start in this process (it is a multiprocessing daemon)."""


def _signature(t: Any) -> tuple[tuple, Any]:
    """(What the process's copy of `t` was rebuilt from: its storage's address and size, the
    view's layout; the storage, which the record keeps alive, so that no other storage can take
    its address while the number stands). A tensor moved onto another storage (`set_`, or into
    shared memory by its first trip) or reshaped in place no longer matches."""
    storage = t.untyped_storage()
    return (storage.data_ptr(), storage.nbytes(), t.dtype, t.storage_offset(), tuple(t.size()),
            tuple(t.stride())), storage


class _Known:
    """The training side's record of the tensors the process holds, by id: (number, weak ref to
    the tensor, its signature, its storage).

    `message` pickles a state against it without changing it; `sent` records what a message
    said once it is on its way (a state that fails to pickle, or a send that fails, leaves the
    record as the process has it).
    """

    def __init__(self) -> None:
        self._held: dict[int, tuple[int, weakref.ref, tuple, Any]] = {}
        self._numbers = itertools.count()  # never reused: one tensor for the process's life

    def message(self, obj: Any) -> tuple[tuple[bytes, dict[int, Any], list[int]], dict]:
        """((`obj` pickled with a number for each tensor, the tensors new to the process by
        number, the numbers it should forget), the record's changes)."""
        import torch

        held = self._held
        gone = [entry[0] for entry in held.values() if entry[1]() is None]  # freed here
        changed: dict[int, tuple[int, weakref.ref, tuple, Any]] = {}
        new: dict[int, Any] = {}
        numbers = self._numbers

        class Pickler(pickle.Pickler):
            def persistent_id(self, o: Any) -> int | None:
                if not isinstance(o, torch.Tensor):
                    return None
                entry = changed.get(id(o)) or held.get(id(o))
                signature, storage = _signature(o)
                if entry is None or entry[1]() is not o or entry[2] != signature:
                    if entry is not None and entry[1]() is not None:
                        gone.append(entry[0])  # the same tensor, moved: its old copy goes
                    entry = changed[id(o)] = (next(numbers), weakref.ref(o), signature, storage)
                    new[entry[0]] = o
                return entry[0]

        buffer = io.BytesIO()
        Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return (buffer.getvalue(), new, gone), changed

    def sent(self, message: tuple[bytes, dict[int, Any], list[int]], changed: dict) -> None:
        # `gone` has every entry whose tensor was freed (also one whose id a new tensor reuses)
        # or moved; `changed` the entries that replace them.
        gone = set(message[2])
        self._held = {i: e for i, e in self._held.items() if e[0] not in gone}
        self._held.update(changed)


def _loads(data: bytes, held: dict[int, Any]) -> Any:
    class Unpickler(pickle.Unpickler):
        def persistent_load(self, number: int) -> Any:
            return held[number]

    return Unpickler(io.BytesIO(data)).load()


def _serve(conn) -> None:
    """The process: `write_durably` each (seq, path, (data, new, gone)) received, its tensors
    the ones held by number; reply (seq, ok, value)."""
    import torch

    from ringtrain.checkpoint.files import write_durably

    torch.set_num_threads(1)
    held: dict[int, Any] = {}  # number -> tensor (its storage mapped from shared memory)
    while True:
        try:
            seq, path, (data, new, gone) = conn.recv()
        except (EOFError, OSError):  # the training process is gone (or closed us): stop
            return
        for number in gone:  # freed on the training side: unmap ours
            held.pop(number, None)
        held.update(new)
        del new
        try:
            reply = (seq, True, write_durably(Path(path), _loads(data, held)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            reply = (seq, False, e)
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
        self._known = _Known()  # what this process holds; a new process holds nothing

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
        self._known = _Known()

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
            message, changed = self._known.message(obj)  # the state's pickling errors raise here
            try:
                self._conn.send((seq, str(path), message))
                self._known.sent(message, changed)
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
