"""Slurm, for real: a one-node cluster from Debian's packages runs `srun -n 2` of a ringtrain script
and of `ringtrain train`, to the same weights as `ringtrain run`; and preemption (SIGUSR1, SIGTERM).

    apt-get install -y slurm-wlm munge          # or `make slurm`
    .venv/bin/pytest -q tests/test_slurm.py     # root; skips with the reason where Slurm is absent

The cluster is private to the test: munged, slurmctld and slurmd run in the foreground on
loopback ports picked here, with their configuration, key, state and logs in a temporary
directory, and are stopped (and the directory removed) at the end, also after a failure. No
cgroups: ProctrackType=proctrack/linuxproc, TaskPlugin=task/none, so it runs in containers.
The tests at the bottom need no cluster: what Slurm's signals need from `ringtrain run`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))

from same_weights import ENV, SCRIPT, read_digest, reference_digest  # noqa: E402

from ringtrain.errors import REQUEUE_EXIT_CODE  # noqa: E402
from ringtrain.launch.launcher import has_shutdown_timeout  # noqa: E402
from ringtrain.launch.network import free_port  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sinfo", "squeue", "scancel")
UP_S, RUN_S = 30.0, 150.0  # cluster start-up; one srun of two workers on a busy machine
TINY = ["--steps", "20", "--n-layer", "1", "--n-embd", "32", "--batch-size", "16",
        "--eval-every", "10", "--no-progress", "--no-report", "--threads", "1"]
ENDLESS = ["--steps", "100000", "--n-layer", "1", "--n-embd", "32", "--batch-size", "16",
           "--eval-every", "100000", "--log-every", "1", "--snapshot-every", "100000",
           "--no-progress", "--no-report", "--threads", "1"]  # runs until a signal stops it


def _unavailable() -> str | None:
    missing = [b for b in DAEMONS + CLIENTS if shutil.which(b) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): "
                "apt-get install -y slurm-wlm munge")
    if os.geteuid() != 0:
        return "slurmd must run as root to start tasks"
    try:  # srun's tasks take the master from the node list: the node's name must resolve
        socket.gethostbyname(socket.gethostname())
    except OSError as e:
        return f"this machine's hostname {socket.gethostname()!r} does not resolve ({e})"
    return None


SLURM_CONF = """\
ClusterName=rt{tag}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge.socket
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
FirstJobId={first_job}
NodeName={host} NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=10 State=UP
"""


class Cluster:
    """munged + slurmctld + slurmd in `root`, each a child of this process (foreground mode)."""

    def __init__(self, root: Path):
        self.root, self.host = root, socket.gethostname()
        self.procs: list[subprocess.Popen] = []
        (root / "state").mkdir()
        (root / "spool").mkdir()
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        # FirstJobId varies the MASTER_PORT srun's tasks derive from the job id
        # (20000 + id % 10000).
        (root / "slurm.conf").write_text(SLURM_CONF.format(
            tag=os.getpid(), host=self.host, ctld_port=free_port(), slurmd_port=free_port(),
            dir=root, first_job=random.randrange(1000, 9000)))
        self.env = {k: v for k, v in ENV.items() if not k.startswith("SLURM_")}
        self.env["SLURM_CONF"] = str(root / "slurm.conf")

    def _start(self, *cmd: str) -> None:
        # Closed with the directory.
        log = open(self.root / f"{Path(cmd[0]).name}.out", "w")  # noqa: SIM115
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                           start_new_session=True))

    def start(self) -> str | None:
        """Start the daemons; None once the node is idle, else why not (with their logs)."""
        r = self.root
        self._start("munged", "-F", "-f", f"--key-file={r}/munge.key", f"--socket={r}/munge.socket",
                    f"--pid-file={r}/munged.pid", f"--log-file={r}/munged.log",
                    f"--seed-file={r}/munged.seed")
        self._start("slurmctld", "-D", "-i", "-f", f"{r}/slurm.conf")
        self._start("slurmd", "-D", "-f", f"{r}/slurm.conf", "-N", self.host)
        deadline = time.monotonic() + UP_S
        state = ""
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                break
            state = self.run(["sinfo", "-h", "-o", "%T"], timeout=10).stdout.strip()
            if state == "idle":
                return None
            time.sleep(0.3)
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(r.glob("*.log"))
                         if p.stat().st_size)
        return f"the Slurm node did not become idle within {UP_S:g} s (state {state!r})\n{logs}"

    def run(self, cmd: list[str], timeout: float = RUN_S, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env | kw.pop("env", {}), capture_output=True, text=True,
                              timeout=timeout, **kw)

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True,
                       timeout=10, check=False)
        for p in reversed(self.procs):  # slurmd, slurmctld, then munged: each its own group
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=10)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


@pytest.fixture(scope="module")
def slurm():
    why = _unavailable()
    if why:
        print(f"skipped: {why}")
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="ringtrain-slurm-"))
    cluster = Cluster(root)
    try:
        why = cluster.start()
        if why:
            print(f"skipped: {why}")
            pytest.skip(why)
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def _srun(n: int, *cmd: str) -> list[str]:
    return ["srun", "-n", str(n), "--kill-on-bad-exit=1", "--time=5", *cmd]


def test_srun_runs_a_script_to_the_same_weights(slurm, request, tmp_path):
    out = tmp_path / "slurm.json"
    proc = slurm.run(_srun(2, sys.executable, str(SCRIPT), "--steps", "30", "--out", str(out)),
                     cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The master came from SLURM_JOB_NODELIST, the port from SLURM_JOB_ID.
    assert (f"ringtrain: slurm: rank 0 of world_size 2 (local_rank 0), master {slurm.host}:2"
            in proc.stderr)
    assert read_digest(out) == reference_digest(request.config, tmp_path)


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_srun_runs_ringtrain_train_to_the_same_weights(slurm, tmp_path):
    # The reference runs meanwhile: most of either run is four processes importing torch.
    ref = subprocess.Popen([sys.executable, "-m", "ringtrain", "train", "--nproc-per-node", "2",
                            *TINY, "--run-dir", str(tmp_path / "run")], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=ENV, cwd=tmp_path)
    try:
        proc = slurm.run(_srun(2, sys.executable, "-m", "ringtrain", "train", *TINY, "--run-dir",
                               str(tmp_path / "slurm")), cwd=tmp_path)
        ref_out = ref.communicate(timeout=RUN_S)[0]
    finally:
        if ref.poll() is None:
            ref.kill()
            ref.wait(timeout=10)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ref.returncode == 0, ref_out
    assert _summary(tmp_path / "slurm")["world_size"] == 2
    assert (_summary(tmp_path / "slurm")["param_sha256"]
            == _summary(tmp_path / "run")["param_sha256"])


def _lines(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


def _wait_for_step(run_dir: Path, proc: subprocess.Popen, timeout_s: float = RUN_S) -> None:
    """Until this run has logged two more steps (a resumed run starts after the old lines)."""
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout_s
    before = _lines(metrics)
    while _lines(metrics) < before + 2:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no step logged within {timeout_s:g} s"
        time.sleep(0.1)


def _stop_with(cluster: Cluster, run_dir: Path, how: list[str], log: Path) -> tuple[int, str]:
    """Start an endless 2-task `ringtrain train`, send a signal through Slurm, return
    (rc, output)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(_srun(2, sys.executable, "-m", "ringtrain", "train", *ENDLESS,
                                      "--run-dir", str(run_dir)), env=cluster.env, stdout=f,
                                stderr=subprocess.STDOUT, cwd=run_dir.parent)
    try:
        _wait_for_step(run_dir, proc)
        jobs = cluster.run(["squeue", "-h", "-o", "%i"], timeout=10).stdout.split()
        assert len(jobs) == 1, jobs
        cluster.run(["scancel", *how, jobs[0]], timeout=10, check=True)
        return proc.wait(timeout=RUN_S), log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.slow
def test_preemption_saves_the_same_step_and_asks_to_be_requeued(slurm, tmp_path):
    run_dir = tmp_path / "run"
    # Slurm's warning before the time limit (`sbatch --signal=USR1@90`), sent to every task.
    rc, out = _stop_with(slurm, run_dir, ["--signal=USR1"], tmp_path / "usr1.log")
    assert rc == REQUEUE_EXIT_CODE, out
    step = int(out.split("stopped at step ")[1].split()[0])
    assert f"on SIGUSR1; snapshot of step {step}" in out
    snap = run_dir / "snapshots" / f"snap-{step:08d}"
    assert sorted(p.name for p in snap.iterdir()) == ["COMMITTED", "manifest.json", "rank0.pt",
                                                      "rank1.pt", "shared.pt"]
    # Requeued: the same command resumes there; now preempted with SIGTERM (scancel's default).
    rc, out = _stop_with(slurm, run_dir, ["--signal=TERM"], tmp_path / "term.log")
    assert rc == REQUEUE_EXIT_CODE, out
    assert f"resumed from {snap}: step {step}" in out
    assert "on SIGTERM; snapshot of step" in out


# ---- what Slurm's signals need from `ringtrain run`, without a cluster --------------------------

GRACE_WORKER = """
import os, signal, sys, time
def on_term(signum, frame):
    time.sleep(1.0)  # "saving"
    open(sys.argv[2], "w").close()
    sys.exit(143)
signal.signal(signal.SIGTERM, on_term)
open(sys.argv[1], "w").close()
time.sleep(120)
"""


@pytest.mark.skipif(not has_shutdown_timeout(), reason="torch < 2.13 has no --shutdown-timeout "
                    "(tests/test_launcher.py checks the error it gets instead)")
@pytest.mark.parametrize("grace_s,saved", [(60, True), (0, False)])
def test_shutdown_timeout_is_the_grace_before_sigkill(tmp_path, grace_s, saved):
    script, ready, done = tmp_path / "w.py", tmp_path / "ready", tmp_path / "done"
    script.write_text(GRACE_WORKER)
    proc = subprocess.Popen([sys.executable, "-m", "ringtrain", "run", "--nproc-per-node", "1",
                             "--shutdown-timeout", str(grace_s),
                             str(script), str(ready), str(done)],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + RUN_S
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=RUN_S)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == REQUEUE_EXIT_CODE, out
    assert done.exists() == saved, out


def test_ringtrain_run_passes_sigusr1_on_and_asks_to_be_requeued(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "ringtrain", "train", "--nproc-per-node", "2",
                             *ENDLESS, "--run-dir", str(run_dir)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        _wait_for_step(run_dir, proc)
        proc.send_signal(signal.SIGUSR1)  # as `srun --signal=USR1@90 ringtrain train ...` would
        out = proc.communicate(timeout=RUN_S)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == REQUEUE_EXIT_CODE, out
    assert "on SIGUSR1; snapshot of step" in out
