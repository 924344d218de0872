"""benchmarks/chaos.py's report: one chaos run against its fault-free run, in figures.

Not run by itself: `.venv/bin/python benchmarks/chaos.py [--live]` (see its docstring).
`report` gives the figures of either path (restart, live); `live_figures` adds what only a live
job can say (whose process trained from where: RUN_DIR/live/PID.json, written by
`ringtrain.training.live`); `stalls` reads the plan's DIR/commits.log; `print_table` prints one
column per path.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path


def report(a, faults, fired, ref, chaos, steps, check, same_history, left, extra) -> dict:
    """The figures of one chaos run (either path) against its fault-free run `ref`."""
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
        "throughput_kept": None if a.anchor_beside else round(ref["wall_s"] / chaos["wall_s"], 3),
        "stall_s": extra["stalls"], "stall_s_median": _median(extra["stalls"]),
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


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 2) if known else None


def stalls(chaos_dir: Path, fired: list[dict]) -> list[float | None]:
    """Each fault's stall: from the step it followed (its own moment) to the first commit of
    the next step after it, by any process (DIR/commits.log). None for `kill-at-start`, which
    follows no step: its cost is in the stall of the fault before it."""
    path = chaos_dir / "commits.log"
    commits = []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if len(parts) == 3:  # a line cut by a kill is dropped
            commits.append((int(parts[0]), float(parts[1])))
    out: list[float | None] = []
    for f in fired:
        step = f.get("fired_step")
        after = [t for s, t in commits if step is not None and s == step + 1 and t > f["unix"]]
        out.append(round(min(after) - f["unix"], 2) if after else None)
    return out


def stall_parts(chaos_dir: Path, fired: list[dict]) -> list[dict | None]:
    """Where each live stall went, for a fault whose worker was replaced (else None):
    `to_start` (the fault to the replacement's exec: detection, the agent's poll, its respawn),
    `start_up` (exec to a built trainer: Python, torch, ringtrain, the model) and `join` (to the
    next step committed: registering, the survivors' new generation, the heal, the step).
    From DIR/starts.log and DIR/commits.log (tests/support/chaos_plan.py)."""
    path = chaos_dir / "starts.log"
    starts = []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if len(parts) == 5 and parts[4] != "0":  # replacements only
            starts.append((float(parts[1]), float(parts[2])))
    out: list[dict | None] = []
    for f, stall in zip(fired, stalls(chaos_dir, fired), strict=True):
        later = sorted(s for s in starts if s[0] > f["unix"])
        if stall is None or not later or f["kind"] == "raise":
            out.append(None)
            continue
        exec_at, ready = later[0]
        out.append({"to_start": round(exec_at - f["unix"], 2),
                    "start_up": round(ready - exec_at, 2),
                    "join": round(f["unix"] + stall - ready, 2)})
    return out


def live_figures(run_dir: Path, log: Path, fired: list[dict], world: int,
                 last_launch_unix: float) -> dict:
    """What a live run says beyond the common figures (see `live_extra` in chaos.py's doc).

    Args:
        run_dir: the run directory (RUN_DIR/live/PID.json: each process's part).
        log: the job's output (the agent's lines on replacements, the snapshots' commits).
        fired: the faults fired (their victims' pids, steps).
        world: the job's world size when whole.
        last_launch_unix: when the last (re)launch of the command started: the records of
            processes that joined before it belong to an earlier job.
    """
    victims = {f["pid"] for f in fired}
    records = []
    for p in sorted((run_dir / "live").glob("*.json")):
        try:
            records.append((p.stat().st_mtime, json.loads(p.read_text())))
        except (OSError, ValueError):  # written by os.replace: a partial file is not expected
            continue
    final = [r for t, r in records if t >= last_launch_unix]
    not_hit = [r for r in final if r["pid"] not in victims]
    text = log.read_text(errors="replace") if log.exists() else ""
    in_save = [f["fired_step"] for f in fired if f["kind"] == "kill-in-save"]
    return {
        # Every process of the final job that no fault hit trained to the end in one process.
        "survivor_pids_unchanged": bool(not_hit) and all(r["status"] == "finished"
                                                         for r in not_hit),
        "survivors": sum(1 for r in not_hit if r["uid"] < world and r["status"] == "finished"),
        "replacements_started": len(re.findall(r"replacement \d+ of at most", text)),
        # A replacement that joined a generation healed from a live peer (never from disk).
        "replacements_healed": sum(1 for _, r in records if r["uid"] >= world),
        "members_at_end": sorted({r["members"] for r in final if r["status"] == "finished"}),
        # The snapshot a kill-in-save hit is never committed (the step is not saved again).
        "in_flight_snapshots_committed": sum(f"snapshot of step {s} (" in text for s in in_save),
    }


ROWS = [  # (label, how to show a report's figure)
    ("faults injected / planned", lambda o: f"{o['faults_injected']} / {o['faults_planned']}"),
    ("faults survived", lambda o: o["faults_survived"]),
    ("by kind (planned, injected)", lambda o: ", ".join(
        f"{k} {v['planned']},{v['injected']}" for k, v in o["by_kind"].items())),
    ("whole-job restarts (relaunches)", lambda o: f"{o['restarts']} ({o['relaunches']})"),
    ("survivors' pids unchanged", lambda o: o.get("survivor_pids_unchanged", "-")),
    ("replacements started / healed", lambda o: f"{o['replacements_started']} / "
                                                f"{o['replacements_healed']}"
     if "replacements_started" in o else "-"),
    ("steps recomputed", lambda o: f"{o['steps_recomputed']} (of {o['steps_trained']} trained)"),
    ("stall per fault (s)", lambda o: " ".join("-" if s is None else f"{s:.1f}"
                                               for s in o["stall_s"])),
    ("median stall (s)", lambda o: o["stall_s_median"]),
    ("stall: start / start-up / join", lambda o: " ".join(
        "-" if p is None else f"{p['to_start']:.1f}/{p['start_up']:.1f}/{p['join']:.1f}"
        for p in o["stall_parts"]) if "stall_parts" in o else "-"),
    ("wall time: chaos / fault-free", lambda o: f"{o['wall_s']} s / {o['fault_free_wall_s']} s"),
    ("throughput kept (goodput)", lambda o: "-" if o["throughput_kept"] is None
     else f"{o['throughput_kept']:.1%}"),
    ("processes left behind", lambda o: o["processes_left"]),
    ("param_sha256 equals fault-free", lambda o: o["param_sha256_equal"]),
    ("samples skipped / repeated", lambda o: f"{(o['samples'] or {}).get('skipped')} / "
                                             f"{(o['samples'] or {}).get('repeated')}"),
    ("history equals fault-free", lambda o: o["history_equals_fault_free"]),
]


def print_table(outs: dict[str, dict]) -> None:
    """One column per path (`live`, `restart`), then each path's notes."""
    names = list(outs)
    print(f"{'':34s}" + "".join(f"{n:>24s}" for n in names))
    for label, show in ROWS:
        cells = [str(show(outs[n])) for n in names]
        if len(names) == 1 or len(max(cells, key=len)) < 24:
            print(f"{label:34s}" + "".join(f"{c:>24s}" for c in cells))
        else:  # too wide for columns: one line per path
            for n, c in zip(names, cells, strict=True):
                print(f"{label + ' (' + n + ')':34s} {c}")
    for n in names:
        for line in outs[n]["notes"] + outs[n]["history_errors"]:
            print(f"note ({n}):", line)
