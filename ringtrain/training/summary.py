"""The end of a run: the replicas' digests compared, the summary, summary.json and report.png.

    sha = agreed_sha256(state_dict, runtime, agreement)   # every rank: a warning if they differ
    summary = run_summary(loop_state, strategy, runtime, config, data_world_size, ...)
    disk_full = write_run_files(run_dir, summary, records, title=..., saved_step=...)  # rank 0

Apart from the step loop (`trainer.py`) because it runs once, after the last step, and only
reads what the loop left: what summary.json says (its keys, in order), how a divergence
between replicas is reported, and how rank 0 writes the files at the end without raising on
a full disk (matplotlib is imported here, on rank 0 only).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from torch import nn

from ringtrain.checkpoint.run_dir import is_no_space, no_space_message
from ringtrain.replicas import divergence
from ringtrain.runtime import Runtime
from ringtrain.strategies.base import Strategy
from ringtrain.training.config import TrainerConfig, param_sha256
from ringtrain.training.progress import write_json
from ringtrain.training.state import RATES, LoopState

__all__ = ["agreed_sha256", "eager_copy", "run_summary", "write_run_files"]

log = logging.getLogger("ringtrain")


def agreed_sha256(state: dict[str, Any], runtime: Runtime, agreement: Any) -> str:
    """`param_sha256` of the final weights, checked across ranks: a warning if they differ."""
    sha = param_sha256(state)
    if runtime.world_size > 1:
        digests = agreement.gather(sha)  # the ranks still in the job
        if len(set(digests.values())) > 1:  # known on every rank: all take part
            where = divergence(state, agreement.gather)
            shas = ", ".join(f"rank {r} {d[:12]}" for r, d in digests.items())
            if runtime.rank == 0:
                log.warning("warning: param_sha256 differs across ranks, the replicas "
                            "diverged: %s; %s", shas, where)
    return sha


def run_summary(st: LoopState, s: Strategy, rt: Runtime, config: TrainerConfig,
                data_world_size: int, eval_names: list[str], *, steps: int, started: float,
                sha: str, gather: Callable[[str], dict[int, str]] | None = None
                ) -> dict[str, Any]:
    """The loop's part of summary.json: results, speed, resumes, the digest, the batch.

    `gather` (a live job's, over the members at the end): the speed is that of the member
    that trained longest. Rank 0 may be a replacement, whose tokens and time count only the
    steps since it joined: not the job's figure.
    """
    tokens, seconds = st.tokens, st.train_time_s
    if gather is not None:
        views = gather(f"{tokens!r} {seconds!r}").values()
        tokens, seconds = max((tuple(map(float, v.split())) for v in views), key=lambda v: v[1])
    summary: dict[str, Any] = {
        "steps": steps, "world_size": rt.world_size, "strategy": s.name,
        "train_loss": st.last.get("loss"), "eval_loss": st.last.get("eval_loss"),
    }
    summary.update({f"eval_{n}": st.last.get(f"eval_{n}") for n in eval_names})
    summary.update({
        RATES[st.unit][0]: tokens / seconds if seconds else 0.0,
        "wall_s": time.time() - started,
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "resumed_from_step": [r["step"] for r in st.resumes], "resumes": st.resumes,
        "param_sha256": sha,
        "compute_s_per_step": st.last.get("compute_s"),
        "comm_s_per_step": st.last.get("comm_s"),
        "seed": config.seed, "dtype": config.dtype,
        "global_batch_size": config.batch_size * config.grad_accum * data_world_size,
    })
    return summary


def write_run_files(run_dir: str, summary: dict[str, Any], records: list[dict[str, Any]], *,
                    title: str, saved_step: int | None, report: bool = True) -> str | None:
    """summary.json and report.png (rank 0; not with `report=False`); a full disk: the message
    (`disk_full`), not raised."""
    try:
        write_json(os.path.join(run_dir, "summary.json"), summary)
        if report:
            from ringtrain.training.report import (
                write_report,  # matplotlib: rank 0 only, at the end
            )

            write_report(records, os.path.join(run_dir, "report.png"), title=title)
    except OSError as e:  # a full disk: said in one message (`disk_full`), not raised
        if not is_no_space(e):
            raise
        return no_space_message(run_dir, "summary.json and report.png", saved_step)
    return None


def eager_copy(model: nn.Module, state: dict[str, Any], *,
               model_fn: Callable[[], nn.Module]) -> nn.Module:
    """A fresh, uncompiled model holding the whole `state`, on `model`'s device, to generate
    from: `model` itself may have been changed by its strategy (tp replaced its layers by their
    slices), and a compiled one would compile again at each new length of the input."""
    eager = model_fn()
    eager.load_state_dict(state)
    return eager.to(next(model.parameters()).device).eval()
