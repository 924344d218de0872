"""The agent in live mode (`ringtrain train --live`): a lost worker is replaced, the rest go on.

    with replacing_lost_workers():
        elastic_launch(config, cmd)(*args)

torch's agent stops every worker when one fails and restarts them all (or gives up). In live
mode the survivors recover by themselves (`ringtrain.live.LiveGroup`), so the agent's part is:
- a worker killed by a signal (kill -9, the OOM killer), or one that exited with
  `LEFT_OUT_EXIT_CODE` (its peers left it out of a generation: it was too slow), is marked
  `departed/{uid}` in the store (the survivors regroup at once) and started again in place,
  with `REPLACEMENT_ENV` set: the new process registers in the store as a replacement, is let
  in at a step boundary and heals from a live peer (no disk). The others never stop;
- a member the others declared lost while its process still runs (a hang: SIGSTOP, a deadlock,
  a machine swapping) is killed with SIGKILL, then replaced as above: `LiveGroup` writes
  `departed/{uid}` with the uid's `pid/{uid}` under its prefix in the store, read here;
- with warm spares (`replacing_lost_workers(spares=N)`, `ringtrain train --live-spares N`),
  N more processes run the same command from the start with `SPARE_ENV` set: each imports
  torch, builds its model, optimizer and data, registers as a waiting replacement and waits.
  A lost member's place in the next generation is then taken by a spare at once
  (`LiveGroup`'s proposal), not after a ~2.5 s process start; the agent puts that spare in the
  lost worker's slot (`adopt`: torch polls and tears it down as that worker) and starts a new
  spare in the background. A spare that dies is started again (each start after the first N
  counts as a replacement); at the job's end the spares learn it is over and exit 0.
  Replacements and spares are started as torch's agent starts its workers: forked from the
  job's warm process where they can be (`starts.py` says when and why).
  Spares are plain subprocesses the agent owns, not workers of torch's group: a worker there
  has a rank in the rendezvous, a place in WORLD_SIZE and a failure policy that stops the job,
  none of which a process that may never train should have. Under `--memory-limit` each spare
  gets a memory cgroup of its own with the workers' limit, and keeps it when it takes a place
  (`ringtrain.launch.cgroup` says why);
- any other failure (an exception, a mistake, a stop on SIGTERM) is the job's, as without
  --live: every worker stops, one report; a worker that dies meanwhile (torch SIGKILLs one
  that outlives its shutdown timeout) is not replaced.

The store is the one the agent hosts for the rendezvous (its workers get
TORCHELASTIC_USE_AGENT_STORE), so it outlives every worker. If the agent or its machine dies,
the job is lost: run the same command again and it resumes from its last snapshot. At most
`MAX_REPLACEMENTS` replacements per job: a worker that dies every time it starts is a bug to
report, not a fault to ride out.

Across nodes (`--nnodes N`, a fixed N) each node's agent does the above for its own workers;
the store is node 0's agent's, and every agent reads it from a thread (`StoreWatch`,
live_store.py: a call to a host whose link is down blocks for minutes). A worker that exited
is judged only once the store has answered since (a lost store fails every worker of a node
within a second: neither the job's failure nor a fault a replacement could mend). An agent
whose store has not answered for `STORE_SILENT_S` (10 s) SIGKILLs its workers and spares and
raises `LiveStoreLostError`: its link is down (the other nodes trained on without its members
after about a second) or node 0 is gone (the job is lost: a restart from the last snapshot),
and it cannot tell which, so the error says both. A failure that is the job's (an exception:
the same bug on any replacement) is every node's, not only the failed worker's node's: its
agent writes `failed` in the store (node, rank, exit code, error line; the first failure
wins) and waits until the other agents have read it (`StoreWatch.fail`) before torch stops
its workers and it reports the failure as on one node; every other agent, on reading it,
stops its workers and spares (`LiveJobFailedError`: torch's SIGTERM shutdown, no replacement)
and its launcher exits 1 naming the failed node, rank and error. Only a kill, a hang or a lost
link is a fault the other nodes ride out. torch's re-rendezvous is off
(`ringtrain.launch.rendezvous._BoundedRendezvous`): a node that arrives late waits outside and
never restarts the others' workers. The agents' exit barrier waits only for agents still
beating in the store, not torch's 300 s for a node that is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ringtrain.launch.cgroup import MemoryCgroups
from ringtrain.launch.live_spares import REPLACEMENT_ENV, SPARE_ENV, Spares
from ringtrain.launch.live_store import StoreWatch
from ringtrain.launch.starts import forked
from ringtrain.torch_internals import (
    CAPTURE_PROCESS_FAILURES,
    EXIT_BARRIER,
    MONITOR_WORKERS,
    adopt,
    running_workers,
    spawn_like,
    sync_worker_ids,
)

__all__ = ["LEFT_OUT_EXIT_CODE", "MAX_REPLACEMENTS", "REPLACEMENT_ENV", "SPARE_ENV",
           "LiveJobFailedError", "LiveStoreLostError", "replacing_lost_workers"]

LEFT_OUT_EXIT_CODE = 76  # a worker its peers left out of a generation (LiveMemberLostError)
MAX_REPLACEMENTS = 32
FORKED = "forked from the warm process"  # said of a start `starts.Starts` forked

class LiveStoreLostError(RuntimeError):
    """This node's agent lost the job's store (node 0's agent) and stopped its workers."""


class LiveJobFailedError(RuntimeError):
    """Another node's worker failed (an exception): this node's agent stopped its workers."""


def respawn(context: Any, local_rank: int, env: dict[str, str]) -> subprocess.Popen:
    """Start `local_rank`'s command again in its slot, `env` on top (a replacement)."""
    proc = spawn_like(context, local_rank, env)
    adopt(context, local_rank, proc)
    return proc


def _replaceable(exitcode: int) -> bool:
    """A death the survivors ride out: a signal other than a stop the job asked for, or left out."""
    return exitcode == LEFT_OUT_EXIT_CODE or (exitcode < 0 and exitcode != -signal.SIGTERM)


@contextlib.contextmanager
def replacing_lost_workers(max_replacements: int = MAX_REPLACEMENTS, *, spares: int = 0,
                           memory: MemoryCgroups | None = None) -> Iterator[None]:
    """Inside: the agent replaces a lost worker in place (by one of `spares` warm spares where
    one waits) and kills a member found hung (see the module docstring); every other failure
    stops the job as torch's agent does. `memory`: the workers' cgroups (`--memory-limit`),
    beside which each spare gets its own. New processes start as the job's workers do (forked
    inside `starts.forked_worker_starts`)."""
    original = CAPTURE_PROCESS_FAILURES.get()
    departed = StoreWatch()
    warm = Spares(spares, memory)
    count = [0]

    def may_start() -> bool:
        if count[0] >= max_replacements:
            return False
        count[0] += 1
        return True

    stopping = [False]  # a failure that is the job's: torch now stops every worker

    def capture(self, done_local_ranks: set[int]) -> None:
        # Once a worker failed in a way that is the job's (an exception), torch stops the rest
        # (SIGTERM, then SIGKILL after its shutdown timeout) and polls them once more: a death
        # by its own SIGKILL then is no fault to ride out (seen: a replacement started while
        # the job stopped on a raise, benchmarks/chaos.py --live).
        workers = running_workers(self)
        if workers and not stopping[0]:
            departed.start(self.envs)
            silent = departed.silent_s()
            if silent > departed.silent_after_s:
                _stop_node(self, warm, departed, silent)
            record = departed.failure()
            if record is not None:  # another node's worker failed: the job is over
                stopping[0] = True
                warm.close(grace_s=0)
                raise LiveJobFailedError(_failed_elsewhere(
                    departed.node, record, [rank for _, rank, _ in running_workers(self)]))
            # A worker that exited is judged once the store has answered since: across nodes a
            # lost store fails every worker here within a second, which is neither the job's
            # failure nor a fault a replacement (that could not reach the store) would mend.
            if not departed.answered_since(
                    [proc.pid for _, _, proc in workers if proc.poll() not in (None, 0)]):
                return
        failed = [(local, rank, proc) for local, rank, proc in workers
                  if proc.poll() not in (None, 0) and not _replaceable(proc.returncode)]
        if failed and not stopping[0]:
            stopping[0] = True
            # Every node's failure, not this one's alone (an exception is the same bug on any
            # replacement): the record goes in the store, and the other agents have read it,
            # before this node's workers stop and its members vanish from the others' group.
            departed.fail(_failure_record(self, *failed[0]))
        if stopping[0]:
            warm.close(grace_s=0)
            original(self, done_local_ranks)
            return
        if workers:
            hung = set(departed.pids())
            for _, rank, proc in workers:
                if proc.pid in hung and proc.poll() is None:
                    print(f"ringtrain run: live: rank {rank} (pid {proc.pid}) was left out by "
                          "its peers (silent or hung): killing it to start a replacement",
                          file=sys.stderr, flush=True)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
            for proc, *_ in warm.procs:  # a spare let in while another took the slot
                if proc.pid in hung and proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGKILL)  # keep_up starts another
        for local_rank, rank, proc in running_workers(self):
            exitcode = proc.poll()
            if exitcode is None or not _replaceable(exitcode):
                continue
            how = (f"killed by {signal.Signals(-exitcode).name}" if exitcode < 0
                   else f"left out by its peers (exit code {exitcode})")
            departed.mark(proc.pid)  # the survivors regroup now, not a heartbeat bound later
            spare = warm.take()
            if spare is not None:  # built and waiting: the next generation takes it at once
                adopt(self, local_rank, spare[0])
                where = f", memory cgroup {spare[2]}" if spare[2] else ""
                started = FORKED + ", " if spare[3] else ""
                print(f"ringtrain run: live: rank {rank} (pid {proc.pid}) {how}; the others go "
                      f"on, warm spare pid {spare[0].pid} ({started}waiting for "
                      f"{time.monotonic() - spare[1]:.1f} s{where}) takes its place",
                      file=sys.stderr, flush=True)
                continue
            if not may_start():
                continue
            new = respawn(self, local_rank, {REPLACEMENT_ENV: str(count[0])})
            print(f"ringtrain run: live: rank {rank} (pid {proc.pid}) {how}; the others go on, "
                  f"replacement {count[0]} of at most {max_replacements} started (pid "
                  f"{new.pid}{', ' + FORKED if forked(new) else ''})", file=sys.stderr,
                  flush=True)
        if warm.count and not stopping[0]:
            warm.keep_up(self, departed, may_start)
        original(self, done_local_ranks)
        if warm.procs and not {w[0] for w in running_workers(self)} - done_local_ranks:
            # Every worker is done: close the spares now, while the agent's store is up (they
            # read "finished" there and exit 0; past this poll the store goes, and a spare
            # still starting would fail on it).
            warm.close(grace_s=5)

    monitor = MONITOR_WORKERS.get()

    def monitor_workers(self, worker_group):
        sync_worker_ids(self, worker_group)  # a replacement is that worker now
        return monitor(self, worker_group)

    def exit_barrier(self) -> None:  # torch's waits 300 s for every node's agent, even a lost one
        gone = departed.finish()
        departed.close()  # before torch closes the store under its reads
        if gone:
            print(f"ringtrain run: live: node {departed.node} done; not waiting for node"
                  f"{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))}, whose agent "
                  f"stopped answering the store over {departed.silent_after_s:g} s ago (lost "
                  "or cut off; the job went on without it)", file=sys.stderr, flush=True)
        record = departed.failure()
        if record is not None:  # a worker failed on another node after this node's finished
            raise LiveJobFailedError(_failed_elsewhere(departed.node, record, None))

    with CAPTURE_PROCESS_FAILURES.replaced(capture), MONITOR_WORKERS.replaced(monitor_workers), \
            EXIT_BARRIER.replaced(exit_barrier):
        try:
            yield
        finally:  # the job is over (done, failed or stopped): no spare outlives it
            warm.close(grace_s=3)
            departed.close()


def _stop_node(context: Any, warm: Spares, watch: StoreWatch, silent_s: float) -> None:
    """The store has not answered for `silent_s`: stop this node's workers and spares (SIGKILL:
    the job's state lives with the members the store still reaches, or in its snapshots) and
    raise `LiveStoreLostError`, which says what happened and what to do."""
    ranks = []
    for _, rank, proc in running_workers(context):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        ranks.append(rank)
    warm.close(grace_s=0)
    raise LiveStoreLostError(
        f"node {watch.node} lost the job's store at {watch.endpoint} (node 0's agent): no "
        f"answer for {silent_s:.0f} s. Stopped this node's workers (ranks {ranks}). If only "
        "this node's link went down, the other nodes go on without it (nothing to do here). If "
        "node 0 or its agent is gone, the job is lost: run the same command again on every "
        "node; it resumes from the last snapshot")


def _failure_record(context: Any, local_rank: int, rank: int, proc: subprocess.Popen) -> dict:
    """What the other nodes' agents say about this node's failed worker (`StoreWatch.fail`):
    where it ran, its exit code and the first line of what it raised, if its error file (a
    worker under `@record`, as `ringtrain train`'s) has it."""
    error_file = context.envs[local_rank].get("TORCHELASTIC_ERROR_FILE", "")
    message: Any = ""
    if error_file and os.path.isfile(error_file):  # else torch makes up a line that says nothing
        with contextlib.suppress(ValueError, KeyError, TypeError, OSError):  # cut short: none
            message = ProcessFailure(local_rank=local_rank, pid=proc.pid,
                                     exitcode=proc.returncode, error_file=error_file).message
    if isinstance(message, dict):  # {"message": ..., "extraInfo": {"py_callstack": ...}}
        message = message.get("message", "")
    error = next(iter(str(message).strip().splitlines()), "")
    return {"host": socket.gethostname(), "rank": rank, "local_rank": local_rank,
            "pid": proc.pid, "exitcode": proc.returncode, "error": error}


def _failed_elsewhere(node: int, record: dict, stopped: list[int] | None) -> str:
    """`LiveJobFailedError`'s message: which node's worker failed, how, and what to do; this
    node's ranks `stopped` (None: its workers had finished)."""
    code = record["exitcode"]
    how = (f"was killed by {signal.Signals(-code).name}" if code < 0
           else f"exited with exit code {code}")
    error = f": {record['error']}" if record.get("error") else ""
    here = (f"this node's workers (node {node}) had finished, the job had not" if stopped is None
            else f"stopped this node's workers (node {node}, ranks {stopped})")
    return (f"node {record['node']} (host {record['host']}): rank {record['rank']} (local_rank "
            f"{record['local_rank']}, pid {record['pid']}) {how}{error}. A worker's failure is "
            f"the job's on every node (the same error would end any replacement): {here}. Fix "
            "the cause and run the same command again on every node; it resumes from the last "
            "snapshot")
