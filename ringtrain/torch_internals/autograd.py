"""torch's autograd internals: what ringtrain does inside a backward.

- `backward_tls_free`: a collective launched during backward (ringtrain.ddp.reducer,
  ringtrain.zero) without backward's context in torch's TLS, the guard against SIGABRT at exit;
- `current_autograd_node`, `queue_backward_callback`: the gradient sync at the end of backward;
- `preserve_version_counter`: buffers synced while a backward still holds them (ddp);
- `tensor_hooks`: a split backward's weight pass runs each parameter's hooks once (pipeline).

Each section says which names its feature needs and what it does without them
(`features.py`: how a name is looked up, a feature switched off).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ringtrain.torch_internals.features import Feature, lookup

# ---- a clean exit after collectives launched during backward --------------------------------

# Off (no `_remove_obj_from_tls`) on 2.11, whose backward stashes nothing, and on 2.12, whose
# backward stashes the context and then None, never erasing the key: there every collective's
# work holds an object of Python's. Nothing measurable is lost: `runtime.settle_comm_threads`,
# the exit handler of `init_distributed()` and the DDP constructor, lets gloo's threads drop
# their references before shutdown. On 2.12.1, 2 CPU burners: tests/scripts/exit_paths.py's
# four exit paths, 60 launches, and 10 `ringtrain train` runs, no abort (session 30). So no
# warning: it would be said on every run of 2.12 about a cost nobody could observe.
_TLS = Feature(
    "lifting backward's context out of torch's TLS while a collective launches "
    "(backward_tls_free; ringtrain.ddp.reducer, ringtrain.zero)", None)
_is_key_in_tls = lookup("torch._C._is_key_in_tls", _TLS)
_get_obj_in_tls = lookup("torch._C._get_obj_in_tls", _TLS)
_remove_obj_from_tls = lookup("torch._C._remove_obj_from_tls", _TLS)
_stash_obj_in_tls = lookup("torch._C._stash_obj_in_tls", _TLS)

# torch.autograd.graph._engine_run_backward (2.12 and later) stashes the caller's
# contextvars.Context under this key for the whole of backward (2.13 and later erase it after;
# 2.12 overwrites it with None); 2.11's stashes nothing.
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

    On a torch that cannot lift it (2.11 has nothing to lift; 2.12 cannot erase the key) this
    is a no-op, and the exit handler covers the race (`_TLS` above says how it was measured).
    """
    if not _TLS.on:
        yield
        return
    if not _is_key_in_tls(_BACKWARD_CONTEXT_KEY):
        yield
        return
    saved = _get_obj_in_tls(_BACKWARD_CONTEXT_KEY)
    _remove_obj_from_tls(_BACKWARD_CONTEXT_KEY)
    try:
        yield
    finally:
        _stash_obj_in_tls(_BACKWARD_CONTEXT_KEY, saved)


# ---- the bucketed all-reduce at the end of backward (ringtrain.ddp.reducer, ringtrain.zero) ----

_REDUCER = Feature(
    "the gradient sync at the end of backward (ringtrain.ddp.reducer, ringtrain.zero)",
    "ringtrain's DistributedDataParallel and ZeRO cannot sync gradients (their backward raises)")
_current_autograd_node = lookup("torch._C._current_autograd_node", _REDUCER)
_engine = lookup("torch.autograd.Variable._execution_engine", _REDUCER)
lookup("torch.autograd.Variable._execution_engine.queue_callback", _REDUCER)


def current_autograd_node() -> Any:
    """The autograd node running on this thread, or None outside one.

    Inside an end-of-backward callback it is None unless that backward is nested in another
    one's node (reentrant checkpointing).
    """
    _REDUCER.require()
    return _current_autograd_node()


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Have the autograd engine call `callback` when the running backward ends (call it inside one).

    Args:
        callback: called with no arguments on the thread that ran backward, before
            `backward()` returns.
    """
    _REDUCER.require()
    _engine.queue_callback(callback)



# ---- syncing buffers while a backward still holds them (ringtrain.ddp.distributed) ---------

_BUFFERS = Feature(
    "syncing buffers while a backward still holds them (ringtrain.ddp.distributed)",
    "syncing buffers before a forward bumps their version counters: a backward still pending "
    "from an earlier forward that saved one fails with autograd's in-place error (run backward "
    "before the next forward, or pass broadcast_buffers=False)")
_preserve_version_counter = lookup("torch.autograd._unsafe_preserve_version_counter", _BUFFERS)


def preserve_version_counter(
        tensors: tuple[torch.Tensor, ...]) -> contextlib.AbstractContextManager:
    """`with preserve_version_counter(tensors):` in-place writes inside leave their version
    counters as they were, so autograd does not take them for a user's in-place edit of a saved
    tensor (a no-op where this torch cannot)."""
    if _preserve_version_counter is None:
        return contextlib.nullcontext()
    return _preserve_version_counter(tensors)


# ---- a split backward's weight pass runs each parameter's tensor hooks once (pipeline.backward) --

_HOOKS = Feature(
    "running a parameter's tensor hooks once in a split backward's weight pass "
    "(ringtrain.pipeline.backward: zb-h1, zb-v)",
    "a split backward runs a parameter's register_hook hooks twice (sequence parallelism's sum "
    "over tp counts tp times): zb-h1 and zb-v refuse --sequence-parallel")
lookup("torch._C.TensorBase._backward_hooks", _HOOKS)


def tensor_hooks(t: torch.Tensor) -> dict | None:
    """The dict of `t`'s `register_hook` hooks, which torch's one C++ pre-hook on `t` reads at
    each call (so emptying it in place holds them); None if none or `tensor_hooks_held_off()`."""
    return t._backward_hooks if _HOOKS.on else None


def tensor_hooks_held_off() -> bool:
    """Whether this torch keeps a leaf's hooks where `tensor_hooks` cannot reach them."""
    return not _HOOKS.on


#: This module's features, in order (`ringtrain.torch_internals.FEATURES` lists every one).
FEATURES = [_TLS, _REDUCER, _BUFFERS, _HOOKS]
