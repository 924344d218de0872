"""The host copy of a snapshot's state: buffers kept from save to save, part copied beside the step.

    host = HostCopy()
    staged = host.copy(state, later=model_and_optimizer_tensors)  # buffers now, the rest later
    staged.guard([optimizer])     # optimizer.step() waits until the copy has landed
    ...                           # the writer thread: staged.finish(), then it reads staged.state
    staged.unguard()              # once the save is joined

Why copy at all: the optimizer changes parameters and moments *in place* at the next step, and
a write takes seconds, so the writer must read a copy that nothing else touches. The copy keeps
what `torch.save` would have written exactly (tensors that share a storage still share one, a
view keeps its offset and strides), so a snapshot saved in the background is byte for byte the
one a synchronous save writes. `guard` is torch.distributed.checkpoint's
`synchronize_staging()`, called by the optimizer itself (a step pre-hook) rather than the loop.

When the copy runs (the rule). A tensor the strategy declares as changed only by its optimizer
step (`Strategy.updated_state()`: parameters, optimizer moments) is copied *beside* the next
step's forward and backward, and the optimizer's next `step()` waits for it: on CUDA the copy
runs on a side stream and the optimizer's stream waits for its event (no host sync); on the
CPU the writer thread copies it first thing (`copy_` releases the GIL) and the step waits for a
threading event. Everything else (buffers a forward changes in place: BatchNorm's running
stats, DDP's broadcast of buffers; state a backward changes: PowerSGD's error feedback) is
copied at once, in the snapshot's step. A strategy that declares nothing has all its state
copied in the step, as before. Tests: `.venv/bin/pytest -q tests/test_async_snapshots.py`.
"""

from __future__ import annotations

import copy
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

__all__ = ["HostCopy", "StagedCopy", "state_bytes"]

_Key = tuple[Any, ...]  # a storage: (device, address, bytes)


def _key(storage: torch.UntypedStorage, device: torch.device) -> _Key:
    return (device, storage.data_ptr(), storage.nbytes())


def _copy(host: torch.UntypedStorage, source: torch.UntypedStorage, non_blocking: bool) -> None:
    """`host.copy_(source)` through byte tensors: a tensor's `copy_` releases the GIL, a
    storage's does not (measured: a Python thread beside a 400 MB storage copy ran 4x slower),
    and the training thread must go on while the writer thread copies."""
    def as_bytes(s: torch.UntypedStorage) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)
    as_bytes(host).copy_(as_bytes(source), non_blocking=non_blocking)


def state_bytes(obj: Any) -> int:
    """Bytes of the tensors' storages in `obj`, each storage once: what `HostCopy` copies."""
    seen: dict[_Key, int] = {}

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            if o.layout == torch.strided and not o.is_quantized and o.device.type != "meta":
                s = o.untyped_storage()
                seen[_key(s, o.device)] = s.nbytes()
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, list | tuple):
            for v in o:
                walk(v)
    walk(obj)
    return sum(seen.values())


class _Deferred:
    """One source storage whose copy waits for `StagedCopy.finish()`: its host buffer (None
    until `finish` allocates it, on the CPU: a first allocation of a gigabyte of page-locked or
    shared memory takes seconds, which the step should not hold) and the staged tensors that
    view it (`set_` onto the buffer once it exists)."""

    def __init__(self, source: torch.UntypedStorage, host: torch.UntypedStorage | None):
        self.source, self.host = source, host
        self.views: list[tuple[torch.Tensor, int, torch.Size, tuple[int, ...]]] = []

    def view(self, t: torch.Tensor) -> torch.Tensor:
        staged = torch.empty(0, dtype=t.dtype)
        if self.host is not None:
            return staged.set_(self.host, t.storage_offset(), t.size(), t.stride())
        self.views.append((staged, t.storage_offset(), t.size(), t.stride()))
        return staged


class StagedCopy:
    """One save's host copy: `state` (what the writer saves), `finish()` on the writer's thread
    before it reads `state`, and `fence()` / `guard()` for the step before it changes the source.

    Args:
        state: the copied object; its deferred tensors hold their values once `finish()` ran.
        later: the deferred CPU storages to copy in `finish()` (keyed as in `buffers`).
        buffers: the `HostCopy`'s buffers, where `finish()` keeps the ones it allocates.
        new_buffer: `HostCopy`'s allocator, `(nbytes, device) -> storage`.
        events: device events `finish()` waits for (the copies queued on a stream).
        side_events: the side stream's events `fence()` makes the current stream wait for.
        staged_s: seconds the step spent on the copy (the buffers and the non-deferred tensors).
    """

    def __init__(self, state: Any, later: dict[_Key, _Deferred], buffers: dict, new_buffer,
                 events: list, side_events: list, staged_s: float, nbytes: int,
                 later_bytes: int):
        self.state, self.staged_s, self.bytes = state, staged_s, nbytes
        self.later_bytes = later_bytes  # copied beside the next step (CPU and device)
        self._later, self._buffers, self._new_buffer = later, buffers, new_buffer
        self._events, self._side_events = events, side_events
        self._landed = threading.Event()
        if not later:
            self._landed.set()
        self.overlap_s = 0.0  # seconds the deferred copy took beside the step (writer's clock)
        self._hooks: list = []

    def finish(self) -> None:
        """The writer's thread, before it reads `state`: copy the deferred host tensors, wait
        for the device's copies; the step's `fence()` returns from then on."""
        t0 = time.monotonic()
        try:
            for key, d in self._later.items():
                if d.host is None:
                    d.host = self._buffers[key] = self._new_buffer(d.source.nbytes(), key[0])
                    for staged, offset, size, stride in d.views:
                        staged.set_(d.host, offset, size, stride)
                _copy(d.host, d.source, False)  # the GIL released: the step goes on meanwhile
        finally:
            self._later = {}  # the sources are the live parameters: hold no reference to them
            self._landed.set()  # before the device's wait: the step's fence needs only this
        for event in self._events:
            event.synchronize()
        self.overlap_s = time.monotonic() - t0

    def fence(self) -> None:
        """Before anything changes the deferred tensors (the optimizer step): wait for their copy.

        On the CPU this waits for the writer thread's `finish()`; on CUDA the current stream waits
        for the side stream's event, so later kernels (the optimizer's) run after the copy and the
        host does not wait at all.
        """
        for event in self._side_events:
            torch.accelerator.current_stream(event.device).wait_event(event)
        self._side_events = []
        self._landed.wait()

    def guard(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Make each optimizer's next `step()` call `fence()` first (a step pre-hook, removed by
        `unguard`); a step that comes after the copy landed costs one event check."""
        for optimizer in optimizers:
            self._hooks.append(optimizer.register_step_pre_hook(lambda *_: self.fence()))

    def unguard(self) -> None:
        """Remove the pre-hooks (the caller's thread, once the save is joined)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


class HostCopy:
    """Copies of state dicts in host memory, into buffers kept from one save to the next.

    Args:
        shared: allocate the buffers in shared memory, so a writer process reads them without a
            copy (`ringtrain.checkpoint.writer`); on CUDA they are page-locked too.

    The buffers are keyed by the source's storage (device, address, size): parameters and
    optimizer moments keep their storage across steps, so from the second save on nothing is
    allocated (a pinned allocation costs milliseconds per megabyte on CUDA). A buffer is
    reused only by the next `copy`, which the manager makes after the previous write finished.

    .. warning:: Objects that are not tensors, numpy arrays or containers (dict, list, tuple)
       are kept by reference, not copied: `state_dict()` builds them afresh, and a deep copy
       would pickle them once more in the step.
    """

    def __init__(self, shared: bool = False) -> None:
        self.shared = shared
        self._buffers: dict[_Key, torch.UntypedStorage] = {}
        self._side: dict[torch.device, Any] = {}  # a side stream per device, made once
        self.bytes = 0  # copied by the last `copy`

    def copy(self, obj: Any, later: Iterable[torch.Tensor] = ()) -> StagedCopy:
        """`obj` with every tensor copied to host memory; tensors sharing a storage with one of
        `later` are copied beside the next step instead (see the module's rule)."""
        t0 = time.monotonic()
        deferred = {_key(t.untyped_storage(), t.device) for t in later}
        used: dict[_Key, torch.UntypedStorage] = {}
        pending: dict[_Key, _Deferred] = {}
        devices: set[torch.device] = set()
        state = self._walk(obj, used, devices, (deferred, pending))
        self._buffers = used  # storages gone since the last save free their buffers
        self.bytes = sum(s.nbytes() for s in used.values())
        later_bytes = sum(d.source.nbytes() for d in pending.values())
        self.bytes += sum(d.source.nbytes() for d in pending.values() if d.host is None)
        # From CUDA the copies of now are queued on the current stream (pinned memory,
        # non_blocking): the step goes on at once, and the stream runs them before the next
        # step's kernels change the buffers. The writer waits for this event before reading.
        events, side_events = [], []
        for device in devices:
            event = torch.Event(device=device)
            event.record()
            events.append(event)
        later_cpu = {key: d for key, d in pending.items() if key[0].type == "cpu"}
        by_device: dict[torch.device, list] = {}
        for key, d in pending.items():
            if key[0].type != "cpu":
                by_device.setdefault(key[0], []).append((d.host, d.source))
        for device, pairs in by_device.items():
            # The side stream first waits for the work queued so far (the optimizer step that
            # made this state), then copies while the current stream runs the next forward;
            # `fence` makes the current stream wait for it before the optimizer's kernels.
            side = self._side.get(device) or torch.Stream(device=device)
            self._side[device] = side
            side.wait_stream(torch.accelerator.current_stream(device))
            with side:
                for host, source in pairs:
                    _copy(host, source, True)
            event = torch.Event(device=device)
            event.record(side)
            events.append(event)
            side_events.append(event)
        return StagedCopy(state, later_cpu, used, self._new_buffer, events, side_events,
                          time.monotonic() - t0, self.bytes, later_bytes)

    def _walk(self, obj: Any, used: dict, devices: set, later: tuple) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, used, devices, later)
        if isinstance(obj, dict):
            out = copy.copy(obj)  # the same type and attributes (a state_dict's `_metadata`)
            for k, v in obj.items():
                out[k] = self._walk(v, used, devices, later)
            return out
        if type(obj) is list:
            return [self._walk(v, used, devices, later) for v in obj]
        if type(obj) is tuple:
            return tuple(self._walk(v, used, devices, later) for v in obj)
        if isinstance(obj, np.ndarray):
            return obj.copy()
        return obj

    def _new_buffer(self, nbytes: int, device: torch.device) -> torch.UntypedStorage:
        if not self.shared:
            return torch.empty(nbytes, dtype=torch.uint8,
                               pin_memory=device.type == "cuda").untyped_storage()
        host = torch.empty(nbytes, dtype=torch.uint8).share_memory_().untyped_storage()
        if device.type == "cuda" and nbytes:
            # Page-locked in place, as DCP's stager does with its shared buffers, so the copy
            # from the device is asynchronous; unregistered when the buffer is freed.
            cudart = torch.cuda.cudart()
            ptr = host.data_ptr()
            if int(cudart.cudaHostRegister(ptr, nbytes, 1)) == 0:  # 1: cudaHostRegisterPortable
                weakref.finalize(host, cudart.cudaHostUnregister, ptr)
        return host

    def _tensor(self, t: torch.Tensor, used: dict, devices: set, later: tuple) -> torch.Tensor:
        if (type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided
                or t.is_quantized or t.device.type == "meta"):
            return t.detach().to("cpu", copy=True)  # rare kinds: a plain copy, no buffer reuse
        source = t.untyped_storage()
        key = _key(source, t.device)
        deferred, pending = later
        if key in deferred:  # copied by `finish` (CPU) or on the side stream (device)
            d = pending.get(key)
            if d is None:
                host = self._buffers.get(key)
                if host is None and t.device.type != "cpu":  # the side stream copies at once
                    host = self._new_buffer(source.nbytes(), t.device)
                d = pending[key] = _Deferred(source, host)
                if host is not None:
                    used[key] = host
            return d.view(t)
        host = used.get(key)
        if host is None:  # the first tensor on this storage copies all of it, as torch.save
            host = self._buffers.get(key)
            if host is None:
                host = self._new_buffer(source.nbytes(), t.device)
            on_device = t.device.type != "cpu"
            _copy(host, source, on_device)
            if on_device:
                devices.add(t.device)
            used[key] = host
        return torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())
