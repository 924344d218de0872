"""How long the surviving ranks take to exit after one rank dies, on one host and across two.

    .venv/bin/python benchmarks/dead_rank.py   # ~10 min; needs root for two hosts
    .venv/bin/python benchmarks/dead_rank.py --repeats 1 --timeouts 5 --places two-hosts

Each run starts 2 ranks with `ringtrain run` running this file's worker: an all-reduce (or, with
"compute", a matmul) every 10 ms under a `Watchdog` set up as `ringtrain train` sets it up
(`timeout_s=--watchdog-timeout`, `interval_s=min(1, timeout_s / 3)`). Rank 1 fails at step 3:

    SIGKILL, others in all_reduce   rank 1 SIGKILLs itself; rank 0 is blocked in the next all-reduce
    SIGKILL, others computing       the same while rank 0 only computes (no collective notices it)
    raise, others in all_reduce     rank 1 raises ValueError
    host killed                     (two hosts) rank 1 sleeps, rank 0 blocks in the all-reduce, and
                                    every process of host b is SIGKILLed (its kernel closes sockets)
    host unplugged                  (two hosts) as above, but host b's link goes down first: no
                                    FIN/RST ever arrives, as when a machine loses power
    rendezvous host killed/unplugged  (two hosts) the same for host a, which runs the rendezvous
                                    store (rank 0 fails; the figure is host b's launcher)

"one host": `ringtrain run --nproc-per-node 2` (its agent sees a dead worker within 0.1 s).
"two hosts": network namespaces joined by a veth pair (tests/netns.py), one `ringtrain run
--nnodes 2` per host; the figure is the surviving host's launcher. The time runs from the failure
(the failing rank's own timestamp, or the kill) until the surviving launcher has exited; "named"
counts the runs whose surviving side named the failure: `rank 1 died` / `rank 1 failed`, or the
lost rendezvous host's address. Prints a table, then one JSON line. Timing is noisy on a busy
machine: read medians, and the load printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUN = [sys.executable, "-m", "ringtrain", "run"]
ENV = {k: v for k, v in os.environ.items() if k != "LOGLEVEL"} | {"PYTHONUNBUFFERED": "1",
                                                                   "OMP_NUM_THREADS": "1"}
FAIL_AT = 3
# (label, how the victim fails, what the others do meanwhile, two hosts only, victim rank = node)
SCENARIOS = [
    ("SIGKILL, others in all_reduce", "kill", "collective", False, 1),
    ("SIGKILL, others computing", "kill", "compute", False, 1),
    ("raise, others in all_reduce", "raise", "collective", False, 1),
    ("host killed", "host-kill", "collective", True, 1),
    ("host unplugged", "host-unplug", "collective", True, 1),
    ("rendezvous host killed", "host-kill", "collective", True, 0),
    ("rendezvous host unplugged", "host-unplug", "collective", True, 0),
]
# The survivors must name the failed rank, or (rendezvous host) the lost store's address.
NAMED = {1: r"\brank 1 (died|failed)\b", 0: r"rendezvous store at 198\.18\.0\.1\b"}


# -- the worker (run by `ringtrain run`) --------------------------------------------------------

def worker(how: str, where: str, ready_file: str, watchdog_timeout_s: float, victim: int) -> None:
    import torch
    import torch.distributed as dist

    from ringtrain.launch.parent import die_with_parent
    from ringtrain.launch.process_group import init_distributed
    from ringtrain.launch.watchdog import Watchdog

    die_with_parent()
    torch.set_num_threads(1)
    rt = init_distributed("gloo")
    t = watchdog_timeout_s
    # The same watchdog as `ringtrain train`.
    with Watchdog(name="train", timeout_s=t, interval_s=min(1.0, t / 3)) as watchdog:
        dist.all_reduce(torch.ones(1))  # everyone is up before anyone fails
        a = torch.randn(64, 64)
        for step in range(10**9):
            watchdog.set_step(step)
            if rt.rank == victim and step == FAIL_AT:
                Path(ready_file).write_text(f"{time.time()}\n")  # the failure's own timestamp
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif how == "raise":
                    raise ValueError(f"boom at step {step}")
                else:  # the benchmark takes the host down; until then rank 0 waits for us
                    time.sleep(3600)
            if where == "collective":
                dist.all_reduce(torch.ones(1))
            else:
                a = torch.tanh(a @ a)  # (64, 64): local work only
            time.sleep(0.01)


# -- the driver ---------------------------------------------------------------------------------

def _wait_file(path: Path, procs: list[subprocess.Popen], limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while not path.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            return False
        time.sleep(0.005)
    time.sleep(0.005)  # let the write finish
    return True


def run_once(place: str, how: str, where: str, victim: int, timeout_s: float,
             limit_s: float) -> dict:
    """One failure; returns {"s": seconds until the survivors' launcher exited or None, ...}."""
    from netns import two_hosts  # tests/netns.py

    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp, "ready")
        worker_args = [str(Path(__file__).resolve()), "--worker", how, where, str(ready),
                       str(timeout_s), str(victim)]
        hosts_cm = two_hosts() if place == "two hosts" else nullcontext()
        with hosts_cm as hosts:
            logs = [open(Path(tmp, f"out{i}"), "w+")  # noqa: SIM115 - closed below
                    for i in range(2)]
            if hosts is None:
                procs = [subprocess.Popen([*RUN, "--nproc-per-node", "2", *worker_args], cwd=REPO,
                                          env=ENV, stdout=logs[0], stderr=subprocess.STDOUT,
                                          start_new_session=True)]
            else:
                procs = [h.popen([*RUN, "--nnodes", "2", "--node-rank", str(i),
                                  "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                  "--rdzv-endpoint", f"{hosts[0].addr}:29400", *worker_args],
                                 env=ENV, cwd=REPO, stdout=logs[i], stderr=subprocess.STDOUT)
                         for i, h in enumerate(hosts)]
            try:
                if not _wait_file(ready, procs, 120):
                    return {"s": None, "code": None, "named": False, "error": "no start"}
                survivor = 1 - victim if hosts is not None else 0  # (one host: the launcher)
                if how.startswith("host-"):
                    t0 = time.time()
                    if how == "host-unplug":
                        hosts[victim].unplug()
                    hosts[victim].kill_all()
                else:
                    t0 = float(ready.read_text())
                try:
                    procs[survivor].wait(timeout=limit_s)
                except subprocess.TimeoutExpired:
                    pass
                code = procs[survivor].poll()
                took = time.time() - t0 if code is not None else None
                logs[survivor].seek(0)
                out = logs[survivor].read()
                line = next((ln for ln in out.splitlines() if ln.startswith("ringtrain run: ")
                             and "local address" not in ln), "")
                named = re.search(NAMED[victim], out) is not None
                return {"s": took, "code": code, "named": named, "report": line[:160]}
            finally:
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=10)
                for f in logs:
                    f.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeouts", default="30,5",
                   help="--watchdog-timeout values (30 is the default)")
    p.add_argument("--places", default="one-host,two-hosts")
    p.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)  # HOW WHERE READY TIMEOUT VICTIM
    args = p.parse_args()
    if args.worker:
        how, where, ready, timeout_s, victim = args.worker
        from ringtrain.launch.launcher import record

        record(worker)(how, where, ready, float(timeout_s), int(victim))
        return
    sys.path.insert(0, str(REPO / "tests"))
    from netns import unavailable

    places = [pl.replace("-", " ") for pl in args.places.split(",")]
    if "two hosts" in places and (reason := unavailable()):
        print(f"skipping two hosts: {reason}")
        places.remove("two hosts")
    timeouts = [float(t) for t in args.timeouts.split(",")]
    print(f"repeats={args.repeats} load(1 min)={os.getloadavg()[0]:.1f} cores={os.cpu_count()}")
    print(f"{'place':10s} {'failure':30s} {'timeout':>7s} {'median':>8s} {'min':>6s} {'max':>6s} "
          f"{'named':>5s}  report")
    results = []
    for place in places:
        for label, how, where, needs_two, victim in SCENARIOS:
            if needs_two and place != "two hosts":
                continue
            for timeout_s in timeouts:
                runs = [run_once(place, how, where, victim, timeout_s, timeout_s + 30)
                        for _ in range(args.repeats)]
                times = [r["s"] for r in runs if r["s"] is not None]
                done = len(times) == len(runs)
                row = {"place": place, "failure": label, "watchdog_timeout_s": timeout_s,
                       "median_s": statistics.median(times) if done else None,
                       "min_s": min(times, default=None), "max_s": max(times, default=None),
                       "runs": len(runs), "exited": len(times),
                       "named": sum(r["named"] for r in runs),
                       "exit_codes": sorted({r["code"] for r in runs if r["code"] is not None})}
                results.append(row)
                median = f"{row['median_s']:.2f}" if done else f">{timeout_s + 30:g}"
                print(f"{place:10s} {label:30s} {timeout_s:7g} {median:>8s} "
                      f"{row['min_s'] or float('nan'):6.2f} {row['max_s'] or float('nan'):6.2f} "
                      f"{row['named']:>2d}/{len(runs):<2d}  "
                      f"{runs[-1].get('report', runs[-1].get('error', ''))}",
                      flush=True)
    print(json.dumps({"benchmark": "dead_rank", "repeats": args.repeats,
                      "load_1min_end": round(os.getloadavg()[0], 2), "results": results}))


if __name__ == "__main__":
    main()
