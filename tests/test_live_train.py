"""`ringtrain train --live` end to end (CLI, gloo, CPU, 3 workers, a tiny GPT).

One faulted run and its fault-free reference, started together (the faulted run mostly waits:
for a dead peer's heartbeat, a hung peer's timeout, a replacement's start-up):
- after step 4, rank 1 is killed (SIGKILL, as kill -9) and rank 2 stops (SIGSTOP: a hang), at
  once (one stall instead of two: the replacements start together); `--live-wait 60` makes
  the survivor wait for the replacements, so every step runs on 3 members;
- the survivor, rank 0, trains every step in its own process, the agent kills the hung worker
  and starts a replacement for each lost one, which heals from a live peer at the step the
  group is at (RUN_DIR/live/PID.json says who trained from where); step 4's metrics sum, which
  failed on the survivor, is agreed and written at step 6;
- after the last step rank 0 is killed too, with no step left to recover in: the run's end
  recovers instead (`LiveDriver.settle`), its replacement is let in at the last step and, rank
  0 now, writes step 10's line, the last snapshot and the end's files;
- the final `param_sha256` is the fault-free run's, and the committed sample history (in the
  last snapshot, `--record-samples`) is the fault-free run's: every step the same global batch,
  each sample once.
A third run, started beside them, has a warm spare (`--live-spares 1`) and loses its rank 0 (the
process that writes metrics.jsonl) to a kill after step 5: the survivors find it in step 6's
all-reduce, having computed their shares of it, and keep them (`LiveHooks.contribution`); the
spare, started with the job, takes its
place (and rank 0) at once (the agent says so, naming its pid and how long it had waited) and
trains exactly the lost member's share of step 6 (the members' records say what each redo held
and trained again), the survivors keep their pids and
record the stall, and the run ends with the fault-free weights bit for bit and its samples; no
process is left. The spare, rank 0 now, writes metrics.jsonl on: every logged step once, in
order, and the end's files (summary.json with the fault-free `param_sha256`, report.png, the
exported model). Where memory cgroups can be made
(root, or a delegated cgroup) that run also has `--memory-limit`: each spare waits, and trains
once let in, in a memory cgroup of its own with the workers' limit.
Pure parts (the launcher's and the options' refusals) are tested without processes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.faults import fault_env
from support.live_history import assert_fault_free_history, live_members, wait_all

from ringtrain.data.sample_log import SampleLog
from ringtrain.launch.cgroup import CgroupUnavailable, MemoryCgroups

STEPS, BATCH, WORLD = 10, 8, 3
LIVE = ["--nproc-per-node", str(WORLD), "--steps", str(STEPS), "--n-layer", "1", "--n-embd", "32",
        "--batch-size", str(BATCH), "--dropout", "0", "--log-every", "2", "--eval-every",
        str(STEPS), "--snapshot-every", str(STEPS), "--threads", "1", "--no-progress",
        "--device", "cpu", "--live", "--live-wait", "60", "--record-samples",
        "--watchdog-timeout", "6"]
FAULTS, AT = "kill:1:4,stop:2:4,kill:0:10", 4
SPARE_AT = 5  # the spared run's kill: in step 6's forward (kill-next), found in its all-reduce
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "RINGTRAIN_TEST_FAULT",
                "RINGTRAIN_STEP_HOOK")


def _memory_limit() -> tuple[tuple[str, ...], str]:
    """(`--memory-limit 3G`, "") where a memory cgroup can be made here, else ((), why not)."""
    try:
        MemoryCgroups.create(64 << 20, 1).remove()
    except CgroupUnavailable as e:
        return (), str(e)
    return ("--memory-limit", "3G"), ""


MEMORY, NO_MEMORY_WHY = _memory_limit()


def _start(run_dir: Path, fault: str | None, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    if fault:
        env.update(fault_env(fault))
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "ringtrain", "train", *LIVE, "--run-dir",
                             str(run_dir), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=run_dir.parent, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    procs = {"faulted": _start(root / "faulted", FAULTS), "clean": _start(root / "clean", None),
             "spared": _start(root / "spared", f"kill-next:0:{SPARE_AT}",
                              ("--live-spares", "1", *MEMORY))}
    return wait_all(procs, {name: root / name for name in procs})


def _history(run_dir: Path) -> SampleLog:
    shared = torch.load(run_dir / "snapshots" / f"snap-{STEPS:08d}" / "shared.pt",
                        weights_only=True)
    return SampleLog.from_state(shared["trainer"]["samples"])


def _logged_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]


def test_survivors_keep_their_pids_and_each_lost_worker_is_replaced_and_healed(runs):
    run_dir, stderr = runs["faulted"]
    members = live_members(run_dir)
    by_slot = {(m["launcher_rank"], m["joined_at_step"]): m for m in members}
    assert len(members) == 6, members  # 3 started, 2 replacements at step 4, 1 at the end
    # The killed and the hung ones never finished; rank 0 trained every step, then was killed
    # (its record is the one it wrote when it joined).
    assert by_slot[1, 0]["status"] == by_slot[2, 0]["status"] == by_slot[0, 0]["status"] \
        == "training"
    # Each replacement joined at the step the group had committed, and finished the run; the
    # two of step 4 recovered once more at the end, letting rank 0's replacement in.
    for slot in (1, 2):
        assert by_slot[slot, AT]["status"] == "finished" and by_slot[slot, AT]["step"] == STEPS
        assert by_slot[slot, AT]["recoveries"] == 1
    last = by_slot[0, STEPS]
    assert last["status"] == "finished" and last["rank"] == 0 and last["recoveries"] == 0
    assert {m["members"] for m in members if m["status"] == "finished"} == {WORLD}
    # The agent said what it did, naming the pids that the records name.
    for killed in (by_slot[1, 0], by_slot[0, 0]):
        assert f"(pid {killed['pid']}) killed by SIGKILL" in stderr, stderr[-3000:]
    assert f"(pid {by_slot[2, 0]['pid']}) was left out by its peers" in stderr, stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == WORLD and summary["steps"] == STEPS
    assert summary["train_loss"] is not None and summary["eval_loss"] is not None
    # Step 4's line, whose sum failed on the survivor, was agreed at step 6; step 10's, whose
    # sum failed when rank 0 was killed, at the end, and written by its replacement.
    assert _logged_steps(run_dir) == _logged_steps(runs["clean"][0]) == [2, 4, 6, 8, 10]
    took_over = f"rank 0 now (pid {last['pid']}): writes metrics.jsonl from step {STEPS} on"
    assert took_over in stderr, stderr[-3000:]
    assert (run_dir / "report.png").exists() and (run_dir / "model.safetensors").exists()


def test_the_faulted_run_ends_with_the_fault_free_weights_and_samples(runs):
    (faulted, _), (clean, _) = runs["faulted"], runs["clean"]
    sha = {name: json.loads((d / "summary.json").read_text())["param_sha256"]
           for name, d in (("faulted", faulted), ("clean", clean))}
    assert sha["faulted"] == sha["clean"]
    history, reference = _history(faulted), _history(clean)
    assert_fault_free_history(history, reference, steps=STEPS, global_batch=BATCH * WORLD)


def test_a_warm_spare_takes_a_killed_members_place_at_once(runs):
    (run_dir, stderr), (clean, _) = runs["spared"], runs["clean"]
    members = live_members(run_dir)
    survivors = [m for m in members if m["joined_at_step"] == 0 and m["status"] == "finished"]
    killed = [m for m in members if m["status"] == "training"]
    spares = [m for m in members if m["joined_at_step"] == SPARE_AT]
    assert len(survivors) == WORLD - 1 and len(killed) == 1 and len(spares) == 1, members
    assert {m["launcher_rank"] for m in survivors} == {1, 2} and killed[0]["launcher_rank"] == 0
    # The spare was started with the job, before the fault: the agent says how long it waited.
    said = re.search(rf"\(pid {killed[0]['pid']}\) killed by SIGKILL; the others go on, warm "
                     rf"spare pid {spares[0]['pid']} \((?:forked from the warm process, )?"
                     r"waiting for ([0-9.]+) s[,)]", stderr)
    assert said is not None and float(said.group(1)) > 0, stderr[-3000:]
    assert spares[0]["status"] == "finished" and spares[0]["step"] == STEPS
    # One recovery each, its stall recorded (last commit before the kill to the first after).
    stalls = [m["stalls_s"] for m in survivors]
    assert all(len(s) == 1 and 0 < s[0] < 60 for s in stalls), stalls
    print(f"stall with a warm spare (s): {stalls}")
    # Step 6 redone: the survivors' two shares held from before the fault, the lost one's
    # share (a third of the global batch) trained again, by the spare alone.
    redo = [{"step": SPARE_AT + 1, "held": 2 * BATCH, "trained": BATCH}]
    assert [m["redone"] for m in survivors + spares] == [redo] * WORLD, members
    sha = [json.loads((d / "summary.json").read_text())["param_sha256"] for d in (run_dir, clean)]
    assert sha[0] == sha[1]
    # The lost rank 0 wrote metrics.jsonl up to step 4; the spare, rank 0 since, took it over
    # at step 6 and wrote the end's files.
    assert spares[0]["rank"] == 0 and killed[0]["rank"] == 0
    assert _logged_steps(run_dir) == [2, 4, 6, 8, 10], (run_dir / "metrics.jsonl").read_text()
    took_over = f"rank 0 now (pid {spares[0]['pid']}): writes metrics.jsonl from step 6 on"
    assert took_over in stderr, stderr[-3000:]
    assert (run_dir / "report.png").exists() and (run_dir / "model.safetensors").exists()
    assert_fault_free_history(_history(run_dir), _history(clean), steps=STEPS,
                              global_batch=BATCH * WORLD)
    # No process of the job is left: workers, the spare let in, the spare started after it.
    for pid in {int(p) for p in re.findall(r"pid (\d+)", stderr)}:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_spare_waits_and_trains_in_a_memory_cgroup_of_its_own(runs):
    if not MEMORY:
        pytest.skip(f"cannot make a memory cgroup here: {NO_MEMORY_WHY}")
    run_dir, stderr = runs["spared"]
    spare = next(m for m in live_members(run_dir) if m["joined_at_step"] == SPARE_AT)
    taken = (rf"warm spare pid {spare['pid']} \((?:forked from the warm process, )?waiting "
             r"for [0-9.]+ s, memory cgroup spare1\)")
    assert re.search(taken, stderr), stderr[-3000:]
    # The launcher's report: each cgroup's peak. Spare 1's holds the model and the steps it
    # trained in rank 0's place (charged there, not to a worker's cgroup; torch's pages it
    # shares with the warm process it was forked from stay that one's); the spare started
    # after it may have been killed before it built anything at the end.
    said = re.search(r"peak memory per worker under --memory-limit 3.00 GiB: (.*)", stderr)
    assert said is not None, stderr[-3000:]
    peaks = {name: int(mib) for name, mib in re.findall(r"(rank \d|spare \d) (\d+) MiB",
                                                         said.group(1))}
    assert {"rank 0", "rank 1", "rank 2", "spare 1"} <= set(peaks), said.group(1)
    assert peaks["spare 1"] > 100, said.group(1)


@pytest.mark.parametrize("argv, said", [
    (["--grad-compress", "fp16"], "--grad-compress fp16 is a hook on DDP's wrapper"),
    (["--max-restarts", "2"], "replaces a lost worker instead of restarting the job"),
])
def test_live_is_refused_before_launch_with_the_reason_and_the_fix(argv, said):
    from ringtrain.cli.train_args import check_args, parse_options

    with pytest.raises(ValueError, match="drop") as e:
        check_args(parse_options(["--live", "--nproc-per-node", "3", *argv]), world_size=3)
    assert said in str(e.value)
    for fine in ([], ["--strategy", "localsgd"], ["--strategy", "diloco"],  # ddp, the rounds,
                 *(["--strategy", "zero", "--zero-stage", s] for s in "123")):  # ZeRO, any stage
        check_args(parse_options(["--live", "--nproc-per-node", "3", *fine]), world_size=3)
    with pytest.raises(ValueError, match="--live-wait 5 needs --live"):
        check_args(parse_options(["--live-wait", "5"]), world_size=3)
    with pytest.raises(ValueError, match="--live-spares 1 needs --live"):
        check_args(parse_options(["--live-spares", "1"]), world_size=3)
    with pytest.raises(ValueError, match="--live-dead-after 2 needs --live"):
        check_args(parse_options(["--live-dead-after", "2"]), world_size=3)
    with pytest.raises(ValueError, match="--live-dead-after 0: .* more than 0"):
        check_args(parse_options(["--live", "--nproc-per-node", "3", "--live-dead-after", "0"]),
                   world_size=3)


def test_the_live_launcher_refuses_restarts():
    from ringtrain.launch.launcher import launch

    with pytest.raises(ValueError, match="live mode replaces workers in place"):
        launch("x.py", [], nproc_per_node=2, max_restarts=1, live=True)
