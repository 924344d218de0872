"""`ringtrain run` end to end: success, a killed or raising worker, signals, no orphans.

    .venv/bin/pytest -q tests/test_launcher.py

Each test launches `python -m ringtrain run ... tests/scripts/allreduce_loop.py --tag <unique>`
in a subprocess (bounded by a timeout) and afterwards scans /proc for that tag: the launcher
must leave no process of its job behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ringtrain.errors import REQUEUE_EXIT_CODE
from ringtrain.launch.environments import LAUNCHER_PID_ENV
from ringtrain.launch.failure_report import (
    ChildFailedError,
    ProcessFailure,
    format_failure,
    root_cause,
)
from ringtrain.launch.launcher import main
from ringtrain.launch.peer_failure import PEER_FAILED_EXIT_CODE

REPO = Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "tests" / "scripts" / "allreduce_loop.py")
RUN = [sys.executable, "-m", "ringtrain", "run"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
ENV.pop("LOGLEVEL", None)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="scans /proc")


def _tagged(tag: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose command line holds `tag`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if tag in cmdline and state != "Z":  # a zombie has exited; only its reaping is pending
            found.append((int(entry.name), cmdline))
    return found


def _wait_gone(tag: str, timeout_s: float) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout_s
    while (left := _tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture
def tag():
    """A unique word for the job's command lines; kills (by pid) whatever a failing test left."""
    tag = f"ringtrain-test-{uuid.uuid4().hex[:12]}"
    yield tag
    for pid, _ in _tagged(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_for_file(path: Path, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"launcher exited ({proc.returncode}) before {path.name}:\n"
                                 + proc.communicate()[1])
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} not written within {timeout_s} s")
        time.sleep(0.05)


def test_two_single_node_jobs_at_once_both_succeed(tmp_path):
    # No port given to either: each must pick its own. Job A uses torchrun's `_` spelling,
    # job B the Python API that `ringtrain train` relaunches itself through.
    api = ("import sys; from ringtrain.launch.launcher import launch; "
           f"sys.exit(launch({SCRIPT!r}, ['--steps', '5'], nproc_per_node=2))")
    jobs = [
        subprocess.Popen([*RUN, "--nproc_per_node=2", SCRIPT, "--steps", "5"], env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        subprocess.Popen([sys.executable, "-c", api], env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
    ]
    for job in jobs:
        out, err = job.communicate(timeout=90)
        assert job.returncode == 0, err
        assert "allreduce ok: world_size=2 steps=5 sum=15" in out
        assert "ringtrain run:" not in err


def test_killed_worker_stops_all_names_rank_and_signal(tmp_path, tag):
    ready = tmp_path / "killed"
    proc = subprocess.Popen(
        [*RUN, "--nproc-per-node", "2", SCRIPT, "--steps", "100000", "--fail-rank", "1",
         "--fail-how", "kill", "--ready-file", str(ready), "--tag", tag],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    exited = time.time()
    killed = float(ready.read_text())
    assert proc.returncode != 0
    assert exited - killed < 30, f"launcher exited {exited - killed:.1f} s after the kill"
    report = [line for line in err.splitlines() if line.startswith("ringtrain run:")]
    assert len(report) == 1, err
    assert "rank 1 failed" in report[0] and "SIGKILL" in report[0], err
    assert _wait_gone(tag, 0.5) == []


def test_raising_worker_traceback_and_rank_reported_once(tag):
    out = subprocess.run(
        [*RUN, "--nproc-per-node", "2", SCRIPT, "--steps", "100000", "--fail-rank", "1",
         "--fail-how", "raise", "--tag", tag],
        env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    lines = out.stderr.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("ringtrain run:")]
    assert len(heads) == 1, out.stderr
    head = lines[heads[0]]
    assert "rank 1 failed" in head and "ValueError: boom at step 3" in head, head
    report = "\n".join(lines[heads[0]:])
    assert "Traceback (most recent call last)" in report
    assert 'raise ValueError(f"boom at step {step}")' in report
    assert len(re.findall(r"(?<!local_)rank 1\b", report)) == 1, report
    assert _wait_gone(tag, 0.5) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_stops_every_worker(tmp_path, tag, signum):
    # Rank 1 sleeps at step 3, so rank 0 is blocked inside an all-reduce: a stuck job.
    ready = tmp_path / "stuck"
    proc = subprocess.Popen(
        [*RUN, "--nproc-per-node", "2", SCRIPT, "--steps", "100000", "--fail-rank", "1",
         "--fail-how", "hang", "--ready-file", str(ready), "--tag", tag],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_file(ready, proc)
        time.sleep(0.2)
        sent = time.monotonic()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=40)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, err
    assert f"got {signum.name}; stopped all workers" in err
    assert took < 30, f"{took:.1f} s to stop after {signum.name}"
    assert _wait_gone(tag, 0.5) == []


def test_workers_die_when_the_launcher_is_sigkilled(tmp_path, tag):
    ready = tmp_path / "stuck"
    proc = subprocess.Popen(
        [*RUN, "--nproc-per-node", "2", SCRIPT, "--steps", "100000", "--fail-rank", "1",
         "--fail-how", "hang", "--ready-file", str(ready), "--tag", tag],
        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_file(ready, proc)
        assert len(_tagged(tag)) == 3  # the launcher and its two workers
        proc.kill()  # SIGKILL: the launcher runs no cleanup at all
        proc.wait(timeout=10)
        left = _wait_gone(tag, 5.0)
    finally:
        proc.kill()
    assert left == [], f"orphans after the launcher died: {left}"


def test_help_reads_ringtrain_run(capsys):
    assert main(["--help"]) == 0  # in-process, as `python -m ringtrain run --help` runs it
    out = capsys.readouterr().out
    assert out.startswith("usage: ringtrain run")
    assert "--nproc-per-node" in out and "--rdzv-endpoint" in out
    # torch's help states torch's defaults; ours differ (SIGUSR1 passed on, a free port, 0.1 s)
    words = " ".join(out.split())
    assert "(default: SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1:" in words
    assert "Defaults to 29500" not in words and "a free port picked by the OS" in words


@pytest.mark.parametrize("argv, error", [
    (["--no-such-flag", "3", SCRIPT], "unrecognized arguments: --no-such-flag"),
    (["--nnodes", "x", SCRIPT], "--nnodes 'x': expected N or MIN:MAX"),
    (["--nproc-per-node", "two", SCRIPT], "--nproc-per-node two: give a number of workers"),
    (["--nproc-per-node", "2", "no_such_script.py"],
     "training script 'no_such_script.py' not found"),
])
def test_bad_flags_give_a_clear_error_and_exit_2(capsys, argv, error):
    assert main(argv) == 2  # parsing is all in-process; nothing is launched
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("ringtrain run: error: ") and error in err, err


def test_nproc_per_node_gpu_without_a_gpu_says_so(capsys, monkeypatch):
    import ringtrain.launch.launcher as launcher

    monkeypatch.setattr(launcher, "launcher_gpu_count", lambda: 0)  # also on a GPU box
    assert main(["--nproc-per-node", "gpu", SCRIPT]) == 2  # torch: "Cuda is not available."
    err = capsys.readouterr().err.strip()
    assert err.startswith("ringtrain run: error: --nproc-per-node gpu: torch ") and err.endswith(
        "sees no GPU on this machine; give a number of processes, or auto (one per GPU, else one "
        "per CPU core)"), err


# -- the report, without processes -------------------------------------------------------------

def _failure(tmp_path: Path, local_rank: int, exitcode: int, raised: str | None = None):
    path = tmp_path / f"error_{local_rank}.json"
    if raised is not None:
        path.write_text(json.dumps({"message": {"message": raised, "extraInfo": {
            "py_callstack": f"Traceback (most recent call last):\n  ...\n{raised}",
            "timestamp": "1700000000"}}}))
    return ProcessFailure(local_rank=local_rank, pid=1000 + local_rank, exitcode=exitcode,
                          error_file=str(path))


def test_root_cause_skips_symptoms_and_the_agents_own_sigterm(tmp_path):
    # Observed first: rank 0 stopped by its watchdog and rank 2 with a gloo error; rank 1 raised.
    failures = {
        0: _failure(tmp_path, 0, PEER_FAILED_EXIT_CODE, "PeerFailure: rank 1 failed at step 3"),
        2: _failure(tmp_path, 2, 1, "RuntimeError: [gloo/transport/tcp] Connection closed by peer"),
        1: _failure(tmp_path, 1, -signal.SIGTERM, "ValueError: boom"),
        3: _failure(tmp_path, 3, -signal.SIGTERM),
    }
    assert root_cause(failures) == 1
    report = format_failure(ChildFailedError("train.py", failures))
    head, *rest = report.splitlines()
    assert head.startswith("ringtrain run: rank 1 failed (local_rank 1")
    assert "ValueError: boom" in head
    assert "  Traceback (most recent call last):" in rest
    assert "  rank 3: stopped by the launcher" in rest


def test_ranks_that_raised_the_same_error_are_said_to_have(tmp_path):
    """Every rank made the same mistake: the report says so, not 'exit code 1' (the launcher
    stopped rank 3 after it raised: what it raised still counts)."""
    shape = "RuntimeError: mat1 and mat2 shapes cannot be multiplied (3x5 and 4x2)"
    failures = {0: _failure(tmp_path, 0, 1, shape),  # in the order the agent saw them end
                3: _failure(tmp_path, 3, -signal.SIGTERM, shape),
                2: _failure(tmp_path, 2, 1, "ValueError: rank 2 has bad data"),
                1: _failure(tmp_path, 1, 1, shape)}
    _, *rest = format_failure(ChildFailedError("train.py", failures)).splitlines()
    assert rest[-2:] == ["  ranks 1, 3: the same error",
                         "  rank 2: ValueError: rank 2 has bad data"]


def test_a_job_whose_every_attempt_raised_the_same_is_told_restarts_do_not_fix_it(tmp_path):
    """--max-restarts 2 on a script with a bug: three attempts, three identical reports, then
    a line saying what restarts are for; not after a kill, an exit code or another error."""
    from ringtrain.launch.failure_report import root_message, same_every_attempt

    shape = "RuntimeError: mat1 and mat2 shapes cannot be multiplied (3x5 and 4x2)"
    raised = {1: _failure(tmp_path, 1, 1, shape), 0: _failure(tmp_path, 0, -signal.SIGTERM)}
    assert root_message(raised) == shape
    assert same_every_attempt([shape, shape], shape) == (
        "ringtrain run: every attempt (3) failed with this same error: restarts help a worker "
        "or node that was lost, not a mistake in the script; fix it, then run again")
    killed = root_message({2: _failure(tmp_path, 2, -signal.SIGKILL)})  # no error file
    assert killed == "killed by SIGKILL"
    for earlier, last in (([], shape), ([killed], killed), (["ValueError: x"], shape),
                          ([shape], "exit code 3")):
        assert same_every_attempt(earlier, last) is None, (earlier, last)


def test_report_for_a_signal_without_error_file(tmp_path):
    failures = {1: _failure(tmp_path, 1, -signal.SIGKILL),
                0: _failure(tmp_path, 0, -signal.SIGTERM)}
    assert root_cause(failures) == 1
    report = format_failure(ChildFailedError("x.py", failures))
    assert report.splitlines()[0].endswith("killed by SIGKILL")
    failures = {0: _failure(tmp_path, 0, 3)}
    assert "exit code 3" in format_failure(ChildFailedError("x.py", failures))
    assert "@ringtrain.launch.launcher.record" in format_failure(ChildFailedError("x.py", failures))


RAISES = """
import sys, torch, ringtrain
rt = ringtrain.init_distributed()
model = ringtrain.DistributedDataParallel(torch.nn.Linear(4, 1))
for step in range(5):
    model(torch.randn(8, 4)).sum().backward()
    if step == 2 and rt.rank == 1:
        raise ValueError("bad batch at step 2\\nsecond line")
ringtrain.destroy_distributed()
"""


def test_the_report_names_what_a_scripts_rank_raised(tmp_path, tag):
    """A script that calls init_distributed needs no @record: the watchdog's excepthook writes
    the launcher's error file, so the report names the exception; its traceback, printed by the
    rank itself, appears once."""
    script = tmp_path / "raises.py"
    script.write_text(RAISES)
    out = subprocess.run([*RUN, "--nproc-per-node", "2", str(script), tag], env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    report = out.stderr[out.stderr.index("ringtrain run: rank 1 failed"):].splitlines()
    assert report[0].endswith("): ValueError: bad batch at step 2"), out.stderr
    # Rank 0 is stopped by the launcher, or first by its watchdog (under load): either way once.
    assert report[1:] in (["  rank 0: stopped by the launcher"],
                          ["  rank 0: exit code 75 (stopped by its watchdog: a peer failed)"]), \
        out.stderr
    assert out.stderr.count("Traceback (most recent call last)") == 1, out.stderr
    assert _wait_gone(tag, 5.0) == []


UNEVEN = """
import sys
import torch
import ringtrain

rt = ringtrain.init_distributed()
torch.set_num_threads(1)
model = ringtrain.DistributedDataParallel(torch.nn.Linear(4, 1))
data = [torch.randn(4) for _ in range(20 + 4 * rt.rank)]  # rank 1 listed more files
sampler = ringtrain.DistributedSampler(data)
for x in torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler):  # 5 and 6 batches
    model(x).sum().backward()
print(f"rank {rt.rank} done", flush=True)
ringtrain.destroy_distributed()
"""


def test_a_rank_with_more_batches_than_its_peers_is_told_why_at_once(tmp_path, tag):
    """Rank 0 ends its loop after 5 steps and exits; rank 1's 6th all-reduce loses its
    connection. It waited for the watchdog to name a silent peer (60 s: none is silent, rank 0
    finished) and then reported only the lost connection; now the peer's checkout says why."""
    script = tmp_path / "uneven.py"
    script.write_text(UNEVEN)
    started = time.monotonic()
    out = subprocess.run([*RUN, "--nproc-per-node", "2", str(script), tag], env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "rank 0 done" in out.stdout, out.stderr
    report = out.stderr[out.stderr.index("ringtrain run: rank 1 failed"):].splitlines()
    assert "): still in a collective after rank 0 had finished the script: the ranks ran " \
           "different numbers of steps or collectives, e.g. a different number of batches per " \
           "rank" in report[0], out.stderr
    assert time.monotonic() - started < 40, out.stderr  # not the watchdog's 60 s
    assert _wait_gone(tag, 5.0) == []


DIE = """
import os, signal, sys, time
rank, hows = int(os.environ["RANK"]), sys.argv[1].split(",")
if 1 <= rank <= len(hows):  # rank r dies the r-th way
    time.sleep(0.5 * rank)
    if hows[rank - 1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(hows[rank - 1]))
time.sleep(2.0)  # the others outlive them, then finish well
print(f"rank {rank} done", flush=True)
"""


# One job for both ways a tolerated rank dies (a signal, an exit code): ranks 1 and 2, while
# rank 3, tolerated too, lives; a job per way cost a launcher start each.
@pytest.mark.parametrize("hows, tolerated", [("kill,3", True), ("75", False)])
def test_a_tolerated_rank_dies_and_the_others_finish(tmp_path, tag, hows, tolerated):
    # ringtrain train tolerates async parameter-server workers this way. A watchdog's exit
    # (75: "a peer failed") is never the rank's own death: it still fails the job.
    script = tmp_path / "die.py"
    script.write_text(DIE)
    api = ("import sys; from ringtrain.launch.launcher import launch; "
           f"sys.exit(launch({str(script)!r}, [{hows!r}, {tag!r}], nproc_per_node=4, "
           "tolerate_ranks={1, 2, 3}))")
    out = subprocess.run([sys.executable, "-c", api], env=ENV, capture_output=True, text=True,
                         timeout=60)
    if tolerated:
        assert out.returncode == 0, out.stderr
        assert "rank 0 done" in out.stdout and "rank 3 done" in out.stdout
        warnings = [line for line in out.stderr.splitlines() if "tolerated rank" in line]
        assert len(warnings) == 2, out.stderr
        said = {r: [w for w in warnings if f"rank {r} " in w] for r in (1, 2)}  # in any order
        assert len(said[1]) == 1 and "killed by SIGKILL" in said[1][0], out.stderr
        assert len(said[2]) == 1 and "exit code 3" in said[2][0], out.stderr
    else:
        assert out.returncode == 1 and "rank 1: exit code 75" in out.stderr, out.stderr
        assert "tolerated rank" not in out.stderr
    assert _wait_gone(tag, 0.5) == []


def test_tolerate_ranks_is_refused_for_a_function():
    from ringtrain.launch.launcher import launch

    with pytest.raises(ValueError, match="not a function"):
        launch(print, [], nproc_per_node=2, tolerate_ranks={1})


def test_a_module_entrypoint_is_found_as_python_m_would_without_importing_it(tmp_path, monkeypatch):
    from ringtrain.launch.entrypoint import missing_entrypoint, module_found

    pkg = tmp_path / "rtpkg"
    (pkg / "sub").mkdir(parents=True)
    # Importing the package would raise: finding must not run it.
    (pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "train.py").write_text("")
    (tmp_path / "plain.py").write_text("")
    monkeypatch.chdir(tmp_path)
    # ringtrain itself is found however it is installed (an editable install's finder is on
    # sys.meta_path, not on sys.path), as `ringtrain train` launches `-m ringtrain` workers.
    for name in ("rtpkg", "rtpkg.sub.train", "plain", "json.tool", "sys", "ringtrain.cli"):
        assert module_found(name), name
    for name in ("rtpkg.nope", "plain.x", "nope_rt", "bad-name", "sys.x"):
        assert not module_found(name), name
    assert missing_entrypoint("rtpkg.sub.train", module=True, no_python=False) is None
    assert "module 'nope_rt' not found" in missing_entrypoint(
        "nope_rt", module=True, no_python=False
    )
    assert missing_entrypoint("anything", module=False, no_python=True) is None


def test_a_script_that_does_not_compile_starts_no_worker(tmp_path, monkeypatch, capsys):
    """A typo made every worker print the same SyntaxError, then a failure report; now one
    error, in Python's words, before anything starts (compiling runs none of the script)."""
    from ringtrain.launch.entrypoint import missing_entrypoint
    from ringtrain.launch.launcher import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "typo.py").write_text("import sys\ndef f(:\n    pass\n")
    (tmp_path / "ok.py").write_text("raise SystemExit('ran')\n")
    (tmp_path / "nul.py").write_bytes(b"x = 1\0\n")
    assert missing_entrypoint("ok.py", module=False, no_python=False) is None
    said = missing_entrypoint("typo.py", module=False, no_python=False)
    assert said.splitlines() == [
        "training script 'typo.py' does not compile; no worker was started. Fix it and run "
        "again:", '  File "typo.py", line 2', "    def f(:", "          ^",
        "SyntaxError: invalid syntax"]
    assert "null bytes" in missing_entrypoint("nul.py", module=False, no_python=False)
    # What python runs by its __main__.py is not compiled as a script: a zipapp (or a pex, a
    # zip with a shebang) has null bytes, and a directory no source at all.
    import zipapp

    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text("print('ran')\n")
    zipapp.create_archive(tmp_path / "app", tmp_path / "app.pyz")
    (tmp_path / "empty").mkdir()
    for ok in ("app", "app.pyz"):
        assert missing_entrypoint(ok, module=False, no_python=False) is None, ok
    assert "'empty' is a directory without a __main__.py" in missing_entrypoint(
        "empty", module=False, no_python=False)
    assert main(["--nproc-per-node", "2", "typo.py"]) == 2
    assert "ringtrain run: error: training script 'typo.py' does not compile" in \
        capsys.readouterr().err


def test_shutdown_timeout_on_a_torch_without_it_is_one_clear_error(monkeypatch, capsys):
    """torch 2.11's torchrun has no --shutdown-timeout: argparse said only 'unrecognized
    arguments'. Here `ringtrain run` and `launch()` name the torch version and the fix."""
    import ringtrain.launch.launcher as launcher
    import ringtrain.launch.run_args as run_args

    for module in (launcher, run_args):  # launch() asks too, not only the parser
        monkeypatch.setattr(module, "has_shutdown_timeout", lambda: False)
    real = run_args._torch_args_parser

    def without_it():  # torch 2.11's parser: the same, less the option
        parser = real()
        for action in list(parser._actions):
            if "--shutdown-timeout" in action.option_strings:
                parser._remove_action(action)
                for flag in action.option_strings:
                    del parser._option_string_actions[flag]
        return parser

    monkeypatch.setattr(run_args, "_torch_args_parser", without_it)
    assert main(["--shutdown-timeout", "5", "x.py"]) == 2
    err = capsys.readouterr().err
    assert "argument --shutdown-timeout/--shutdown_timeout: needs torch 2.13 or newer" in err
    with pytest.raises(ValueError, match="shutdown_timeout=5: needs torch 2.13 or newer"):
        launcher.launch("x.py", [], nproc_per_node=1, shutdown_timeout=5)


def test_a_signal_that_torchs_metrics_wrapper_hides_still_stops_with_its_code(tmp_path,
                                                                               monkeypatch,
                                                                               capsys):
    """torch's `metrics.prof` can raise UnboundLocalError from its `finally` over the agent's
    SignalException (a SIGTERM handled before its timer was set): the launcher said
    "ringtrain run: UnboundLocalError: ..." and exited 1 instead of 143 (requeue me)."""
    from torch.distributed.elastic.multiprocessing import SignalException

    import ringtrain.launch.launcher as launcher

    def agent(config, entrypoint):
        def run(*args):  # torch's wrapper, the signal handled before its timer was set
            try:
                raise SignalException("Process 1 got signal: 15", signal.SIGTERM)
                start = time.time()
            finally:
                print(time.time() - start)
        return run

    monkeypatch.setattr(launcher, "elastic_launch", agent)
    monkeypatch.setenv(LAUNCHER_PID_ENV, "")  # the launcher sets it: unset after the test
    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["--nproc-per-node", "1", str(script)]) == REQUEUE_EXIT_CODE
    err = capsys.readouterr().err
    assert "got SIGTERM; stopped all workers" in err and "UnboundLocalError" not in err
