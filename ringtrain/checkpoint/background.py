"""A snapshot saved in the background: state copied to host memory in the step, written by a thread.

    host = HostCopy()
    staged, ready = host.copy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    save = BackgroundSave(step, lambda: (ready(), write(staged))[1])   # the step loop goes on
    ...
    result = save.result()        # joins the thread; raises what the write raised

`SnapshotManager` (`snapshot.py`) uses both when its `background` is on (the trainer's default,
`--sync-snapshots` for the old behaviour): `save` copies the state here and hands the write,
the ranks' handshake and the commit to a `BackgroundSave`. This is torch.distributed.checkpoint's
`async_save` in small: stage to host memory (pinned on CUDA), then a background writer.

Why copy at all: the optimizer changes parameters and moments *in place* at the next step, and
a write takes seconds, so the writer must read a copy that nothing else touches. The copy keeps
what `torch.save` would have written exactly (tensors that share a storage still share one, a
view keeps its offset and strides), so a snapshot saved in the background is byte for byte the
one a synchronous save writes. Tests: `.venv/bin/pytest -q tests/test_async_snapshots.py`.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["BackgroundSave", "HostCopy"]


class HostCopy:
    """Copies of state dicts in host memory, into buffers kept from one save to the next.

    The buffers are keyed by the source's storage (device, address, size): parameters and
    optimizer moments keep their storage across steps, so from the second save on nothing is
    allocated (a pinned allocation costs milliseconds per megabyte on CUDA). A buffer is
    reused only by the next `copy`, which the manager makes after the previous write finished.

    .. warning:: Objects that are not tensors, numpy arrays or containers (dict, list, tuple)
       are kept by reference, not copied: `state_dict()` builds them afresh, and a deep copy
       would pickle them once more in the step.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.UntypedStorage] = {}
        self.bytes = 0  # copied by the last `copy`

    def copy(self, obj: Any) -> tuple[Any, Callable[[], None]]:
        """`obj` with every tensor copied to host memory; and `ready()`, which waits until the
        device-to-host copies have landed (call it on the writer's thread, not in the step).
        """
        used: dict[tuple[Any, ...], torch.UntypedStorage] = {}
        devices: set[torch.device] = set()
        staged = self._walk(obj, used, devices)
        self._buffers = used  # storages gone since the last save free their buffers
        self.bytes = sum(s.nbytes() for s in used.values())
        # From CUDA the copies are queued on the current stream (pinned memory, non_blocking):
        # the step goes on at once, and the writer waits for this event before reading them.
        # The stream runs them before the next step's kernels change the parameters.
        events = []
        for device in devices:
            event = torch.Event(device=device)
            event.record()
            events.append(event)

        def ready() -> None:
            for event in events:
                event.synchronize()
        return staged, ready

    def _walk(self, obj: Any, used: dict, devices: set) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, used, devices)
        if isinstance(obj, dict):
            out = copy.copy(obj)  # the same type and attributes (a state_dict's `_metadata`)
            for k, v in obj.items():
                out[k] = self._walk(v, used, devices)
            return out
        if type(obj) is list:
            return [self._walk(v, used, devices) for v in obj]
        if type(obj) is tuple:
            return tuple(self._walk(v, used, devices) for v in obj)
        if isinstance(obj, np.ndarray):
            return obj.copy()
        return obj

    def _tensor(self, t: torch.Tensor, used: dict, devices: set) -> torch.Tensor:
        if (type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided
                or t.is_quantized or t.device.type == "meta"):
            return t.detach().to("cpu", copy=True)  # rare kinds: a plain copy, no buffer reuse
        source = t.untyped_storage()
        key = (t.device, source.data_ptr(), source.nbytes())
        host = used.get(key)
        if host is None:  # the first tensor on this storage copies all of it, as torch.save
            host = self._buffers.get(key)
            if host is None:
                host = torch.empty(source.nbytes(), dtype=torch.uint8,
                                   pin_memory=t.device.type == "cuda").untyped_storage()
            on_device = t.device.type != "cpu"
            host.copy_(source, non_blocking=on_device)
            if on_device:
                devices.add(t.device)
            used[key] = host
        return torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())


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
