"""Chaos: one `ringtrain train` run through a seeded burst of faults, against a fault-free run.

    .venv/bin/python benchmarks/chaos.py                                  # 8 faults, one host
    .venv/bin/python benchmarks/chaos.py --hosts 2 --faults 32 --seed 1   # the full run (root)
    .venv/bin/python benchmarks/chaos.py --faults 4 --kinds kill-in-save,raise,corrupt  # the test's
    .venv/bin/python benchmarks/chaos.py --live --faults 8   # live, and the restart path beside it

Runs the same `ringtrain train` twice: fault-free (the anchor), then under `--max-restarts` with
`RINGTRAIN_TEST_FAULT=plan:PLAN` (tests/support/chaos_plan.py, played in the workers by
tests/support/faults.py through `RINGTRAIN_STEP_HOOK=faults:hook`), a seeded schedule of faults,
each fired once and in order, each meeting the job as the previous one left it:

    kill           SIGKILL of a random worker after a random step
    kill-in-save   SIGKILL of a random worker while it writes its part of a snapshot
    kill-at-start  SIGKILL of a worker as the restarted job starts (follows a kill or raise)
    stop           SIGSTOP of a random worker for longer than --watchdog-timeout, then SIGCONT
    raise          an exception out of the training loop of a random worker
    corrupt        a flipped byte in the newest committed snapshot, then a SIGKILL (after the
                   next step, or inside the next save: --corrupt-then), so the resume meets
                   it: it is skipped, and the one before is used
    disk-full      the run directory's filesystem (a tmpfs mounted for the run) filled up: the
                   next snapshot fails on every rank, which stop with exit 74 (by design); the
                   harness then does what the user would: frees the space (and, if the launcher
                   has used up its restarts, runs the same command again: it resumes)
    link           (--hosts 2) host b's veth link down for --link-seconds, then up again

Every run records each step's sample indices (`--record-samples`). Reported: faults injected
and survived, restarts (attempts - 1, relaunches included), steps recomputed (steps trained -
steps), the stall of each fault (its step to the next step committed after it), wall time
against the fault-free run (throughput kept, or goodput = fault-free wall / chaos wall),
processes left behind, whether the final `param_sha256` equals the fault-free run's, and the
committed sample history checked (`ringtrain.data.sample_log.check_history`): every step one
global batch, each epoch's order taken once, no index skipped or repeated, step for step the
fault-free run's. Prints a table, then one JSON line. Needs root for --hosts 2 (network
namespaces, tests/netns.py) and for disk-full (mount -t tmpfs); without it those are left out.

`--live` plays the same schedule (the same seed draws) against `ringtrain train --live
--live-wait S` (docs/fault_tolerance.md): a lost worker is replaced in place and heals from a
live peer, the others never stop. `--live-wait` (default 60) has the survivors wait for the
replacement, so every step runs on the whole world and the run ends with the fault-free
`param_sha256`; the stall of a kill or stop is then detection plus a replacement's start.
Its fault-free anchor is a fault-free live run. The kinds that mean something live:

    kill, stop     the survivors go on at once after a kill, after 1 s of silence after a
                   stop; the agent SIGKILLs a stopped worker and starts a replacement (or
                   hands its place to a warm spare: --live-spares N)
    kill-in-save   the members' rank 0 (the one process that writes a live job's snapshots,
                   whoever it is by then) dies inside the save: that snapshot is never
                   committed, the replacement heals from a peer, never from the disk
    kill-at-start  the next process to start is killed before it registers: a replacement
                   dies, the agent starts another (the survivors wait on)
    raise          an exception is the job's own error, in live mode too (`ringtrain.launch.
                   live_agent`: only a death by a signal, or a worker left out by its peers, is
                   replaced): every worker stops and the harness runs the same command again,
                   which resumes from the last snapshot: one whole-job restart per raise

Left out in live mode: `link` (it needs two hosts, and --live refuses --nnodes > 1: the store
lives in one agent), `disk-full` (a full disk stops every rank at the same step, exit 74, by
design: no worker is lost, nothing to replace) and `corrupt` (a snapshot is read only by a
whole-job resume; a live job heals from a peer). Also reported, live: whole-job restarts (0
unless a raise), the survivors' pids unchanged (every process of the final job that no fault
hit trained to the end: RUN_DIR/live/PID.json), replacements started and healed (joined a
generation), the in-flight snapshots committed (0: a kill-in-save's snapshot never is), and
where each stall went (`stall_parts`: the fault to the replacement's exec, its start-up to a
built trainer, then joining, healing and the next step).
`--compare` (the default with --live; `--no-compare` to skip) runs the restart path on the same
plan beside it (its own fault-free anchor): the table has a column each, the JSON line holds
the restart path's figures under "restart". `--strategy` is passed through (default ddp).
"""

from __future__ import annotations

import argparse
import bisect
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # netns.py: the two-host setup the tests use
sys.path.insert(0, str(REPO / "benchmarks"))  # chaos_run.py, chaos_report.py
sys.path.insert(0, str(REPO))

from chaos_report import live_figures, print_table, report, stall_parts, stalls  # noqa: E402
from chaos_run import BATCH, SEED, committed_history, left_behind, mount_tmpfs, run  # noqa: E402
from support.chaos_plan import (  # noqa: E402 - the schedule, test code outside the package
    KINDS_INSIDE,
    KINDS_OUTSIDE,
    make_plan,
)

from ringtrain.data.addition import train_size  # noqa: E402
from ringtrain.data.sample_log import check_history  # noqa: E402

ALL_KINDS = KINDS_INSIDE + KINDS_OUTSIDE
LIVE_KINDS = ("kill", "kill-in-save", "kill-at-start", "stop", "raise")
LIVE_LEFT_OUT = {  # why a kind means nothing against --live (the docstring says more)
    "link": "it needs two hosts and --live refuses --nnodes > 1",
    "disk-full": "a full disk stops every rank at the same step by design (exit 74)",
    "corrupt": "a live job heals from a peer; only a whole-job resume reads a snapshot"}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--faults", type=int, default=8, help="faults to inject (default: 8)")
    p.add_argument("--seed", type=int, default=0, help="the schedule's seed (default: 0)")
    p.add_argument("--kinds", help="comma-separated fault kinds (default: all; with --live: "
                   f"{','.join(LIVE_KINDS)})")
    p.add_argument("--hosts", type=int, choices=(1, 2), default=1, help="1 host, or 2 namespaces")
    p.add_argument("--nproc", type=int, help="workers per host (default: 2 on one host, 1 on two)")
    p.add_argument("--strategy", default="ddp", help="ddp, pipeline, zero (default: ddp); with "
                   "--live, one that ringtrain train --live accepts")
    p.add_argument("--snapshot-every", type=int, default=5)
    p.add_argument("--slot", type=int, help="steps per fault, a multiple of --snapshot-every "
                   "(default: 2 x --snapshot-every); longer slots: fewer faults per step")
    p.add_argument("--watchdog-timeout", type=float, default=4.0)
    p.add_argument("--corrupt-then", choices=("kill", "kill-in-save", "random"), default="random",
                   help="what follows a corrupt snapshot: a kill, or a kill inside the next save")
    p.add_argument("--link-seconds", type=float, default=2.0, help="how long a link stays down")
    p.add_argument("--disk-size", default="32m", help="the tmpfs for the run directory")
    p.add_argument("--relaunches", type=int, default=6,
                   help="most relaunches (as a scheduler would)")
    p.add_argument("--timeout", type=float, default=3600, help="bound on the chaos run (s)")
    p.add_argument("--out", help="directory for the runs (default: a temp dir, removed)")
    p.add_argument("--model", default="--n-layer 1 --n-head 2 --n-embd 32",
                   help="model flags for ringtrain train")
    p.add_argument("--live", action="store_true",
                   help="play the plan against ringtrain train --live (see above)")
    p.add_argument("--live-wait", type=float, default=60.0,
                   help="with --live: seconds the survivors wait for a replacement (default 60)")
    p.add_argument("--live-spares", type=int, default=0,
                   help="with --live: warm spares per node (ringtrain train --live-spares)")
    p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=None,
                   help="with --live: the restart path on the same plan too (default: on)")
    p.add_argument("--anchor-beside", action="store_true",
                   help="run the fault-free run at the same time as the chaos run (a test's "
                   "shortcut: the final sha and history are compared, goodput is not measured)")
    return p.parse_args(argv)



def main(argv=None) -> dict:
    a = parse(argv)
    a.nproc = a.nproc or (2 if a.hosts == 1 else 1)
    if a.compare and not a.live:
        raise SystemExit("chaos.py --compare runs the restart path beside --live: add --live "
                         "(without it, the restart path alone is the run)")
    a.compare = a.live and a.compare is not False
    world = a.nproc * a.hosts
    kinds = [k.strip() for k in (a.kinds or ",".join(LIVE_KINDS if a.live else ALL_KINDS))
             .split(",") if k.strip()]
    bad = sorted(set(kinds) - set(ALL_KINDS))
    if bad:
        raise SystemExit(f"chaos.py: unknown --kinds {bad}; choose from {', '.join(ALL_KINDS)}")
    if a.live and set(kinds) - set(LIVE_KINDS):
        raise SystemExit("chaos.py --live: " + "; ".join(
            f"--kinds {k} means nothing live: {LIVE_LEFT_OUT[k]}"
            for k in sorted(set(kinds) - set(LIVE_KINDS))) + f"; choose from {LIVE_KINDS}")
    if a.live and a.hosts != 1:
        raise SystemExit(f"chaos.py --live --hosts {a.hosts}: --live refuses --nnodes > 1 "
                         "(the store lives in one agent); use --hosts 1")
    if a.slot is not None and (a.slot % a.snapshot_every or a.slot < 2 * a.snapshot_every):
        raise SystemExit(f"chaos.py: --slot {a.slot} must be a multiple of --snapshot-every "
                         f"{a.snapshot_every}, at least twice it")
    notes: list[str] = []
    root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    disk = None
    if "disk-full" in kinds:
        disk = root / "disk"
        why = mount_tmpfs(disk, a.disk_size)
        if why:
            kinds.remove("disk-full")
            notes.append(f"disk-full left out: {why}")
            disk = None
    hosts_cm = None
    hosts = None
    if a.hosts == 2:
        from netns import two_hosts, unavailable

        why = unavailable()
        if why:
            raise SystemExit(f"chaos.py --hosts 2: {why}")
        hosts_cm = two_hosts()
        hosts = hosts_cm.__enter__()
    elif "link" in kinds:
        kinds.remove("link")
        notes.append("link left out: it needs --hosts 2")
    try:
        restart_after = {"kill", "raise", "stop", "kill-in-save"}
        faults, steps = make_plan(kinds, a.faults, a.seed, a.snapshot_every, world,
                                  a.watchdog_timeout + 3, restart_after,
                                  a.slot or 2 * a.snapshot_every, a.corrupt_then, live=a.live)
        paths = ["live", "restart"] if a.compare else ["live" if a.live else "restart"]
        print(f"chaos: {len(faults)} faults over {steps} steps, world size {world} "
              f"({a.hosts} host{'s' if a.hosts > 1 else ''}), {' and '.join(paths)}, "
              f"runs in {root}", flush=True)
        outs = {}
        for path in paths:
            # One directory per path (the plan's markers are per run); the restart path alone
            # keeps today's layout, which the tests read.
            where = root if len(paths) == 1 and path == "restart" else root / path
            where.mkdir(exist_ok=True)
            outs[path] = one_path(a, path, faults, steps, world, where, hosts, disk, notes)
    finally:
        if hosts_cm is not None:
            hosts_cm.__exit__(None, None, None)
        if disk is not None:
            if subprocess.run(["umount", str(disk)], capture_output=True, timeout=60).returncode:
                subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=60)
        if not a.out:
            shutil.rmtree(root, ignore_errors=True)
    print_table(outs)
    out = outs[paths[0]]
    if a.compare:
        out = {**out, "restart": outs["restart"], "ok": out["ok"] and outs["restart"]["ok"]}
    print(json.dumps(out), flush=True)
    return out


def one_path(a, path: str, faults: list[dict], steps: int, world: int, root: Path, hosts,
             disk: Path | None, notes: list[str]) -> dict:
    """The fault-free anchor, then the plan, on one recovery path ("live" or "restart")."""
    live = path == "live"
    chaos_dir = root / "chaos"
    chaos_dir.mkdir(exist_ok=True)
    plan = root / "plan.json"
    plan.write_text(json.dumps({"dir": str(chaos_dir), "faults": faults}, indent=1))
    ref_dir = root / "fault-free"
    beside: list[dict] = []
    anchor = threading.Thread(target=lambda: beside.append(run(
        a, ref_dir, steps, root / "fault-free.log", None, hosts, None, None,
        None if live else 0)), name="fault-free", daemon=True)
    anchor.start()
    if not a.anchor_beside:
        anchor.join()
    run_dir = (disk or root) / "run"
    log = root / "chaos.log"
    chaos = run(a, run_dir, steps, log, plan, hosts, chaos_dir, disk,
                None if live else 3 * len(faults) + 5)
    anchor.join(a.timeout)
    ref = beside[0] if beside else {"exit_codes": ["timeout"]}
    if ref["exit_codes"][-1:] != [0]:
        raise SystemExit(f"the fault-free run ({path}) failed: {ref['exit_codes']}; "
                         f"see {root}/fault-free.log")
    if a.anchor_beside:  # both ran on the same cores at once: their walls say nothing
        chaos["notes"].append("the fault-free run ran beside the chaos run: goodput not measured")
    fired = [json.loads(p.read_text()) for p in sorted(chaos_dir.glob("fired-*.json"))]
    attempts = chaos_dir / "attempts.log"
    extra = {"steps_trained": _steps_trained(chaos_dir, chaos["launched_unix"], live),
             "attempts": len(attempts.read_text().splitlines()) if attempts.exists() else 0,
             "notes": list(notes), "stalls": stalls(chaos_dir, fired)}
    # pipeline: fewer data ranks
    global_batch = ref["summary"].get("global_batch_size", BATCH * world)
    n = train_size(2)
    history, ref_history = committed_history(run_dir), committed_history(ref_dir)
    check = check_history(history, dataset_len=n, seed=SEED, global_batch=global_batch,
                          steps=steps) if history else None
    same = bool(history and ref_history and history.step_sets() == ref_history.step_sets())
    # A stopped worker's waker (`sleep S; kill -CONT`) outlives a live job that went on without
    # the worker; it ends by itself, S after the stop: not a process left behind.
    wakers = [f["unix"] + f["seconds"] for f in fired if f["kind"] == "stop"]
    time.sleep(max(0.0, max(wakers, default=0.0) + 0.5 - time.time()))
    left = left_behind(run_dir, plan, hosts)
    out = report(a, faults, fired, ref, chaos, steps, check, same, left, extra)
    if not live:
        return out
    out = {"mode": "live", "live_wait_s": a.live_wait, "live_spares": a.live_spares, **out,
           **live_figures(run_dir, log, fired, world, chaos["launched_unix"][-1])}
    if not a.live_spares:  # with spares the process let in was started before the fault
        out["stall_parts"] = stall_parts(chaos_dir, fired)
    raises = sum(f["kind"] == "raise" for f in fired)
    # By design a raise is the job's error (a whole-job restart); every other fault is not.
    out["ok"] = bool(out["ok"] and out["restarts"] == raises  # relaunches included
                     and out["survivor_pids_unchanged"]
                     and out["in_flight_snapshots_committed"] == 0)
    return out


def _steps_trained(chaos_dir: Path, launched: list[float], live: bool) -> int:
    """Steps trained, a step trained again counted again. The restart path: rank 0's lines
    (DIR/steps.log, every attempt). Live: no step is committed twice within one job (a failed
    step is redone before its commit), so the distinct steps of each (re)launch
    (DIR/commits.log: every process's lines; rank 0 may be lost while the others go on)."""
    if not live:
        path = chaos_dir / "steps.log"
        return len(path.read_text().split()) if path.exists() else 0
    path = chaos_dir / "commits.log"
    seen = set()
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if len(parts) == 3:
            seen.add((bisect.bisect_right(launched, float(parts[1])), int(parts[0])))
    return len(seen)


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
