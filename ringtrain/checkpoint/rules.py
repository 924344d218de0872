"""The rules of a resume, as plain functions: what must match (`check_options`: the options,
the tokenizer, --steps, --new-schedule), how the global batch is kept, and after which steps a
snapshot is taken.

    elastic_batch(64, 3, 8, saved_data_world_size=2)   # ConfigError: 64 is not a multiple of 3
    config_differences({"lr": 0.001}, {"lr": 0.002})   # ["--lr 0.001 in the snapshot, 0.002 now"]
    snapshot_due(7, every=5, steps=7)                  # True: the last step has one

Apart from `Checkpointer` (`resume.py`), which applies them, because they need no process, no
store and no file: each is unit-tested on its own (`.venv/bin/pytest -q tests/test_elastic.py`).
`reseed` touches only this process's random generators: the (seed, rank, step) rule an elastic
resume seeds them by.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import torch

from ringtrain.errors import ConfigError

__all__ = ["config_differences", "elastic_batch", "reseed", "snapshot_due"]


def snapshot_due(step: int, *, every: int, steps: int) -> bool:
    """Whether the trainer saves a snapshot after `step` (1-based) of a `steps`-step run: every
    `every` steps and after the last one (0: never). The last: a finished run with none (a
    run shorter than --snapshot-every) could be neither extended nor run again without
    training over its results from step 0."""
    return every > 0 and (step % every == 0 or step == steps)


def elastic_batch(global_batch: int, data_world_size: int, batch_size: int, *,
                  saved_data_world_size: int) -> tuple[int, int]:
    """(batch_size, grad_accum) per rank that keep `global_batch` on `data_world_size` ranks.

    Keeps `batch_size` and changes grad_accum when that divides evenly; otherwise takes the
    largest per-rank micro-batch up to `batch_size` (memory stays within what was asked) that
    divides this rank's share. Raises ValueError naming both world sizes when the global batch
    cannot be split evenly over the new number of ranks.
    """
    if global_batch % data_world_size:
        fits = [w for w in range(1, global_batch + 1) if global_batch % w == 0][:8]
        raise ConfigError(
            f"cannot keep the global batch of {global_batch} samples per step (set when the run "
            f"started, on {saved_data_world_size} data ranks) on {data_world_size} data ranks: "
            f"{global_batch} is not a multiple of {data_world_size}. Resume on a number of data "
            f"ranks that divides {global_batch} (e.g. {', '.join(map(str, fits))}), or start "
            "afresh with --no-resume"
        )
    per_rank = global_batch // data_world_size
    if per_rank % batch_size == 0:
        return batch_size, per_rank // batch_size
    accum = next(a for a in range(1, per_rank + 1)
                 if per_rank % a == 0 and per_rank // a <= batch_size)
    return per_rank // accum, accum


def check_options(path: str, step: int, saved: dict[str, Any], now: dict[str, Any],
                  trainer_config: Any, steps: int) -> list[str]:
    """Refuse the snapshot at `path`, of `step`, saved with other options than `now` (naming
    them), but let `--steps` change: a run extended (or shortened) follows the schedule of its
    new length (`lr_at`); and with `trainer_config.new_schedule`, the learning-rate schedule.
    Returns that schedule's changes (what --new-schedule takes), for the caller to say.
    `trainer_config`: the run's `TrainerConfig` (its `resume_view`, `schedule_names`)."""
    saved, now, where = dict(saved), dict(now), f"{path} (step {step})"
    for c in (saved, now):  # the strategy may change: its layout is compared when loading
        c.pop("strategy", None)
    if changed := tokenizer_change(saved, now):
        raise ConfigError(f"{where}: {changed}")
    schedule = schedule_changes(trainer_config.resume_view(saved, new_schedule=False), now,
                                trainer_config.schedule_names())
    diffs = config_differences(trainer_config.resume_view(saved), now)
    if diffs:
        raise ConfigError(
            f"{where} was saved by a run with other options: {'; '.join(diffs)}. Resume with "
            "the snapshot's options"
            + (", add --new-schedule to train on with this command's learning rates from step "
               f"{step}" if set(diffs) <= set(schedule) else "")
            + ", or start afresh with --no-resume (the earlier run is set aside) or in another "
            "--run-dir")
    if steps < step:
        raise ConfigError(
            f"--steps {steps} is before the snapshot's step {step} ({path}): a "
            f"resumed run goes on from it; use --steps {step} or more, or start afresh with "
            "--no-resume or in another --run-dir")
    return schedule


def schedule_changes(saved: dict[str, Any], now: dict[str, Any], names: tuple[str, ...]
                     ) -> list[str]:
    """`config_differences` among `names` only (the schedule's: `config.schedule_fields`)."""
    return config_differences({k: v for k, v in saved.items() if k in names},
                              {k: v for k, v in now.items() if k in names})


def config_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The options whose values differ, as `--name saved (snapshot) vs now` lines.

    A key one side lacks is that option at its default: a run config leaves out an option
    added later (a snapshot from before it ran as its default) or one at a default that keeps
    older snapshots resuming (`--pad-vocab 1`)."""
    now = json.loads(json.dumps(now))  # the saved side went through JSON: compare like with like
    missing = object()
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key, missing), now.get(key, missing)
        if a != b:
            show = [("(the default)" if v is missing else _shown(v, b if v is a else a))
                    for v in (a, b)]
            out.append(f"--{key.replace('_', '-')} {show[0]} in the snapshot, {show[1]} now")
    return out


def _shown(value: Any, other: Any) -> str:
    """A float as the user would type it (0.0003, not 0.00030000000000000003: --min-lr is
    --lr / 10) where that still tells it from `other`; anything else as repr."""
    if isinstance(value, float) and isinstance(other, float) and f"{value:.6g}" != f"{other:.6g}":
        return f"{value:.6g}"
    return repr(value)


TOKENIZER = "tokenizer"  # a run_config key: the data's tokenizer ("char, 29 tokens, 3f2a...")


def tokenizer_change(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """Take the tokenizer out of both configs; say how it changed, if it did. A snapshot from
    before it was recorded has none: nothing to compare."""
    theirs, ours = saved.pop(TOKENIZER, None), now.pop(TOKENIZER, None)
    if theirs is None or ours is None or theirs == ours:
        return None
    return (f"the data's tokenizer is not the one the snapshot's model was trained with ({theirs}"
            f" then, {ours} now): the data changed since (a text edited, or --data another "
            "dataset), and every token id would mean another token. Resume with the data it was "
            "trained on, or start afresh with --no-resume or in another --run-dir")


def reseed(seed: int, rank: int, step: int) -> None:
    """Fresh Python, NumPy and torch generators for `rank` from (seed, rank, step)."""
    a, b = np.random.SeedSequence([seed, rank, step]).generate_state(2)
    random.seed(int(a))
    np.random.seed(int(a))
    torch.manual_seed(int(b))
