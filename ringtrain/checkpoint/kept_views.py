"""Tensors over a snapshot's own buffers, kept from one save to the next (`host_copy.py`).

A save of a 14-layer GPT and its AdamW state hands the writer ~700 host tensors and makes ~500
copies; each tensor made afresh (`torch.empty(0).set_(...)`) costs 5-10 us of Python, in the
step or on the writer's thread (where it holds the GIL the step needs). The buffers are kept
from save to save, and so are the storages, offsets and shapes of what they hold: so are these.
The copies themselves go one call per pair of devices (`ByteViews.copy_all`: torch's foreach
copy through `ringtrain.torch_internals.copy_tensors`), not one per storage.
"""

from __future__ import annotations

from typing import Any

import torch

from ringtrain.torch_internals import copy_tensors

__all__ = ["ByteViews", "HostViews"]

_Key = tuple[Any, ...]  # a storage: (device, address, bytes), as host_copy keys it


class ByteViews:
    """uint8 tensors over storages, what `copy` copies through; those over our own buffers
    (host and staging) kept from save to save.

    A tensor's `copy_` releases the GIL, a storage's does not (measured: a Python thread beside
    a 400 MB storage copy ran 4x slower), and the training thread must go on while the writer
    thread copies. Making a byte tensor costs ~5 us, and a save of a 14-layer GPT's parameters
    and moments makes ~500 copies, in the step (device staging) or on the writer's thread,
    where Python holds the GIL the step needs. A source's byte tensor is made afresh each time:
    a kept one would hold the live parameters' storages from one save to the next.

    A kept tensor is handed out again only while its storage still holds the same bytes at the
    same address (a guard: our buffers are never resized); one not asked for at a save is
    dropped at the next.

    Args:
        batched: `copy_all` queues its copies in one call (`torch_internals.copy_tensors`:
            torch's foreach copy) rather than one Python call per storage, the per-tensor
            reference (False) that tests compare it with.
    """

    def __init__(self, batched: bool = True) -> None:
        self.batched = batched
        self.calls = 0  # copy calls Python made (a batch is one): what `batched` saves
        self._kept: dict[_Key, torch.Tensor] = {}
        self._now: dict[_Key, torch.Tensor] = {}

    def start(self) -> None:
        """A new save: what the last one used is what this one may use again."""
        if self._now:
            self._kept, self._now = self._now, {}

    def of(self, s: torch.UntypedStorage) -> torch.Tensor:
        key = (s.device, s.data_ptr(), s.nbytes())
        t = self._now.get(key)
        if t is None:
            t = self._kept.get(key)
        if t is None or t.data_ptr() != key[1] or t.numel() != key[2]:
            t = torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)
        self._now[key] = t
        return t

    def copy(self, host: torch.UntypedStorage, source: torch.UntypedStorage,
             non_blocking: bool, ours: bool = False) -> None:
        """`host.copy_(source)` (`host`: a buffer of ours; `source` too where `ours`), the GIL
        released."""
        self.copy_all([(host, source)], non_blocking, ours)

    def copy_all(self, pairs: list[tuple[torch.UntypedStorage, torch.UntypedStorage]],
                 non_blocking: bool, ours: bool = False) -> None:
        """`copy` of each (host, source) pair: one call for all where `batched` (one hand-over
        of the GIL on the writer's thread, one launch of the copies from the step), queued in
        the pairs' order on the current stream. A pair may be two tensors alike instead (a host
        view and a source covering its storage: `copy_plan.py`), copied as they are."""
        if not pairs:
            return
        tensor = torch.Tensor
        dsts = [host if isinstance(host, tensor) else self.of(host) for host, _ in pairs]
        srcs = [source if isinstance(source, tensor) else self.of(source) if ours else
                torch.empty(0, dtype=torch.uint8, device=source.device).set_(source)
                for _, source in pairs]
        self.calls += 1 if copy_tensors(dsts, srcs, non_blocking, self.batched) else len(pairs)


class HostViews:
    """The host tensors a save hands the writer, kept for the next save's same tensors.

    A state's tensors are new objects at every save (`state_dict()`), but they view the same
    storages at the same offsets, sizes and strides, and the host buffers are kept from save to
    save: so the host tensor made for one at the last save (`torch.empty(0).set_(...)`, ~10 us
    each, ~700 of them for a 14-layer GPT and its AdamW state) is handed out again, unchanged.
    Within one save each tensor of the state gets an object of its own, as before: tied weights
    (two entries viewing one storage alike) stay two tensors sharing a storage in the file, not
    one object pickled twice (the file stays a synchronous save's, byte for byte).
    """

    def __init__(self) -> None:
        self._kept: dict[tuple, tuple[torch.UntypedStorage, torch.Tensor]] = {}
        self._now: dict[tuple, tuple[torch.UntypedStorage, torch.Tensor]] = {}

    def start(self) -> None:
        """A new save: what the last one made is what this one may hand out again."""
        if self._now:
            self._kept, self._now = self._now, {}

    def view(self, host: torch.UntypedStorage, key: _Key, t: torch.Tensor) -> torch.Tensor:
        """A host tensor over `host` shaped as `t` (which views the storage `key`)."""
        k = (key, t.dtype, t.storage_offset(), t.size(), t.stride())
        if k not in self._now:
            kept = self._kept.get(k)
            if kept is not None and kept[0] is host:  # the same buffer as at the last save
                self._now[k] = kept
                return kept[1]
        staged = torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())
        self._now.setdefault(k, (host, staged))
        return staged
