"""Test-only: a seeded schedule of faults played inside `ringtrain train`'s workers.

    RINGTRAIN_STEP_HOOK=faults:hook RINGTRAIN_TEST_FAULT=plan:/tmp/chaos/plan.json \
        PYTHONPATH=tests/support ringtrain train --max-restarts 20 ...

(`benchmarks/chaos.py` writes the plan and plays the faults that need the outside world.)
`faults.hook` (this folder) hands a `plan:` spec to `plan_hook`; ringtrain holds only the
generic hook point (RINGTRAIN_STEP_HOOK, `ringtrain/cli/step_hook.py`). Not named chaos.py:
`benchmarks/chaos.py`, run as a script, would import itself under that name.
The plan is JSON: {"dir": DIR, "faults": [{"kind", "rank", "step", ...}]}.
Faults fire in order, each once: fault i is armed once fault i-1 has fired (a marker file
`DIR/fired-<i>.json`, taken with O_EXCL so two ranks or two attempts never both fire it).
So each fault meets the job as the previous one left it: restarted, resumed, relaunched.

Kinds played by the worker itself, after step `step` on rank `rank`:
- `kill`: SIGKILL (kill -9);
- `kill-in-save`: SIGKILL in the middle of the snapshot of this step (`step` is a snapshot step):
  this rank's next file write (`torch.save`) finishes its bytes, then the process dies before
  reporting them, so the snapshot is never committed;
- `kill-at-start`: SIGKILL as the next attempt starts (right after the restart the previous
  fault caused, before it has resumed); `step` is ignored;
- `stop`: SIGSTOP for `seconds` (longer than the watchdog bound), then SIGCONT from a helper;
- `raise`: a `RuntimeError` out of the training loop.
Kinds played by the harness (`outside`): the worker writes `DIR/request-<i>` and waits (at
most 30 s) for `DIR/done-<i>`: `corrupt` (a flipped byte in the newest committed snapshot),
`disk-full` (the run directory's filesystem filled up), `link` (a host's link down and up).

A fault whose `rank` is null goes to whichever process meets its moment first: `kill-in-save` to
the process that writes the snapshot of `step` (in live mode the members' rank 0, which moves as
members are lost and replaced), `kill-at-start` to the first process that starts after the
fault before it (in live mode a replacement, or any worker of a relaunched job).

Every attempt's rank 0 appends its steps to `DIR/steps.log` (steps recomputed = lines - steps)
and a line to `DIR/attempts.log` as it starts; every process appends `STEP UNIX PID` to
`DIR/commits.log` after each step (the stall of a fault: its step to the next step after it)
and `PID EXEC_UNIX READY_UNIX RANK REPLACEMENT` to `DIR/starts.log` once its trainer is built
(where a replacement's part of a stall goes: started, then ready to join).
Also here, for the harness: `make_plan` (the seeded schedule) and the outside faults' actions
(`fill`, `corrupt_newest`).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ringtrain.launch.live_agent import REPLACEMENT_ENV

KINDS_INSIDE = ("kill", "kill-in-save", "kill-at-start", "stop", "raise")
KINDS_OUTSIDE = ("corrupt", "disk-full", "link")


class InjectedFault(RuntimeError):
    """The exception a `raise` fault throws out of the training loop."""


def _fired(d: Path, i: int) -> bool:
    return (d / f"fired-{i}.json").exists()


def _take(d: Path, i: int, fault: dict[str, Any], rank: int, step: int | None) -> bool:
    """Claim fault i (first caller only); records when, where and in which attempt."""
    try:
        fd = os.open(d / f"fired-{i}.json", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({**fault, "index": i, "fired_rank": rank, "fired_step": step, "unix": time.time(),
                   "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                   "pid": os.getpid()}, f)
        f.flush()
        os.fsync(f.fileno())
    print(f"[rank {rank}] chaos: fault {i} ({fault['kind']}) after step {step} at unix time "
          f"{time.time():.3f}", file=sys.stderr, flush=True)
    return True


def _armed(d: Path, faults: list[dict[str, Any]]) -> int | None:
    """The first fault not fired yet (every earlier one has), or None when all have."""
    for i in range(len(faults)):
        if not _fired(d, i):
            return i
    return None


def _kill_on_next_save(rank: int) -> None:
    """Make this process's next torch.save (a snapshot file) its last: SIGKILL after it."""
    _die_after_save(rank)
    # Snapshots are written by a thread while the step loop goes on (the default): hold the loop
    # in this save until the write (and the kill) comes, so the kill is inside the save of this
    # step, on the writer's thread, and the steps trained before it do not depend on timing.
    from ringtrain.checkpoint import background

    started = background.BackgroundSave.__init__

    def start_and_wait(self, step, fn):
        started(self, step, fn)
        while not self.done():
            time.sleep(0.005)

    background.BackgroundSave.__init__ = start_and_wait


def _kill_in_save_of_writer(d: Path, i: int, fault: dict[str, Any], rank: int,
                            step: int) -> Callable[[], None]:
    """Fault i (`kill-in-save` with no rank) goes to the process that starts writing the
    snapshot of `step` first: the live members' rank 0, which moves as members are lost and
    replaced. Every process arms it; the returned function disarms it (at the next step)."""
    from ringtrain.checkpoint import background

    started = background.BackgroundSave.__init__

    def claim_then_die(self, save_step, fn):
        if save_step != step or not _take(d, i, fault, rank, step):
            started(self, save_step, fn)
            return
        _die_after_save(rank)
        started(self, save_step, fn)
        while not self.done():  # held here until the kill, as `_kill_on_next_save`
            time.sleep(0.005)

    background.BackgroundSave.__init__ = claim_then_die

    def disarm() -> None:
        background.BackgroundSave.__init__ = started
    return disarm


def _die_after_save(rank: int) -> None:
    original = torch.save

    def save_then_die(*args, **kwargs):
        original(*args, **kwargs)
        print(f"[rank {rank}] chaos: SIGKILL inside a snapshot write", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = save_then_die


def _ask_outside(d: Path, i: int, rank: int) -> None:
    (d / f"request-{i}").write_text(str(rank))
    deadline = time.monotonic() + 30
    while not (d / f"done-{i}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def _play(d: Path, i: int, fault: dict[str, Any], rank: int) -> None:
    kind = fault["kind"]
    if kind in ("kill", "kill-at-start"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "kill-in-save":
        _kill_on_next_save(rank)
    elif kind == "stop":
        # A helper outside this process sends SIGCONT: a stopped process cannot.
        subprocess.Popen(["sh", "-c", f"sleep {float(fault['seconds'])}; kill -CONT {os.getpid()}"],
                         start_new_session=True, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "raise":
        raise InjectedFault(f"chaos: fault {i}, an exception raised on rank {rank} after step "
                            f"{fault['step']}")
    elif kind in KINDS_OUTSIDE:
        # The outside acts on the newest committed snapshot: let this rank's background write
        # (and with it the commit it waits for) end first, or `corrupt` could hit the snapshot
        # before it and the resume step would depend on timing (seen: 5 steps redone, not 10).
        from faults import snapshot_written

        snapshot_written()
        _ask_outside(d, i, rank)
    else:
        raise ValueError(f"chaos plan: unknown fault kind {kind!r}; one of "
                         f"{', '.join(KINDS_INSIDE + KINDS_OUTSIDE)}")


def plan_hook(on_step: Callable[[int], None] | None, rank: int, path: str
              ) -> Callable[[int], None]:
    """Wrap a trainer's `on_step` with the plan at `path` (see the module docstring).

    Args:
        on_step: the callback to keep calling first (a watchdog's `set_step`), or None.
        rank: this process's rank.
        path: the plan's JSON file.
    """
    plan = json.loads(Path(path).read_text())
    d, faults = Path(plan["dir"]), plan["faults"]
    d.mkdir(parents=True, exist_ok=True)
    if rank == 0 and not os.environ.get(REPLACEMENT_ENV):  # a live replacement is no attempt
        with open(d / "attempts.log", "a") as f:
            f.write(f"{time.time():.3f} {os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}\n")
    with open(d / "starts.log", "a") as f:  # where a replacement's start-up time goes
        f.write(f"{os.getpid()} {_exec_unix():.3f} {time.time():.3f} {rank} "
                f"{os.environ.get(REPLACEMENT_ENV, '0')}\n")
    i = _armed(d, faults)
    if i is not None and faults[i]["kind"] == "kill-at-start" and _mine(faults[i], rank) \
            and i > 0 and _take(d, i, faults[i], rank, None):
        _play(d, i, faults[i], rank)
    steps_log = open(d / "steps.log", "a", buffering=1) if rank == 0 else None  # noqa: SIM115
    commits = open(d / "commits.log", "a", buffering=1)  # noqa: SIM115 - every process's steps
    disarm: list[Callable[[], None]] = []

    def hook(step: int) -> None:
        if on_step is not None:
            on_step(step)
        if steps_log is not None:
            steps_log.write(f"{step}\n")
        commits.write(f"{step} {time.time():.3f} {os.getpid()}\n")  # one short line: atomic
        while disarm:
            disarm.pop()()
        j = _armed(d, faults)
        if j is None:
            return
        f = faults[j]
        if f["kind"] == "kill-at-start" or not _mine(f, rank) or f["step"] != step:
            return
        if f["kind"] == "kill-in-save" and f["rank"] is None:
            disarm.append(_kill_in_save_of_writer(d, j, f, rank, step))
        elif _take(d, j, f, rank, step):
            _play(d, j, f, rank)
    return hook


def _exec_unix() -> float:
    """When this process was started (exec'd), in unix time, from /proc (Linux; else now)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        since_boot = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))


def _mine(fault: dict[str, Any], rank: int) -> bool:
    """A fault with no rank is whichever process meets its moment first (live mode: the
    snapshot's writer, the first replacement to start)."""
    return fault["rank"] is None or fault["rank"] == rank


# ---- the schedule (benchmarks/chaos.py writes it) -----------------------------------------------

def make_plan(kinds: list[str], n: int, seed: int, every: int, world: int, stop_s: float,
              restart_after: set[str], slot: int, corrupt_then: str = "random",
              live: bool = False) -> tuple[list[dict], int]:
    """Faults in order, one per slot of `slot` steps; returns (faults, steps of the run).

    With `live`, the same schedule (the same seed draws) but `kill-in-save` and `kill-at-start`
    carry no rank: in a live job only the members' rank 0 writes snapshots, and the process
    that starts after a fault is a replacement in the lost worker's slot (see `_mine`); a
    restarting job plays such a plan too (the first writer, the first worker to start).
    """
    rng = random.Random(seed)
    order: list[str] = []
    while len(order) < n:
        batch = [k for k in kinds if k != "kill-at-start"]
        rng.shuffle(batch)
        order += batch
    order = order[:n]
    if "kill-at-start" in kinds:  # replace some faults that follow a restart-causing one
        for i in range(1, n):
            if order[i - 1] in restart_after and rng.random() < 0.3:
                order[i] = "kill-at-start"
    faults = []
    for i, kind in enumerate(order):
        base = every * 2 + i * slot  # a snapshot step: two snapshots exist before the first
        rank = rng.randrange(world)
        if kind == "kill-in-save":
            faults.append({"kind": kind, "rank": rank, "step": base + every})
        elif kind == "corrupt":  # right after the snapshot of `base`, then a kill meets it:
            faults.append({"kind": kind, "rank": 0, "step": base + 1})
            then = (corrupt_then if corrupt_then != "random"
                    else rng.choice(["kill", "kill-in-save"]))
            if then == "kill":  # a plain one, or one inside the next save (still the newest)
                faults.append({"kind": "kill", "rank": rank, "step": base + 2, "after": "corrupt"})
            else:
                faults.append({"kind": "kill-in-save", "rank": rank, "step": base + every,
                               "after": "corrupt"})
        elif kind == "disk-full":  # the save at base + every fails
            faults.append({"kind": kind, "rank": 0, "step": base + 1})
        elif kind == "stop":
            faults.append({"kind": kind, "rank": rank, "step": base + rng.randrange(1, slot - 1),
                           "seconds": stop_s})
        else:
            faults.append({"kind": kind, "rank": rank if kind != "link" else 0,
                           "step": base + rng.randrange(1, slot - 1)})
    if live:
        for f in faults:
            if f["kind"] in ("kill-in-save", "kill-at-start"):
                f["rank"] = None
    steps = every * 2 + len(order) * slot + 2 * every
    return faults, steps


# ---- the outside faults, played by the harness (benchmarks/chaos.py) -------------------------

def fill(disk: Path) -> Path:
    """Fill `disk` up to the last byte; returns the filler file (removing it frees the space)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for size in (1 << 16, 1 << 12, 1):  # big pieces, then the last bytes
            try:
                while os.write(fd, b"\0" * size) == size:
                    pass
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def corrupt_newest(snaps: Path) -> str:
    """Flip one byte in the middle of a file of the newest committed snapshot."""
    done = sorted(p.parent for p in snaps.glob("snap-*/COMMITTED"))
    if not done:
        return "no committed snapshot"
    files = sorted(p for p in done[-1].glob("*.pt"))
    victim = files[random.Random(len(files)).randrange(len(files))]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    return f"{victim.parent.name}/{victim.name}"
