"""benchmarks/chaos.py's runs: one `ringtrain train` job driven to its end, the outside faults
played on request, relaunched after a stop as a user (or a scheduler) would; what it left.

Not run by itself: `.venv/bin/python benchmarks/chaos.py [--live]` (see its docstring).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # support/: the plan's outside faults, the workers' env
sys.path.insert(0, str(REPO))

from support.chaos_plan import corrupt_newest, fill  # noqa: E402 - test code outside the package
from support.faults import fault_env  # noqa: E402 - what the workers need to play the plan

from ringtrain.data.sample_log import SampleLog  # noqa: E402
from ringtrain.launch.launcher import has_shutdown_timeout  # noqa: E402

ENV = {k: v for k, v in os.environ.items()
       if k not in ("LOGLEVEL", "RINGTRAIN_TEST_FAULT", "RINGTRAIN_STEP_HOOK",
                    "TORCHELASTIC_RESTART_COUNT")} | {
    "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
SEED, BATCH = 1337, 16


# ---- running ringtrain train --------------------------------------------------------------------

class Job:
    """One `ringtrain train` job (one launcher, or one per host) and its output file.

    `restarts` None: a live job (`--live --live-wait`: a lost worker is replaced, the others go
    on); else the restart path (`--max-restarts restarts`: every worker restarts and resumes).
    """

    def __init__(self, a: argparse.Namespace, run_dir: Path, steps: int, log: Path,
                 plan: Path | None, hosts, restarts: int | None):
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
                "--strategy", a.strategy, *self.recovery(),
                # 5 s to save after SIGTERM instead of 30 (torch 2.11's agent has no such option)
                *(["--shutdown-timeout", "5"] if has_shutdown_timeout() else []),
                "--run-dir", str(self.run_dir)]

    def recovery(self) -> list[str]:
        if self.restarts is None:
            return ["--live", "--live-wait", str(self.a.live_wait),
                    *(["--live-spares", str(self.a.live_spares)] if self.a.live_spares else [])]
        return ["--max-restarts", str(self.restarts)]

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
        chaos_dir: Path | None, disk: Path | None, restarts: int | None) -> dict:
    """One run to the end: the job, relaunched after a stop as a user would, the outside faults
    played on request. Returns its figures."""
    job = Job(a, run_dir, steps, log, plan, hosts, restarts)
    try:
        return _drive(a, job, run_dir, log, plan, hosts, chaos_dir, disk)
    finally:
        job.stop()  # also when the harness itself fails: nothing of the job outlives it


def _drive(a, job, run_dir, log, plan, hosts, chaos_dir, disk) -> dict:
    started = time.monotonic()
    launched = [time.time()]  # each (re)launch: a live run's records say which job they are of
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
            launched.append(time.time())
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
            "notes": notes, "launched_unix": launched}


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
