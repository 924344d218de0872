"""`ringtrain train --live` for local SGD and DiLoCo (CLI, gloo, CPU, 3 workers, a tiny GPT).

    RINGTRAIN_FULL=1 .venv/bin/pytest -q tests/test_live_rounds.py   # localsgd too

Their replicas meet every `--sync-every` H = 4 steps; the meetings are the commit points
(`ringtrain.strategies.localsgd_live`). One faulted run and its fault-free reference
per strategy, all started together; both faults hit the second round (steps 5 to 8):
- after step 5, launcher rank 1 is killed (SIGKILL): the survivors find it in an inner step
  (step 6's sample-record all-gather), go back to the meeting of step 4, wait for the
  replacement (`--live-wait 60`) and redo the round's steps 5 and 6 with it;
- after step 7, launcher rank 2 is killed: found inside step 8's meeting (its all-reduce), the
  round is redone from step 4 once more, with a second replacement;
- launcher rank 0's process trains every step; each replacement joins at the commit of step 4
  and heals from a live peer (model, the last meeting's weights, DiLoCo's anchor and outer
  momentum, the step count in the period, the sample history);
- the committed sample history is the fault-free run's: every step the same global batch,
  each sample once.
- the final `param_sha256` is the fault-free run's: each replacement took the lost member's
  inner AdamW moments from the copy its ring successor received at the meeting of step 4, its
  rank and its shares, so the redone round is the fault-free one, bit for bit. (Launcher ranks
  are not the members' ranks: when the two victims are adjacent in the ring, the second one's
  copy was on the first one's replacement, which rebuilt it from its predecessor in its repair.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.faults import fault_env
from support.live_history import assert_fault_free_history, live_members, wait_all

from ringtrain.data.sample_log import SampleLog

slow = pytest.mark.slow  # two CLI jobs of 3 workers each (four with RINGTRAIN_FULL=1)

STEPS, BATCH, WORLD, H = 8, 8, 3, 4
FULL = os.environ.get("RINGTRAIN_FULL") == "1"
STRATEGIES = ["diloco", *(["localsgd"] if FULL else [])]  # diloco's state holds localsgd's
FAULTS = "kill:1:5,kill:2:7"  # an inner step's fault, then a meeting's, both in round 2
COMMIT = 4  # the meeting both faults go back to
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "RINGTRAIN_TEST_FAULT",
                "RINGTRAIN_STEP_HOOK")


def _argv(strategy: str) -> list[str]:
    return ["--strategy", strategy, "--sync-every", str(H), "--nproc-per-node", str(WORLD),
            "--steps", str(STEPS), "--n-layer", "1", "--n-embd", "32", "--batch-size",
            str(BATCH), "--dropout", "0", "--log-every", "2",
            "--eval-every", str(STEPS), "--snapshot-every", str(STEPS), "--threads", "1",
            "--no-progress", "--device", "cpu", "--live", "--live-wait", "60",
            "--record-samples", "--watchdog-timeout", "6", "--no-report"]


def _start(run_dir: Path, strategy: str, fault: str | None,
           record: bool = True) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    if fault:
        env.update(fault_env(fault))
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    argv = [a for a in _argv(strategy) if record or a != "--record-samples"]
    return subprocess.Popen([sys.executable, "-m", "ringtrain", "train", *argv,
                             "--run-dir", str(run_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=run_dir.parent, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("live_rounds")
    procs = {(s, kind): _start(root / f"{s}-{kind}", s, None if kind == "clean" else FAULTS,
                               record=kind != "unrecorded")
             for s in STRATEGIES for kind in ("faulted", "clean", "unrecorded")}
    return wait_all(procs, {key: root / f"{key[0]}-{key[1]}" for key in procs})


def _snapshot(run_dir: Path, part: str) -> dict:
    return torch.load(run_dir / "snapshots" / f"snap-{STEPS:08d}" / part, weights_only=True)


@slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_survivors_redo_the_round_and_each_replacement_heals_at_its_meeting(runs, strategy):
    run_dir, stderr = runs[strategy, "faulted"]
    members = live_members(run_dir)
    by_slot = {(m["launcher_rank"], m["joined_at_step"]): m for m in members}
    assert len(members) == 5, members  # 3 started, 2 replacements
    survivor = by_slot[0, 0]  # trained every step in its own process, recovered twice
    assert survivor["status"] == "finished" and survivor["step"] == STEPS
    assert survivor["recoveries"] == 2, stderr[-4000:]
    assert by_slot[1, 0]["status"] == by_slot[2, 0]["status"] == "training"  # killed
    # Each replacement healed to the meeting of step 4 (the commit), not to a step mid-round.
    assert by_slot[1, COMMIT]["status"] == by_slot[2, COMMIT]["status"] == "finished"
    assert {m["members"] for m in members if m["status"] == "finished"} == {WORLD}
    for slot in (1, 2):
        assert f"(pid {by_slot[slot, 0]['pid']}) killed by SIGKILL" in stderr, stderr[-3000:]
    assert "redoing it from step 4" in stderr, stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == WORLD and summary["steps"] == STEPS
    assert summary["meetings"] == STEPS // H  # the redone rounds met once each, in the end


@slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_sample_history_is_the_fault_free_runs(runs, strategy):
    (faulted, _), (clean, _) = runs[strategy, "faulted"], runs[strategy, "clean"]
    history = SampleLog.from_state(_snapshot(faulted, "shared.pt")["trainer"]["samples"])
    reference = SampleLog.from_state(_snapshot(clean, "shared.pt")["trainer"]["samples"])
    assert_fault_free_history(history, reference, steps=STEPS, global_batch=BATCH * WORLD)


@slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_faulted_run_ends_with_the_fault_free_weights(runs, strategy):
    (faulted, _), (clean, _) = runs[strategy, "faulted"], runs[strategy, "clean"]
    sha = {name: json.loads((d / "summary.json").read_text())["param_sha256"]
           for name, d in (("faulted", faulted), ("clean", clean))}
    assert sha["faulted"] == sha["clean"]
    got, want = (_snapshot(d, "rank0.pt")["strategy"] for d in (faulted, clean))
    assert got["inner_steps"] == want["inner_steps"] == STEPS
    # Rank 0's inner moments (a survivor's) and DiLoCo's anchor and outer momentum, exactly.
    pairs = [(got["optimizer"]["state"], want["optimizer"]["state"])]
    if strategy == "diloco":
        pairs += [(got["outer"]["anchor"], want["outer"]["anchor"]),
                  (got["outer"]["optimizer"]["state"], want["outer"]["optimizer"]["state"])]
    for a, b in pairs:
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_without_a_per_step_collective_each_loss_is_found_at_the_next_step(runs, strategy):
    """No --record-samples: an inner step has no collective until the meeting, and a lost
    member is found by the loop's stop vote after the step it died in; the next step recovers
    at once (`GenerationAgreement.take_failure`), not at the meeting, where both losses would
    be found together, ranks 1 and 2: a member and the only copy of its moments."""
    run_dir, stderr = runs[strategy, "unrecorded"]
    survivor = next(m for m in live_members(run_dir)
                    if m["launcher_rank"] == 0 and m["joined_at_step"] == 0)
    assert survivor["recoveries"] == 2, stderr[-4000:]
    assert "a member was lost after step" in stderr, stderr[-3000:]
    sha = {name: json.loads((runs[strategy, name][0] / "summary.json").read_text())[
        "param_sha256"] for name in ("unrecorded", "clean")}
    assert sha["unrecorded"] == sha["clean"]


def _hooks(rank: int, world_size: int):
    """A set-up one-rank local SGD strategy's live hooks, told it is `rank` of `world_size`."""
    from ringtrain.runtime import Runtime
    from ringtrain.strategies.localsgd import LocalSGDStrategy

    runtime = Runtime(0, 1, 0, "gloo", torch.device("cpu"), None, None)
    strategy = LocalSGDStrategy(runtime, sync_every=H)
    strategy.setup(torch.nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                   torch.nn.functional.mse_loss)
    hooks = strategy.live_hooks()
    return hooks, Runtime(rank, world_size, 0, "gloo", torch.device("cpu"), None, None)


def _moments(momentum: float) -> dict:
    """An SGD state whose momentum buffers hold `momentum` (a member's inner moments)."""
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1, momentum=0.9)
    for p in opt.param_groups[0]["params"]:
        opt.state[p]["momentum_buffer"] = torch.full_like(p, momentum)
    return opt.state_dict()


def _set_moments(hooks, momentum: float) -> None:
    hooks.strategy.optimizer.load_state_dict(_moments(momentum))


@pytest.mark.parametrize("whose, repaired, want_moments, want_slot", [
    ("own", False, 2.0, 1),       # a survivor's restore: its moments, rank and copy
    ("peer", False, 5.0, None),   # a heal: the healer's moments, its own found in a repair
    ("peer", True, 1.0, 1),       # a heal again in the same round: the moments repaired before
])
def test_a_loaded_commit_gives_a_member_its_own_moments_or_marks_them_missing(
        whose, repaired, want_moments, want_slot):
    """In process, no group: what `RoundLiveHooks.load_state_dict` keeps of a commit."""
    hooks, runtime = _hooks(1, 3)
    assert [hooks.commits_at(s) for s in (0, 3, 4, 8)] == [True, False, True, True]
    if repaired:  # moments received in an earlier repair, for this same commit (0 steps)
        hooks.repaired = (0, 1, _moments(1.0))
    committer = hooks if whose == "own" else _hooks(0, 3)[0]
    _set_moments(committer, 2.0 if whose == "own" else 5.0)
    state = {**committer.state_dict(), "slot_rank": 1, "commit_size": 3, "buddy": _moments(0.0),
             "buddy_of": 0}
    _set_moments(hooks, 9.0)  # moved on since the commit
    hooks.load_state_dict(state)
    hooks.on_members(runtime)
    buffers = [s["momentum_buffer"] for s in hooks.strategy.optimizer.state.values()]
    assert buffers and all(torch.equal(b, torch.full_like(b, want_moments)) for b in buffers)
    assert hooks.slot_rank == want_slot and hooks.commit_size == 3
    assert (hooks.buddy_of == 0) == (whose == "own")  # a peer's copy is not this member's
    assert hooks.strategy.runtime is runtime
