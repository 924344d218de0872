"""Processes forked from a warm one (`ringtrain.launch.zygote`), and the agent's starts.

    .venv/bin/pytest -q tests/test_zygote.py

Forking makes the forking process a subreaper, so the forks run in a driver process of their
own (`DRIVER`), not in pytest's: it prints one JSON line per fork, checked here. Each fork must
look like `Popen(command, env=..., cwd=..., stdout=..., start_new_session=True)`: its arguments,
environment, working directory, output files and exit code (a raise: 1, a kill: -9), a session
of its own, this driver as its parent; and find torch imported already. CPU only: no process
group, no device (the warm process never touches CUDA; it refuses to fork once it has), except
the `ringtrain train` job at the end: gloo on the CPU, asked for (with a GPU visible, "auto"
would pick NCCL).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ringtrain.launch import memory_exec, starts
from ringtrain.launch.zygote import forkable

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only (prctl)")

CHILD = """
import json, os, sys, time
print(json.dumps({"pid": os.getpid(), "pgid": os.getpgid(0), "cwd": os.getcwd(),
                  "argv": sys.argv, "env": os.environ.get("ZYGOTE_TEST"),
                  "torch": "torch" in sys.modules, "path0": sys.path[0],
                  "cmdline": open("/proc/self/cmdline", "rb").read().rstrip(b"\\0").decode()
                  .split("\\0")}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
code = int(sys.argv[1])
if code == 99:
    raise ValueError("raised in the child")
if code == 98:
    time.sleep(60)
sys.exit(code)
"""

DRIVER = """
import json, os, signal, subprocess, sys, time
from ringtrain.launch.zygote import Zygote, ZygoteError
child, out_dir = sys.argv[1], sys.argv[2]
zygote = Zygote([sys.executable, "-u"], dict(os.environ), ["torch"])
while not zygote.ready():
    time.sleep(0.01)
print(json.dumps({"zygote": zygote.info}), flush=True)
for code in (0, 3, 99, 98):
    with open(os.path.join(out_dir, f"out-{code}.txt"), "w") as out:
        started = time.monotonic()
        proc = zygote.fork([sys.executable, "-u", child, str(code)],
                           {"ZYGOTE_TEST": f"env-{code}", "PATH": os.environ["PATH"]},
                           cwd=out_dir, stdout=out, stderr=subprocess.STDOUT)
    forked_s = time.monotonic() - started
    parent = int(open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[1])
    if code == 98:
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGKILL)  # its own session, as Popen(start_new_session)
    print(json.dumps({"code": code, "pid": proc.pid, "returncode": proc.wait(timeout=30),
                      "parent": parent, "me": os.getpid(), "forked_s": forked_s}), flush=True)
try:
    zygote.fork(["/bin/echo", "hi"], {})
except ZygoteError as e:
    print(json.dumps({"refused": str(e)}), flush=True)
zygote.close()
print(json.dumps({"zygote_code": zygote.proc.returncode}), flush=True)
"""


def _driver(tmp_path: Path, source: str, *args: str, env: dict | None = None) -> list[dict]:
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "driver.py").write_text(textwrap.dedent(source))
    run = subprocess.run([sys.executable, str(tmp_path / "driver.py"), *args],
                         env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def test_a_fork_is_the_command_started_with_its_env_cwd_output_and_exit_code(tmp_path):
    lines = _driver(tmp_path, DRIVER, str(tmp_path / "child.py"), str(tmp_path))
    assert lines[0]["zygote"]["ready"] is True
    forks = {line["code"]: line for line in lines if "code" in line}
    assert {c: f["returncode"] for c, f in forks.items()} == {0: 0, 3: 3, 99: 1, 98: -9}
    for code, fork in forks.items():
        assert fork["parent"] == fork["me"], fork  # the driver waits for it as for a Popen
        text = (tmp_path / f"out-{code}.txt").read_text()
        said = json.loads(text.splitlines()[0])
        assert said["pid"] == said["pgid"] == fork["pid"]  # a session of its own
        assert said["argv"] == [str(tmp_path / "child.py"), str(code)]
        assert said["env"] == f"env-{code}" and said["cwd"] == str(tmp_path)
        assert said["path0"] == str(tmp_path)  # as `python SCRIPT`: the script's directory
        assert said["torch"] is True  # imported once, in the warm process
        # as `ps` and `pgrep -f` see it: the command, not the warm process's
        assert said["cmdline"] == [sys.executable, "-u", str(tmp_path / "child.py"), str(code)]
        assert "to stderr" in text  # stderr=STDOUT
    assert "ValueError: raised in the child" in (tmp_path / "out-99.txt").read_text()
    print("fork seconds:", [round(f["forked_s"], 3) for f in forks.values()])
    assert "not a Python module or script command" in lines[-2]["refused"]
    assert lines[-1]["zygote_code"] == 0  # it exits when the agent's end of its socket closes


FRESH_CHILD = """
import json, os, signal, sys, torch
print(json.dumps({"sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                  "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                  "sighup_ignored": signal.getsignal(signal.SIGHUP) == signal.SIG_IGN,
                  "threads": torch.get_num_threads(), "stdin": os.readlink("/proc/self/fd/0"),
                  "write_through": sys.stdout.write_through,
                  "raw": type(sys.stdout.buffer).__name__, "env": os.environ.get("ZYGOTE_TEST"),
                  "launcher_only": os.environ.get("LAUNCHER_ONLY"), "pgid": os.getpgid(0),
                  "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
                  "pid": os.getpid()}), flush=True)
"""

FORKED_HERE = """
import json, os, signal, sys, threading, time
import torch  # as a launcher: imported before torchrun sets OMP_NUM_THREADS for the workers
from ringtrain.launch.zygote import Zygote, ZygoteError
signal.signal(signal.SIGTERM, lambda *a: None)  # the launcher's: a fresh worker has none
# As from a terminal: a shell's background job (`make test &`) starts with SIGINT ignored, and
# an ignored SIGINT stays ignored in a fresh worker too (it is, in the fork: found that way).
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup: survives an exec, so a fork keeps it
os.environ["LAUNCHER_ONLY"] = "1"
leaked = open(os.devnull)  # noqa: SIM115 - a descriptor of the launcher's: not the workers'
print("printed once", end="")  # buffered (stdout is a pipe): not printed again by the fork
child = sys.argv[1]
env = {k: v for k, v in os.environ.items() if k != "LAUNCHER_ONLY"}
zygote = Zygote.forked_here([sys.executable, "-u"], env, ["json"])
assert zygote.wait_ready(60), zygote.proc.poll()
print(json.dumps({"zygote": zygote.info, "me": os.getpid(), "default_threads":
                  torch.get_num_threads()}), flush=True)
proc = zygote.fork([sys.executable, "-u", child],
                   {**env, "ZYGOTE_TEST": "worker", "OMP_NUM_THREADS": "1"},
                   stdout=sys.stdout)
print(json.dumps({"returncode": proc.wait(timeout=60)}), flush=True)
zygote.close()
stop = threading.Event()
threading.Thread(target=stop.wait, name="agent-thread").start()
try:
    Zygote.forked_here([sys.executable, "-u"], env, ["json"])
except ZygoteError as e:
    print(json.dumps({"refused": str(e)}), flush=True)
try:
    Zygote.forked_here(["/usr/bin/python3", "-u"], env, ["json"])
except ZygoteError as e:
    print(json.dumps({"other_python": str(e)}), flush=True)
stop.set()
"""


def test_a_zygote_forked_from_the_launcher_forks_fresh_interpreters(tmp_path):
    """`Zygote.forked_here` (the launcher's, torch imported once a job): its forks are what
    a fresh `python -u` of their environment is, not copies of the launcher: no Python signal
    handler of its (an ignored signal stays ignored, as through an exec), its environment,
    stdin /dev/null, unbuffered output, OMP_NUM_THREADS read (torchrun sets it after the
    launcher's import torch); refused with a thread running, or for another Python."""
    (tmp_path / "fresh.py").write_text(FRESH_CHILD)
    (tmp_path / "driver.py").write_text(FORKED_HERE)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    run = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "fresh.py")],
                         env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("printed once") == 1, run.stdout
    lines = [json.loads(line) for line in run.stdout.replace("printed once", "").splitlines()
             if line.startswith("{")]
    zygote, said, ended, refused, other = lines
    assert zygote["zygote"]["forked"] is True and ended == {"returncode": 0}
    assert said["sigterm"] and said["sigint"] and said["sighup_ignored"], said
    assert said["env"] == "worker" and said["launcher_only"] is None
    assert said["stdin"] == os.devnull and said["pid"] == said["pgid"]
    assert said["fds"][:3] == [0, 1, 2] and len(said["fds"]) <= 4, said  # 3: listdir's own
    assert said["write_through"] is True and said["raw"] == "FileIO"  # as `python -u`
    assert said["threads"] == 1, (said, zygote["default_threads"])
    assert "a Python thread runs in the warm process (agent-thread)" in refused["refused"]
    assert "/usr/bin/python3" in other["other_python"]


THREADED = """
import json, os, sys, time
from ringtrain.launch.zygote import Zygote, ZygoteError
zygote = Zygote([sys.executable, "-u"], dict(os.environ), [sys.argv[1]])
while not zygote.ready():
    time.sleep(0.01)
try:
    zygote.fork([sys.executable, "-u", "-m", "json.tool", "--help"], dict(os.environ))
except ZygoteError as e:
    print(json.dumps({"refused": str(e)}), flush=True)
print(json.dumps({"zygote_pid": zygote.proc.pid}), flush=True)
os._exit(0)  # no close: the zygote must not outlive its agent
"""


def test_a_zygote_with_a_thread_refuses_and_dies_with_its_agent(tmp_path):
    (tmp_path / "threaded.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), "
        "name='sleeper', daemon=True).start()\n")
    lines = _driver(tmp_path, THREADED, "threaded",
                    env={"PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"})
    assert "a Python thread runs in the warm process (sleeper)" in lines[0]["refused"]
    pid, deadline = lines[1]["zygote_pid"], time.monotonic() + 10
    while time.monotonic() < deadline:  # PDEATHSIG: killed as its parent exits
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the zygote {pid} outlived its agent")


FAKE_DRIVER = """
static int initialised;
int cuInit(unsigned int flags) { initialised = 1; return 0; }
int cuDeviceGetCount(int *count) { if (!initialised) return 3; *count = 1; return 0; }
"""
PROBE = """
import ctypes, json, sys
from ringtrain.launch import zygote_server
said = {"none": zygote_server.fork_problem()}
driver = ctypes.CDLL(sys.argv[1])  # as `import torch` loads it: mapped, not initialised
said["loaded"] = zygote_server.fork_problem()
driver.cuInit(0)  # as a device query of a library, or torch's lazy init, does
said["initialised"] = zygote_server.fork_problem()
print(json.dumps(said))
"""


def test_the_warm_process_refuses_once_the_cuda_driver_is_initialised_not_when_loaded(tmp_path):
    """`import torch` of a CUDA build maps libcuda.so without cuInit; forks then use CUDA (a raw
    fork on an H200, session 22). A fake driver (the two calls the probe and the test use)
    stands in for it on a box without one."""
    compiler = next((c for c in ("cc", "gcc") if shutil.which(c)), None)
    if compiler is None:
        pytest.skip("no C compiler to build the fake libcuda.so.1")
    (tmp_path / "fake.c").write_text(FAKE_DRIVER)
    library = tmp_path / "libcuda.so.1"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(tmp_path / "fake.c")],
                   check=True, timeout=60)
    run = subprocess.run([sys.executable, "-c", PROBE, str(library)], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr
    said = json.loads(run.stdout.splitlines()[-1])
    assert said["none"] is None and said["loaded"] is None, said
    assert "the CUDA driver is initialised in the warm process" in said["initialised"]


@pytest.mark.parametrize("command, expected", [
    (["/usr/bin/python3", "-u", "-m", "ringtrain", "train", "--steps", "3"],
     (("/usr/bin/python3", "-u"), ("module", "ringtrain"), ["ringtrain", "train", "--steps", "3"])),
    (["python", "w.py", "x"], (("python",), ("script", "w.py"), ["w.py", "x"])),
    (["python", "-O", "w.py"], None),  # a flag the zygote was not started with
    (["python", "-c", "pass"], None),
    (["/bin/true"], None), (["numactl", "-N", "0", "python", "w.py"], None), (["python"], None),
])
def test_forkable_commands(command, expected):
    assert forkable(command) == expected


def test_under_a_memory_limit_every_start_is_cold_and_a_live_job_says_why():
    """A fork's pages shared with the warm process would be charged to its cgroup."""
    started = []
    job = starts.Starts(live=True)
    proc = job.start(lambda a, e: started.append(a) or SimpleNamespace(pid=1, args=a),
                     ("/usr/bin/python3", "-u", memory_exec.__file__, "train"), {}, None, None)
    assert started and not starts.forked(proc) and job.zygote is None
    assert "--memory-limit" in job.off


@pytest.mark.parametrize("live", [True, False])
def test_a_command_the_zygote_cannot_run_starts_cold_and_a_live_job_says_why_once(capsys, live):
    started = []

    def popen(args, env):
        started.append(args)
        return SimpleNamespace(pid=1, args=args)

    job = starts.Starts(live=live)
    for _ in range(2):
        proc = job.start(popen, ("/bin/true", "x"), {"A": "1"}, None, None)
        assert not starts.forked(proc) and proc.args == ("/bin/true", "x")
    assert len(started) == 2 and job.zygote is None
    said = capsys.readouterr().err
    if live:
        assert said.count("start cold") == 1 and "not `python -m MODULE` or a script" in said
    else:  # any other job starts cold as torchrun would, silently
        assert said == ""


WORKER = """
import json, os, sys
preloaded = "torch" in sys.modules  # before this script imported anything of its own
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
path = os.path.join(sys.argv[1], f"{attempt}-{os.environ['RANK']}.json")
with open(path + ".tmp", "w") as f:
    json.dump({"preloaded": preloaded, "ppid": os.getppid()}, f)
os.replace(path + ".tmp", path)  # whole when seen
if attempt == 0 and os.environ["RANK"] == "1":  # fails once rank 0 has said its part
    import time
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(sys.argv[1], "0-0.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(3)
"""


def test_a_users_script_under_ringtrain_run_starts_as_torchrun_starts_it(tmp_path):
    """Not forked outside a live job (its atexit handlers, shutdown and import-time environment
    are a fresh interpreter's), at the start and at a restart; the launcher's children."""
    (tmp_path / "worker.py").write_text(WORKER)
    run = subprocess.run(
        [sys.executable, "-m", "ringtrain", "run", "--nproc-per-node", "2", "--max-restarts",
         "1", str(tmp_path / "worker.py"), str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    said = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*-*.json")}
    assert sorted(said) == ["0-0", "0-1", "1-0", "1-1"]  # rank 1 failed once: one restart
    assert len({s["ppid"] for s in said.values()}) == 1
    assert not any(s["preloaded"] for s in said.values()), said
    assert "start cold" not in run.stderr


def _children(pid: int) -> list[str]:
    """The command lines of `pid`'s children now."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            if entry.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append((entry / "cmdline").read_bytes().rstrip(b"\0")
                             .replace(b"\0", b" ").decode())
        except (OSError, ValueError, IndexError):
            continue
    return found


@pytest.mark.parametrize("cold", [False, True])
def test_ringtrain_train_workers_are_forked_from_the_jobs_warm_process(tmp_path, cold):
    """`ringtrain train`'s workers are the launcher's children, as `ps` names them, started by
    its warm process (alive beside them for restarts); --cold-starts: none."""
    job = subprocess.Popen(
        [sys.executable, "-m", "ringtrain", "train", "--nproc-per-node", "2", "--steps", "10",
         "--device", "cpu", "--backend", "gloo", "--run-dir", str(tmp_path / "run"), "--no-report",
         *(["--cold-starts"] if cold else [])],
        env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    seen: set[str] = set()
    while job.poll() is None:
        seen.update(_children(job.pid))
        time.sleep(0.1)
    out = job.stdout.read()
    assert job.returncode == 0, out[-3000:]
    workers = [c for c in seen if " -m ringtrain train" in c and "zygote" not in c]
    assert workers, seen  # named as `python -u -m ringtrain train`, whoever started them
    # Forked from the launcher itself (torch imported once for the job), not started fresh.
    assert any(f"ringtrain.launch.zygote_server (forked from {job.pid})" in c
               for c in seen) is not cold, seen
