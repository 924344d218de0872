"""Every private torch name ringtrain relies on, in one place, looked up once at import.

torch gives no stability promise for names that start with an underscore (nor for module
attributes it does not document), and users' machines come with the torch they have (a GPU
image had 2.11 while we tested 2.13). So a name this torch lacks never fails `import
ringtrain`: it switches off only the feature that needs it, which then, as each section below
says, uses a public equivalent (nothing lost), or keeps torch's own behaviour and warns once
per process what the user loses (`TorchFeatureWarning`), or also raises `TorchInternalsError`
(the torch version, the missing name, what to install) when the feature is actually used.

Read this file for which names each feature needs and what it does without them;
`features.py` for how a name is looked up and a feature switched off. `TESTED_TORCH` lists the
torch versions the suite passed on (`make test-torch TORCH_VERSION=...`), `TORCH_RANGE` is
pyproject.toml's range, and `FEATURES` says at run time what is off. On those versions:

    feature                                   2.11                                 2.13  2.15
    backward_tls_free (_remove_obj_from_tls)  not needed: backward leaves TLS empty  on    on
    every other feature                       on                                   on    on

No other module of ringtrain touches these names (`tests/test_torch_internals.py` checks it).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch

# Re-exported (`X as X`): callers and tests import them from the package.
from ringtrain.torch_internals.features import TESTED_TORCH as TESTED_TORCH
from ringtrain.torch_internals.features import TORCH_RANGE as TORCH_RANGE
from ringtrain.torch_internals.features import Feature as Feature
from ringtrain.torch_internals.features import PatchPoint as PatchPoint
from ringtrain.torch_internals.features import TorchFeatureWarning as TorchFeatureWarning
from ringtrain.torch_internals.features import TorchInternalsError as TorchInternalsError
from ringtrain.torch_internals.features import lookup, patch_point, set_by_init

#: Every feature below, in order; `[f for f in FEATURES if not f.on]` are off on this torch.
FEATURES: list[Feature] = []


def _feature(what: str, when_off: str | None) -> Feature:
    FEATURES.append(feature := Feature(what, when_off))
    return feature


# ---- a clean exit after collectives launched during backward --------------------------------

_TLS = _feature(
    "lifting backward's context out of torch's TLS while a collective launches "
    "(backward_tls_free; ringtrain.ddp.reducer, ringtrain.zero)",
    "collectives launched during backward keep backward's context in their work; the guard "
    "against SIGABRT at interpreter exit ('terminate called without an active exception') is off")
_is_key_in_tls = lookup("torch._C._is_key_in_tls", _TLS)
_get_obj_in_tls = lookup("torch._C._get_obj_in_tls", _TLS)
_remove_obj_from_tls = lookup("torch._C._remove_obj_from_tls", _TLS)
_stash_obj_in_tls = lookup("torch._C._stash_obj_in_tls", _TLS)

# torch.autograd.graph._engine_run_backward (2.13 and later) stashes the caller's
# contextvars.Context under this key for the whole of backward; 2.11's stashes nothing (and has
# no `_remove_obj_from_tls`), so there it has nothing to lift.
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

    On a torch that cannot lift it, this is a no-op that warns once, the first time there is
    something to lift (never on 2.11, whose backward leaves the TLS empty).
    """
    if not _TLS.on:
        if _is_key_in_tls is None or _is_key_in_tls(_BACKWARD_CONTEXT_KEY):
            _TLS.announce()
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


# ---- naming a rank that hangs (ringtrain.launch.hang) -----------------------------------------

_HANG = _feature(
    "naming a rank that hangs outside a collective the others wait in (ringtrain.launch.hang)",
    "the watchdog cannot name a rank stuck in its own code while the others wait in a "
    "collective (they wait for the backend's timeout); dead and silent ranks are still named")
_world = lookup("torch.distributed.distributed_c10d._world", _HANG)
lookup("torch.distributed.distributed_c10d._world.pg_map", _HANG)
lookup("torch.distributed.ProcessGroup._get_sequence_number_for_group", _HANG)


def process_groups() -> list[torch.distributed.ProcessGroup]:
    """Every process group this process belongs to (a snapshot: safe from another thread).

    None where this torch cannot say: every rank's count is then 0 and the hang check quiet.
    """
    return list(dict(_world.pg_map)) if _HANG.on else []


def sequence_number(group: torch.distributed.ProcessGroup) -> int:
    """How many collectives this rank has issued on `group` (counted when issued, not done)."""
    _HANG.require()
    return int(group._get_sequence_number_for_group())


# ---- the bucketed all-reduce at the end of backward (ringtrain.ddp.reducer, ringtrain.zero) ----

_REDUCER = _feature(
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


# ---- broadcasting tensors in a few flat chunks (ringtrain.ddp.init_sync) ------------------------

_COALESCED = _feature("broadcasting parameters and buffers in a few flat chunks "
                      "(ringtrain.ddp.init_sync.broadcast_coalesced)", None)
_flatten = lookup("torch._utils._flatten_dense_tensors", _COALESCED)
_unflatten = lookup("torch._utils._unflatten_dense_tensors", _COALESCED)


def flatten_dense_tensors(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One 1-D tensor holding `tensors` back to back (without torch's helper: a public cat)."""
    if _flatten is not None:
        return _flatten(tensors)
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_dense_tensors(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` shaped as the tensors in `like` (without torch's helper: split + view)."""
    if _unflatten is not None:
        return _unflatten(flat, like)
    return [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in like]), like,
                                                strict=True)]


_BUFFERS = _feature(
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


# ---- the store of a process group torch started (ringtrain.runtime, ringtrain.checkpoint) ------

_STORE = _feature(
    "the default process group's store (ringtrain.runtime, ringtrain.checkpoint.snapshot)",
    "ringtrain cannot use a process group that torch.distributed.init_process_group started "
    "(call ringtrain.init_distributed() instead), nor find a SnapshotManager's store on it "
    "(pass store=)")
_get_default_store = lookup("torch.distributed.distributed_c10d._get_default_store", _STORE)


def default_store() -> torch.distributed.Store:
    """The store the default process group was made with (it must be initialised)."""
    _STORE.require()
    return _get_default_store()


# ---- communication lanes with their group's timeout (ringtrain.ddp.lanes) -----------------------

_LANES = _feature("giving communication lanes their group's timeout (ringtrain.ddp.lanes)",
                  "communication lanes (comm_lanes > 1) get torch's default collective timeout, "
                  "not their group's")
lookup("torch.distributed.ProcessGroup._get_backend", _LANES)
lookup("torch._C._distributed_c10d.Backend.Options._timeout", _LANES)


def group_timeout(group: torch.distributed.ProcessGroup) -> timedelta | None:
    """The collective timeout `group` was made with, or None where its CPU backend does not say.

    None when the group has no CPU backend, or its backend keeps no options (a custom one):
    which backend a group has is a runtime fact, not torch's version. None too where this
    torch cannot say (torch's default timeout then applies).
    """
    if not _LANES.on:
        return None
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:  # no backend for CPU tensors on this group
        return None
    options = getattr(backend, "options", None)
    return None if options is None else options._timeout


# ---- rendezvous across nodes (ringtrain.launch.rendezvous) --------------------------------------

_HOSTNAME = _feature("telling the rendezvous host across nodes that it hosts the store "
                     "(ringtrain.launch.rendezvous)", None)
_matches_machine_hostname = lookup(
    "torch.distributed.elastic.rendezvous.utils._matches_machine_hostname", _HOSTNAME)


def matches_machine_hostname(host: str) -> bool:
    """Whether torch's rendezvous sees by itself that `host` names this machine.

    False where this torch has no such test: the caller then says `is_host` itself whenever the
    endpoint's address is one of ours, which is right either way.
    """
    return _matches_machine_hostname is not None and _matches_machine_hostname(host)


_RDZV = _feature("bounding the agent's rendezvous store queries across nodes "
                 "(ringtrain.launch.rendezvous)",
                 "across nodes, an agent whose rendezvous host is gone waits for torch's own "
                 "timeouts instead of giving up after 30 s of silence")
#: The registry `elastic_launch` gets its rendezvous handler from.
RDZV_REGISTRY = patch_point("torch.distributed.launcher.api.rdzv_registry", _RDZV)


# ---- tolerated ranks in `ringtrain run` (ringtrain.launch.launcher) -----------------------------

_TOLERATE = _feature("tolerated ranks in `ringtrain run` (launch(..., tolerate_ranks=...), "
                     "ringtrain.launch.launcher) and a lost worker replaced in place "
                     "(`ringtrain train --live`, ringtrain.launch.live_agent)",
                     "launch(..., tolerate_ranks=...) and --live are unavailable (they raise)")
_MP_API = "torch.distributed.elastic.multiprocessing.api"
#: `SubprocessContext._capture_process_failures(self, done_local_ranks)`: the step of the
#: agent's poll that records each exited worker as finished or failed.
CAPTURE_PROCESS_FAILURES = patch_point(f"{_MP_API}.SubprocessContext._capture_process_failures",
                                        _TOLERATE, raise_when_off=True)
for _name in ("_running_local_ranks", "subprocess_handlers", "envs"):
    set_by_init(CAPTURE_PROCESS_FAILURES.owner, _name, _TOLERATE)
set_by_init(lookup("torch.distributed.elastic.multiprocessing.subprocess_handler."
                     "subprocess_handler.SubprocessHandler", _TOLERATE), "proc", _TOLERATE)


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


# ---- restarts counted for the job in `ringtrain run` (ringtrain.launch.launcher) ----------------

_RESTARTS = _feature("restarts counted for the whole job across nodes, not per node "
                     "(`ringtrain run --nnodes N --max-restarts M`, ringtrain.launch.launcher)",
                     "with --nnodes N --max-restarts M each node counts its own restarts, as "
                     "torch does (up to N x M in all)")
_AGENT = "torch.distributed.elastic.agent.server"
#: `LocalElasticAgent._start_workers(self, worker_group)`: after each rendezvous, starts the
#: workers with TORCHELASTIC_RESTART_COUNT = max_restarts - the agent's remaining restarts.
START_WORKERS = patch_point(f"{_AGENT}.local_elastic_agent.LocalElasticAgent._start_workers",
                             _RESTARTS)
#: `SimpleElasticAgent._restart_workers(self, worker_group)`: stop, rendezvous again, start; called
#: after a failure (the group's state FAILED or UNHEALTHY) or when nodes wait to join (HEALTHY).
RESTART_WORKERS = patch_point(f"{_AGENT}.api.SimpleElasticAgent._restart_workers", _RESTARTS)
set_by_init(RESTART_WORKERS.owner, "_remaining_restarts", _RESTARTS)


def set_remaining_restarts(agent: Any, remaining: int) -> None:
    """Set the restarts `agent` has left: its loop restarts after a failure while it is > 0."""
    agent._remaining_restarts = remaining


# ---- a split backward's weight pass runs each parameter's tensor hooks once (pipeline.backward) --

_HOOKS = _feature(
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


# ---- the BatchNorm warning of pipeline stages (ringtrain.pipeline.engine) -----------------------

_BATCHNORM = _feature("warning that BatchNorm normalises over micro-batches (ringtrain.pipeline)",
                      None)
#: The base class of every BatchNorm layer (1d/2d/3d, lazy and sync), for `isinstance`; where
#: this torch lacks it, the public classes it covers.
BatchNorm: type | tuple[type, ...] = lookup("torch.nn.modules.batchnorm._BatchNorm",
                                             _BATCHNORM) or (
    torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm,
    torch.nn.LazyBatchNorm1d, torch.nn.LazyBatchNorm2d, torch.nn.LazyBatchNorm3d)



# ---- a lost worker replaced in `ringtrain train --live` (ringtrain.launch.live_agent) -----------

# Its process-context half is the tolerated ranks' feature (the same classes), its agent half
# the job's restarts' (the same agent); --live raises where either is off.
#: `SubprocessHandler._popen(self, args, env)`: how the handler started its worker (`spawn_like`).
_POPEN = lookup("torch.distributed.elastic.multiprocessing.subprocess_handler."
                "subprocess_handler.SubprocessHandler._popen", _TOLERATE)

#: `LocalElasticAgent._monitor_workers(self, worker_group)`: the agent's poll, which first checks
#: that its workers' ids are its process context's pids (a replaced worker's would not be).
MONITOR_WORKERS = patch_point("torch.distributed.elastic.agent.server.local_elastic_agent."
                              "LocalElasticAgent._monitor_workers", _RESTARTS,
                              raise_when_off=True)
set_by_init(MONITOR_WORKERS.owner, "_pcontext", _RESTARTS)
#: `SimpleElasticAgent._exit_barrier(self)`: once its workers succeeded, waits for every node's
#: agent (300 s); a live job waits only for those still up (`ringtrain.launch.live_store`).
EXIT_BARRIER = patch_point(f"{_AGENT}.api.SimpleElasticAgent._exit_barrier", _RESTARTS)


def sync_worker_ids(agent: Any, worker_group: Any) -> None:
    """Give `worker_group`'s workers the pids of `agent`'s processes now (after an `adopt`)."""
    pids = agent._pcontext.pids() if agent._pcontext is not None else {}
    for worker in worker_group.workers:
        if worker.local_rank in pids:
            worker.id = pids[worker.local_rank]


def spawn_like(context: Any, local_rank: int, env: dict[str, str]) -> subprocess.Popen:
    """`local_rank`'s command started once more as the agent started it (arguments, environment,
    output files, a session of its own), `env` on top; the agent sees it once `adopt`ed."""
    if _POPEN is None:
        _TOLERATE.require()
    handler = context.subprocess_handlers[local_rank]
    return handler._popen(handler.proc.args, {**os.environ, **context.envs[local_rank], **env})


def adopt(context: Any, local_rank: int, proc: subprocess.Popen) -> None:
    """Make `proc` `local_rank`'s process: the agent's poll and teardown see it as that worker."""
    context.subprocess_handlers[local_rank].proc = proc


# Say once, now, what this torch turns off; backward_tls_free says it when there is something
# to lift, which a torch whose backward stashes nothing (2.11) never has.
for _f in FEATURES:
    if _f is not _TLS:
        _f.announce()
