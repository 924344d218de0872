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
step's forward and backward. On CUDA with the memory for it (`device_staging.py`'s rule), the
step copies it on the device into staging buffers kept from save to save, on the current stream
after the optimizer step (at the device's memory bandwidth: nothing waits), and the writer
thread copies those to pinned host memory on a side stream, allocating that memory there at the
first save. Without the memory (or on another accelerator) the copy to the host runs on a side
stream and the optimizer's next `step()` waits for its event (a stream wait, no host sync); its
host buffers are allocated in the step at the first save (the side stream copies at once). On
the CPU the writer thread copies it first thing (`copy_` releases the GIL) and the optimizer's
next step waits for a threading event. Everything else (buffers a forward changes in place:
BatchNorm's running stats, DDP's broadcast of buffers; state a backward changes: PowerSGD's
error feedback) is copied at once, in the snapshot's step. A strategy that declares nothing
has all its state copied in the step, as before. Tests:
`.venv/bin/pytest -q tests/test_async_snapshots.py`.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ringtrain.checkpoint.copy_plan import CopyPlan, Stale, rebuild
from ringtrain.checkpoint.device_staging import DeviceStaging
from ringtrain.checkpoint.kept_views import ByteViews, HostViews

__all__ = ["HostCopy", "StagedCopy", "state_bytes"]

_Key = tuple[Any, ...]  # a storage: (device, address, bytes)
_CPU = torch.device("cpu")  # where every host buffer is


def _key(storage: torch.UntypedStorage, device: torch.device) -> _Key:
    return (device, storage.data_ptr(), storage.nbytes())


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
    until `finish` allocates it, on the CPU and from device staging: a first allocation of a
    gigabyte of page-locked or shared memory takes seconds, which the step should not hold),
    its device staging buffer (None unless staged: what `finish` copies from) and the staged
    tensors that view it (`set_` onto the buffer once it exists). `pair`: what the copy to the
    host copies instead of (host, source), where a plan has tensors covering both (a replay)."""

    def __init__(self, source: torch.UntypedStorage, host: torch.UntypedStorage | None,
                 staging: torch.UntypedStorage | None = None, pair: tuple | None = None):
        self.source, self.host, self.staging, self.pair = source, host, staging, pair
        self.views: list[tuple[torch.Tensor, int, torch.Size, tuple[int, ...]]] = []

    def view(self, t: torch.Tensor, views: HostViews, key: _Key) -> torch.Tensor:
        if self.host is not None:
            return views.view(self.host, key, t)
        staged = torch.empty(0, dtype=t.dtype)
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
        staged: the device-staged storages `finish()` copies to the host (keyed as `later`).
        sides: per staged device, (its side stream, the event recorded after the step's copies).
        path: how the deferred state reaches the host, in words (the snapshot's log line).
    """

    def __init__(self, state: Any, later: dict[_Key, _Deferred], buffers: dict, new_buffer,
                 events: list, side_events: list, staged_s: float, nbytes: int,
                 later_bytes: int, staged: dict[_Key, _Deferred] | None = None,
                 sides: dict | None = None, path: str = "", copies: ByteViews | None = None):
        self.state, self.staged_s, self.bytes = state, staged_s, nbytes
        self._copies = copies if copies is not None else ByteViews()
        self.later_bytes = later_bytes  # copied beside the next step (CPU and device)
        self.path = path
        self._later, self._buffers, self._new_buffer = later, buffers, new_buffer
        self._staged, self._sides = staged or {}, sides or {}
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
                self._host(key, d)
            # One call for all (the GIL released once): the step goes on meanwhile.
            self._copies.copy_all([d.pair or (d.host, d.source) for d in self._later.values()],
                                  False)
        finally:
            self._later = {}  # the sources are the live parameters: hold no reference to them
            self._landed.set()  # before the device's wait: the step's fence needs only this
        try:
            # Device staging: the staging buffers (which training never touches) go to the host
            # on the side stream, once the step's copies into them are done; nothing waits here
            # but this thread, so the host buffers are allocated here, not in the step. This
            # thread's current device is its own (device 0 when new): the source's, for the
            # page-locking of a shared buffer (no context made on another GPU).
            by_device: dict[torch.device, list[tuple[_Key, _Deferred]]] = {}
            for key, d in self._staged.items():
                by_device.setdefault(key[0], []).append((key, d))
            for device, staged in by_device.items():
                side, ready = self._sides[device]
                with torch.accelerator.device_index(device.index):
                    for key, d in staged:
                        self._host(key, d)
                    side.wait_event(ready)
                    with side:  # one call per device, not one per buffer (the GIL held less)
                        self._copies.copy_all([(d.host, d.staging) for _, d in staged], True,
                                              ours=True)
            for device, (side, _) in self._sides.items():
                event = torch.Event(device=device)
                event.record(side)
                self._events.append(event)
        finally:
            self._staged = {}
        for event in self._events:
            event.synchronize()
        self.overlap_s = time.monotonic() - t0

    def _host(self, key: _Key, d: _Deferred) -> None:
        """Allocate `d`'s host buffer if it has none yet (kept for the next save), and set the
        staged tensors that view it onto it."""
        if d.host is None:
            d.host = self._buffers[key] = self._new_buffer(d.source.nbytes(), key[0])
            for staged, offset, size, stride in d.views:
                staged.set_(d.host, offset, size, stride)

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
        batched: queue the storages' copies a few calls at a time (torch's foreach copy: one
            per device pair and stream, in the step and on the writer's thread); False: one
            call per storage, the reference. The files are the same, byte for byte.
        planned: replay the last save's walk where the state is the same (`copy_plan.py`: the
            step's Python per tensor cut to a check); False: walk in full at every save, the
            reference. The files are the same, byte for byte.

    The buffers are keyed by the source's storage (device, address, size): parameters and
    optimizer moments keep their storage across steps, so from the second save on nothing is
    allocated (a pinned allocation costs milliseconds per megabyte on CUDA). A buffer is
    reused only by the next `copy`, which the manager makes after the previous write finished.

    .. warning:: Objects that are not tensors, numpy arrays or containers (dict, list, tuple)
       are kept by reference, not copied: `state_dict()` builds them afresh, and a deep copy
       would pickle them once more in the step.
    """

    def __init__(self, shared: bool = False, batched: bool = True, planned: bool = True) -> None:
        self.shared = shared
        self.planned = planned
        self._plan: CopyPlan | None = None  # the last full walk's, for the next save's replay
        self.replays = 0  # saves copied by replaying a plan rather than by the full walk
        self._buffers: dict[_Key, torch.UntypedStorage] = {}
        self._side: dict[torch.device, Any] = {}  # a side stream per device, made once
        self._staging = DeviceStaging()  # device buffers kept from save to save, by its rule
        self._views = HostViews()  # host tensors kept from save to save
        self._bytes = ByteViews(batched)  # the byte tensors copies go through, likewise
        self.bytes = 0  # copied by the last `copy`

    @property
    def copy_calls(self) -> int:
        """Copy calls Python has made for this object's saves, in the step and in `finish` (a
        batch counts one): ~500 a save of a 14-layer GPT and its AdamW state one by one."""
        return self._bytes.calls

    def copy(self, obj: Any, later: Iterable[torch.Tensor] = ()) -> StagedCopy:
        """`obj` with every tensor copied to host memory; tensors sharing a storage with one of
        `later` are copied beside the next step instead (see the module's rule)."""
        t0 = time.monotonic()
        self._views.start()
        self._bytes.start()
        sources = {_key(t.untyped_storage(), t.device): t.untyped_storage() for t in later}
        on_device = {k: s for k, s in sources.items() if k[0].type != "cpu"}
        staged = self._staging.plan(on_device) if on_device else set()
        body = None
        plan, self._plan = self._plan, None
        if plan is not None and self.planned and plan.fits(sources.keys(), staged):
            try:
                body = plan.replay(obj, sources, self._staging.buffer, _Deferred)
                self._plan = plan
                self.replays += 1
            except Stale:
                pass  # walked in full below, and a new plan recorded
        if body is None:
            body = self._walk_all(obj, sources, staged)
        state, used, pending, devices, queued = body
        for (_, source_device), pairs in queued.items():
            # Queued now, in one call per pair of devices (the staging copies on one device
            # apart from those to the host: torch's fast path takes one device), on the current
            # stream: the events below are recorded after them.
            self._bytes.copy_all(pairs, source_device.type != "cpu")
        self._buffers = used  # storages gone since the last save free their buffers
        if self._plan is not None and self._plan.bytes is not None:  # replayed: the same sizes
            self.bytes, later_bytes = self._plan.bytes
        else:
            self.bytes = sum(s.nbytes() for s in used.values())
            later_bytes = sum(d.source.nbytes() for d in pending.values())
            self.bytes += sum(d.source.nbytes() for d in pending.values() if d.host is None)
            if self._plan is not None:  # recorded by this walk
                self._plan.bytes = (self.bytes, later_bytes)
        # From CUDA the copies of now (to pinned memory, and into staging buffers) are queued
        # on the current stream, non_blocking: the step goes on at once, and the stream runs
        # them before the next step's kernels change their sources. The writer waits for this
        # event before reading (and staging's side stream before copying to the host).
        events, side_events, sides = [], [], {}
        for device in devices:
            event = torch.Event(device=device)
            event.record()
            events.append(event)
            if device in staged:
                sides[device] = (self._side_stream(device), event)
        later_cpu = {key: d for key, d in pending.items() if key[0].type == "cpu"}
        later_staged = {key: d for key, d in pending.items() if d.staging is not None}
        by_device: dict[torch.device, list] = {}
        for key, d in pending.items():
            if key[0].type != "cpu" and d.staging is None:
                by_device.setdefault(key[0], []).append(d.pair or (d.host, d.source))
        for device, pairs in by_device.items():
            # The side stream first waits for the work queued so far (the optimizer step that
            # made this state), then copies while the current stream runs the next forward;
            # `fence` makes the current stream wait for it before the optimizer's kernels.
            side = self._side_stream(device)
            side.wait_stream(torch.accelerator.current_stream(device))
            with side:
                self._bytes.copy_all(pairs, True)
            event = torch.Event(device=device)
            event.record(side)
            events.append(event)
            side_events.append(event)
        paths = [self._staging.paths[k] for k in sorted(self._staging.paths, key=str)
                 if k in {key[0] for key in pending}]
        if later_cpu:
            paths.append("by the writer thread")
        return StagedCopy(state, later_cpu, used, self._new_buffer, events, side_events,
                          time.monotonic() - t0, self.bytes, later_bytes, later_staged, sides,
                          "; ".join(paths) or "none deferred", self._bytes)

    def _side_stream(self, device: torch.device) -> Any:
        """The device's side stream for copies to the host, made at its first use."""
        side = self._side.get(device)
        if side is None:
            side = self._side[device] = torch.Stream(device=device)
        return side

    def _walk_all(self, obj: Any, sources: dict, staged: set) -> tuple:
        """The full walk (the reference): every tensor keyed, deferred or copied now, given its
        host view; records the plan the next save may replay (`copy_plan.py`)."""
        used: dict[_Key, torch.UntypedStorage] = {}
        pending: dict[_Key, _Deferred] = {}
        devices: set[torch.device] = set()
        queued: dict[tuple[torch.device, torch.device], list] = {}  # (to, from): the copies
        walked: list = []  # per tensor, what the plan records (`CopyPlan.record`)
        bag = (set(sources), pending, staged, queued, walked)
        state = rebuild(obj, lambda t: self._tensor(t, used, devices, bag), {})
        if self.planned:
            self._plan = CopyPlan.record(walked, sources.keys(), staged, pending, used, devices,
                                         list(queued))
        return state, used, pending, devices, queued

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
        deferred, pending, staged, queued, walked = later
        if (type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided
                or t.is_quantized or t.device.type == "meta"):
            walked.append(None)  # no plan: copied afresh at every save
            return t.detach().to("cpu", copy=True)  # rare kinds: a plain copy, no buffer reuse
        source = t.untyped_storage()
        key = _key(source, t.device)
        if key in deferred:  # copied by `finish` (CPU, staging) or on the side stream (device)
            d = pending.get(key)
            if d is None:
                host, staging = self._buffers.get(key), None
                if t.device in staged:  # on the device now; `finish` takes it to the host
                    staging = self._staging.buffer(key, source)
                    queued.setdefault((t.device, t.device), []).append((staging, source))
                    devices.add(t.device)
                elif host is None and t.device.type != "cpu":  # the side stream copies at once
                    host = self._new_buffer(source.nbytes(), t.device)
                d = pending[key] = _Deferred(source, host, staging)
                if host is not None:
                    used[key] = host
            view = d.view(t, self._views, key)
            # A view made before its buffer (`finish` sets it) is this save's alone: no plan.
            walked.append((t, view, None, key) if d.host is not None else None)
            return view
        host = used.get(key)
        first = None
        if host is None:  # the first tensor on this storage copies all of it, as torch.save
            host = self._buffers.get(key)
            if host is None:
                host = self._new_buffer(source.nbytes(), t.device)
            first = ((_CPU, t.device), host)
            queued.setdefault(first[0], []).append((host, source))
            if t.device.type != "cpu":
                devices.add(t.device)
            used[key] = host
        view = self._views.view(host, key, t)
        walked.append((t, view, first, key))
        return view
