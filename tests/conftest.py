"""Fixtures shared by the test files (pytest finds this file by name).

- `clean_env`: a `ringtrain train` run inside the test process leaves no trace: the launcher's
  variables are unset, and the `ringtrain` logger, the torch thread count and the process group
  are put back afterwards.
- `single_process`: a world of one in this process (1 thread, no report.png), its Runtime.
- the device: every test means the CPU (gloo, CPU tensors) unless marked `cuda`. An unmarked
  test runs with RINGTRAIN_DEVICE=cpu, which every process it starts inherits (`ringtrain
  train`, `ringtrain run`, scripts calling `init_distributed()`): on a GPU box "auto" would pick
  NCCL and put two ranks on one GPU. A test marked `cuda` picks the GPU itself and is skipped,
  saying so, where torch sees none.
- bytecode: the suite writes and reads .pyc files (PYTHONDONTWRITEBYTECODE is dropped for it and
  every process it starts), so no process recompiles ringtrain.
- the tiers: `make test` runs everything; `make test-fast` (`pytest --fast`) runs only the
  tests that start no process: a test is in the fast tier by what it does, not by a label that
  can be wrong. Under `--fast` starting a process (subprocess, multiprocessing, the forkserver
  of `ringtrain.testing.run_workers`, os.fork/system/posix_spawn) skips the test at that point,
  "starts processes (fast tier)", whatever the test does with the exception, and the run ends
  with how many ran. Markers choose among the rest: `slow`, `multinode`, `cuda` (pyproject.toml).
"""

from __future__ import annotations

import logging
import multiprocessing.process
import multiprocessing.util
import os
import subprocess
import sys

import pytest
import torch

from ringtrain.launch.device import DEVICE_ENV, cuda_device_count
from ringtrain.launch.process_group import destroy_distributed, init_distributed

# Set at import, before any test module copies os.environ into an ENV of its own.
os.environ[DEVICE_ENV] = "cpu"
# Bytecode is cached: with PYTHONDONTWRITEBYTECODE set (this machine's environment sets it) every
# process the suite starts recompiled ringtrain's 186 modules, ~1 s of CPU per 2-rank `ringtrain
# train` (11.9 -> 10.9 s CPU measured). __pycache__ is git-ignored; pytest-xdist's workers, the
# forkserver and every subprocess start after this line and inherit it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False  # this process and pytest's rewritten test modules too
# torch's TCP store looks up each connecting peer's name (getnameinfo: reverse DNS, of
# 127.0.0.1 too, seen as ::ffff:127.0.0.1, which /etc/hosts does not list) on its one serving
# thread, and every client waits meanwhile. This machine's resolver drops about 1 query in 25:
# a 5 s stall (the resolver's timeout) every ~25 store connections (session 27). A test that
# times a recovery measures ringtrain, not the resolver: a lookup is given up after 1 s here.
# Heartbeats excuse a stalled store (tests/test_live_roster.py stalls one for 2 s).
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")


@pytest.fixture(autouse=True)
def _device(request, monkeypatch):
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setenv(DEVICE_ENV, "cpu")  # a test that changed it does not leak it
        return
    if cuda_device_count() == 0:
        pytest.skip("needs CUDA: torch sees no GPU here")
    monkeypatch.delenv(DEVICE_ENV, raising=False)


@pytest.fixture
def clean_env(monkeypatch):
    for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
              "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(v, raising=False)
    logger = logging.getLogger("ringtrain")
    saved = (list(logger.handlers), logger.level, logger.propagate, torch.get_num_threads())
    yield
    destroy_distributed()
    logger.handlers[:], logger.level, logger.propagate = saved[:3]  # leave no trace for other tests
    torch.set_num_threads(saved[3])


@pytest.fixture
def single_process(monkeypatch):
    for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr("ringtrain.training.report.write_report", lambda *args, **kwargs: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield init_distributed()
    torch.set_num_threads(threads)
    destroy_distributed()


# --- the fast tier -------------------------------------------------------------------------
FAST_SKIP = "starts processes (fast tier)"


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help="the fast tier (make test-fast): "
                          "a test that starts a process is skipped there")


class _NoProcesses:
    """Refuses every way a test could start a process, while one test runs (setup to teardown).

    Patched per test, not for the session: pytest-xdist starts its workers with subprocess.
    """

    # (owner, attribute): each door to a new process; Popen covers subprocess.run and friends,
    # BaseProcess.start every multiprocessing context, spawnv_passfds the forkserver and the
    # resource tracker, os.* what is left (os.spawn* and pty go through os.fork).
    DOORS = [(subprocess.Popen, "_execute_child"), (multiprocessing.process.BaseProcess, "start"),
             (multiprocessing.util, "spawnv_passfds"), (os, "fork"), (os, "forkpty"),
             (os, "system"), (os, "posix_spawn"), (os, "posix_spawnp")]

    def __init__(self):
        self.item = None
        self.tried: str | None = None  # the first door this test tried

    def refuse(self, door: str):
        self.tried = self.tried or door
        raise pytest.skip.Exception(FAST_SKIP)  # the location of every fast-tier skip

    def __enter__(self):
        self.saved = [(owner, name, getattr(owner, name)) for owner, name in self.DOORS
                      if hasattr(owner, name)]
        for owner, name, _ in self.saved:
            setattr(owner, name, self._closed(f"{getattr(owner, '__name__', owner)}.{name}"))
        return self

    def _closed(self, door: str):
        return lambda *args, **kwargs: self.refuse(door)

    def __exit__(self, *exc):
        for owner, name, original in self.saved:
            setattr(owner, name, original)


_guard = _NoProcesses()
_SKIP_LOCATION = (__file__, _NoProcesses.refuse.__code__.co_firstlineno + 2)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if not item.config.getoption("fast"):
        return (yield)
    _guard.item, _guard.tried = item, None
    with _guard:
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that tried to start a process is skipped, even where it caught the refusal
    (`except BaseException`, a thread) and passed or failed for it."""
    report = yield
    if _guard.item is item and _guard.tried is not None:
        if report.when == "teardown":
            if report.failed:  # the test is reported skipped; its teardown tidied after a refusal
                report.outcome, report.longrepr = "passed", None
        elif not report.skipped:
            report.outcome, report.longrepr = "skipped", (*_SKIP_LOCATION, f"Skipped: {FAST_SKIP}")
    return report


FAST_BUDGET_S = 2.0  # a test of the fast tier that takes longer is named at the end
_over_budget: list[tuple[float, str]] = []


def pytest_runtest_logreport(report):
    # Here, not in makereport: under xdist the controller sees every worker's reports.
    if report.when == "call" and report.passed and report.duration > FAST_BUDGET_S:
        _over_budget.append((report.duration, report.nodeid))


def pytest_terminal_summary(terminalreporter, config):
    if not config.getoption("fast"):
        return
    for duration, nodeid in sorted(_over_budget, reverse=True):
        terminalreporter.write_line(f"fast tier: {nodeid} took {duration:.1f} s (budget "
                                    f"{FAST_BUDGET_S:g} s): make it smaller or mark it slow")
    stats = terminalreporter.stats
    ran = sum(len(stats.get(k, [])) for k in ("passed", "failed", "xfailed", "xpassed"))
    refused = sum(FAST_SKIP in str(r.longrepr) for r in stats.get("skipped", []))
    terminalreporter.write_line(f"fast tier: {ran} tests ran; {refused} skipped at their first "
                                "process start (`make test` runs them)")


import ringtrain.training.report as _report  # noqa: E402

_WRITE_REPORT = _report.write_report


@pytest.fixture(autouse=True)
def _real_write_report():
    """Worker functions stub `write_report` (matplotlib is slow) in their own process; one run
    in the test process leaked the stub into later tests (test_trainer's report.png was missing
    in a full run). Every test starts with the real one."""
    _report.write_report = _WRITE_REPORT
    yield
    _report.write_report = _WRITE_REPORT
