"""Where a snapshot step's time goes: `snapshot_stall.py --phases`.

Wraps the save's parts (the loop's two halves around the metrics line, the host copy, device
staging's plan, buffer allocation, the optimizer's fence, the writer thread's `finish` and
write) to record each call's wall-clock interval and thread, and prints, for every snapshot
step and the steps after it, how much of the step's window (the host's) each part covered.
A diagnosis, not a figure: the wrappers cost microseconds a call, and only the benchmark's own
process is seen (not the writer process).
"""

from __future__ import annotations

import functools
import importlib
import threading
import time

PARTS = {  # name: (module, class, method)
    "loop.stage": ("ringtrain.training.snapshots", "LoopSnapshots", "stage"),
    "metrics.line": ("ringtrain.training.trainer", "Trainer", "_log"),  # waits for the device
    "loop.save": ("ringtrain.checkpoint.loop_save", "LoopSave", "save"),
    "manager.stage": ("ringtrain.checkpoint.snapshot", "SnapshotManager", "stage"),
    "host.copy": ("ringtrain.checkpoint.host_copy", "HostCopy", "copy"),
    "staging.plan": ("ringtrain.checkpoint.device_staging", "DeviceStaging", "plan"),
    "new_buffer": ("ringtrain.checkpoint.host_copy", "HostCopy", "_new_buffer"),
    "fence": ("ringtrain.checkpoint.host_copy", "StagedCopy", "fence"),
    "finish": ("ringtrain.checkpoint.host_copy", "StagedCopy", "finish"),
    "write": ("ringtrain.checkpoint.snapshot", "SnapshotManager", "_save_now"),
}


class Phases:
    """The intervals of the wrapped parts' calls: (part, thread name, start, end)."""

    def __init__(self) -> None:
        self.intervals: list[tuple[str, str, float, float]] = []
        self._originals: list[tuple[type, str, object]] = []

    def install(self) -> None:
        for part, (module, cls_name, method) in PARTS.items():
            cls = getattr(importlib.import_module(module), cls_name)
            original = getattr(cls, method)
            self._originals.append((cls, method, original))
            setattr(cls, method, self._wrap(part, original))

    def remove(self) -> None:
        for cls, method, original in reversed(self._originals):
            setattr(cls, method, original)
        self._originals = []

    def _wrap(self, part: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.intervals.append((part, threading.current_thread().name, t0,
                                       time.perf_counter()))
        return timed

    def take(self) -> list[tuple[str, str, float, float]]:
        out, self.intervals = self.intervals, []
        return out

    @staticmethod
    def lines(mode: str, marks: list[float], intervals: list, every: int,
              after: int = 3) -> list[str]:
        """Per snapshot step (and the `after` steps that follow it): its ms, and the ms each
        part covered inside its window, by thread. Step k runs from marks[k-1] to marks[k]."""
        out = []
        for k in range(every + 1, len(marks), every):
            for j in range(k, min(k + after + 1, len(marks))):
                a, b = marks[j - 1], marks[j]
                cover: dict[str, float] = {}
                for part, thread, t0, t1 in intervals:
                    overlap = min(b, t1) - max(a, t0)
                    if overlap > 0:
                        key = f"{part}@{'main' if thread == 'MainThread' else 'writer'}"
                        cover[key] = cover.get(key, 0.0) + overlap
                parts = ", ".join(f"{key} {1e3 * s:.1f}" for key, s in sorted(cover.items()))
                tag = "snapshot" if j == k else f"+{j - k}"
                out.append(f"phases {mode:12s} step {j:5d} ({tag:8s}) {1e3 * (b - a):8.1f} ms"
                           f"{': ' + parts if parts else ''}")
        return out
