"""Live recovery on gloo and the CPU: survivors keep training, a replacement heals from a peer.

    .venv/bin/pytest -q tests/test_live.py

Five jobs run side by side in one start of 16 processes (a job's wall time is mostly its
fault's detection, so running them together costs one job's time), on one store hosted here,
in the test's process (never in a member, which may die):
- "clean": the fault-free run, the reference;
- "kill_spare": member 1 SIGKILLs itself at step 3; a spare, waiting from the start, takes its
  rank before the step is redone, so the run ends with the clean run's parameters, bit for bit;
- "kill": the same kill, no spare: two members finish the run, each step on the same global
  batch, the loss within 1e-4 of the clean run's;
- "kill_marked" (4 members, dead_after_s 16): the same kill, marked `departed/{uid}` as an agent
  does when it sees its worker exit: every survivor gives up the step's all-reduce at once,
  also one waiting on a live peer, not a heartbeat bound later;
- "hang": member 1 SIGSTOPs itself at step 3 (found by its silent heartbeat within ~1 s, inside
  the all-reduce, not by the group's 20 s collective timeout); a replacement started once the
  survivors have moved on is let in at a later step boundary;
- "slow" (2 members): member 1 sleeps 2.5 s (past the 1 s heartbeat bound) before its step's
  all-reduce: its heartbeat thread still beats, so nobody is declared lost;
- "bug" (2 members): the step raises on every member; nobody is lost, so after one redo the
  error comes out of `train_live` on both, as `LiveRecoveryError`.
Every member appends each committed step's sample ids and loss to its own file, so the ids of
a member that was killed are counted too: every job's steps hold the clean run's samples, each
once. The records, not the members' word, prove exactly-once. The members sum their gradients
with `LiveGradients`: the redo of the faulted step trains only the lost member's share (the
spare alone, or split over the two survivors), each record saying how many samples it trained.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ringtrain.live import (
    GlobalBatches,
    LiveGradients,
    LiveGroup,
    LiveRecoveryError,
    LiveState,
    train_live,
)
from ringtrain.testing import WorkerError, run_workers

# The task, model and optimizer the netns member script trains too (tests/test_live_link.py).
sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import live_member  # noqa: E402

N, BATCH, STEPS = live_member.N, live_member.BATCH, live_member.STEPS  # 60, 12, 8
FAULT_STEP, WORLD = 3, 3  # 5 steps per epoch: the run crosses one
JOBS = {"clean": (None, 3), "kill_spare": ("kill", 4), "kill": ("kill", 3), "hang": ("stop", 4),
        "bug": ("bug", 2), "slow": ("slow", 2), "kill_marked": ("kill_marked", 4)}
MARKED_DEAD_AFTER_S = 16.0  # kill_marked's heartbeat bound: far past what its stall may take
FAULTS = ("kill", "stop", "kill_marked")  # the member faulting dies or freezes


def _sha(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for v in model.state_dict().values():
        h.update(v.numpy().tobytes())
    return h.hexdigest()


def _member(rank, world_size, port, records_dir, plan):
    job, fault, late = plan[rank]
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    if late:  # a replacement started after the survivors committed a step without the victim
        store.wait([f"{job}/recovered"])
    x, y = live_member.data()
    model = live_member.model()
    # SGD with momentum by hand: torch.optim's construction imports torch._dynamo (~4 s of CPU
    # per process; 14 processes here). Its buffers are state a replacement must heal.
    optimizer = live_member.Momentum(model.parameters())
    state = LiveState(model, optimizer, GlobalBatches(N, BATCH, seed=1))
    group = LiveGroup(store, {"bug": 2, "slow": 2, "kill_marked": 4}.get(job, WORLD), name=job,
                      timeout_s=20, heartbeat_s=0.1,
                      dead_after_s=MARKED_DEAD_AFTER_S if job == "kill_marked" else 1)
    store.add(f"{job}/registered", 1)  # beaten once: from here on it may be let in
    if late:
        store.set(f"{job}/spare_ready", b"1")  # registered: let in at the next step boundary
    records = open(Path(records_dir) / f"{job}-{group.uid}.jsonl", "a")  # noqa: SIM115
    generations = []
    gradients = LiveGradients(model)
    trained = {}  # step -> samples the last attempt at it trained (a redo: the unheld ones)

    def step(ids, process_group):
        if fault == "bug" and state.step == 2:  # the job's own error, on every member
            raise RuntimeError("a bug in the step, not a lost peer")
        if fault == "slow" and state.step == FAULT_STEP and group.rank == 1:
            time.sleep(2.5)  # the other member waits in the all-reduce meanwhile
        if (fault in FAULTS and state.step == FAULT_STEP and group.rank == 1
                and store.compare_set(f"{job}/fault", "", str(os.getpid())) == str(os.getpid())
                .encode()):
            _wait_for_count(store, f"{job}/committed_before_fault", group.size)
            # and every process started with the job is registered (kill_spare's spare too)
            _wait_for_count(store, f"{job}/registered", JOBS[job][1] - (job == "hang"))
            store.set(f"{job}/fault_at", str(time.monotonic()))  # one clock for the host
            if fault == "kill_marked":  # what the agent writes once it sees this process exit
                dist.PrefixStore(f"ringtrain/live/{job}", store).set(f"departed/{group.uid}",
                                                                     b"1")
            os.kill(os.getpid(), signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
        trained[state.step] = len(ids)
        return live_member.train_step(model, optimizer, x, y, ids, process_group, gradients)

    def on_commit(done, result):
        # The samples this member's part of the step covers: after a fault, those it held
        # from before it and those it trained again (`trained`).
        records.write(json.dumps({"step": done, "loss": result[0], "ids": gradients.ids,
                                  "trained": trained[done], "at": time.monotonic()}) + "\n")
        records.flush()
        generations.append((group.generation, group.size))
        if done == FAULT_STEP - 1 and fault in FAULTS:  # see `_wait_for_count`
            store.add(f"{job}/committed_before_fault", 1)
        if done == FAULT_STEP and fault:  # the interrupted step, redone and committed
            store.set(f"{job}/recovered", b"1")
        if done == FAULT_STEP + 1 and fault == "stop":  # the replacement comes in at step 5
            store.wait([f"{job}/spare_ready"])

    pid = os.getpid()
    try:
        joined = train_live(group, state, step, STEPS, on_commit=on_commit, gradients=gradients)
    except LiveRecoveryError as e:
        return {"job": job, "error": str(e), "step": state.step}
    if fault == "stop" and joined and group.rank == 0:  # the agent would reap the frozen one
        os.kill(int(store.get(f"{job}/fault")), signal.SIGKILL)
    loops = _gloo_loops(settle_s=10.0 if fault == "kill" and joined else 0.0)
    return {"job": job, "joined": joined, "pid": pid, "pid_now": os.getpid(), "uid": group.uid,
            "generations": generations, "sha": _sha(model), "step": state.step,
            "healed_bytes": group.last_heal.nbytes if group.last_heal else 0, "loops": loops}


def _wait_for_count(store: dist.Store, key: str, count: int, within_s: float = 30.0) -> None:
    """Wait until `count` members have added to `key`: the victim faults in step FAULT_STEP
    once every member has committed the step before it. Without it, under load, the victim
    could commit that step (its all-reduce done, its `on_commit` run), mark itself departed
    and die while a slower peer was still in the same all-reduce, which the mark cuts: the
    survivors then redo that step without it (each sample once among them, as they must),
    but the victim's record of it, its local commit, would count its samples a second time
    here and the redo would not be at FAULT_STEP (seen once in a full suite, session 23).
    The same for a spare started with the job: under load it was not yet registered when the
    victim died, and the survivors redid the step without it (1 of 10 runs under two burners)."""
    deadline = time.monotonic() + within_s
    while store.add(key, 0) < count and time.monotonic() < deadline:
        time.sleep(0.01)


def _gloo_loops(settle_s: float) -> int:
    """This process's gloo event-loop threads (one per group alive), after up to `settle_s` for
    the past generations' groups to be released (ringtrain.live.watched.RetiredGroups): after
    `train_live` has returned, none is left."""
    deadline = time.monotonic() + settle_s
    while True:
        tasks = Path(f"/proc/{os.getpid()}/task")
        loops = sum(1 for t in tasks.iterdir()
                    if _read(t / "comm").strip() == "gloo_tcp_loop")
        if loops == 0 or time.monotonic() > deadline:
            return loops
        time.sleep(0.1)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:  # a thread that ended meanwhile
        return ""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    records_dir = tmp_path_factory.mktemp("live")
    # (job, fault, started late): the hang job's last process is its late replacement
    plan = [(job, fault, job == "hang" and i == n - 1)
            for job, (fault, n) in JOBS.items() for i in range(n)]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    faulty = [r for r, (job, fault, _) in enumerate(plan) if fault in FAULTS]
    try:
        results = run_workers(_member, len(plan), args=(store.port, str(records_dir), plan),
                              init=False, timeout_s=90, tolerate=faulty)
    except (TimeoutError, WorkerError) as e:  # which job the ranks named belong to
        raise AssertionError(f"{e}\nranks by (job, fault, late): {dict(enumerate(plan))}") from e
    by_job: dict[str, list] = {job: [] for job in JOBS}
    for (job, _, _), result in zip(plan, results, strict=True):
        by_job[job].append(result)
    steps: dict[str, dict[int, list]] = {job: {} for job in JOBS}  # step -> its records
    for path in sorted(records_dir.glob("*.jsonl")):
        job = path.name.rsplit("-", 1)[0]
        for line in path.read_text().splitlines():
            record = json.loads(line)
            steps[job].setdefault(record["step"], []).append(record)
    fault_at = {job: float(store.get(f"{job}/fault_at")) for job, (fault, _) in JOBS.items()
                if fault in FAULTS}
    return by_job, steps, fault_at


def _finished(results):
    return [r for r in results if r is not None and r["joined"]]


def test_the_clean_run_trains_every_step_on_three_members(run):
    by_job, _, _ = run
    clean = _finished(by_job["clean"])
    assert len(clean) == 3 and {r["generations"][-1] for r in clean} == {(0, 3)}
    assert len({r["sha"] for r in clean}) == 1


@pytest.mark.parametrize("job", ["kill_spare", "kill", "hang"])
def test_the_survivors_finish_in_their_own_processes(run, job):
    by_job, _, _ = run
    assert sum(r is None for r in by_job[job]) == 1, "one member, the victim, died"
    finished = _finished(by_job[job])
    assert len(finished) == 3 if job != "kill" else 2
    for r in finished:
        assert r["pid_now"] == r["pid"] and r["step"] == STEPS
    survivors = [r for r in finished if r["generations"][0][0] == 0]
    assert len(survivors) == 2  # the two that were members from the start; none restarted
    assert len({r["sha"] for r in finished}) == 1, "the members end with the same weights"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_the_survivors_release_the_dead_generations_group(run):
    # A group whose peer died, kept, spins gloo's event loop on its broken connections (20-90 %
    # of a core per survivor in benchmarks/live_recovery.py): it is released once idle, and the
    # last generation's at the end of the run.
    survivors = _finished(run[0]["kill"])
    assert survivors and [r["loops"] for r in survivors] == [0] * len(survivors), survivors


def test_a_spare_that_takes_the_dead_members_rank_ends_with_the_fault_free_weights(run):
    by_job, _, _ = run
    clean_sha = _finished(by_job["clean"])[0]["sha"]
    finished = _finished(by_job["kill_spare"])
    assert {r["sha"] for r in finished} == {clean_sha}
    spare = [r for r in finished if r["generations"][0][0] != 0]
    assert len(spare) == 1 and spare[0]["generations"][0] == (1, 3)  # let in at the redo
    assert spare[0]["healed_bytes"] > 0  # from a peer's memory, not from disk


def test_a_replacement_is_let_in_at_a_later_step_boundary(run):
    by_job, _, _ = run
    late = [r for r in _finished(by_job["hang"]) if r["generations"][0][0] != 0]
    assert len(late) == 1
    generation, size = late[0]["generations"][0]
    assert generation == 2 and size == 3  # 0: three members, 1: the survivors, 2: healed


@pytest.mark.parametrize("job", ["kill_spare", "kill", "hang"])
def test_every_step_trains_the_fault_free_samples_once_with_its_loss(run, job):
    _, steps, _ = run
    assert sorted(steps[job]) == sorted(steps["clean"]) == list(range(STEPS))
    for s in range(STEPS):
        ids = Counter(i for record in steps[job][s] for i in record["ids"])
        clean = Counter(i for record in steps["clean"][s] for i in record["ids"])
        assert ids == clean and set(ids.values()) == {1}, f"step {s}: not the clean run's batch"
        assert sorted(ids) == sorted(GlobalBatches(N, BATCH, seed=1).batch(s))
        clean_loss = steps["clean"][s][0]["loss"]
        for record in steps[job][s]:
            assert record["loss"] == pytest.approx(clean_loss, abs=1e-4), f"step {s}"
    fewer = [s for s in range(STEPS) if len(steps[job][s]) == 2]
    assert FAULT_STEP in fewer if job != "kill_spare" else fewer == []


@pytest.mark.parametrize("job, trained", [("kill_spare", [0, 0, BATCH // WORLD]),
                                          ("kill", [BATCH // WORLD // 2] * 2)])
def test_the_redo_of_the_faulted_step_trains_only_the_lost_share(run, job, trained):
    # The survivors hold their shares of the step from before the kill (`LiveGradients`): the
    # spare in the lost member's place trains its share alone, or the two survivors split it.
    _, steps, _ = run
    assert sorted(r["trained"] for r in steps[job][FAULT_STEP]) == trained
    for s in set(range(STEPS)) - {FAULT_STEP}:
        assert {r["trained"] for r in steps[job][s]} == {len(steps[job][s][0]["ids"])}


def test_a_member_that_is_slow_but_beats_is_not_taken_for_a_lost_one(run):
    by_job, steps, _ = run
    for r in by_job["slow"]:
        assert r["step"] == STEPS and r["generations"] == [(0, 2)] * STEPS
    for s in range(STEPS):
        assert len(steps["slow"][s]) == 2
        assert steps["slow"][s][0]["loss"] == pytest.approx(steps["clean"][s][0]["loss"], abs=1e-4)


def test_a_failure_that_loses_no_member_is_redone_once_then_raised_on_every_member(run):
    by_job, steps, _ = run
    for r in by_job["bug"]:  # not retried forever, not hung: both members raise, at step 2
        assert r["step"] == 2
        assert "step 2 failed on uid" in r["error"] and "2 times in a row" in r["error"]
        assert "every member ([0, 1]) is still in the job" in r["error"]
        assert "a bug in the step, not a lost peer" in r["error"]
    assert sorted(steps["bug"]) == [0, 1]


@pytest.mark.parametrize("job", ["kill_spare", "kill", "hang"])
def test_the_stall_is_the_detection_bound_not_a_restart(run, job):
    # From the fault to the redone step's commit: about dead_after_s (1 s) after a kill or a
    # hang, plus a group build, a heal and a step. Printed with -s; the bound is loose, for a
    # loaded 2-core host, but below the 20 s collective timeout a hang would otherwise wait.
    _, steps, fault_at = run
    stall = min(r["at"] for r in steps[job][FAULT_STEP]) - fault_at[job]
    print(f"{job}: {stall:.2f} s from the fault to step {FAULT_STEP} committed again")
    assert 0 < stall < 15


def test_a_kill_its_agent_marked_departed_is_given_up_at_once_by_every_survivor(run):
    # 4 members, heartbeat bound 16 s: a survivor whose all-reduce waits on a live peer, not on
    # the dead one, used to learn of the kill only at that bound, and the regroup waited for it
    # (benchmarks/live_recovery.py: 0.7 s of a kill's 2 s stall at a 1 s bound). A departed
    # member now fails every survivor's collective within a heartbeat period.
    by_job, steps, fault_at = run
    finished = _finished(by_job["kill_marked"])
    assert len(finished) == 3 and all(r["pid_now"] == r["pid"] for r in finished)
    assert {r["step"] for r in finished} == {STEPS} and len({r["sha"] for r in finished}) == 1
    for s in range(STEPS):
        ids = sorted(i for record in steps["kill_marked"][s] for i in record["ids"])
        assert ids == sorted(GlobalBatches(N, BATCH, seed=1).batch(s)), f"step {s}"
    stall = min(r["at"] for r in steps["kill_marked"][FAULT_STEP]) - fault_at["kill_marked"]
    print(f"kill_marked: {stall:.2f} s from the kill to step {FAULT_STEP} committed again")
    assert 0 < stall < MARKED_DEAD_AFTER_S / 2, (
        f"{stall:.2f} s: a survivor waited out the heartbeat bound ({MARKED_DEAD_AFTER_S} s) "
        "instead of reading departed/")
