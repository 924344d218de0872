"""Process-group start-up and teardown: one call that validates before it waits.

`init_distributed()` reads whichever launcher started the process (`ringtrain run` / torchrun /
TorchX, Slurm's srun, Kubernetes, MPI: `ringtrain.launch.environments`), or explicit arguments,
or falls back to a single process when nothing is set; under Ray Train, which starts the group
itself, it takes the group as it is. gloo on CPU, NCCL on CUDA. Outside torchrun's agent it runs
its own rendezvous on a TCPStore so that a missing rank is reported by number within a bounded
time instead of hanging. Under `ringtrain run` it also starts the watchdog
(`ringtrain.launch.watchdog`). Rank 0 logs what it found, once (logger "ringtrain", INFO).

    python -c "import ringtrain; rt = ringtrain.init_distributed(); print(rt)"
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ringtrain.launch.device import choose
from ringtrain.launch.environments import detect, existing_group_name, from_arguments
from ringtrain.launch.network import network_interfaces, route_source
from ringtrain.launch.watchdog import Watchdog
from ringtrain.runtime import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DistributedInitError,
    Runtime,
    get_runtime,
    register_exit_grace,
    set_runtime,
)

DEFAULT_RENDEZVOUS_TIMEOUT_S = 60.0
_runtime: Runtime | None = None  # what this module started (`ringtrain.runtime` records it too)
_own_store: dist.Store | None = None  # the TCPStore we host/joined (None under torchrun's agent)
# The gloo interface this module put in the environment: taken out again at teardown, so that
# processes started afterwards (a launcher's workers in another network namespace) pick their own.
_chosen_ifname: str | None = None
_own_group = False  # whether init_distributed started the group (not Ray Train, not the script)
log = logging.getLogger("ringtrain")


def _pick_gloo_interface(master_addr: str, rank: int) -> None:
    """Make gloo use the interface that routes to the master, or reject a bad GLOO_SOCKET_IFNAME.

    gloo otherwise binds to whatever the hostname resolves to, often 127.0.0.1, which cannot
    reach another host: the classic multi-node hang.
    """
    interfaces = network_interfaces()
    chosen = os.environ.get("GLOO_SOCKET_IFNAME")
    if chosen:
        bad = [n for n in chosen.split(",") if n not in interfaces]
        if bad:
            raise DistributedInitError(
                f"GLOO_SOCKET_IFNAME={chosen!r}: no interface {bad} with an IPv4 address here; "
                f"interfaces: {', '.join(f'{n} ({a})' for n, a in interfaces.items())}"
            )
    else:
        try:
            local = route_source(socket.gethostbyname(master_addr))
        except OSError:
            return
        names = [n for n, a in interfaces.items() if a == local]
        if local is None or not names:
            return
        chosen = names[0]
        global _chosen_ifname
        os.environ["GLOO_SOCKET_IFNAME"] = _chosen_ifname = chosen  # undone by destroy_distributed
    log.debug("rank %d: gloo uses interface %s (%s)", rank, chosen,
              interfaces.get(chosen.split(",")[0]))


def _rendezvous(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Every rank announces itself, then waits (bounded) until all have; names who is missing."""
    if store.add(f"ringtrain/rdzv/{rank}", 1) > 1:
        raise DistributedInitError(
            f"rank {rank} joined twice: two processes were started with RANK={rank}; "
            "give each process its own RANK in [0, WORLD_SIZE)"
        )
    keys = [f"ringtrain/rdzv/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if time.monotonic() > deadline:
            arrived = [r for r, k in enumerate(keys) if store.check([k])]
            missing = [r for r in range(world_size) if r not in arrived]
            raise DistributedInitError(
                f"world_size={world_size} but only {len(arrived)} ranks joined within "
                f"{timeout_s:g} s: ranks {arrived} arrived, {missing} missing; start the missing "
                "ranks, or lower WORLD_SIZE / --nproc-per-node"
            )
        time.sleep(0.05)


def _agent_store(addr: str, port: int, timeout_s: float) -> dist.Store:
    """A client of the store torchrun's agent hosts, with this restart's keys apart.

    The agent hands every restart of the group the same store, and torch's process-group keys
    (each rank's gloo address, under the group's name) carry no restart number: a restarted
    rank could read the dead attempt's addresses and fail with "Connection refused" or wait on
    a port that is someone else's now (pytorch/pytorch#135712). Under a prefix naming the run
    and the restart, every attempt starts from an empty key space.
    """
    try:
        client = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as e:
        raise DistributedInitError(
            f"could not reach the launcher's store at {addr}:{port} within {timeout_s:g} s "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); is the agent "
            "(torchrun / ringtrain run) still running?") from e
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"ringtrain/{run}/attempt_{attempt}", client)


def _own_rendezvous(addr: str, port: int, rank: int, world_size: int,
                    timeout_s: float) -> dist.Store:
    """Rank 0 hosts a TCPStore, every rank checks in (bounded): no launcher ran a rendezvous."""
    global _own_store
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=rank == 0,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        role = "listen on" if rank == 0 else "reach the master at"
        raise DistributedInitError(
            f"rank {rank} could not {role} {addr}:{port} within {timeout_s:g} s "
            f"({e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}); check "
            "MASTER_ADDR/MASTER_PORT, that rank 0 is running, and that the port is free"
        ) from e
    _rendezvous(store, rank, world_size, timeout_s)
    _own_store = store
    return store


def init_distributed(
    backend: str | None = None,
    *,
    device: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S,
    timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
) -> Runtime:
    """Start the default process group and return this process's `Runtime`.

    Args:
        backend: "gloo" or "nccl"; default (None or "auto"): RINGTRAIN_BACKEND, else NCCL
            where the device is CUDA and gloo on the CPU (`ringtrain.launch.device`).
        device: "cpu" or "cuda"; default (None or "auto"): RINGTRAIN_DEVICE, else CUDA where
            torch sees a GPU and the backend is not gloo. NCCL gives each local rank a GPU of
            its own and refuses more processes per machine than GPUs; gloo with
            device="cuda" lets ranks share one.
        rank, world_size, master_addr, master_port: override torchrun's variables (any of
            them given: the launcher's other variables are not read).
        rendezvous_timeout_s: how long to wait for every rank to arrive before failing.
        timeout_s: collective timeout handed to the process group.

    Calling it again while initialised returns the existing runtime (arguments that describe
    another group are refused). A process group that is already up (Ray Train's) is taken as
    it is, and left to whoever started it.
    """
    global _runtime, _own_group
    asked = {"backend": backend, "device": device, "rank": rank, "world_size": world_size}
    if _runtime is not None:
        return _unchanged(_runtime, asked)
    if dist.is_available() and dist.is_initialized():  # Ray Train (or the script) started it
        return _unchanged(_adopt_group(existing_group_name(os.environ)), asked)
    if (rank, world_size, master_addr, master_port) == (None, None, None, None):
        found = detect(os.environ)
    else:
        found = from_arguments(os.environ, rank, world_size, master_addr, master_port)
    rank, world_size, addr, port = (found.rank, found.world_size, found.master_addr,
                                    found.master_port)
    local_rank = found.local_rank
    # LOCAL_WORLD_SIZE: torchrun's and `ringtrain run`'s; other launchers leave the check to
    # the ranks whose local rank has no GPU of its own.
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or local_rank + 1)
    placement = choose(backend, device, local_rank=local_rank, local_world_size=local_world)
    backend, device = placement.backend, placement.device
    if device.type == "cuda":
        torch.cuda.set_device(device)

    timeout = timedelta(seconds=timeout_s)
    if world_size > 1:  # NCCL's group has a gloo part too (below)
        _pick_gloo_interface(addr or os.environ.get("MASTER_ADDR", "127.0.0.1"), rank)
    if world_size == 1:
        store: dist.Store = dist.HashStore()
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and master_addr is None:
        # torchrun's agent ran the rendezvous
        store = _agent_store(addr, port, rendezvous_timeout_s)
    else:
        store = _own_rendezvous(addr, port, rank, world_size, rendezvous_timeout_s)
    # NCCL takes CUDA tensors only; the agreement's sums, the stop vote and resume's step
    # vote are small CPU tensors, so an NCCL group carries those over gloo ("cpu:gloo").
    dist.init_process_group("cpu:gloo,cuda:nccl" if backend == "nccl" else backend,
                            store=dist.PrefixStore("ringtrain/pg", store), rank=rank,
                            world_size=world_size, timeout=timeout)
    _own_group = True
    _runtime = Runtime(rank, world_size, local_rank, backend, device, dist.group.WORLD, store)
    _log_found(found.name, _runtime, addr, port)
    # Teardown at interpreter exit too, whatever the script called (it is idempotent), then
    # the grace that keeps gloo's threads from aborting the exit (settle_comm_threads).
    register_exit_grace()
    atexit.register(destroy_distributed)  # registered last, so it runs first
    set_runtime(_runtime)  # get_runtime() and every helper reading it
    _start_watchdog(_runtime)
    return _runtime


def init_live(*, device: str | None = None,
              rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S) -> Runtime:
    """A live job's worker (`ringtrain train --live`): its place and the agent's store, no group.

    No default process group: a replacement started later could never join one (its peers
    built theirs long ago), and a dead member's group cannot be torn down collectively. The
    members form their groups themselves, one per generation, on this store
    (`ringtrain.live.LiveGroup`), with gloo. The store is the one `ringtrain run`'s agent hosts,
    so it outlives any worker; if the agent (or its machine) dies, the job is lost and resumes
    from its last snapshot when the command is run again. The `Runtime` has no process group.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise DistributedInitError(
            "live recovery needs a store that outlives every worker: start the job with "
            "`ringtrain train --live --nproc-per-node N` (its agent hosts the store), not by "
            "hand or under another launcher")
    found = detect(os.environ)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or found.local_rank + 1)
    placement = choose("gloo", device, local_rank=found.local_rank, local_world_size=local_world)
    if placement.device.type == "cuda":
        torch.cuda.set_device(placement.device)
    _pick_gloo_interface(found.master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1"),
                         found.rank)
    store = _agent_store(found.master_addr, found.master_port, rendezvous_timeout_s)
    register_exit_grace()
    rt = Runtime(found.rank, found.world_size, found.local_rank, "gloo", placement.device,
                 None, store)  # type: ignore[arg-type]
    _log_found(found.name, rt, found.master_addr, found.master_port)
    return rt


def _unchanged(rt: Runtime, asked: dict) -> Runtime:
    """`rt`, if the arguments of this call describe it: a group that is up is never restarted,
    and ignoring `backend="nccl"` on a gloo group would leave the caller believing otherwise."""
    have = {"backend": rt.backend, "device": rt.device.type, "rank": rt.rank,
            "world_size": rt.world_size}
    differ = {k: v for k, v in asked.items() if v not in (None, "auto") and v != have[k]}
    if differ:
        args = ", ".join(f"{k}={v!r}" for k, v in differ.items())
        up = ", ".join(f"{k}={have[k]!r}" for k in differ)
        raise DistributedInitError(
            f"init_distributed({args}): the process group is already up with {up}, and a "
            "second call returns it as it is; call ringtrain.destroy_distributed() first to "
            "start another, or leave those arguments out")
    return rt


def _adopt_group(name: str) -> Runtime:
    """The group someone else started, as a `Runtime`; `destroy_distributed` leaves it to them.

    Ray Train's TorchTrainer calls init_process_group itself (gloo when its workers have no
    GPU) and destroys the group after the training function returns. The device is the one
    the worker was given (`ringtrain.runtime`); MASTER_ADDR/PORT are what Ray exported.
    """
    global _runtime
    _runtime = get_runtime()  # built from the group (ringtrain.runtime._require)
    set_runtime(_runtime)
    register_exit_grace()
    _log_found(name, _runtime, os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
    return _runtime


def _log_found(name: str, rt: Runtime, addr: str | None, port: object) -> None:
    if rt.rank == 0:  # once per job: every rank found the same launcher
        where = f"master {addr}:{port}" if addr else "no master (one process)"
        # "ringtrain: slurm: ...", but "ringtrain run: ...", not "ringtrain: ringtrain run: ..."
        said = name if name.startswith("ringtrain") else f"ringtrain: {name}"
        log.info("%s: rank %d of world_size %d (local_rank %d), %s, device %s",
                 said, rt.rank, rt.world_size, rt.local_rank, where, rt.device)


WATCHDOG_ENV = "RINGTRAIN_WATCHDOG_TIMEOUT"  # set by `ringtrain run --watchdog-timeout`
_watchdog = None  # the Watchdog init_distributed started for a script under `ringtrain run`


def _start_watchdog(rt: Runtime) -> None:
    """Under `ringtrain run`, watch the peers: a rank that dies, raises or hangs is named.

    Without it a rank that hangs outside a collective leaves the others waiting in it for
    the collective timeout (300 s), and they are the ones reported.
    """
    global _watchdog
    value = os.environ.get(WATCHDOG_ENV, "")
    try:
        timeout_s = float(value) if value else 0.0
    except ValueError:
        raise DistributedInitError(f"{WATCHDOG_ENV}={value!r} is not a number of seconds") from None
    if rt.world_size == 1 or timeout_s <= 0:
        return
    _watchdog = Watchdog(name="run", timeout_s=timeout_s,
                         interval_s=min(1.0, timeout_s / 3)).start()


def destroy_distributed(checkout_timeout_s: float = 5.0) -> None:
    """Tear the default process group down. Safe to call twice or without init.

    Rank 0 hosts the TCPStore; if it exits while a peer still talks to the store, the peer can
    abort in C++ ("terminate called without an active exception"). So each rank checks out
    through the store and rank 0 waits, at most `checkout_timeout_s`, for the others.
    """
    global _runtime, _own_store, _watchdog, _own_group
    if _watchdog is not None:  # first: the peers must see this rank finish, not go silent
        _watchdog.stop(done=getattr(sys, "last_value", None) is None)
        _watchdog = None
    rt, store, own = _runtime, _own_store, _own_group
    _runtime = _own_store = None
    _own_group = False
    set_runtime(None)
    global _chosen_ifname
    if _chosen_ifname is not None and os.environ.get("GLOO_SOCKET_IFNAME") == _chosen_ifname:
        del os.environ["GLOO_SOCKET_IFNAME"]
    _chosen_ifname = None
    if (own or rt is None) and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # not a group Ray Train started: Ray destroys that one
    if getattr(sys, "last_value", None) is not None:
        checkout_timeout_s = 0.0  # exiting on an uncaught exception: peers may be dead, don't wait
    if rt is not None and store is not None and rt.world_size > 1:
        try:  # after the group is gone, so no peer thread still uses the store when rank 0 exits
            left = store.add("ringtrain/checkout", 1)
            deadline = time.monotonic() + checkout_timeout_s
            while rt.rank == 0 and left < rt.world_size and time.monotonic() < deadline:
                time.sleep(0.02)
                left = store.add("ringtrain/checkout", 0)
        except (RuntimeError, OSError):
            pass  # the store is gone already (a peer died): nothing to wait for

    del store  # non-zero ranks close their client here, while rank 0's server still listens
