"""Lightning and accelerate with ringtrain's DDP swapped in end with torch's DDP's weights.

    pip install -e '.[frameworks]'                  # or `make frameworks`
    .venv/bin/pytest -q tests/test_frameworks.py    # skips with the reason when they are absent

One pair of ranks of tests/scripts/framework_worker.py (gloo, CPU, torchrun's variables) runs
every installed framework's scenarios, one after another (a module fixture: a pair per test cost
~10 s of CPU each in imports of torch and the framework); each test checks its scenario's
reports. A scenario trains twice in the same processes on the same seed and data: with torch's
`DistributedDataParallel`, then with ringtrain's put in torch.nn.parallel's name and the
framework's own, as a user would. Both runs must end without error, and the ranks exit 0
after the last scenario (Lightning's teardown calls
`_get_ddp_logging_data()`; its manual optimization and accelerate's trigger_sync_in_backward
call the reducer's `_rebuild_buckets()` / `prepare_for_backward(outputs)`: see
ringtrain/ddp/framework_members.py) and give bit-identical parameters and buffers on both ranks
at every checkpoint the scenario records. torch's own DDP is deterministic here: two ranks'
averages are one addition and a halving.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ringtrain.launch.network import reserve_port

WORKER = Path(__file__).parent / "scripts" / "framework_worker.py"
# Lightning's and accelerate's imports (~5 s each on a busy 2-core machine), the four scenarios'
# two trainings each and teardown, per rank: ~60 s quiet, ~180 s measured under load. The
# test that runs first runs the pair (in its setup): pytest's 300 s would not bound it.
RUN_S = 500.0
pytestmark = pytest.mark.timeout(RUN_S + 60)
HAVE_LIGHTNING = importlib.util.find_spec("lightning") is not None
HAVE_ACCELERATE = importlib.util.find_spec("accelerate") is not None
LIGHTNING = pytest.mark.skipif(
    not HAVE_LIGHTNING,
    reason="lightning is not installed: pip install -e '.[frameworks]' (or `make frameworks`)")
ACCELERATE = pytest.mark.skipif(
    not HAVE_ACCELERATE,
    reason="accelerate is not installed: pip install -e '.[frameworks]' (or `make frameworks`)")
# Every scenario of an installed framework, in the order the pair runs them.
SCENARIOS = ["fabric", "trainer", "manual"] * HAVE_LIGHTNING + ["accelerate"] * HAVE_ACCELERATE
# What another launcher (or the test's own environment) would tell the frameworks otherwise.
DROPPED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
           "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "RINGTRAIN_LAUNCHER_PID")


def run_pair(scenarios: list[str], out: Path) -> tuple[dict[str, list[dict]], str]:
    """Both ranks of the worker on `scenarios`, in order; the reports of each scenario both
    ranks finished (a scenario that failed has none, nor have the ones after it), and the ranks'
    output."""
    base = {k: v for k, v in os.environ.items()
            if k not in DROPPED and not k.startswith(("SLURM_", "OMPI_", "PMI_", "ACCELERATE_"))}
    # What `ringtrain run` (torch's elastic agent) gives each worker. Without TORCHELASTIC_RUN_ID
    # Lightning asks MPI next, where mpi4py is installed: on a GPU image with mpi4py and no
    # ssh, MPI_Init aborted the worker ("plm_rsh_agent: ssh : rsh" not found).
    # Held while the ranks run: no other process takes it before rank 0's store does.
    with reserve_port() as port:
        base |= {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                 "TORCHELASTIC_RUN_ID": "test-frameworks", "OMP_NUM_THREADS": "1",
                 "PYTHONUNBUFFERED": "1"}
        logs = [out / f"rank{r}.log" for r in range(2)]
        procs = []
        for r in range(2):
            with logs[r].open("w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(WORKER), *scenarios, "--out", str(out)],
                    env=base | {"RANK": str(r), "LOCAL_RANK": str(r)}, cwd=out, stdout=log,
                    stderr=subprocess.STDOUT))
        deadline = time.monotonic() + RUN_S
        try:
            # A rank that failed leaves the other blocked in a collective: stop at the first
            # failure.
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if any(p.poll() not in (None, 0) for p in procs):
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(timeout=30)
    output = "\n".join(f"---- rank {r} (exit {p.returncode}) ----\n{logs[r].read_text()[-6000:]}"
                       for r, p in enumerate(procs))
    reports = {s: [json.loads((out / f"{s}-rank{r}.json").read_text()) for r in range(2)]
               for s in scenarios if all((out / f"{s}-rank{r}.json").exists() for r in range(2))}
    if any(p.returncode != 0 for p in procs) and scenarios[-1] in reports:
        del reports[scenarios[-1]]  # every scenario ran, then a rank failed on its way out
    return reports, output


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> tuple[dict[str, list[dict]], str]:
    return run_pair(SCENARIOS, tmp_path_factory.mktemp("frameworks"))


def scenario_reports(reports: tuple[dict[str, list[dict]], str], scenario: str) -> list[dict]:
    """Both ranks' reports of `scenario`; a failure shows both ranks' output."""
    done, output = reports
    assert scenario in done, f"the ranks did not finish scenario {scenario!r}:\n{output}"
    return done[scenario]


def check_equal_weights(reports: list[dict], checkpoints: list[str]) -> None:
    for report in reports:
        assert report["wrappers"] == {
            "torch": "torch.nn.parallel.distributed.DistributedDataParallel",
            "ringtrain": "ringtrain.ddp.distributed.DistributedDataParallel",
        }, report  # the swap reached the framework
        assert list(report["max_abs_diff"]) == checkpoints, report
        assert report["max_abs_diff"] == dict.fromkeys(checkpoints, 0.0), report
        assert all(report["bitwise"].values()), report
        print(f"rank {report['rank']}: import {report['import_s']} s, "
              f"runs {report['run_s']} s")


@LIGHTNING
def test_lightning_fabric_automatic_loop_with_no_backward_sync(reports):
    check_equal_weights(scenario_reports(reports, "fabric"), ["epoch 0", "epoch 1"])


@LIGHTNING
def test_lightning_trainer_fit_checkpoint_and_resume(reports):
    check_equal_weights(scenario_reports(reports, "trainer"), ["fit 1 epoch", "resumed to epoch 2"])


@LIGHTNING
def test_lightning_trainer_manual_optimization(reports):
    check_equal_weights(scenario_reports(reports, "manual"), [
        "manual", "manual, find_unused_parameters", "manual, static_graph"])


@ACCELERATE
def test_accelerate_prepare_accumulate_state_and_trigger_sync(reports):
    check_equal_weights(scenario_reports(reports, "accelerate"), [
        "accumulate, epoch 1", "accumulate, epoch 2", "load_state", "trigger_sync_in_backward"])
