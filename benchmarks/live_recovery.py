"""Live recovery against today's restart path: two network-namespace hosts, faults in turns.

    .venv/bin/python benchmarks/live_recovery.py            # full size (root): ~1 s steps,
                                                            #   a fault every 60 s and every 10 s
    nice .venv/bin/python benchmarks/live_recovery.py --quick   # small GPT, a fault every 8 s
    .venv/bin/python benchmarks/live_recovery.py --device-time 0.12 --tokens 16
        # a device per worker emulated: ~1 s steps that leave the host's cores free

Two hosts (tests/netns.py), 2 workers each (world size 4), the store in its own process on
host a; the same GPT, data and global batches in every mode (benchmarks/live_recovery_worker.py):
- `plain`: the fault-free run of today's path (the restart mode's loop: a fixed gloo group, a
  snapshot every --snapshot-every steps), the anchor of `goodput`;
- `clean`: the fault-free run in live mode (heartbeats, a commit in memory every step, in place
  as ddp's, watched collectives): `goodput_vs_clean` leaves out what live mode costs without a
  fault;
- `live@N`: a fault every N s, in turns: SIGKILL of a worker on b (marked departed in the store
  0.1 s later, as `ringtrain train --live`'s agent does on its poll), SIGSTOP of a worker on a,
  host b's link down (`ip link set ... down`, both its workers lost). The survivors regroup and
  go on; once they have committed a step without the lost ones, the benchmark does what an
  agent would: reaps what is left of them (SIGKILL; the link back up) and starts as many spares
  with the same command, which join at a step boundary and heal from a peer;
- `spare@N`: live, with `--spares` warm spares per host (default 1) started beside the workers
  (what `ringtrain train --live --live-spares 1` does): a lost member's place is taken at once
  by a spare that is already built and waiting, and the benchmark starts a new spare for each
  process the fault took (a spare on a host whose link went down is lost with it: with one
  spare per host, a lost link's second member is replaced only once a new spare is built;
  with `--spares 2`, host a's two spares take both places at once);
- `restart@N`: today's path, the same faults: the agent kills every worker and starts them all
  again, and they resume from the newest snapshot (every --snapshot-every steps). The agent
  is told of each fault at once, which favours it (a real one waits out its watchdog for a
  hang or a lost link).
All "hosts" share this machine's cores, so a replacement's start (importing torch, building
its model: ~4 s of CPU) takes the survivors' cores, as it would not on a cluster; with
`--niced-start` a process started after the job began builds at nice 19 and trains at 0.
Each fault meets a job of 4 workers, training (the restart path is not faulted again before it
has trained at all). `--fault-clock wall` (the default): the next fault is due N s of wall time
after the last, and waits, if due earlier, until the job is whole again. `--fault-clock whole`
(sessions 13-15): the clock runs only while the job is whole: the next fault comes N s after
the spares are in (live) or after the restarted job's first step (restart).
Reported per mode: goodput (samples committed per second from the first commit to the last, over
the plain run's; `goodput_vs_clean`: over the clean run's; `goodput_own_devices`: an estimate for a
device per worker, where a step of 3 members takes 4/3 of a plain step, as it does not on these
shared cores; with `--device-time` the goodput itself: such steps took their 4/3), the faults a
minute and what each cost (`cost_per_fault_s`: the run's wall time over the plain run's, per fault;
a fault waits for a whole job, so the fault count depends on the mode), each fault's stall (the
longest wait for a new step from the last step committed before it to the first step committed by
the regrouped or restarted job: a redone step does not count, and neither does a step that was in
flight when the link went down), heals (seconds, bytes), the committed history checked against
`GlobalBatches` (samples skipped or repeated; a share whose member was killed or stopped between
its commit and its record's flush is counted from the step's size and rank as `unlogged_shares`),
samples held through a fault (`samples_held`: a redo after a fault trains only what nobody holds,
`ringtrain.live.redo`), samples whose training was thrown away (restart: steps redone; live: a step
that members lost just after committing it had committed, which the survivors redid), processes
left. A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # netns.py: the two-host setup the tests use
sys.path.insert(0, str(REPO))

from netns import two_hosts, unavailable  # noqa: E402

from ringtrain.launch.zygote import Zygote  # noqa: E402
from ringtrain.live import GlobalBatches  # noqa: E402

WORKER = REPO / "benchmarks" / "live_recovery_worker.py"
PORT = 29571
KINDS = ("kill", "stop", "link")
# What a worker forked from a host's warm process finds imported (--cold-starts: none).
PRELOAD = ("torch", "torch._dynamo", "torch.optim", "torch.distributed", "ringtrain.live",
           "ringtrain.models.gpt")
WORLD_SIZE = 4  # 2 hosts x 2 workers: a job of fewer members is short
# Builds at nice 19, the process and its session's autogroup (where the kernel has them).
NICED_EXEC = ('[ -w /proc/self/autogroup ] && echo 19 > /proc/self/autogroup; '
              'exec nice -n 19 "$@"')
AGENT_POLL_S = 0.1  # `ringtrain run`'s monitor_interval: how soon an agent sees a worker exit
# The store's process, on host a; it also does the agent's part for a killed worker: each
# line "JOB PID" on its stdin marks the live member of that pid departed.
STORE = """
import sys, time, torch.distributed as d
store = d.TCPStore('{addr}', {port}, is_master=True, wait_for_workers=False)
for line in sys.stdin:
    job, pid = line.split()
    keys = d.PrefixStore('ringtrain/live/' + job, store)
    for uid in range(keys.add('uids', 0)):
        if keys.check(['pid/%d' % uid]) and keys.get('pid/%d' % uid).decode() == pid:
            keys.set('departed/%d' % uid, b'1')
time.sleep(24 * 3600)
"""


FULL = {"steps": 300, "intervals": "60,10", "n_layer": 4, "n_embd": 256, "block_size": 128,
        "global_batch": 32}
QUICK = {"steps": 240, "intervals": "8", "n_layer": 2, "n_embd": 128, "block_size": 64,
         "global_batch": 64}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"smaller: {QUICK}")
    p.add_argument("--steps", type=int, help=f"default {FULL['steps']}")
    p.add_argument("--intervals", help="seconds between faults, one run per interval and mode "
                   f"(default {FULL['intervals']})")
    p.add_argument("--n-layer", type=int)
    p.add_argument("--n-embd", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--global-batch", type=int)
    p.add_argument("--device-time", type=float, default=0.0, metavar="S",
                   help="emulate a device per worker: each sample's forward and backward "
                   "sleeps S seconds (its first --tokens tokens trained on the CPU), so that "
                   "the host's cores stay free for starts, heals and regroups, as on a "
                   "cluster, and a share of 3 members takes 4/3 of one of 4 (0: every step "
                   "trained on the shared cores, the default)")
    p.add_argument("--tokens", type=int, help="tokens of each sample trained (default: the "
                   "block size)")
    p.add_argument("--snapshot-every", type=int, default=10, help="the restart path's snapshots")
    p.add_argument("--modes", default="live,spare,restart")
    p.add_argument("--spares", type=int, default=1,
                   help="warm spares per host in the spare runs (ringtrain train --live-spares)")
    p.add_argument("--skip", default="", help="runs left out, e.g. restart@10 (under the wall "
                   "clock a restart every 10 s trains about one step per fault: it never ends)")
    p.add_argument("--kinds", default=",".join(KINDS), help="the faults, fired in turns")
    p.add_argument("--fault-clock", choices=("wall", "whole"), default="wall",
                   help="the N s between faults: of wall time, or of time the job is whole")
    p.add_argument("--dead-after", type=float, default=0.5,
                   help="seconds of heartbeat silence after which a live member is lost "
                   "(ringtrain train --live's default --live-dead-after: 0.5 s)")
    p.add_argument("--niced-start", action="store_true",
                   help="a process started after the job began (a replacement, a new spare) "
                   "imports torch and builds its model at nice 19, then trains at nice 0: on a "
                   "cluster it starts on cores of its own, here its start takes the survivors'")
    p.add_argument("--cold-starts", action="store_true",
                   help="start every process as a new interpreter (importing torch first), as "
                   "`ringtrain run --cold-starts` does; by default each is forked from a warm "
                   "process per host, as `ringtrain run`'s agent does")
    p.add_argument("--keep", help="keep the workers' logs and records in this directory")
    a = p.parse_args(argv)
    a.kinds = a.kinds.split(",")
    if a.spares < 1:
        p.error(f"--spares {a.spares}: a spare run needs at least one warm spare per host "
                "(the live runs have none)")
    if set(a.kinds) - set(KINDS):
        p.error(f"--kinds {','.join(a.kinds)}: choose from {','.join(KINDS)}")
    for key, value in (QUICK if a.quick else FULL).items():
        if getattr(a, key) is None:  # given on the command line: kept
            setattr(a, key, value)
    a.tokens = a.block_size if a.tokens is None else a.tokens
    if not 0 < a.tokens <= a.block_size or a.device_time < 0:
        p.error(f"--tokens {a.tokens} --device-time {a.device_time}: the tokens must be 1 to "
                f"the block size ({a.block_size}) and the time 0 or more")
    return a


class Job:
    """One run's workers on the two hosts, their records and their processes."""

    def __init__(self, a, hosts, out: Path, mode: str, name: str, spares: int = 0):
        self.a, self.hosts, self.out, self.mode, self.name = a, hosts, out, mode, name
        self.spares = spares  # warm spares per host (live mode)
        self.procs: list[tuple[object, subprocess.Popen]] = []  # (host, process)
        self.attempt = 0
        self.store = None  # the store process's stdin: "JOB PID" marks a killed member departed
        self.started = False  # whether the job's first processes are all started
        self._records: list[dict] = []  # parsed so far (`records`)
        self._read_to: dict[Path, int] = {}  # per file: bytes parsed
        # A warm process per host forks every worker, the job's first ones, a restart's,
        # replacements and spares, as `ringtrain run`'s agent does (ringtrain.launch.starts):
        # started with the job, which waits until it is ready. None for --cold-starts.
        self.forks = not a.cold_starts
        self.zygotes: dict[str, Zygote] = {}

    def env(self, host) -> dict[str, str]:
        return {**os.environ, "GLOO_SOCKET_IFNAME": host.ifname, "PYTHONUNBUFFERED": "1"}

    def zygote(self, host) -> Zygote:
        if host.netns not in self.zygotes:
            env = {**self.env(host), "PYTHONPATH": str(REPO)}  # this tree's ringtrain
            self.zygotes[host.netns] = Zygote([sys.executable], env, PRELOAD,
                                              popen=host.popen)
        return self.zygotes[host.netns]

    def close(self) -> None:
        for zygote in self.zygotes.values():
            zygote.close()

    def start(self, host, rank: int = -1, spare: bool = False) -> subprocess.Popen:
        config = {"mode": self.mode, "store": [self.hosts[0].addr, PORT], "job": self.name,
                  "world_size": WORLD_SIZE, "steps": self.a.steps, "out_dir": str(self.out),
                  "model": {"n_layer": self.a.n_layer, "n_embd": self.a.n_embd,
                            "block_size": self.a.block_size},
                  "global_batch": self.a.global_batch, "tokens": self.a.tokens,
                  "device_s": self.a.device_time, "rank": rank, "attempt": self.attempt,
                  "snapshot_every": self.a.snapshot_every, "spare": spare,
                  "dead_after_s": self.a.dead_after,
                  "renice": bool(self.a.niced_start and self.started)}
        env = self.env(host)
        command = [sys.executable, str(WORKER), json.dumps(config)]
        zygote = self.zygote(host) if self.forks else None
        if zygote is not None and zygote.wait_ready(120):
            with open(self.out / f"{self.name}.log", "a") as log:
                proc = zygote.fork(command, env, stdout=log, stderr=subprocess.STDOUT,
                                   nice=19 if config["renice"] else 0)
            self.procs.append((host, proc))
            return proc
        log = open(self.out / f"{self.name}.log", "a")  # noqa: SIM115 - the child holds it
        # exec'd: the same pid. Each worker runs in a session of its own (netns popen), and
        # with the kernel's autogroups (sched_autogroup_enabled) CPU is shared fairly between
        # sessions, whatever a process's own nice: `nice -n 19` alone left a building
        # replacement a full share of the cores (measured: a niced busy loop in its own session
        # ran as fast as its neighbours; with its autogroup at nice 19, 3 % as fast).
        nice = ["sh", "-c", NICED_EXEC, "sh"] if config["renice"] else []
        proc = host.popen([*nice, *command], env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append((host, proc))
        return proc

    def start_all(self) -> None:
        a, b = self.hosts
        if self.forks:
            for host in (a, b):  # both warm processes import at once
                self.zygote(host)
        for rank, host in enumerate((a, a, b, b)):
            self.start(host, rank)
        for host in (a, b):
            for _ in range(self.spares):
                self.start(host, spare=True)
        self.started = self.mode == "live"  # from now on a start is a replacement or new spare

    def records(self) -> list[dict]:
        """Every record so far, each file read from where the last call stopped: the run's loop
        asks every 50 ms, and parsing every file whole each time grew with the run (~20 x 1200
        lines a second by its end) and took the workers' CPU (the steps drifted 8-11 % slower
        over a 260-step run, the fault-free plain loop's too)."""
        for path in self.out.glob(f"{self.name}-*.jsonl"):
            pid = int(path.stem.rsplit("-", 1)[1])
            with open(path, "rb") as f:
                f.seek(self._read_to.get(path, 0))
                data = f.read()
            whole = data[:data.rfind(b"\n") + 1]  # a line being written: read it next time
            self._read_to[path] = self._read_to.get(path, 0) + len(whole)
            for line in whole.splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill: never completed
                    continue
                self._records.append({**record, "pid": pid})
        return list(self._records)

    def committed(self) -> list[dict]:
        return [r for r in self.records() if "step" in r]

    def alive(self, host=None) -> list[subprocess.Popen]:
        return [p for h, p in self.procs if p.poll() is None and (host is None or h is host)]

    def members(self, host) -> list[subprocess.Popen]:
        """The processes on `host` training in the job now. In live mode: those that committed
        a step of the newest generation; a warm spare waiting to be let in is not one (a fault
        on it stops nothing, and the fault clock would then wait for a regroup that never
        comes: session 13's first spare@10 run fired 4 faults in 280 s)."""
        alive = self.alive(host)
        committed = self.committed()
        if self.mode != "live" or not committed:
            return alive
        gen = max(r["gen"] for r in committed)
        pids = {r["pid"] for r in committed if r["gen"] == gen}
        return [p for p in alive if p.pid in pids]

    def done(self) -> bool:
        last = self.a.steps - 1
        return any(r["step"] == last for r in self.committed()) and not self.alive()


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _inject(kind: str, job: Job) -> list[subprocess.Popen]:
    """Fire one fault; the processes it took out of the job."""
    a, b = job.hosts
    # A kill takes a member on host b, a stop one on host a; where that host has none left (the
    # spares that took a lost link's places ran on the other), the other host's.
    if kind == "kill":
        victim = (job.members(b) or job.members(a))[0]
        victim.send_signal(signal.SIGKILL)
        if job.mode == "live":  # as `ringtrain train --live`'s agent: it polls its workers
            # (monitor_interval 0.1 s) and marks one that died `departed/{uid}` (live_agent's
            # `_Departed.mark`): the survivors regroup then, not a heartbeat bound later
            time.sleep(AGENT_POLL_S)
            job.store.write(f"{job.name} {victim.pid}\n")
            job.store.flush()
        return [victim]
    if kind == "stop":
        victim = (job.members(a) or job.members(b))[-1]
        victim.send_signal(signal.SIGSTOP)
        return [victim]
    b.unplug()
    return job.alive(b)


def _reap(job: Job, lost: list[subprocess.Popen]) -> None:
    """What the agent does once the fault is known: nothing of the lost ones is left."""
    b = job.hosts[1]
    for p in lost:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
    subprocess.run(["ip", "-n", b.netns, "link", "set", b.ifname, "up"], check=True,
                   capture_output=True, timeout=10)


def run_job(a, hosts, out: Path, mode: str, interval: float | None, store) -> dict:
    name = f"{mode}@{interval:g}" if interval else mode
    job = Job(a, hosts, out, "restart" if mode in ("restart", "plain") else "live", name,
              spares=a.spares if mode == "spare" else 0)
    job.store = store
    job.start_all()
    if not _wait(lambda: job.committed(), 300):
        raise RuntimeError(f"{name}: no step committed within 300 s; see {out / name}.log")
    faults = []
    next_at: float | None = time.time() + (interval or 0)
    deadline = time.monotonic() + 60 * 60
    while not job.done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: not done within an hour; see {out / name}.log")
        now = time.time()
        committed = job.committed()
        newest = max(r["step"] for r in committed)
        # spares in: a fault each
        whole = max(committed, key=lambda r: r["t"])["size"] == WORLD_SIZE
        if next_at is None and whole:  # the clock runs while the job is whole and training
            next_at = now + interval
        if interval and next_at and now >= next_at and newest < a.steps - 3 and whole:
            kind = a.kinds[len(faults) % len(a.kinds)]
            if kind == "link" and not job.members(hosts[1]):  # b's link holds no member now
                kind = "kill"  # (a's holds the store: the job's, not a member's, fault)
            lost = _inject(kind, job)
            faults.append({"kind": kind, "t": now, "before": newest})
            if job.mode == "live":  # the survivors regroup (with a warm spare if one waits)
                gen = max(r["gen"] for r in committed)
                _wait(lambda t=now, g=gen: any(r["t"] > t and r["gen"] > g
                                               for r in job.committed()), 120)
                _reap(job, lost)
                for p in lost:  # replacements join at a step boundary; or new warm spares
                    job.start(next(h for h, q in job.procs if q is p), spare=job.spares > 0)
            else:  # restart: everything stops, everything starts again
                for _, p in job.procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGKILL)
                        p.wait(timeout=30)
                _reap(job, [])
                job.attempt += 1
                job.start_all()
                restarted = time.time()
                _wait(lambda t=restarted: any(r["t"] > t for r in job.committed()), 300)
            next_at = None if a.fault_clock == "whole" else now + interval
        time.sleep(0.05)
    time.sleep(1)
    left = len(job.alive())
    for _, p in job.procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
    job.close()
    return analyse(a, name, job.records(), faults, left, started=len(job.procs))


def analyse(a, name: str, records: list[dict], faults: list[dict], left: int,
            started: int) -> dict:
    steps = [r for r in records if "step" in r]
    by_step: dict[int, list[dict]] = {}
    for r in steps:
        by_step.setdefault(r["step"], []).append(r)
    batches = GlobalBatches(4096, a.global_batch, seed=2)
    skipped = repeated = redone = unlogged = held = 0
    short = 0.0  # steps' worth a job of one device per worker loses to steps of fewer members
    for s in range(a.steps):
        rs = by_step.get(s, [])
        # The step as the job finally committed it: the newest restart's (attempt), or the
        # newest generation's (gen). Members lost just after committing it in an older
        # generation took their commit with them, and the survivors redid the step: that
        # training was thrown away (redone), not repeated, unless a process committed it twice.
        final = max(((r.get("attempt", 0), r.get("gen", 0)) for r in rs), default=(0, 0))
        kept = [r for r in rs if (r.get("attempt", 0), r.get("gen", 0)) == final]
        thrown = [r for r in rs if (r.get("attempt", 0), r.get("gen", 0)) != final]
        redone += sum(len(r["ids"]) for r in thrown)
        twice = {r["pid"] for r in kept} & {r["pid"] for r in thrown if "gen" in r}
        repeated += sum(len(r["ids"]) for r in thrown if r["pid"] in twice)
        ids = Counter(i for r in kept for i in r["ids"])
        # Samples a member held through a fault (computed before it, not trained again).
        held += sum(len(r["ids"]) - r["trained"] for r in kept if "trained" in r)
        if kept:  # a member stopped or killed between its commit and its record's flush
            size = kept[0]["size"]
            short += WORLD_SIZE / size - 1
            for rank in set(range(size)) - {r["rank"] for r in kept}:
                unlogged += 1
                ids.update(batches.share(s, rank, size))
        skipped += len(set(batches.batch(s)) - set(ids))
        repeated += sum(c - 1 for c in ids.values()) + len(set(ids) - set(batches.batch(s)))
    first = min(r["t"] for r in by_step[0])
    last = max(r["t"] for r in by_step[a.steps - 1])
    stalls = []
    for f in faults:
        prev = max((r for r in steps if r["t"] < f["t"]), key=lambda r: r["t"])
        # Up to the first step committed by the regrouped (live) or restarted job, the longest
        # wait for a new step: a step whose all-reduce was done when the link went down may
        # still commit just after the fault, and is not the end of the stall.
        group = (prev.get("gen"), prev.get("attempt"))
        later = [r for r in steps if r["t"] > f["t"] and r["step"] > prev["step"]]
        end = min((r["t"] for r in later if (r.get("gen"), r.get("attempt")) != group),
                  default=min(r["t"] for r in later))  # no regroup (a spare that was not in)
        firsts: dict[int, float] = {}
        for r in steps:
            if r["step"] > prev["step"] and prev["t"] < r["t"] <= end:
                firsts[r["step"]] = min(firsts.get(r["step"], end), r["t"])
        times = [prev["t"], *sorted(firsts.values())]
        stalls.append(round(max(b - a for a, b in zip(times, times[1:], strict=False)), 3))
    heals = [r for r in records if "heal_s" in r]
    return {"name": name, "faults": [f["kind"] for f in faults], "stalls_s": stalls,
            "median_stall_s": round(statistics.median(stalls), 3) if stalls else None,
            "samples_per_s": round((a.steps - 1) * a.global_batch / (last - first), 3),
            "wall_s": round(last - first, 2),
            "heal_s": [round(r["heal_s"], 3) for r in heals],
            "heal_bytes": [r["heal_bytes"] for r in heals],
            "skipped": skipped, "repeated": repeated, "samples_redone": redone,
            "unlogged_shares": unlogged, "samples_held": held, "short_steps": round(short, 2),
            "processes_started": started, "processes_left": left}


def main(argv=None) -> dict:
    a = parse(argv)
    reason = unavailable()
    if reason:
        sys.exit(f"live_recovery needs two network-namespace hosts: {reason}")
    intervals = [float(i) for i in a.intervals.split(",") if i]
    modes = [m for m in a.modes.split(",") if m]
    planned = [(m, i) for i in intervals for m in modes]
    skip = set(filter(None, a.skip.split(",")))
    unknown = skip - {f"{m}@{i:g}" for m, i in planned}
    if unknown:  # before any host is made
        sys.exit(f"--skip {a.skip}: {sorted(unknown)} is not a planned run; the runs are "
                 f"{[f'{m}@{i:g}' for m, i in planned]}")
    runs = [("plain", None), ("clean", None)] + [
        (m, i) for m, i in planned if f"{m}@{i:g}" not in skip]
    results = {}
    keep = contextlib.nullcontext(a.keep) if a.keep else tempfile.TemporaryDirectory(
        prefix="live_recovery-")
    with keep as tmp, two_hosts() as hosts:
        out = Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        store = hosts[0].popen([sys.executable, "-c", STORE.format(addr=hosts[0].addr,
                                                                  port=PORT)],
                               stdin=subprocess.PIPE, text=True)
        try:
            for mode, interval in runs:
                r = run_job(a, hosts, out, mode, interval, store.stdin)
                results[r["name"]] = r
                print(json.dumps(r), file=sys.stderr, flush=True)
        finally:
            store.kill()
    plain, clean = results["plain"]["samples_per_s"], results["clean"]["samples_per_s"]
    for r in results.values():
        r["goodput"] = round(r["samples_per_s"] / plain, 3)
        r["goodput_vs_clean"] = round(r["samples_per_s"] / clean, 3)
        # A fault waits for a whole job (and, under `--fault-clock whole`, its clock too), so
        # how many faults a run meets depends on how soon it is whole again: the time each
        # fault cost is the figure that does not (the run's wall time over the plain run's).
        r["cost_per_fault_s"] = (round((r["wall_s"] - results["plain"]["wall_s"])
                                       / len(r["faults"]), 2) if r["faults"] else None)
        r["faults_per_min"] = round(len(r["faults"]) / r["wall_s"] * 60, 2)
        # Here every worker shares the same 2 cores, so 3 members train a step as fast as 4
        # (the cores, not the members, bound it). With a device per worker, a step of 3 takes
        # 4/3 of a plain step: `short_steps` plain steps more in all. An estimate, first order.
        # With --device-time the steps of 3 members took their 4/3 already: no estimate.
        step_s = results["plain"]["wall_s"] / (a.steps - 1) if not a.device_time else 0.0
        r["goodput_own_devices"] = round(
            results["plain"]["wall_s"] / (r["wall_s"] + step_s * r["short_steps"]), 3)
    print(f"{'run':<12}{'faults':>7}{'/min':>6}{'s/fault':>8}{'goodput':>9}{'vs clean':>9}"
          f"{'own dev':>8}"
          f"{'stall med':>10}  "
          f"{'stalls (s)':<28}"
          f"{'heal s':>8}{'heal MB':>9}{'skip':>5}{'rep':>5}{'redone':>7}{'left':>5}")
    for r in results.values():
        heal_s = f"{statistics.median(r['heal_s']):.2f}" if r["heal_s"] else "-"
        heal_mb = f"{statistics.median(r['heal_bytes']) / 1e6:.1f}" if r["heal_bytes"] else "-"
        med = f"{r['median_stall_s']:.2f}" if r["median_stall_s"] is not None else "-"
        cost = f"{r['cost_per_fault_s']:.2f}" if r["cost_per_fault_s"] is not None else "-"
        print(f"{r['name']:<12}{len(r['faults']):>7}{r['faults_per_min']:>6.1f}{cost:>8}"
              f"{r['goodput']:>9.3f}"
              f"{r['goodput_vs_clean']:>9.3f}{r['goodput_own_devices']:>8.3f}{med:>10}  "
              f"{str(r['stalls_s'])[:27]:<28}{heal_s:>8}{heal_mb:>9}{r['skipped']:>5}"
              f"{r['repeated']:>5}{r['samples_redone']:>7}{r['processes_left']:>5}")
    summary = {"benchmark": "live_recovery", "steps": a.steps, "global_batch": a.global_batch,
               "model": {"n_layer": a.n_layer, "n_embd": a.n_embd, "block_size": a.block_size},
               "tokens": a.tokens, "device_time_s": a.device_time,
               "fault_clock": a.fault_clock, "spares_per_host": a.spares,
               "starts": "cold" if a.cold_starts else "forked",
               "results": results}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
