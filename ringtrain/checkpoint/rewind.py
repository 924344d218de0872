"""Going back to an earlier snapshot on purpose: the later ones are set aside, never deleted.

    committed_steps(root)                        # [200, 400, 600]: what there is to go back to
    check_step(root, 400)                        # cheap, before a launch: a ValueError naming them
    set_aside_after(root, 400, into=DIR, move=[...], copy=[...])   # rank 0, before any resume
    set_aside([RUN_DIR/snapshots, RUN_DIR/metrics.jsonl, ...], into=DIR)  # a run started afresh

A resume takes the newest committed snapshot (`SnapshotManager.latest`), and a save of a step
below an intact later snapshot is refused (`commit.newer_than`): so a run that goes on from an
earlier step (a loss spike after it, a bug fixed since) first moves the later snapshots out of the
snapshot directory. They go whole into `into` (`ringtrain train --resume-from STEP`: RUN_DIR/
set-aside/after-STEP-<time>/), where no resume looks (`snap_dirs` reads `root/snap-*` only), with
what the caller names of the abandoned run: files to move (its final model and summary, which
describe a run that is no longer the directory's) and files to copy (its metrics.jsonl, which the
resumed run trims to STEP and goes on writing).

Before anything moves, the snapshot of `step` is verified (every file against its checksum): a
corrupt one would make the resume fall back to an older step without being asked. Each move is a
rename in the same filesystem, newest step first; a crash in the middle leaves every snapshot whole,
either still in `root` or in `into`, and the same request made again moves the rest.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ringtrain.checkpoint.files import (
    COMMITTED,
    SnapshotError,
    fsync_dir,
    read_manifest,
    snap_dirs,
    snap_step,
    verify,
)

#: RUN_DIR/set-aside/<name>: `--no-resume`'s (a whole run, its snapshots/ inside) begin with
#: this; `--resume-from STEP`'s are after-STEP-<time> (the later snap-* directories themselves).
FRESH_PREFIX = "fresh-"
#: ... and a finished run's end (summary, final model), set aside when it goes on for more steps:
#: end-STEP-<time> (`cli/run_dir_setup._set_aside_end`).
END_PREFIX = "end-"


def committed_steps(root: str | os.PathLike) -> list[int]:
    """The steps of the committed snapshots under `root`, oldest first (checksums not read)."""
    return sorted(snap_step(p) for p in snap_dirs(Path(root)) if (p / COMMITTED).is_file())


def _listing(root: Path) -> str:
    steps = committed_steps(root)
    return (f"its committed snapshots are of steps {', '.join(map(str, steps))}" if steps
            else "it holds no committed snapshot")


def check_step(root: str | os.PathLike, step: int) -> None:
    """A ValueError when `root` has no committed snapshot of `step`, naming the steps it has.

    Cheap (no checksum read): for the launcher, before any worker starts; `set_aside_after`
    verifies the files."""
    root = Path(root)
    if not (root / f"snap-{step:08d}" / COMMITTED).is_file():
        raise ValueError(f"--resume-from {step}: {root} has no committed snapshot of step "
                         f"{step}; {_listing(root)} (--keep N keeps the newest N)")


def set_aside_after(root: str | os.PathLike, step: int, *, into: str | os.PathLike,
                    move: tuple[str | os.PathLike, ...] | list = (),
                    copy: tuple[str | os.PathLike, ...] | list = ()) -> list[Path]:
    """Rank 0, before any rank resumes or saves: move the snapshots of steps after `step`
    (committed or not) into `into`, with the files in `move` that exist; copy those in `copy`.

    Returns the snapshot directories moved (their new paths), newest first; nothing is made or
    moved when there are none. Raises ValueError when the snapshot of `step` is missing or does
    not match its checksums (nothing moved): the resume would not take it.
    """
    root, into = Path(root), Path(into)
    check_step(root, step)
    here = root / f"snap-{step:08d}"
    try:
        verify(here, read_manifest(here))
    except SnapshotError as e:
        raise ValueError(f"--resume-from {step}: the snapshot {here} is damaged ({e}); "
                         f"{_listing(root)}: choose another") from None
    later = [p for p in snap_dirs(root) if snap_step(p) > step]
    if not later:
        return []
    into.mkdir(parents=True, exist_ok=True)
    for f in copy:
        if os.path.isfile(f):
            shutil.copy2(f, into / Path(f).name)
    set_aside(list(move), into=into)
    # newest first (snap_dirs' order): what stays in root is always a whole, earlier run
    return set_aside(later, into=into)


def set_aside(paths: list[str | os.PathLike], *, into: str | os.PathLike) -> list[Path]:
    """Move each of `paths` that exists (a file, or a directory whole: a snapshot directory
    with everything in it) into `into`, made only when something moves. Returns the new paths.

    `ringtrain train --no-resume`: the earlier run in RUN_DIR is kept, out of the way of the
    new one (a resume looks in RUN_DIR/snapshots/ only), not deleted.
    """
    into = Path(into)
    moved, left = [], set()
    for p in map(Path, paths):
        if p.exists():
            into.mkdir(parents=True, exist_ok=True)
            os.replace(p, into / p.name)  # a rename: the same filesystem, whole or not at all
            moved.append(into / p.name)
            left.add(p.parent)
    for d in {into, *left} if moved else ():
        fsync_dir(d)
    return moved
