"""Every private torch name ringtrain relies on, in one place, checked at import.

torch gives no stability promise for names that start with an underscore (nor for module
attributes it does not document). Each one ringtrain uses is looked up here once, when this
module is imported; a torch release without it fails at import with a `TorchInternalsError`
naming the torch version, the feature that needs it and the torch ringtrain was checked against
(`TESTED_TORCH`, the range in pyproject.toml). There is no silent fallback: a feature never
quietly does less on another torch. No other module of ringtrain touches these names
(`tests/test_torch_internals.py` checks it).

Features and the names each one needs:
- a clean exit after collectives launched during backward (`backward_tls_free`):
  `torch._C._is_key_in_tls`, `_get_obj_in_tls`, `_remove_obj_from_tls`, `_stash_obj_in_tls`;
- naming a rank that hangs (`process_groups`, `sequence_number`, used by ringtrain.launch.hang):
  `torch.distributed.distributed_c10d._world` (its `pg_map`),
  `ProcessGroup._get_sequence_number_for_group`;
- the bucketed all-reduce at the end of backward (ringtrain.ddp.reducer: `current_autograd_node`,
  `queue_backward_callback`): `torch._C._current_autograd_node`,
  `torch.autograd.Variable._execution_engine` (its `queue_callback`);
- broadcasting tensors in a few flat chunks (ringtrain.ddp.distributed's `broadcast_coalesced`:
  `flatten_dense_tensors`, `unflatten_dense_tensors`): `torch._utils._flatten_dense_tensors`,
  `torch._utils._unflatten_dense_tensors`;
- syncing buffers while a backward still holds them (ringtrain.ddp.distributed, `preserve_version_counter`):
  `torch.autograd._unsafe_preserve_version_counter`;
- the store of a process group torch started (ringtrain.runtime, ringtrain.checkpoint.snapshot:
  `default_store`): `torch.distributed.distributed_c10d._get_default_store`;
- communication lanes with their group's timeout (ringtrain.ddp.lanes, `group_timeout`):
  `ProcessGroup._get_backend`, `torch._C._distributed_c10d.Backend.Options._timeout`;
- advertising a reachable address across nodes (ringtrain.launch.rendezvous,
  `matches_machine_hostname`):
  `torch.distributed.elastic.rendezvous.utils._matches_machine_hostname`;
- bounded rendezvous store queries across nodes (ringtrain.launch.rendezvous, `RDZV_REGISTRY`):
  `torch.distributed.launcher.api.rdzv_registry`;
- tolerated ranks in `ringtrain run` (ringtrain.launch.launcher, `CAPTURE_PROCESS_FAILURES`,
  `running_workers`, `mark_finished`): `SubprocessContext._capture_process_failures`, and the
  attributes its constructors set: `_running_local_ranks`, `subprocess_handlers` (each with
  `proc`), `envs`;
- restarts counted for the job, not per node, in `ringtrain run` (ringtrain.launch.launcher,
  `START_WORKERS`, `RESTART_WORKERS`, `set_remaining_restarts`):
  `LocalElasticAgent._start_workers`, `SimpleElasticAgent._restart_workers`, and the attribute
  its constructor sets: `_remaining_restarts`;
- the BatchNorm warning of pipeline stages (ringtrain.pipeline.engine, `BatchNorm`):
  `torch.nn.modules.batchnorm._BatchNorm`.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.autograd
import torch.distributed
import torch.distributed.elastic.agent.server.api as _agent_api
import torch.distributed.elastic.agent.server.local_elastic_agent as _local_agent
import torch.distributed.elastic.multiprocessing.api as _mp_api
import torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler as _handler
import torch.distributed.elastic.rendezvous.utils as _rdzv_utils
import torch.distributed.launcher.api as _launcher_api
import torch.nn.modules.batchnorm

TESTED_TORCH = "2.13.0"


class TorchInternalsError(ImportError):
    """This torch lacks a private name a ringtrain feature needs."""


def _missing(what: str, feature: str) -> TorchInternalsError:
    return TorchInternalsError(
        f"torch {torch.__version__} has no {what}, which ringtrain needs for {feature}; "
        f"ringtrain was checked against torch {TESTED_TORCH}: install it with "
        f"`pip install torch=={TESTED_TORCH}`")


def _require(owner, name: str, feature: str):
    """`owner.name`, or a `TorchInternalsError` naming the torch version, `feature` and the fix."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise _missing(f"{getattr(owner, '__name__', owner)}.{name}", feature) from None


def _require_set_by_init(cls: type, name: str, feature: str) -> None:
    """Check that a constructor in `cls`'s MRO assigns the instance attribute `name`.

    Instance attributes cannot be looked up on the class; the names a constructor stores are
    in its code object's `co_names`, so a torch that renamed one fails here, at import.
    """
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if name in getattr(getattr(init, "__code__", None), "co_names", ()):
            return
    raise _missing(f"{cls.__module__}.{cls.__qualname__}().{name} (set by its constructor)",
                   feature)


@dataclass(frozen=True)
class PatchPoint:
    """An attribute of torch's that ringtrain replaces for a while (checked to exist at import).

    Args:
        owner: the object (class or module) holding the attribute.
        name: the attribute's name.
    """

    owner: Any
    name: str

    def get(self) -> Any:
        """The attribute's current value (torch's own, unless replaced)."""
        return getattr(self.owner, self.name)

    @contextlib.contextmanager
    def replaced(self, value: Any) -> Iterator[None]:
        """Inside: the attribute is `value`; after, whatever it was before (even on error)."""
        original = getattr(self.owner, self.name)
        setattr(self.owner, self.name, value)
        try:
            yield
        finally:
            setattr(self.owner, self.name, original)


def _patch_point(owner, name: str, feature: str) -> PatchPoint:
    _require(owner, name, feature)
    return PatchPoint(owner, name)


# ---- a clean exit after collectives launched during backward -------------------------------

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


# ---- naming a rank that hangs (ringtrain.launch.hang) ---------------------------------------------

_FEATURE_HANG = "naming a rank that hangs outside a collective the others wait in (ringtrain.launch.hang)"
_c10d = _require(torch.distributed, "distributed_c10d", _FEATURE_HANG)
_world = _require(_c10d, "_world", _FEATURE_HANG)
_require(torch.distributed.ProcessGroup, "_get_sequence_number_for_group", _FEATURE_HANG)


def process_groups() -> list[torch.distributed.ProcessGroup]:
    """Every process group this process belongs to (a snapshot: safe from another thread)."""
    return list(dict(_world.pg_map))


def sequence_number(group: torch.distributed.ProcessGroup) -> int:
    """How many collectives this rank has issued on `group` (counted when issued, not done)."""
    return int(group._get_sequence_number_for_group())


# ---- the bucketed all-reduce at the end of backward (ringtrain.ddp.reducer) --------------------

_FEATURE_REDUCER = "the bucketed gradient all-reduce at the end of backward (ringtrain.ddp.reducer)"

_current_autograd_node = _require(torch._C, "_current_autograd_node", _FEATURE_REDUCER)
_engine = _require(torch.autograd.Variable, "_execution_engine", _FEATURE_REDUCER)
_require(_engine, "queue_callback", _FEATURE_REDUCER)


def current_autograd_node() -> Any:
    """The autograd node running on this thread, or None outside one.

    Inside an end-of-backward callback it is None unless that backward is nested in another
    one's node (reentrant checkpointing).
    """
    return _current_autograd_node()


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Have the autograd engine call `callback` when the running backward ends (call it inside one).

    Args:
        callback: called with no arguments on the thread that ran backward, before
            `backward()` returns.
    """
    _engine.queue_callback(callback)


# ---- broadcasting tensors in a few flat chunks (ringtrain.ddp.distributed) -----------------------------

_FEATURE_COALESCED = ("broadcasting parameters and buffers in a few flat chunks "
                      "(ringtrain.ddp.distributed.broadcast_coalesced)")
#: `flatten_dense_tensors(tensors)`: one 1-D tensor holding `tensors` back to back (a copy).
flatten_dense_tensors = _require(torch._utils, "_flatten_dense_tensors", _FEATURE_COALESCED)
#: `unflatten_dense_tensors(flat, like)`: views of `flat` shaped as the tensors in `like`.
unflatten_dense_tensors = _require(torch._utils, "_unflatten_dense_tensors", _FEATURE_COALESCED)

_FEATURE_BUFFERS = "syncing buffers while a backward still holds them (ringtrain.ddp.distributed)"
#: `with preserve_version_counter(tensors):` in-place writes inside leave their version counters
#: as they were, so autograd does not take them for a user's in-place edit of a saved tensor.
preserve_version_counter = _require(torch.autograd, "_unsafe_preserve_version_counter",
                                    _FEATURE_BUFFERS)


# ---- the store of a process group torch started (ringtrain.runtime, ringtrain.checkpoint.snapshot) --

_FEATURE_STORE = "the default process group's store (ringtrain.runtime, ringtrain.checkpoint.snapshot)"
_get_default_store = _require(_c10d, "_get_default_store", _FEATURE_STORE)


def default_store() -> torch.distributed.Store:
    """The store the default process group was made with (it must be initialised)."""
    return _get_default_store()


# ---- communication lanes with their group's timeout (ringtrain.ddp.lanes) ----------------------

_FEATURE_LANES = "giving communication lanes their group's timeout (ringtrain.ddp.lanes)"
_require(torch.distributed.ProcessGroup, "_get_backend", _FEATURE_LANES)
_c10d_ext = _require(torch._C, "_distributed_c10d", _FEATURE_LANES)
_require(_require(_require(_c10d_ext, "Backend", _FEATURE_LANES), "Options", _FEATURE_LANES),
         "_timeout", _FEATURE_LANES)


def group_timeout(group: torch.distributed.ProcessGroup) -> timedelta | None:
    """The collective timeout `group` was made with, or None where its CPU backend does not say.

    None when the group has no CPU backend, or its backend keeps no options (a custom one):
    which backend a group has is a runtime fact, not torch's version.
    """
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:  # no backend for CPU tensors on this group
        return None
    options = getattr(backend, "options", None)
    return None if options is None else options._timeout


# ---- rendezvous across nodes (ringtrain.launch.rendezvous) ----------------------------------------

_FEATURE_HOSTNAME = ("telling the rendezvous host across nodes that it hosts the store "
                     "(ringtrain.launch.rendezvous)")
#: `matches_machine_hostname(host)`: whether `host` names this machine (torch's own test).
matches_machine_hostname: Callable[[str], bool] = _require(
    _rdzv_utils, "_matches_machine_hostname", _FEATURE_HOSTNAME)

_FEATURE_RDZV = "bounding the agent's rendezvous store queries across nodes (ringtrain.launch.rendezvous)"
#: The registry `elastic_launch` gets its rendezvous handler from.
RDZV_REGISTRY = _patch_point(_launcher_api, "rdzv_registry", _FEATURE_RDZV)


# ---- tolerated ranks in `ringtrain run` (ringtrain.launch.launcher) -------------------------------

_FEATURE_TOLERATE = ("tolerated ranks in `ringtrain run` (launch(..., tolerate_ranks=...), "
                     "ringtrain.launch.launcher)")
SubprocessContext = _mp_api.SubprocessContext
#: `SubprocessContext._capture_process_failures(self, done_local_ranks)`: the step of the
#: agent's poll that records each exited worker as finished or failed.
CAPTURE_PROCESS_FAILURES = _patch_point(SubprocessContext, "_capture_process_failures",
                                        _FEATURE_TOLERATE)
_require_set_by_init(SubprocessContext, "_running_local_ranks", _FEATURE_TOLERATE)
_require_set_by_init(SubprocessContext, "subprocess_handlers", _FEATURE_TOLERATE)
_require_set_by_init(SubprocessContext, "envs", _FEATURE_TOLERATE)
_require_set_by_init(_handler.SubprocessHandler, "proc", _FEATURE_TOLERATE)


def running_workers(context: Any) -> list[tuple[int, int, subprocess.Popen]]:
    """(local rank, global rank, process) of each worker `context` still counts as running.

    Args:
        context: a `SubprocessContext`. Sorted by local rank; the global rank is the worker's
            RANK variable, -1 where it has none.
    """
    return [(local, int(context.envs[local].get("RANK", -1)),
             context.subprocess_handlers[local].proc)
            for local in sorted(context._running_local_ranks)]


def mark_finished(context: Any, local_rank: int) -> None:
    """Take `local_rank` off `context`'s running workers, so its poll never sees it exit."""
    context._running_local_ranks.discard(local_rank)


# ---- restarts counted for the job in `ringtrain run` (ringtrain.launch.launcher) ---------------

_FEATURE_RESTARTS = ("restarts counted for the whole job across nodes, not per node "
                     "(`ringtrain run --nnodes N --max-restarts M`, ringtrain.launch.launcher)")
#: `LocalElasticAgent._start_workers(self, worker_group)`: after each rendezvous, starts the
#: workers with TORCHELASTIC_RESTART_COUNT = max_restarts - the agent's remaining restarts.
START_WORKERS = _patch_point(_local_agent.LocalElasticAgent, "_start_workers", _FEATURE_RESTARTS)
#: `SimpleElasticAgent._restart_workers(self, worker_group)`: stop, rendezvous again, start; called
#: after a failure (the group's state FAILED or UNHEALTHY) or when nodes wait to join (HEALTHY).
RESTART_WORKERS = _patch_point(_agent_api.SimpleElasticAgent, "_restart_workers", _FEATURE_RESTARTS)
_require_set_by_init(_agent_api.SimpleElasticAgent, "_remaining_restarts", _FEATURE_RESTARTS)


def set_remaining_restarts(agent: Any, remaining: int) -> None:
    """Set the restarts `agent` has left: its loop restarts after a failure while it is > 0."""
    agent._remaining_restarts = remaining


# ---- the BatchNorm warning of pipeline stages (ringtrain.pipeline.engine) ------------------

_FEATURE_BATCHNORM = "warning that BatchNorm normalises over micro-batches (ringtrain.pipeline)"
#: The base class of every BatchNorm layer (1d/2d/3d, lazy and sync).
BatchNorm: type = _require(torch.nn.modules.batchnorm, "_BatchNorm", _FEATURE_BATCHNORM)
