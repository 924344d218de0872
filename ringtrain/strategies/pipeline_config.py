"""`--strategy pipeline`'s options and figures: what it checks before any rank starts.

    ringtrain train --pp 2 --tp 2 --nproc-per-node 4   # --pp implies --strategy pipeline

The layout is `ringtrain.grid.Grid(world_size, pp=pp, tp=tp)`: dp x pp x tp, tp innermost.
`--tp` splits every stage's matrices over consecutive ranks (Megatron-LM, as `--strategy tp`
does for a whole replica), under every schedule; `--sequence-parallel` under those in
`sp_schedules()` (all of them on a tested torch; the others are refused here, with the fix).
The strategy itself: `ringtrain/strategies/pipeline.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from ringtrain.config import flag, int_at_least, option
from ringtrain.errors import ConfigError
from ringtrain.grid import Grid
from ringtrain.pipeline.backward import holds_tensor_hooks
from ringtrain.pipeline.schedule import (
    BUBBLE_FORMULA_TEXT,
    SCHEDULES,
    bubble_formula,
    chunks_per_rank,
)
from ringtrain.strategies.base import StrategyConfig
from ringtrain.strategies.figures import FP32_BYTES, Figures, Workload, all_reduce_share
from ringtrain.strategies.tp_options import (
    check_recompute_gather,
    check_tp_model,
    recompute_gather_option,
    sequence_parallel_option,
    tp_option,
)

# The schedules that split a backward in two (input gradient now, weights later,
# `ringtrain.pipeline.backward`). Sequence parallelism sums the norms' gradients over tp in a
# parameter's tensor hook; the weight pass runs such a hook once only where this torch lets it
# hold the hooks while it captures the weight gradients (`backward.tensor_hooks_held`):
# running it twice counted those gradients tp times (weights 5e-3 off after 3 clipped steps).
SPLIT_BACKWARD = ("zb-h1", "zb-v")


def sp_schedules() -> tuple[str, ...]:
    """The schedules that run with --sequence-parallel on this torch (every schedule runs
    with --tp alone, each checked against one process)."""
    return tuple(s for s in SCHEDULES
                 if s not in SPLIT_BACKWARD or holds_tensor_hooks())


def default_microbatches(batch: int, pp: int, schedule: str = "1f1b") -> int:
    """The most micro-batches up to 4 x pp that divide `batch` evenly; for an interleaved
    schedule, a multiple of pp (it runs micro-batches in rounds of pp)."""
    step = pp if schedule == "interleaved" else 1
    for m in range(4 * pp, step - 1, -1):
        if batch % m == 0 and m % step == 0:
            return m
    return 4 * pp  # nothing divides: let split_batch raise with the choices


def check_schedule(schedule: str, pp: int, virtual_stages: int, microbatches: int | None,
                   sequence_parallel: bool = False) -> None:
    """The schedule's own checks (its builder's), and whether it runs with sequence
    parallelism on this torch, as a ConfigError before any rank starts."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"--schedule {schedule!r} is not known; choose one of "
                          f"{sorted(SCHEDULES)}")
    if sequence_parallel and schedule not in sp_schedules():
        raise ConfigError(f"--schedule {schedule} does not run with --sequence-parallel on torch "
                          f"{torch.__version__} (its split backward would sum the norms' "
                          "gradients over tp twice: this torch lets no hook be held); "
                          f"use --schedule in {list(sp_schedules())}, drop "
                          "--sequence-parallel, or install a torch in pyproject.toml's range")
    try:
        SCHEDULES[schedule](0, pp, microbatches or 4 * pp,
                            chunks_per_rank(schedule, virtual_stages))
    except ValueError as e:
        raise ConfigError(str(e).replace("microbatches=", "--microbatches ")
                          .replace("virtual_stages=", "--virtual-stages ")
                          .replace("pp=", "--pp ")) from None


def make_grid(world_size: int, pp: int, tp: int) -> Grid:
    """The grid, its refusal (pp x tp must divide the world) as a ConfigError."""
    try:
        return Grid(world_size, pp=pp, tp=tp)
    except ValueError as e:
        raise ConfigError(str(e)) from None


@dataclass(frozen=True, kw_only=True)
class PipelineFigures(Figures):
    """`--strategy pipeline`'s figures; the common ones are a stage's (its layers' share of the
    parameters: on average 1/pp; `partition` balances them by parameter count), over tp."""

    pp: int
    dp: int  # pipelines (replicas of each stage)
    pipelines: tuple[tuple[int, ...], ...]  # each pipeline's ranks, in stage order (dp x tp)
    microbatches: int
    microbatch_size: int  # samples
    stage_params: float  # parameters per stage, on average
    bubble: float  # the fraction of a step each stage idles, by the schedule's formula
    bubble_formula: str  # that formula in words, e.g. "(pp-1)/(M+pp-1)"
    boundary_bytes: float  # activations across one stage boundary per step (gradients: as many)
    dp_sent_bytes: float  # a rank's share of the ring all-reduce among its stage's replicas
    tp: int = 1  # ranks that split each stage's matrices


@dataclass(frozen=True, kw_only=True)
class PipelineConfig(StrategyConfig):
    """`--strategy pipeline`'s options, checked against the world size before launch."""

    chosen_by = ("pp",)  # with no --strategy, --pp chooses this one (see StrategyConfig)

    pp: int = option(2, "pipeline stages", type=int_at_least(1))
    schedule: str = option("1f1b", "pipeline schedule", choices=sorted(SCHEDULES))
    microbatches: int | None = option(None, "pipeline micro-batches per batch",
                                      type=int_at_least(1),
                                      shown="the most up to 4 x pp that divide the batch")
    virtual_stages: int = option(1, "model chunks per rank (--schedule interleaved; zb-v holds "
                                 "2 in a V): the model is split into pp x v stages, rank r "
                                 "holds r, r+pp, ...",
                                 type=int_at_least(1))
    tp: int = tp_option(1)
    sequence_parallel: bool = sequence_parallel_option()
    recompute_gather: bool = recompute_gather_option()

    def plan(self, world_size: int, step_batch: int) -> int:
        pp, tp = self.pp, self.tp
        dp = make_grid(world_size, pp, tp).dp
        if self.sequence_parallel and tp == 1:
            raise ConfigError("--sequence-parallel shards the sequence over the tp ranks: "
                              "add --tp 2 (or more), or drop --sequence-parallel")
        check_recompute_gather(self.recompute_gather, self.sequence_parallel)
        m = self.microbatches
        if m is not None and step_batch % m:
            fits = [d for d in range(1, step_batch + 1) if step_batch % d == 0]
            raise ConfigError(f"--microbatches {m} must divide the {step_batch} samples of a "
                              f"step (--batch-size x --grad-accum); use --microbatches in {fits}")
        check_schedule(self.schedule, pp, self.virtual_stages,
                       self.microbatches_for(step_batch), self.sequence_parallel)
        return dp

    def check_model(self, model: Any, sequence_length: int | None = None,
                    vocab_size: int | None = None) -> None:
        """Enough layers for the stages (the GPT's: --n-layer blocks, the embedding and the
        head); with --tp: heads, the vocabulary and (SP) the sequence split across the tp
        ranks."""
        stages = self.pp * chunks_per_rank(self.schedule, self.virtual_stages)
        layers = getattr(model, "n_layer", None)
        if layers is not None and stages > layers + 2:
            v = stages // self.pp
            how = ("" if v == 1 else "--virtual-stages 1, " if self.schedule == "interleaved"
                   else "--schedule 1f1b (one stage per rank), ")
            raise ConfigError(
                f"--pp {self.pp}" + (f" with {v} model chunks per rank (--schedule "
                                     f"{self.schedule})" if v > 1 else "") +
                f" makes {stages} stages, but --n-layer {layers} gives the GPT {layers + 2} "
                f"layers (the blocks, the embedding and the head): every stage needs at least "
                f"one. Use {how}a smaller --pp, or --n-layer {stages - 2} or more")
        if self.tp == 1:
            return
        tp_flag = flag(next(f for f in fields(self) if f.name == "tp"))  # --tp, from its field
        check_tp_model(model, self.tp, tp_flag,
                       sequence_length if self.sequence_parallel else None, vocab_size)

    def microbatches_for(self, step_batch: int) -> int:
        """Micro-batches of a step of `step_batch` samples: as set, else the default."""
        return self.microbatches or default_microbatches(step_batch, self.pp, self.schedule)

    def figures(self, workload: Workload) -> PipelineFigures:
        """Per stage and step: the activations of the step's samples forward across each
        boundary and their gradients backward (fp32; 1/tp of them per rank under sequence
        parallelism), and the ring all-reduce of the stage's gradients (1/tp of them per rank)
        among its dp replicas. `sent_bytes` is the busiest stage's: a middle one sends both
        ways, an end stage one way. The tp group's own activation all-reduces are left out
        (`--strategy tp`'s figures count them).
        The bubble is the schedule's formula (`bubble_formula`: GPipe's for 1F1B, Narayanan et
        al. 2021; smaller for interleaved and ZB-H1)."""
        pp, tp, dp = self.pp, self.tp, self.plan(workload.world_size, workload.step_batch)
        grid = make_grid(workload.world_size, pp, tp)
        m = self.microbatches_for(workload.step_batch)
        stage = workload.params / pp
        boundary = float(workload.step_batch * workload.sample_numel * FP32_BYTES)
        if self.sequence_parallel:
            boundary /= tp
        dp_sent = all_reduce_share(dp) * stage / tp * FP32_BYTES
        return PipelineFigures(
            data_ranks=dp, **{k: v / (pp * tp) for k, v in workload.replica().items()},
            sent_bytes=min(2, pp - 1) * boundary + dp_sent, pp=pp, dp=dp, tp=tp,
            pipelines=tuple(tuple(r) for r in grid.groups()["pp"]), microbatches=m,
            microbatch_size=workload.step_batch // m, stage_params=stage,
            bubble=bubble_formula(self.schedule, pp, m, self.virtual_stages),
            bubble_formula=BUBBLE_FORMULA_TEXT[self.schedule],
            boundary_bytes=boundary, dp_sent_bytes=dp_sent)
