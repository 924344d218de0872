"""Measure how long the other ranks take to exit after one rank dies, with and without the watchdog.

    .venv/bin/python tests/scripts/watchdog_timing.py --repeats 3 --timeout 3

Ranks are plain processes with RANK/WORLD_SIZE/MASTER_* set (no launcher agent that would stop
them: the situation of ranks on another host). For each scenario the victim reaches step 3,
then is SIGKILLed / SIGSTOPped by this script (or raises by itself); the figure is the time from
there until every other rank has exited, median over repeats, and whether they named the rank.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = str(Path(__file__).with_name("allreduce_loop.py"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(world_size: int, victim: int, how: str, where: str, watchdog_s: float,
             limit_s: float) -> tuple[float | None, list[int | None], bool]:
    """(seconds until all survivors exited or None, their exit codes, all named the victim)."""
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp, "ready")
        port = _free_port()
        procs, errs = [], []
        fail_how = "raise" if how == "raise" else "hang"
        for rank in range(world_size):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size),
                   "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1"}
            err = open(Path(tmp, f"err{rank}"), "w+")  # noqa: SIM115 - closed below
            errs.append(err)
            procs.append(subprocess.Popen(
                [sys.executable, SCRIPT, "--steps", "1000000", "--fail-rank", str(victim),
                 "--fail-how", fail_how, "--where", where, "--ready-file", str(ready),
                 "--watchdog-timeout", str(watchdog_s)],
                env=env, stdout=subprocess.DEVNULL, stderr=err))
        try:
            deadline = time.monotonic() + 60
            while not ready.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.05)  # the others are now blocked in the all-reduce (or computing)
            if how in ("kill", "stop"):
                procs[victim].send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            t0 = time.monotonic()
            survivors = [p for r, p in enumerate(procs) if r != victim]
            while any(p.poll() is None for p in survivors) and time.monotonic() - t0 < limit_s:
                time.sleep(0.01)
            took = time.monotonic() - t0 if all(p.poll() is not None for p in survivors) else None
            codes = [p.poll() for p in survivors]
            named = True
            for r, err in enumerate(errs):
                if r != victim:
                    err.seek(0)
                    named &= re.search(rf"\brank {victim}\b", err.read()) is not None
            return took, codes, named
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(timeout=10)
            for err in errs:
                err.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=3.0, help="watchdog timeout_s")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--limit", type=float, default=20.0, help="give up waiting after this")
    args = p.parse_args()
    last = args.world_size - 1
    scenarios = [  # (label, victim, how, where, watchdog on)
        ("SIGKILL, others in all_reduce", last, "kill", "collective", True),
        ("SIGKILL, others computing", last, "kill", "compute", True),
        ("SIGSTOP, others in all_reduce", last, "stop", "collective", True),
        ("raise, others in all_reduce", last, "raise", "collective", True),
        ("SIGKILL rank 0 (store host), others computing", 0, "kill", "compute", True),
        ("gloo alone: SIGKILL, others in all_reduce", last, "kill", "collective", False),
        ("gloo alone: SIGSTOP, others in all_reduce", last, "stop", "collective", False),
    ]
    print(f"world_size={args.world_size} watchdog timeout_s={args.timeout} "
          f"repeats={args.repeats} load={os.getloadavg()[0]:.1f}")
    for label, victim, how, where, on in scenarios:
        runs = [run_once(args.world_size, victim, how, where, args.timeout if on else 0.0,
                         args.limit) for _ in range(args.repeats)]
        times = [t for t, _, _ in runs if t is not None]
        median = f"{statistics.median(times):6.2f} s" if len(times) == len(runs) else (
            f"> {args.limit:g} s (hung in {len(runs) - len(times)}/{len(runs)})")
        codes = sorted({c for _, cs, _ in runs for c in cs if c is not None})
        named = sum(n for _, _, n in runs)
        print(f"{label:48s} median {median:>24s}  min/max "
              f"{min(times, default=float('nan')):.2f}/{max(times, default=float('nan')):.2f}  "
              f"exit codes {codes}  named rank {victim}: {named}/{len(runs)}", flush=True)


if __name__ == "__main__":
    main()
