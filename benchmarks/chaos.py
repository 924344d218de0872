"""Chaos: one `ringtrain train` run through a seeded burst of faults, against a fault-free run.

    .venv/bin/python benchmarks/chaos.py                                  # 8 faults, one host
    .venv/bin/python benchmarks/chaos.py --hosts 2 --faults 32 --seed 1   # the full run (root)
    .venv/bin/python benchmarks/chaos.py --faults 4 --kinds kill-in-save,raise,corrupt  # the test's

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
steps), wall time against the fault-free run (throughput kept = fault-free wall / chaos wall),
processes left behind, whether the final `param_sha256` equals the fault-free run's, and the
committed sample history checked (`ringtrain.data.sample_log.check_history`): every step one
global batch, each epoch's order taken once, no index skipped or repeated, step for step the
fault-free run's. Prints a table, then one JSON line. Needs root for --hosts 2 (network
namespaces, tests/netns.py) and for disk-full (mount -t tmpfs); without it those are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # netns.py: the two-host setup the tests use
sys.path.insert(0, str(REPO))

from support.chaos_plan import (  # noqa: E402 - the schedule, test code outside the package
    KINDS_INSIDE,
    KINDS_OUTSIDE,
    corrupt_newest,
    fill,
    make_plan,
)
from support.faults import fault_env  # noqa: E402 - what the workers need to play the plan

from ringtrain.data.addition import train_size  # noqa: E402
from ringtrain.data.sample_log import SampleLog, check_history  # noqa: E402
from ringtrain.launch.launcher import has_shutdown_timeout  # noqa: E402

ENV = {k: v for k, v in os.environ.items()
       if k not in ("LOGLEVEL", "RINGTRAIN_TEST_FAULT", "RINGTRAIN_STEP_HOOK",
                    "TORCHELASTIC_RESTART_COUNT")} | {
    "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
ALL_KINDS = KINDS_INSIDE + KINDS_OUTSIDE
SEED, BATCH = 1337, 16


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--faults", type=int, default=8, help="faults to inject (default: 8)")
    p.add_argument("--seed", type=int, default=0, help="the schedule's seed (default: 0)")
    p.add_argument("--kinds", default=",".join(ALL_KINDS), help="comma-separated fault kinds")
    p.add_argument("--hosts", type=int, choices=(1, 2), default=1, help="1 host, or 2 namespaces")
    p.add_argument("--nproc", type=int, help="workers per host (default: 2 on one host, 1 on two)")
    p.add_argument("--strategy", default="ddp", help="ddp, pipeline, zero (default: ddp)")
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
    return p.parse_args(argv)


# ---- running ringtrain train --------------------------------------------------------------------

class Job:
    """One `ringtrain train` job (one launcher, or one per host) and its output file."""

    def __init__(self, a: argparse.Namespace, run_dir: Path, steps: int, log: Path,
                 plan: Path | None, hosts, restarts: int):
        self.a, self.run_dir, self.steps, self.log, self.plan = a, run_dir, steps, log, plan
        self.hosts, self.restarts, self.procs = hosts, restarts, []

    def argv(self) -> list[str]:
        a = self.a
        return [sys.executable, "-m", "ringtrain", "train", *a.model.split(),
                "--steps", str(self.steps), "--batch-size", str(BATCH), "--seed", str(SEED),
                "--eval-every", str(self.steps),
                "--eval-batch-size", "64", "--log-every", str(a.snapshot_every), "--threads", "1",
                "--no-progress", "--snapshot-every", str(a.snapshot_every), "--keep", "2",
                "--watchdog-timeout", str(a.watchdog_timeout), "--record-samples",
                "--strategy", a.strategy, "--max-restarts", str(self.restarts),
                # 5 s to save after SIGTERM instead of 30 (torch 2.11's agent has no such option)
                *(["--shutdown-timeout", "5"] if has_shutdown_timeout() else []),
                "--run-dir", str(self.run_dir)]

    def start(self) -> None:
        env = dict(ENV)
        if self.plan is not None:
            env.update(fault_env(f"plan:{self.plan}"))
        out = open(self.log, "a")  # noqa: SIM115 - the children hold it
        if self.hosts is None:
            self.procs = [subprocess.Popen([*self.argv(), "--nproc-per-node", str(self.a.nproc)],
                                           env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True)]
        else:
            run_id, port = uuid.uuid4().hex[:8], random.Random().randrange(29500, 29900)
            self.procs = [h.popen([*self.argv(), "--nnodes", "2", "--node-rank", str(i),
                                   "--nproc-per-node", str(self.a.nproc), "--rdzv-id", run_id,
                                   "--rdzv-endpoint", f"{self.hosts[0].addr}:{port}"],
                                  env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
                          for i, h in enumerate(self.hosts)]
        out.close()

    def poll(self) -> int | None:
        """None while running; else the job's exit code (the first non-zero one), once every
        launcher has ended (a failed host's partner is stopped)."""
        codes = [p.poll() for p in self.procs]
        if all(c is None for c in codes):
            return None
        if any(c not in (None, 0) for c in codes) and any(c is None for c in codes):
            time.sleep(2)  # its partner notices on its own, usually
            self.stop()
            codes = [p.poll() for p in self.procs]
        if any(c is None for c in codes):
            return None
        return next((c for c in codes if c != 0), 0)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
        if self.hosts is not None:
            for h in self.hosts:
                h.kill_all()


def mount_tmpfs(where: Path, size: str) -> str | None:
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "mount -t tmpfs needs root"
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True, timeout=30)
    return None if proc.returncode == 0 else proc.stderr.strip()


def _full_messages(log: Path) -> int:
    """How often the job's output says a disk is full (ringtrain's words, or an OSError's)."""
    return log.read_text(errors="replace").lower().count("no space left on device")


def run(a: argparse.Namespace, run_dir: Path, steps: int, log: Path, plan: Path | None, hosts,
        chaos_dir: Path | None, disk: Path | None, restarts: int) -> dict:
    """One run to the end: the job, relaunched after a stop as a user would, the outside faults
    played on request. Returns its figures."""
    job = Job(a, run_dir, steps, log, plan, hosts, restarts)
    try:
        return _drive(a, job, run_dir, log, plan, hosts, chaos_dir, disk)
    finally:
        job.stop()  # also when the harness itself fails: nothing of the job outlives it


def _drive(a, job, run_dir, log, plan, hosts, chaos_dir, disk) -> dict:
    started = time.monotonic()
    job.start()
    launches, codes, notes, filler, full_seen, filled_at = 1, [], [], None, 0, 0.0
    handled: set[int] = set()
    faults = json.loads(plan.read_text())["faults"] if plan is not None else []
    while True:
        code = job.poll()
        if chaos_dir is not None:
            for req in sorted(chaos_dir.glob("request-*")):
                i = int(req.name.split("-")[1])
                if i in handled:
                    continue
                handled.add(i)
                kind = faults[i]["kind"]
                if kind == "corrupt":
                    notes.append(f"fault {i}: corrupted {corrupt_newest(run_dir / 'snapshots')}")
                elif kind == "disk-full" and disk is not None:
                    full_seen = _full_messages(log)
                    filler, filled_at = fill(disk), time.monotonic()
                elif kind == "link" and hosts is not None:
                    b = hosts[1]
                    b.unplug()
                    threading.Timer(a.link_seconds, subprocess.run, args=(
                        ["ip", "-n", b.netns, "link", "set", b.ifname, "up"],), kwargs={
                        "capture_output": True, "timeout": 10}).start()
                (chaos_dir / f"done-{i}").write_text("")
        # The user frees the space once the run said the disk is full (or stopped, or a minute
        # went by); a launcher with restarts left goes on by itself, else it is relaunched below.
        if filler is not None and (code is not None or _full_messages(log) > full_seen
                                   or time.monotonic() - filled_at > 60):
            notes.append(f"disk full for {time.monotonic() - filled_at:.1f} s")
            filler.unlink()
            filler = None
        if code is not None:
            codes.append(code)
            if code == 0 or launches > a.relaunches or time.monotonic() - started > a.timeout:
                break
            launches += 1  # as a scheduler (or the user) would: the same command, it resumes
            job.start()
        if time.monotonic() - started > a.timeout:
            job.stop()
            codes.append("timeout")
            break
        time.sleep(0.05)
    wall = time.monotonic() - started
    job.stop()
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    return {"wall_s": wall, "exit_codes": codes, "launches": launches, "summary": summary,
            "notes": notes}


def committed_history(run_dir: Path) -> SampleLog | None:
    done = sorted(p.parent for p in (run_dir / "snapshots").glob("snap-*/COMMITTED"))
    if not done:
        return None
    shared = torch.load(done[-1] / "shared.pt", weights_only=True)
    return SampleLog.from_state(shared["trainer"]["samples"])


def left_behind(run_dir: Path, plan: Path, hosts) -> list[int]:
    """Processes still running of the job: a command line naming its run dir, or the plan in
    their environment (workers, and the helper that wakes a stopped one)."""
    time.sleep(1.0)
    found = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = (d / "environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if f"--run-dir {run_dir}" in cmd or f"plan:{plan}" in env:
            found.add(int(d.name))
    for h in hosts or ():
        found.update(h.pids())
    return sorted(found)


# ---- the report ---------------------------------------------------------------------------------

def report(a, faults, fired, ref, chaos, steps, check, same_history, left, extra) -> dict:
    kinds: dict[str, list[int]] = {}
    for f in faults:
        k = kinds.setdefault(f["kind"], [0, 0])
        k[0] += 1
    for f in fired:
        kinds[f["kind"]][1] += 1
    finished = chaos["exit_codes"][-1:] == [0]
    sha_ref, sha = ref["summary"].get("param_sha256"), chaos["summary"].get("param_sha256")
    out = {
        "hosts": a.hosts, "world_size": chaos["summary"].get("world_size"), "strategy": a.strategy,
        "seed": a.seed, "steps": steps, "faults_planned": len(faults),
        "faults_injected": len(fired),
        "faults_survived": len(fired) if finished else max(0, len(fired) - 1),
        "by_kind": {k: {"planned": v[0], "injected": v[1]} for k, v in kinds.items()},
        "restarts": extra["attempts"] - 1, "relaunches": chaos["launches"] - 1,
        "exit_codes": chaos["exit_codes"], "steps_trained": extra["steps_trained"],
        "steps_recomputed": extra["steps_trained"] - steps if finished else None,
        "wall_s": round(chaos["wall_s"], 1), "fault_free_wall_s": round(ref["wall_s"], 1),
        "throughput_kept": round(ref["wall_s"] / chaos["wall_s"], 3),
        "processes_left": len(left), "param_sha256": sha, "fault_free_param_sha256": sha_ref,
        "param_sha256_equal": bool(sha and sha == sha_ref),
        "samples": {k: check[k] for k in ("steps", "samples", "epochs", "skipped", "repeated",
                                          "out_of_order", "missing_steps")} if check else None,
        "history_errors": check["errors"] if check else ["no committed history"],
        "history_equals_fault_free": same_history, "notes": chaos["notes"] + extra["notes"],
    }
    out["ok"] = bool(finished and out["param_sha256_equal"] and check and not check["errors"]
                     and same_history and not left and len(fired) == len(faults))
    return out


def main(argv=None) -> dict:
    a = parse(argv)
    a.nproc = a.nproc or (2 if a.hosts == 1 else 1)
    world = a.nproc * a.hosts
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    bad = sorted(set(kinds) - set(ALL_KINDS))
    if bad:
        raise SystemExit(f"chaos.py: unknown --kinds {bad}; choose from {', '.join(ALL_KINDS)}")
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
                                  a.slot or 2 * a.snapshot_every, a.corrupt_then)
        chaos_dir = root / "chaos"
        chaos_dir.mkdir(exist_ok=True)
        plan = root / "plan.json"
        plan.write_text(json.dumps({"dir": str(chaos_dir), "faults": faults}, indent=1))
        print(f"chaos: {len(faults)} faults over {steps} steps, world size {world} "
              f"({a.hosts} host{'s' if a.hosts > 1 else ''}), runs in {root}", flush=True)
        ref_dir = root / "fault-free"
        ref = run(a, ref_dir, steps, root / "fault-free.log", None, hosts, None, None, 0)
        if ref["exit_codes"][-1:] != [0]:
            raise SystemExit(f"the fault-free run failed: {ref['exit_codes']}; "
                             f"see {root}/fault-free.log")
        run_dir = (disk or root) / "run"
        restarts = 3 * len(faults) + 5
        chaos = run(a, run_dir, steps, root / "chaos.log", plan, hosts, chaos_dir, disk, restarts)
        fired = [json.loads(p.read_text()) for p in sorted(chaos_dir.glob("fired-*.json"))]
        steps_log = chaos_dir / "steps.log"
        attempts = chaos_dir / "attempts.log"
        extra = {"steps_trained": len(steps_log.read_text().split()) if steps_log.exists() else 0,
                 "attempts": len(attempts.read_text().splitlines()) if attempts.exists() else 0,
                 "notes": notes}
        # pipeline: fewer data ranks
        global_batch = ref["summary"].get("global_batch_size", BATCH * world)
        n = train_size(2)
        history, ref_history = committed_history(run_dir), committed_history(ref_dir)
        check = check_history(history, dataset_len=n, seed=SEED, global_batch=global_batch,
                              steps=steps) if history else None
        same = bool(history and ref_history and history.step_sets() == ref_history.step_sets())
        left = left_behind(run_dir, plan, hosts)
        out = report(a, faults, fired, ref, chaos, steps, check, same, left, extra)
    finally:
        if hosts_cm is not None:
            hosts_cm.__exit__(None, None, None)
        if disk is not None:
            if subprocess.run(["umount", str(disk)], capture_output=True, timeout=60).returncode:
                subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=60)
        if not a.out:
            shutil.rmtree(root, ignore_errors=True)
    rows = [("faults injected / planned", f"{out['faults_injected']} / {out['faults_planned']}"),
            ("faults survived", out["faults_survived"]),
            ("by kind (planned, injected)", ", ".join(f"{k} {v['planned']},{v['injected']}"
                                                      for k, v in out["by_kind"].items())),
            ("restarts (relaunches)", f"{out['restarts']} ({out['relaunches']})"),
            ("steps recomputed", f"{out['steps_recomputed']} (of {out['steps_trained']} trained)"),
            ("wall time: chaos / fault-free", f"{out['wall_s']} s / {out['fault_free_wall_s']} s"),
            ("throughput kept", f"{out['throughput_kept']:.1%}"),
            ("processes left behind", out["processes_left"]),
            ("param_sha256 equals fault-free", out["param_sha256_equal"]),
            ("samples skipped / repeated", f"{(out['samples'] or {}).get('skipped')} / "
                                           f"{(out['samples'] or {}).get('repeated')}"),
            ("history equals fault-free", out["history_equals_fault_free"])]
    for k, v in rows:
        print(f"{k:32s} {v}")
    for line in out["notes"] + out["history_errors"]:
        print("note:", line)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
