"""`--strategy pipeline`: pipeline (GPipe, 1F1B, interleaved, ZB-H1, ZB-V) x data parallelism.

    ringtrain train --strategy pipeline --pp 2 --nproc-per-node 2 \
[--schedule 1f1b|gpipe|zb-h1|zb-v] [--microbatches 4]
    ringtrain train --strategy pipeline --pp 2 --nproc-per-node 2 --schedule interleaved \
--virtual-stages 2  # each rank holds 2 non-adjacent chunks
    ringtrain train --strategy pipeline --pp 2 --nproc-per-node 4      # dp=2 x pp=2

The world's ranks form `dp` pipelines of `pp` stages (`ringtrain.pipeline.topology`). Every rank
gets the full, identically initialised model in `setup`, splits it the same way (the model's
`to_sequential()`, or the model itself if it is an `nn.Sequential`) into pp x v stages and keeps
its own: stage pp_rank, or for an interleaved schedule the chunks pp_rank, pp_rank + pp, ...
(zb-v: pp_rank and 2 pp - 1 - pp_rank, `ringtrain.pipeline.placement`)
Every stage of one pipeline reads the same batch (`data_rank` is the dp coordinate); the
trainer's gradient-accumulation micro-batches are concatenated into one step batch, which the
pipeline cuts into `microbatches` equal micro-batches of its own. Each stage's gradients are
averaged over its data-parallel peers by DistributedDataParallel on the dp group; weights tied
across stages have their gradients summed between the stages that hold them; gradient clipping
uses the norm over all stages.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain import collectives  # checked first under RINGTRAIN_DEBUG=collectives
from ringtrain.config import MUST_MATCH, int_at_least, option
from ringtrain.errors import ConfigError
from ringtrain.pipeline.engine import PipelineStage, StepStats
from ringtrain.pipeline.names import StageNames, model_tensors
from ringtrain.pipeline.partition import partition, tied_parameters
from ringtrain.pipeline.schedule import (
    BUBBLE_FORMULA_TEXT,
    COMPUTE,
    SCHEDULES,
    bubble_formula,
    chunks_per_rank,
    placement,
)
from ringtrain.pipeline.topology import Topology, create_process_groups
from ringtrain.runtime import Runtime
from ringtrain.strategies import portable
from ringtrain.strategies.base import StepResult, Strategy, StrategyConfig
from ringtrain.strategies.figures import FP32_BYTES, Figures, Workload, all_reduce_share
from ringtrain.trace import COMM, Tracer
from ringtrain.trace import COMPUTE as COMPUTE_LANE
from ringtrain.types import LossFn, OptimizerFn


def _default_microbatches(batch: int, pp: int, schedule: str = "1f1b") -> int:
    """The most micro-batches up to 4 x pp that divide `batch` evenly; for an interleaved
    schedule, a multiple of pp (it runs micro-batches in rounds of pp)."""
    step = pp if schedule == "interleaved" else 1
    for m in range(4 * pp, step - 1, -1):
        if batch % m == 0 and m % step == 0:
            return m
    return 4 * pp  # nothing divides: let split_batch raise with the choices


def _check_schedule(schedule: str, pp: int, virtual_stages: int, microbatches: int | None) -> None:
    """The schedule's own checks (its builder's), as a ConfigError before any rank starts."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"--schedule {schedule!r} is not known; choose one of "
                          f"{sorted(SCHEDULES)}")
    try:
        SCHEDULES[schedule](0, pp, microbatches or 4 * pp,
                            chunks_per_rank(schedule, virtual_stages))
    except ValueError as e:
        raise ConfigError(str(e).replace("microbatches=", "--microbatches ")
                          .replace("virtual_stages=", "--virtual-stages ")
                          .replace("pp=", "--pp ")) from None


def _trace_timeline(tracer: Tracer, stats: StepStats) -> None:
    """The engine's timeline of this step as spans: forward and backward on the compute lane,
    each send (its posting) and receive (its wait) on the comm lane, then the wait for the sends."""
    for a, t0, t1 in stats.timeline:
        lane = COMPUTE_LANE if isinstance(a, COMPUTE) else COMM
        words = re.sub(r"(?<!^)([A-Z])", r" \1", type(a).__name__).lower()  # "recv activation"
        tracer.add(f"{words} {a.mb}" + (f" chunk {a.chunk}" if a.chunk else ""), lane,
                   round(t0 * 1e9), round(t1 * 1e9), {"micro_batch": a.mb, "chunk": a.chunk})
    if stats.timeline:
        tracer.add("wait for sends", COMM, round(stats.timeline[-1][2] * 1e9),
                   round(stats.end * 1e9))


def _as_sequential(model: nn.Module) -> nn.Module | list[nn.Module]:
    to_sequential = getattr(model, "to_sequential", None)
    if callable(to_sequential):
        return to_sequential()
    return model  # partition() raises a clear TypeError unless it is an nn.Sequential


@dataclass(frozen=True, kw_only=True)
class PipelineFigures(Figures):
    """`--strategy pipeline`'s figures; the common ones are a stage's (its layers' share of the
    parameters: on average 1/pp; `partition` balances them by parameter count)."""

    pp: int
    dp: int  # pipelines (replicas of each stage)
    pipelines: tuple[tuple[int, ...], ...]  # each pipeline's ranks, in stage order
    microbatches: int
    microbatch_size: int  # samples
    stage_params: float  # parameters per stage, on average
    bubble: float  # the fraction of a step each stage idles, by the schedule's formula
    bubble_formula: str  # that formula in words, e.g. "(pp-1)/(M+pp-1)"
    boundary_bytes: float  # activations across one stage boundary per step (gradients: as many)
    dp_sent_bytes: float  # a rank's share of the ring all-reduce among its stage's replicas


@dataclass(frozen=True, kw_only=True)
class PipelineConfig(StrategyConfig):
    """`--strategy pipeline`'s options, checked against the world size before launch."""

    pp: int = option(2, "pipeline stages", type=int_at_least(1))
    schedule: str = option("1f1b", "pipeline schedule", choices=sorted(SCHEDULES))
    microbatches: int | None = option(None, "pipeline micro-batches per batch",
                                      type=int_at_least(1),
                                      shown="the most up to 4 x pp that divide the batch")
    virtual_stages: int = option(1, "model chunks per rank (--schedule interleaved; zb-v holds "
                                 "2 in a V): the model is split into pp x v stages, rank r "
                                 "holds r, r+pp, ...",
                                 type=int_at_least(1), resume=MUST_MATCH)

    def plan(self, world_size: int, step_batch: int) -> int:
        pp = self.pp
        try:
            dp = Topology(world_size, pp).dp
        except ValueError as e:  # pp must divide world_size
            raise ConfigError(str(e)) from None
        m = self.microbatches
        if m is not None and step_batch % m:
            fits = [d for d in range(1, step_batch + 1) if step_batch % d == 0]
            raise ConfigError(f"--microbatches {m} must divide the {step_batch} samples of a "
                              f"step (--batch-size x --grad-accum); use --microbatches in {fits}")
        _check_schedule(self.schedule, pp, self.virtual_stages,
                        self.microbatches_for(step_batch))
        return dp

    def microbatches_for(self, step_batch: int) -> int:
        """Micro-batches of a step of `step_batch` samples: as set, else the default."""
        return self.microbatches or _default_microbatches(step_batch, self.pp, self.schedule)

    def figures(self, workload: Workload) -> PipelineFigures:
        """Per stage and step: the activations of the step's samples forward across each
        boundary and their gradients backward (fp32), and the ring all-reduce of the stage's
        gradients among its dp replicas. `sent_bytes` is the busiest stage's: a middle one sends
        both ways, an end stage one way.
        The bubble is the schedule's formula (`bubble_formula`: GPipe's for 1F1B, Narayanan et
        al. 2021; smaller for interleaved and ZB-H1)."""
        pp, dp = self.pp, self.plan(workload.world_size, workload.step_batch)
        topology = Topology(workload.world_size, pp)
        m = self.microbatches_for(workload.step_batch)
        stage = workload.params / pp
        boundary = float(workload.step_batch * workload.sample_numel * FP32_BYTES)
        dp_sent = all_reduce_share(dp) * stage * FP32_BYTES
        return PipelineFigures(
            data_ranks=dp, **{k: v / pp for k, v in workload.replica().items()},
            sent_bytes=min(2, pp - 1) * boundary + dp_sent, pp=pp, dp=dp,
            pipelines=tuple(tuple(topology.pp_group_ranks(d)) for d in range(dp)), microbatches=m,
            microbatch_size=workload.step_batch // m, stage_params=stage,
            bubble=bubble_formula(self.schedule, pp, m, self.virtual_stages),
            bubble_formula=BUBBLE_FORMULA_TEXT[self.schedule],
            boundary_bytes=boundary, dp_sent_bytes=dp_sent)


class PipelineStrategy(Strategy):
    """One rank's stage of a dp x pp pipeline.

    Args:
        runtime: the started process group (`ringtrain.init_distributed()`).
        pp: stages per pipeline; must divide the world size.
        schedule: '1f1b' (default; at most pp micro-batches in flight), 'gpipe', 'zb-h1'
            (1F1B's memory, a third of its bubble), 'zb-v' (2 chunks per rank in a V, 1F1B's
            memory, a sixth of its bubble) or 'interleaved' (with virtual_stages).
        microbatches: micro-batches per step (dividing the step batch; fewer than pp leaves
            stages idle, and interleaved needs a multiple of pp); default: the most up to
            4 x pp that divide the batch.
        split: layers per stage (e.g. [3, 2]; pp x chunks per rank of them); default:
            balanced by parameter count.
        virtual_stages: model chunks per rank, for `schedule='interleaved'`: the bubble shrinks
            to (pp-1)/(v*m) of the compute, for more p2p messages and warm-up activations.
    """

    name = "pipeline"
    Config = PipelineConfig

    def __init__(self, runtime: Runtime, pp: int = 2, schedule: str = "1f1b",
                 microbatches: int | None = None, split: Sequence[int] | None = None,
                 virtual_stages: int = 1):
        if schedule not in SCHEDULES:
            raise ConfigError(f"--schedule {schedule!r} is not known; choose one of "
                              f"{sorted(SCHEDULES)}")
        _check_schedule(schedule, pp, virtual_stages, microbatches)
        # Chunks per rank (zb-v: 2, in the layout, so resuming under another schedule is refused)
        self.runtime, self.virtual_stages = runtime, chunks_per_rank(schedule, virtual_stages)
        try:
            self.topology = Topology(runtime.world_size, pp)
        except ValueError as e:  # pp does not divide the world: the same on every rank
            raise ConfigError(str(e)) from None
        self.schedule, self.microbatches, self.split = schedule, microbatches, split
        self.groups = create_process_groups(self.topology, runtime.rank)

    # -- where this rank reads data ---------------------------------------------------------
    @property
    def data_rank(self) -> int | None:
        return self.groups.dp_rank

    @property
    def data_world_size(self) -> int:
        return self.topology.dp

    # -- setup ------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer_fn: OptimizerFn, loss_fn: LossFn) -> None:
        g, pp, v = self.groups, self.topology.pp, self.virtual_stages
        place = placement(self.schedule, pp, v)
        stages = partition(_as_sequential(model), pp * v, self.split)
        chunks = [stages[place.stage(g.pp_rank, c)].to(self.runtime.device) for c in range(v)]
        stage = chunks[0] if v == 1 else nn.ModuleList(chunks)
        self.stage = stage
        self.names = StageNames.of(model, stages, stage)
        self._param_names = portable.param_names(model)  # id -> name, for the optimizer

        # Tied weights: one group per (tie, pipeline), created by every rank in the same order.
        self._ties: list[tuple[nn.Parameter, dist.ProcessGroup]] = []
        # tied copies whose norm another stage counts
        self._norm_counted_elsewhere: set[int] = set()
        # A tie between two chunks of one rank is one parameter object there: autograd sums it.
        local = {id(p): p for p in stage.parameters()}
        for tie in tied_parameters(stages):
            ranks = sorted({place.where(k)[0] for k in tie.stages})
            if len(ranks) < 2:
                continue
            for d in range(self.topology.dp):
                group = dist.new_group([self.topology.rank_of(d, r) for r in ranks])
                if d == g.dp_rank and g.pp_rank in ranks:
                    k = next(k for k in tie.stages if place.where(k)[0] == g.pp_rank)
                    param = dict(stages[k].named_parameters())[dict(tie.holders)[k]]
                    self._ties.append((local[id(param)], group))
                    if g.pp_rank != ranks[0]:
                        self._norm_counted_elsewhere.add(id(param))

        self.ddp: list[nn.Module] | None = None
        if self.topology.dp > 1:
            from ringtrain.ddp.distributed import DistributedDataParallel

            # One DDP per chunk, each armed before its chunk's last backward (the engine's
            # job). No buffer broadcast in forward: buffers start equal (construction syncs
            # them), and a broadcast per micro-batch forward would add a collective to every step.
            self.ddp = [DistributedDataParallel(chunk, process_group=g.dp_group,
                                                forward_sync_buffers=False, tracer=self.tracer)
                        for chunk in chunks]
        self.optimizer = optimizer_fn(stage.parameters())
        self.engine = PipelineStage(
            self.ddp or chunks, pp_rank=g.pp_rank, pp=pp, pp_ranks=g.pp_ranks,
            pp_group=g.pp_group, loss_fn=loss_fn, schedule=self.schedule,
            no_sync=[d.no_sync for d in self.ddp] if self.ddp else None,
            sync_next_backward=([d.reducer.prepare_for_backward for d in self.ddp] if self.ddp
                                else None),
        )

    # -- one optimizer step -----------------------------------------------------------------
    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, lr: float,
                   grad_clip: float | None) -> StepResult:
        device = self.runtime.device
        x = torch.cat([mb[0] for mb in micro_batches]).to(device)
        y = torch.cat([mb[1] for mb in micro_batches]).to(device)
        m = self.microbatches or _default_microbatches(x.shape[0], self.topology.pp,
                                                         self.schedule)
        self.optimizer.zero_grad(set_to_none=True)
        stats = self.engine.train_step(x, y, m)
        if self.tracer.active:
            _trace_timeline(self.tracer, stats)
        t0 = time.perf_counter()
        for p, group in self._ties:  # a tied weight's gradient is the sum of its uses
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            collectives.all_reduce(p.grad, group=group)
        if grad_clip is not None:
            self._clip(grad_clip)
        comm_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with self.tracer.span("optimizer step"):
            self.optimizer.step()
        step_s = time.perf_counter() - t0
        if self.runtime.world_size == 1:  # nothing is sent: its waits and the clip are compute
            stats.busy_s, stats.wait_s, comm_s = stats.busy_s + stats.wait_s + comm_s, 0.0, 0.0
        return StepResult(stats.loss_sum or 0.0, stats.count, stats.busy_s + step_s,
                          stats.wait_s + comm_s)

    def _clip(self, max_norm: float) -> float:
        """Clip by the 2-norm over every stage's gradients (as clip_grad_norm_ on the whole
        model): each stage sums its squares, the pipeline adds them up. A tied weight counts
        once; data-parallel peers hold equal, already averaged gradients."""
        grads = [p.grad for p in self.stage.parameters()
                 if p.grad is not None and id(p) not in self._norm_counted_elsewhere]
        sq = torch.zeros((), dtype=torch.float32, device=self.runtime.device)
        for grad in grads:
            sq += grad.detach().float().pow(2).sum()
        if self.topology.pp > 1:
            collectives.all_reduce(sq, group=self.groups.pp_group)
        total = float(sq.sqrt())
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for p in self.stage.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return total

    # -- inference and state ----------------------------------------------------------------
    def eval_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        was_training = self.stage.training
        self.stage.eval()
        try:
            return self.engine.forward_only(x.to(self.runtime.device))
        finally:
            self.stage.train(was_training)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's state under its own names, gathered from every stage; equal on all
        ranks (a collective over the pipeline group)."""
        own = self.stage.state_dict()
        local = {name: own[key].detach().cpu().clone() for name, key in self.names.local.items()}
        if self.topology.pp == 1:
            return {name: local[name] for name in self.names.order}
        parts: list[dict[str, torch.Tensor] | None] = [None] * self.topology.pp
        collectives.all_gather_object(parts, local, group=self.groups.pp_group)
        full: dict[str, torch.Tensor] = {}
        for part in parts:
            full.update(part or {})
        return {name: full[name] for name in self.names.order}

    def _layout(self) -> dict[str, int]:
        return {"world_size": self.topology.world_size, "pp": self.topology.pp,
                "dp": self.topology.dp, "pp_rank": self.groups.pp_rank,
                **({"virtual_stages": self.virtual_stages} if self.virtual_stages > 1 else {})}

    def state_layout(self) -> dict[str, Any]:
        """Stages hold other layers under another pp or number of chunks."""
        return {"pp": self.topology.pp, "virtual_stages": self.virtual_stages}

    def state_dict(self) -> dict[str, Any]:
        # The model's names make it convertible to the layout-free form (`to_portable`).
        return {"layout": self._layout(), "stage": self.stage.state_dict(),
                "optimizer": self.optimizer.state_dict(), "names": self.names.keys,
                "param_names": portable.optimizer_param_names(self.optimizer,
                                                              self._param_names)}

    @classmethod
    def to_portable(cls, read_parts: Callable[[list[int]], dict[int, dict[str, Any]]],
                    shared: dict[str, Any] | None,
                    metadata: dict[str, Any]) -> dict[str, Any] | None:
        """The stages of the first pipeline (dp_rank 0; the others hold the same), each
        stage's tensors under the model's names."""
        layout = read_parts([0])[0]["layout"]
        ranks = Topology(int(layout["world_size"]), int(layout["pp"])).pp_group_ranks(0)
        parts = read_parts(ranks)
        if any("names" not in p for p in parts.values()):
            raise ConfigError("this pipeline snapshot was written by a ringtrain that did not "
                              "name the stages' tensors: resume it with --strategy pipeline "
                              f"--pp {layout['pp']}")
        return portable.make(model_tensors(parts), portable.merge(
            portable.optimizer_by_name(p["optimizer"], p["param_names"])
            for _, p in sorted(parts.items())))

    def load_portable_state_dict(self, state: dict[str, Any]) -> None:
        portable.check(state)
        portable.load_model(self.stage, state["model"], names=self.names.keys)
        portable.load_optimizer(
            self.optimizer, portable.optimizer_param_names(self.optimizer, self._param_names),
            state["optimizer"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved, now = state.get("layout"), self._layout()
        if saved != now:
            raise ConfigError(
                f"this pipeline state was saved with layout {saved} but this rank runs {now}: "
                f"stages hold different layers, so it cannot be loaded here. Restart with "
                f"--pp {saved and saved['pp']} and "
                f"--nproc-per-node {saved and saved['world_size']}, "
                "or resume from the full model state (model_state_dict)"
            )
        self.stage.load_state_dict(state["stage"])
        self.optimizer.load_state_dict(state["optimizer"])

    def close(self) -> None:
        """Drop references to the stage and its groups (destroy_distributed frees the groups)."""
        self.engine = self.ddp = None  # type: ignore[assignment]
