"""Device staging: a snapshot's deferred CUDA storages copied on the device in the step.

    staging = DeviceStaging()
    staged = staging.plan(sources)           # {key: storage} deferred -> the devices staged
    buffer = staging.buffer(key, source)     # a device buffer, kept from save to save
    # host_copy.py copies source -> buffer on the current stream, after the optimizer step;
    # the writer thread copies buffer -> pinned host memory on a side stream, then reads it

Why: without it the parameters and moments (`Strategy.updated_state()`) go device -> host on a
side stream beside the next step, and that step's optimizer waits for the copy (`fence`): 1.2 GB
at 25-50 GB/s is 25-50 ms, a whole 30 ms step of a 100 M-parameter GPT on an H100. A copy on the
device of the same bytes runs at the device's memory bandwidth (TB/s), and is queued on the
current stream right after the optimizer step that made the state, so the next optimizer step
(the same stream) cannot reach the copy's source before it: nothing waits on the host or in a
fence. The slow device -> host copy then reads the staging buffer, which nothing in training
touches, so it guards nothing. It runs on the writer's thread, which also allocates the pinned
(or registered shared) host buffers there on the first save: seconds for a gigabyte, off the step.

The rule (which path, and what is kept). A CUDA device is staged when `torch.cuda.mem_get_info`'s
free bytes plus the staging bytes already held there are at least 2 x its deferred bytes +
MARGIN_BYTES (1 GiB): room for the buffers, and as much again plus a GiB left to training, whose
own peak was reached before the first snapshot (a snapshot follows a step). The buffers are KEPT
from save to save: GPU memory equal to the deferred state (about the whole state) for as long as
saves keep finding the margin; a save that does not frees them (back to torch's caching allocator,
where training's allocations reuse them) and takes the side-stream path, as does every device
that is not CUDA. A buffer whose source storage is gone is freed at the next save. The log says
when buffers are first kept or freed, with the figures. Tests:
`.venv/bin/pytest -q tests/test_async_snapshots.py -k cuda` (skipped without a GPU).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["MARGIN_BYTES", "DeviceStaging"]

log = logging.getLogger("ringtrain")

MARGIN_BYTES = 1 << 30  # free device memory left to training beyond twice the staged state

_Key = tuple[Any, ...]  # a storage: (device, address, bytes), as host_copy keys it


class DeviceStaging:
    """Device buffers for the deferred storages of one `HostCopy`, and the rule that keeps them.

    `paths` holds, per device of the last `plan`, the words the snapshot's log line says.
    """

    def __init__(self) -> None:
        self._buffers: dict[_Key, torch.UntypedStorage] = {}
        self.paths: dict[torch.device, str] = {}
        self._said: dict[torch.device, bool] = {}  # staged or not, as last logged

    @property
    def held_bytes(self) -> int:
        return sum(b.nbytes() for b in self._buffers.values())

    def plan(self, sources: dict[_Key, torch.UntypedStorage]) -> set[torch.device]:
        """The devices whose deferred storages (`sources`) are staged at this save (the rule in
        the module's docstring); frees the buffers no longer wanted."""
        need: dict[torch.device, int] = {}
        for key, source in sources.items():
            need[key[0]] = need.get(key[0], 0) + source.nbytes()
        staged: set[torch.device] = set()
        self.paths = {}
        for device, nbytes in need.items():
            if device.type != "cuda":  # mem_get_info is CUDA's: other devices do not stage
                self.paths[device] = "on a side stream the next optimizer step waits for"
                continue
            held = sum(b.nbytes() for k, b in self._buffers.items()
                       if k[0] == device and k in sources)
            free = torch.cuda.mem_get_info(device)[0]
            want = 2 * nbytes + MARGIN_BYTES
            if free + held >= want:
                staged.add(device)
                self.paths[device] = (f"from a copy on {device} made in the step "
                                      f"({nbytes / 1e6:.1f} MB of device memory kept for it "
                                      "from save to save)")
            else:
                self.paths[device] = (
                    f"on a side stream the next optimizer step waits for (no staging on "
                    f"{device}: {(free + held) / 1e9:.2f} GB free < {want / 1e9:.2f} GB, twice "
                    f"the {nbytes / 1e6:.1f} MB staged + 1 GiB)")
            self._say(device, device in staged, nbytes, free, want)
        # Kept: the buffers of storages still deferred on a staged device; the rest is freed.
        self._buffers = {k: b for k, b in self._buffers.items() if k[0] in staged and k in sources}
        return staged

    def _say(self, device: torch.device, staged: bool, nbytes: int, free: int, want: int) -> None:
        if self._said.get(device) == staged:
            return
        if staged:
            log.info("snapshots on %s: the parameters and moments (%.1f MB) are staged by a "
                     "copy on the device in the step, into buffers kept from save to save (that "
                     "much device memory; %.2f GB free)", device, nbytes / 1e6, free / 1e9)
        elif device in self._said:  # staged before: its buffers are freed now
            log.info("snapshots on %s: device staging stopped, its %.1f MB of buffers freed: "
                     "%.2f GB free < %.2f GB (twice the state + 1 GiB); the copy to the host "
                     "runs on a side stream the optimizer waits for", device, nbytes / 1e6,
                     free / 1e9, want / 1e9)
        else:
            log.info("snapshots on %s: no device staging (%.2f GB free < %.2f GB, twice the "
                     "%.1f MB state + 1 GiB): the copy to the host runs on a side stream the "
                     "optimizer waits for", device, free / 1e9, want / 1e9, nbytes / 1e6)
        self._said[device] = staged

    def buffer(self, key: _Key, source: torch.UntypedStorage) -> torch.UntypedStorage:
        """The staging buffer of `source` (allocated on its device at its first save, on the
        current stream: the stream of the copy into it)."""
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = torch.empty(source.nbytes(), dtype=torch.uint8,
                                 device=key[0]).untyped_storage()
            self._buffers[key] = buffer
        return buffer
