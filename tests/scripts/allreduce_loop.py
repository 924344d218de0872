"""A tiny worker for launcher and watchdog tests: all-reduce in a loop, optionally fail one rank.

    ringtrain run --nproc-per-node 2 tests/scripts/allreduce_loop.py --steps 20
    ringtrain run --nproc-per-node 2 tests/scripts/allreduce_loop.py --fail-rank 1 --fail-how kill

--fail-how: kill (SIGKILL itself), raise (ValueError), stop (SIGSTOP itself: frozen, sockets
open, like a host that vanished), hang (sleeps, so the others block in the next all-reduce).
--where compute: after the first all-reduce the ranks only compute, no collectives.
--tag: ignored; a unique word on the command line lets a test find every process of the job.
--ready-file: touched by the failing rank just before it fails (tests time from there).
"""

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import ringtrain
from ringtrain.launch.launcher import record
from ringtrain.launch.parent import die_with_parent
from ringtrain.launch.watchdog import Watchdog


def fail(how: str, step: int, ready_file: str | None) -> None:
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(f"{time.time()}\n")
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if how == "raise":
        raise ValueError(f"boom at step {step}")
    if how == "hang":
        time.sleep(3600)


@record
def main() -> None:
    die_with_parent()
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-at", type=int, default=3)
    p.add_argument("--fail-how", choices=["kill", "raise", "stop", "hang"], default="kill")
    p.add_argument("--where", choices=["collective", "compute"], default="collective")
    p.add_argument("--sleep", type=float, default=0.01, help="seconds per step")
    p.add_argument("--watchdog-timeout", type=float, default=0.0, help="0: no watchdog")
    p.add_argument("--ready-file", default=None)
    p.add_argument("--tag", default="")
    args = p.parse_args()

    torch.set_num_threads(1)
    rt = ringtrain.init_distributed("gloo")
    watchdog = None
    if args.watchdog_timeout > 0:
        watchdog = Watchdog(name="allreduce-loop", interval_s=min(1.0, args.watchdog_timeout / 6),
                            timeout_s=args.watchdog_timeout).start()
    total = torch.zeros(1)
    x = torch.ones(1) * (rt.rank + 1)
    a = torch.randn(64, 64)
    dist.all_reduce(x)  # everyone is up before anyone fails
    for step in range(args.steps):
        if watchdog is not None:
            watchdog.set_step(step)
        if rt.rank == args.fail_rank and step == args.fail_at:
            fail(args.fail_how, step, args.ready_file)
        if args.where == "collective" or step == 0:
            y = torch.ones(1) * (rt.rank + 1)
            dist.all_reduce(y)
            total += y
        else:
            a = torch.tanh(a @ a)  # (64, 64): local work only
        time.sleep(args.sleep)
    if watchdog is not None:
        watchdog.stop()
    if rt.rank == 0:
        print(f"allreduce ok: world_size={rt.world_size} steps={args.steps} sum={total.item():g}",
              flush=True)
    ringtrain.destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())
