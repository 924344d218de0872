"""Every private torch name ringtrain relies on, in one place, checked at import.

torch gives no stability promise for names that start with an underscore. Each one ringtrain
uses is looked up here once; a torch release without it fails at import with the torch version
and the feature that needs it, rather than misbehaving later.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

TESTED_TORCH = "2.13.0"


class TorchInternalsError(ImportError):
    """This torch lacks a private name a ringtrain feature needs."""


def _require(owner, name: str, feature: str):
    try:
        return getattr(owner, name)
    except AttributeError:
        raise TorchInternalsError(
            f"torch {torch.__version__} has no {getattr(owner, '__name__', owner)}.{name}, which "
            f"ringtrain needs for {feature}; ringtrain was checked against torch {TESTED_TORCH}: "
            f"install it with `pip install torch=={TESTED_TORCH}`") from None


_FEATURE_TLS = "collectives launched during backward (a clean exit, see backward_tls_free)"
_is_key_in_tls = _require(torch._C, "_is_key_in_tls", _FEATURE_TLS)
_get_obj_in_tls = _require(torch._C, "_get_obj_in_tls", _FEATURE_TLS)
_remove_obj_from_tls = _require(torch._C, "_remove_obj_from_tls", _FEATURE_TLS)
_stash_obj_in_tls = _require(torch._C, "_stash_obj_in_tls", _FEATURE_TLS)

# torch.autograd.graph._engine_run_backward stashes the caller's contextvars.Context under
# this key for the whole of backward.
_BACKWARD_CONTEXT_KEY = "context"


@contextlib.contextmanager
def backward_tls_free() -> Iterator[None]:
    """Inside: this thread's torch TLS holds no Python object that backward put there.

    Why: a gloo collective captures the launching thread's TLS (`at::ThreadLocalState`) in its
    `Work`. During backward that TLS holds a Python object (the contextvars.Context above), so
    whoever drops the last reference to the Work must take the GIL. When that is gloo's worker
    thread, a moment after the work completed, and the main thread has meanwhile begun
    interpreter shutdown, taking the GIL ends the worker thread with a forced unwind through a
    noexcept frame: `terminate called without an active exception`, SIGABRT at exit, seen
    about 1 run in 4 (`gdb` on the core: `~AsyncAllreduceWork -> ~ThreadLocalState ->
    SafePyObject decref -> take_gil -> pthread_exit`). Launching the collective with the
    object lifted out of the TLS, and putting it back after, leaves the Work nothing of Python's.
    """
    if not _is_key_in_tls(_BACKWARD_CONTEXT_KEY):
        yield
        return
    saved = _get_obj_in_tls(_BACKWARD_CONTEXT_KEY)
    _remove_obj_from_tls(_BACKWARD_CONTEXT_KEY)
    try:
        yield
    finally:
        _stash_obj_in_tls(_BACKWARD_CONTEXT_KEY, saved)


_FEATURE_HANG = "naming a rank that hangs outside a collective the others wait in (ringtrain.hang)"
_c10d = _require(torch.distributed, "distributed_c10d", _FEATURE_HANG)
_world = _require(_c10d, "_world", _FEATURE_HANG)
_require(torch.distributed.ProcessGroup, "_get_sequence_number_for_group", _FEATURE_HANG)


def process_groups() -> list[torch.distributed.ProcessGroup]:
    """Every process group this process belongs to (a snapshot: safe from another thread)."""
    return list(dict(_world.pg_map))


def sequence_number(group: torch.distributed.ProcessGroup) -> int:
    """How many collectives this rank has issued on `group` (counted when issued, not done)."""
    return int(group._get_sequence_number_for_group())
