"""The trainer's settings and the small pure helpers it uses: LR schedule, optimizer, seeds, hashes.

    from ringtrain.training.trainer import TrainerConfig, lr_at   # re-exported by the trainer
    config = TrainerConfig(steps=1000, lr=3e-3).resolved()
    lrs = [lr_at(step, config) for step in range(config.steps)]

A TrainerConfig checks itself when it is built (`TrainerConfig(steps=0)` raises, naming the
field, the value and the rule); `resolved()` fills in what is derived from the others.

No processes, no state: `.venv/bin/pytest -q tests/test_trainer.py -k "schedule or config"`.
"""

from __future__ import annotations

import hashlib
import math
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from ringtrain.config import (
    MUST_MATCH,
    SCHEDULE,
    check_values,
    int_at_least,
    non_negative_float,
    option,
    resume_fields,
    schedule_fields,
)
from ringtrain.types import OptimizerFn

_positive, _non_negative = int_at_least(1), int_at_least(0)


@dataclass
class TrainerConfig:
    """Loop settings, checked when built. `None` means "derive from the others" (`resolved()`).

    Args:
        steps: optimizer steps.
        batch_size: samples per micro-batch on each data rank.
        grad_accum: micro-batches per optimizer step.
        lr, min_lr, warmup_steps, lr_schedule: peak LR, floor, linear warmup, then 'cosine'
            decay to min_lr or 'constant'.
        weight_decay: AdamW decay on matrices (biases and norms are not decayed).
        beta1: AdamW's first-moment decay (momentum).
        beta2: AdamW's second-moment decay (0.95; nanoGPT's small-batch recipes use 0.99).
        grad_clip: max global gradient norm; None or 0 disables.
        seed: shared initialisation, data order and (with the rank) dropout; 0 or more.
        dtype: 'fp32' or 'bf16' (autocast where the device supports it).
        log_every, eval_every: steps between metric lines and evaluations (the last step does both).
        eval_batch_size: samples per evaluation batch per rank.
        progress: draw the progress bar on rank 0.
        report: draw report.png in `run_dir` at the end (rank 0; `--no-report`).
        record_samples: record each step's global sample indices in the snapshots
            (`ringtrain.data.sample_log`; `--record-samples`).
        compile: `torch.compile` the model (`nn.Module.compile`: in place, the same parameter
            names) once the strategy holds it; evaluation compiles a graph of its own, the end
            of run sample runs on an uncompiled copy (`--compile`).
    """

    # The command line's flags are these fields (`ringtrain.config.option`), these defaults
    # its defaults too; a task of `ringtrain train` changes some (cli/options.py TASK_DEFAULTS).
    steps: int = option(2000, "optimizer steps", type=_positive, resume=MUST_MATCH)
    batch_size: int = option(64, "samples per micro-batch per rank", type=_positive)
    grad_accum: int = option(1, "micro-batches per optimizer step", type=_positive)
    lr: float = option(1e-3, "peak learning rate", type=non_negative_float, resume=SCHEDULE)
    min_lr: float | None = option(None, "final learning rate", type=non_negative_float,
                                  shown="lr / 10", resume=SCHEDULE)
    warmup_steps: int | None = option(None, "linear warmup steps", type=_non_negative,
                                      shown="min(100, steps / 10)", resume=SCHEDULE)
    lr_schedule: str = option("cosine", "after warmup", choices=("cosine", "constant"),
                              resume=SCHEDULE)
    new_schedule: bool = option(False, "on a resume, train on with this command's --lr, "
                                "--min-lr, --warmup-steps and --lr-schedule from the "
                                "snapshot's step (after a loss spike, say); without it a "
                                "snapshot resumes only with its own")
    weight_decay: float = option(0.1, "AdamW weight decay on matrices", type=non_negative_float,
                                 resume=MUST_MATCH)
    beta1: float = option(0.9, "AdamW's momentum; a strategy may change it (ps async: 0.5, "
                          "docs/ps.md)", type=non_negative_float)
    beta2: float = option(0.95, "AdamW's second-moment decay", type=non_negative_float)
    grad_clip: float | None = option(1.0, "max gradient norm, 0 disables", type=non_negative_float,
                                     resume=MUST_MATCH)
    # 0 or more: numpy's SeedSequence, which mixes it with the rank, refuses a negative seed.
    seed: int = option(1337, "initialisation, data order, dropout", type=_non_negative,
                       resume=MUST_MATCH)
    dtype: str = option("fp32", "bf16 autocast where the device supports it",
                        choices=("fp32", "bf16"), resume=MUST_MATCH)
    log_every: int | None = option(None, "steps between metric lines", type=_positive,
                                   shown="steps / 100")
    eval_every: int | None = option(None, "steps between evaluations (the last step always "
                                    "evaluates)", type=_positive, shown="steps / 10")
    eval_batch_size: int | None = option(None, "samples per evaluation batch per rank",
                                         type=_positive, shown="max(batch size, 256)")
    progress: bool = option(True, "no progress bar", flag="--no-progress",
                            shown="one bar, on rank 0")
    # Off in the suite's launches that never open it: matplotlib is ~1 s of CPU on rank 0.
    report: bool = option(True, "no RUN_DIR/report.png at the end (matplotlib, ~1 s; draw "
                          "it later with python -m ringtrain.training.report RUN_DIR)",
                          flag="--no-report", shown="drawn")
    record_samples: bool = option(False, "record each step's sample indices in the snapshots, "
                                  "to check exactly-once data (data/sample_log.py)")
    compile: bool = option(False, "torch.compile the model once the strategy holds it: faster "
                           "steps after tens of seconds of compiling; needs a C++ compiler on CPU")

    def __post_init__(self) -> None:
        """Check every value (torchtitan's way: a bad config fails where it is built)."""
        # What the command line's parsers check (the fields' types and choices), and then what
        # one field's type cannot say.
        check_values(self)
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr}: it must be positive")
        if not 0.0 <= self.beta1 < 1.0:
            raise ValueError(f"beta1={self.beta1}: Adam's momentum must be in [0, 1)")
        if not 0.0 <= self.beta2 < 1.0:
            raise ValueError(f"beta2={self.beta2}: Adam's second-moment decay must be in [0, 1)")
        if self.min_lr is not None and self.min_lr > self.lr:
            raise ValueError(f"min_lr={self.min_lr} is above the peak lr ({self.lr}): the "
                             "schedule decays from the peak down to min_lr; lower min_lr "
                             "(default: lr / 10)")

    def must_match(self) -> dict[str, Any]:
        """{field: value} of the fields a resume must match (`resume=MUST_MATCH`): they change
        the trained weights. batch_size and grad_accum may change with the world size (the
        global batch is kept instead)."""
        return {name: getattr(self, name) for name in resume_fields(self)}

    def schedule_names(self) -> tuple[str, ...]:
        """The learning-rate schedule's fields (`resume=SCHEDULE`): --new-schedule's."""
        return schedule_fields(self)

    def resume_view(self, saved: dict[str, Any], *,
                    new_schedule: bool | None = None) -> dict[str, Any]:
        """A snapshot's `must_match()` as this run compares it with its own: `--steps` may
        differ (a run extended, or shortened, to this run's steps: its learning rate then
        follows the schedule of a run of this many steps, `lr_at`), and so may the warmup where
        both runs took its default, which follows --steps; with `new_schedule` (default: this
        config's), the whole learning-rate schedule (its `resume=SCHEDULE` fields: this run's
        from the snapshot's step on)."""
        out = dict(saved)
        if self.new_schedule if new_schedule is None else new_schedule:
            out.update({k: getattr(self, k) for k in self.schedule_names() if k in out})
        if "steps" in out and "warmup_steps" in out:
            if (out["warmup_steps"] == default_warmup(out["steps"])
                    and self.warmup_steps == default_warmup(self.steps)):
                out["warmup_steps"] = self.warmup_steps
            out["steps"] = self.steps
        return out

    def resolved(self) -> TrainerConfig:
        """A copy with every `None` derived from the others. The copy is built, so checked: a
        field set after construction (`config.lr = 0`) is caught here."""
        c = TrainerConfig(**asdict(self))
        c.min_lr = self.lr / 10 if self.min_lr is None else self.min_lr
        c.warmup_steps = (default_warmup(self.steps) if self.warmup_steps is None
                          else self.warmup_steps)
        c.log_every = max(1, self.steps // 100) if self.log_every is None else self.log_every
        c.eval_every = max(1, self.steps // 10) if self.eval_every is None else self.eval_every
        # Evaluation holds no activations for backward, so it can take larger batches.
        c.eval_batch_size = (max(self.batch_size, 256) if self.eval_batch_size is None
                             else self.eval_batch_size)
        c.grad_clip = self.grad_clip or None
        return c


def default_warmup(steps: int) -> int:
    """--warmup-steps' default: a tenth of the run, at most 100 steps."""
    return min(100, steps // 10)


def lr_at(step: int, c: TrainerConfig) -> float:
    """Linear warmup over `warmup_steps`, then cosine decay from lr to min_lr at the last step.

    A function of the step and this run's options only: a run resumed with a larger --steps
    (`resume_view`) follows the schedule of a run of its new length from the snapshot's step
    on, as if it had been started with it (docs/train.md, "Extending a run")."""
    if step < c.warmup_steps:
        return c.lr * (step + 1) / c.warmup_steps
    if c.lr_schedule == "constant":
        return c.lr
    progress = (step - c.warmup_steps) / max(1, c.steps - c.warmup_steps)
    return c.min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (c.lr - c.min_lr)


def adamw(weight_decay: float, betas: tuple[float, float] = (0.9, 0.95)) -> OptimizerFn:
    """AdamW that decays matrices only: decaying biases and LayerNorm gains only hurts.

    Fused (one kernel for all parameters, as nanoGPT's) when every parameter is on a CUDA
    device; elsewhere torch's default (foreach), which keeps CPU runs bit for bit as they were.
    """
    def build(params) -> torch.optim.Optimizer:
        params = [p for p in params if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        # Asked of the tensors, not of torch.cuda: no CUDA call on a CPU path.
        fused = bool(params) and all(p.device.type == "cuda" for p in params)
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=0.0, betas=betas,
                                 **({"fused": True} if fused else {}))
    return build


def autocast(dtype: str, device: torch.device):
    """What the loop runs each step and evaluation in: bf16 autocast for `dtype` "bf16", else
    nothing. Around the strategy's whole step (every strategy gets it without an option of its
    own): backward ops run in the dtype autocast chose for their forward op either way."""
    if dtype != "bf16":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def compile_problem(device: torch.device | str = "cpu") -> str | None:
    """None when torch.compile builds a kernel for `device` here; else why not, in one line (no
    working C++ compiler on the CPU, no triton for CUDA, ...). Compiles one tiny function:
    about a second, and dynamo's imports."""
    try:
        torch.compile(lambda t: t * 2 + 1)(torch.ones(4, device=device))
        return None
    except Exception as e:  # inductor's toolchain errors have no common public type
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def rank_seed(seed: int, rank: int) -> int:
    """A per-rank seed from (seed, rank): well mixed, so nearby seeds and ranks do not correlate."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])


def param_sha256(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the state_dict's tensors in key order (their raw bytes, no names)."""
    h = hashlib.sha256()
    for key in state:
        t = state[key].detach().cpu().contiguous()
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
