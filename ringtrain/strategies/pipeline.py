"""`--strategy pipeline`: pipeline (GPipe, 1F1B, interleaved, ZB-H1, ZB-V) x data parallelism,
with tensor parallelism inside each stage (`--tp`).

    ringtrain train --strategy pipeline --pp 2 --nproc-per-node 2 \
[--schedule 1f1b|gpipe|zb-h1|zb-v] [--microbatches 4]
    ringtrain train --strategy pipeline --pp 2 --nproc-per-node 2 --schedule interleaved \
--virtual-stages 2  # each rank holds 2 non-adjacent chunks
    ringtrain train --strategy pipeline --pp 2 --nproc-per-node 4      # dp=2 x pp=2
    ringtrain train --pp 2 --tp 2 --nproc-per-node 4     # pp=2 x tp=2 (--pp implies pipeline)

The world's ranks form a dp x pp x tp grid (`ringtrain.grid`, tp innermost). Every rank gets
the full, identically initialised model in `setup`; with tp > 1 it first splits every matrix
over its tp group (`pipeline_tp.py`: Megatron-LM's plan, the vocab-parallel loss on the last
stage), then cuts the model the same way (the model's `to_sequential()`, or the model itself if
it is an `nn.Sequential`) into pp x v stages and keeps its own: stage pp_rank, or for an
interleaved schedule the chunks pp_rank, pp_rank + pp, ... (zb-v: pp_rank and 2 pp - 1 -
pp_rank, `ringtrain.pipeline.placement`). A pipeline is the ranks of one tp rank across the
stages: the boundary activations go between the same tp rank of adjacent stages (under
sequence parallelism, each its own slice of the sequence).
Every stage of one pipeline reads the same batch (`data_rank` is the dp coordinate); the
trainer's gradient-accumulation micro-batches are concatenated into one step batch, which the
pipeline cuts into `microbatches` equal micro-batches of its own. Each stage's gradients are
averaged over its data-parallel peers by DistributedDataParallel on the dp group; weights tied
across stages have their gradients summed between the stages that hold them; gradient clipping
uses the norm over all stages and tp slices (torch's `clip_grad_norm_` of the whole model).
Options and figures: `pipeline_config.py`.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain import collectives  # checked first under RINGTRAIN_DEBUG=collectives
from ringtrain.errors import ConfigError
from ringtrain.grid import create_pp_grad_groups, create_process_groups
from ringtrain.pipeline.engine import PipelineStage, StepStats
from ringtrain.pipeline.names import StageNames, model_tensors
from ringtrain.pipeline.partition import parameter_counts, partition, tied_parameters
from ringtrain.pipeline.schedule import COMPUTE, chunks_per_rank, placement
from ringtrain.runtime import Runtime
from ringtrain.strategies import portable
from ringtrain.strategies.base import StepResult, Strategy
from ringtrain.strategies.pipeline_config import (
    PipelineConfig,
    PipelineFigures,
    check_schedule,
    default_microbatches,
    make_grid,
)
from ringtrain.strategies.pipeline_tp import StageSlices, join_slices, parallelize_model
from ringtrain.strategies.tp_options import check_recompute_gather
from ringtrain.tensor_parallel import comm, vocab_parallel_cross_entropy
from ringtrain.trace import COMM, Tracer
from ringtrain.trace import COMPUTE as COMPUTE_LANE
from ringtrain.types import LossFn, OptimizerFn

__all__ = ["PipelineConfig", "PipelineFigures", "PipelineStrategy"]  # the options: re-exported


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


class PipelineStrategy(Strategy):
    """One rank's stage (its tp slice) of a dp x pp x tp pipeline.

    Args:
        runtime: the started process group (`ringtrain.init_distributed()`).
        pp: stages per pipeline; pp x tp must divide the world size.
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
        tp: ranks that split each stage's matrices (Megatron-LM; ringtrain's GPT, tied or
            not, with dropout or not).
        sequence_parallel: with tp, the norms and the residual stream (and so the stage
            boundaries) on block_size / tp tokens per rank; with the schedules in
            `pipeline_config.sp_schedules()` (every one on a tested torch).
        recompute_gather: with it, the column layers' inputs kept as 1/tp and all-gathered
            again in backward (`gpt_plan(recompute_gather=True)`).
    """

    name = "pipeline"
    Config = PipelineConfig

    def __init__(self, runtime: Runtime, pp: int = 2, schedule: str = "1f1b",
                 microbatches: int | None = None, split: Sequence[int] | None = None,
                 virtual_stages: int = 1, tp: int = 1, sequence_parallel: bool = False,
                 recompute_gather: bool = False):
        check_recompute_gather(recompute_gather, sequence_parallel)
        check_schedule(schedule, pp, virtual_stages, microbatches, sequence_parallel)
        if sequence_parallel and tp == 1:
            raise ConfigError("sequence_parallel=True shards the sequence over the tp ranks: "
                              "pass tp=2 (or more), or sequence_parallel=False")
        # Chunks per rank (zb-v: 2, in the layout, so resuming under another schedule is refused)
        self.runtime, self.virtual_stages = runtime, chunks_per_rank(schedule, virtual_stages)
        self.grid = make_grid(runtime.world_size, pp, tp)  # the same refusal on every rank
        self.schedule, self.microbatches, self.split = schedule, microbatches, split
        self.sequence_parallel, self.recompute_gather = sequence_parallel, recompute_gather
        self.groups = create_process_groups(self.grid, runtime.rank)
        self.grad_group = (self.groups.pp_group if "nccl" in runtime.backend
                           else create_pp_grad_groups(self.grid, runtime.rank))

    # -- where this rank reads data ---------------------------------------------------------
    @property
    def data_rank(self) -> int | None:
        return self.groups.dp_rank  # every stage and tp rank of a replica reads alike

    @property
    def data_world_size(self) -> int:
        return self.grid.dp

    def seed_rank(self, rank: int) -> int:
        """With --tp, the first rank of `rank`'s tp group: a stage's tp ranks draw one stream,
        so a dropout of what they hold whole masks it alike (as `--strategy tp`'s)."""
        return rank - self.grid.coords(rank).tp_rank

    # -- setup ------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer_fn: OptimizerFn, loss_fn: LossFn) -> None:
        g, pp, v, tp = self.groups, self.grid.pp, self.virtual_stages, self.grid.tp
        if tp > 1:
            # Split before cutting: the stages then share the parallelised model's modules,
            # so the model's names still say which tensor each stage holds (`StageNames`).
            model = parallelize_model(model, g.tp_group, tp=tp,
                                      sequence_parallel=self.sequence_parallel,
                                      recompute_gather=self.recompute_gather)
            # The lm_head leaves the logits split by vocabulary: the loss is ringtrain's
            # cross-entropy (mean over targets, -1 ignored) without gathering them.
            loss_fn = lambda logits, y: vocab_parallel_cross_entropy(  # noqa: E731
                logits, y, g.tp_group)
        place = placement(self.schedule, pp, v)
        seq = _as_sequential(model)
        if v > 1 and (n := len(parameter_counts(seq))) < pp * v:  # partition's words: --pp
            how = ("--virtual-stages 1" if self.schedule == "interleaved" else
                   "--schedule 1f1b (one stage per rank)")
            raise ConfigError(
                f"--pp {pp} with {v} model chunks per rank (--schedule {self.schedule}) makes "
                f"{pp * v} stages, but the model has only {n} layer{'s' * (n != 1)}: "
                f"every stage needs at least one. Use {how}, a smaller --pp, or a model of "
                f"{pp * v} layers or more (ringtrain's GPT has --n-layer + 2: its embedding "
                "and head are layers too)")
        stages = partition(seq, pp * v, self.split)
        chunks = [stages[place.stage(g.pp_rank, c)].to(self.runtime.device) for c in range(v)]
        stage = chunks[0] if v == 1 else nn.ModuleList(chunks)
        self.stage = stage
        self.names = StageNames.of(model, stages, stage)
        self.slices = StageSlices.of(stage, self.names.keys, g.tp_rank, tp)
        self._param_names = portable.param_names(model)  # id -> name, for the optimizer

        # Tied weights: one group per (tie, pipeline, tp rank), created by every rank in the
        # same order. Under tp each holder has one slice of the tie (`parallelize` cut it
        # alike for the embedding and the lm_head): the stages' tp rank t hold the same rows.
        self._ties: list[tuple[nn.Parameter, dist.ProcessGroup]] = []
        # tied copies whose norm another stage counts
        self._norm_counted_elsewhere: set[int] = set()
        # A tie between two chunks of one rank is one parameter object there: autograd sums it.
        local = {id(p): p for p in stage.parameters()}
        for tie in tied_parameters(stages):
            ranks = sorted({place.where(k)[0] for k in tie.stages})
            if len(ranks) < 2:
                continue
            for d, t in itertools.product(range(self.grid.dp), range(tp)):
                group = dist.new_group([self.grid.rank_of(d, r, t) for r in ranks])
                if (d, t) == (g.dp_rank, g.tp_rank) and g.pp_rank in ranks:
                    k = next(k for k in tie.stages if place.where(k)[0] == g.pp_rank)
                    param = dict(stages[k].named_parameters())[dict(tie.holders)[k]]
                    self._ties.append((local[id(param)], group))
                    if g.pp_rank != ranks[0]:
                        self._norm_counted_elsewhere.add(id(param))
        # The clip norm counts a parameter every tp rank holds whole once, on tp rank 0.
        if g.tp_rank > 0:
            whole = {key for key, names in self.names.keys.items()
                     if not any(self.slices.is_sliced(n) for n in names)}
            self._norm_counted_elsewhere |= {id(p) for key, p in stage.named_parameters()
                                             if key in whole}

        self.ddp: list[nn.Module] | None = None
        if self.grid.dp > 1:
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
            pp_group=g.pp_group, grad_group=self.grad_group, loss_fn=loss_fn,
            schedule=self.schedule,
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
        m = self.microbatches or default_microbatches(x.shape[0], self.grid.pp, self.schedule)
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
        # Every tp rank of the last stage computed the same loss on the same samples: one counts.
        counted = self.groups.tp_rank == 0
        return StepResult((stats.loss_sum or 0.0) if counted else 0.0,
                          stats.count if counted else 0, stats.busy_s + step_s,
                          stats.wait_s + comm_s)

    def _clip(self, max_norm: float) -> float:
        """Clip by the 2-norm over every stage's gradients (as clip_grad_norm_ on the whole
        model): each stage sums its squares, over its tp slices, and the pipeline adds them up.
        A tied weight and a weight every tp rank holds whole count once; data-parallel peers
        hold equal, already averaged gradients."""
        grads = [p.grad for p in self.stage.parameters()
                 if p.grad is not None and id(p) not in self._norm_counted_elsewhere]
        sq = torch.zeros((), dtype=torch.float32, device=self.runtime.device)
        for grad in grads:
            sq += grad.detach().float().pow(2).sum()
        if self.grid.tp > 1:
            collectives.all_reduce(sq, group=self.groups.tp_group)
        if self.grid.pp > 1:
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
            out = self.engine.forward_only(x.to(self.runtime.device))
        finally:
            self.stage.train(was_training)
        if self.grid.tp == 1 or out is None:
            return out
        logits = comm.all_gather(out, -1, self.groups.tp_group)  # (B, T, V/tp) -> (B, T, V)
        return logits if self.groups.tp_rank == 0 else None  # each sample scored once

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's state under its own names, gathered from every stage (and its tp
        slices); equal on all ranks (a collective over the tp and pipeline groups)."""
        own = self.stage.state_dict()
        local = {name: own[key].detach().cpu().clone() for name, key in self.names.local.items()}
        local = self.slices.gather(local, self.groups.tp_group)
        if self.grid.pp == 1:
            return {name: local[name] for name in self.names.order}
        parts: list[dict[str, torch.Tensor] | None] = [None] * self.grid.pp
        collectives.all_gather_object(parts, local, group=self.groups.pp_group)
        full: dict[str, torch.Tensor] = {}
        for part in parts:
            full.update(part or {})
        return {name: full[name] for name in self.names.order}

    def _layout(self) -> dict[str, int]:
        tp = {"tp": self.grid.tp, "tp_rank": self.groups.tp_rank} if self.grid.tp > 1 else {}
        return {"world_size": self.grid.world_size, "pp": self.grid.pp,
                "dp": self.grid.dp, "pp_rank": self.groups.pp_rank, **tp,
                **({"virtual_stages": self.virtual_stages} if self.virtual_stages > 1 else {})}

    def state_layout(self) -> dict[str, Any]:
        """Stages hold other layers under another pp or number of chunks, other slices under
        another tp."""
        return {"pp": self.grid.pp, "virtual_stages": self.virtual_stages,
                **({"tp": self.grid.tp} if self.grid.tp > 1 else {})}

    def state_dict(self) -> dict[str, Any]:
        # The model's names make it convertible to the layout-free form (`to_portable`).
        state = {"layout": self._layout(), "stage": self.stage.state_dict(),
                 "optimizer": self.optimizer.state_dict(), "names": self.names.keys,
                 "param_names": portable.optimizer_param_names(self.optimizer,
                                                               self._param_names)}
        if self.grid.tp > 1:
            state["splits"] = self.slices.to_dict()  # how to put the tp slices together
        return state

    @classmethod
    def to_portable(cls, read_parts: Callable[[list[int]], dict[int, dict[str, Any]]],
                    shared: dict[str, Any] | None,
                    metadata: dict[str, Any]) -> dict[str, Any] | None:
        """The stages of the first pipelines (dp_rank 0; the others hold the same), each
        stage's tensors under the model's names, its tp slices put together."""
        layout = read_parts([0])[0]["layout"]
        grid = make_grid(int(layout["world_size"]), int(layout["pp"]), int(layout.get("tp", 1)))
        stages = [grid.tp_group_ranks(0, s) for s in range(grid.pp)]
        parts = read_parts([r for ranks in stages for r in ranks])
        if any("names" not in p for p in parts.values()):
            raise ConfigError("this pipeline snapshot was written by a ringtrain that did not "
                              "name the stages' tensors: resume it with --strategy pipeline "
                              f"--pp {layout['pp']}")
        model: dict[str, torch.Tensor] = {}
        optimizers = []
        for ranks in stages:
            splits = parts[ranks[0]].get("splits", {})
            model.update(join_slices([model_tensors({r: parts[r]}) for r in ranks], splits))
            optimizers.append({"state": join_slices(
                [portable.optimizer_by_name(parts[r]["optimizer"],
                                            parts[r]["param_names"])["state"] for r in ranks],
                splits)})
        return portable.make(model, portable.merge(optimizers))

    def load_portable_state_dict(self, state: dict[str, Any]) -> None:
        portable.check(state)
        portable.load_model(self.stage, self.slices.cut(state["model"]), names=self.names.keys)
        names = portable.optimizer_param_names(self.optimizer, self._param_names)
        mine = {n: self.slices.cut_entry(n, s) for n, s in state["optimizer"]["state"].items()
                if n in set(names)}  # this stage's parameters' moments, this tp rank's slices
        portable.load_optimizer(self.optimizer, names, {"state": mine})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved, now = state.get("layout"), self._layout()
        if saved != now:
            raise ConfigError(
                f"this pipeline state was saved with layout {saved} but this rank runs {now}: "
                f"stages hold different layers, so it cannot be loaded here. Restart with "
                f"--pp {saved and saved['pp']}"
                + (f" --tp {saved['tp']}" if saved and saved.get("tp", 1) > 1 else "")
                + f" and --nproc-per-node {saved and saved['world_size']}, "
                "or resume from the full model state (model_state_dict)"
            )
        self.stage.load_state_dict(state["stage"])
        self.optimizer.load_state_dict(state["optimizer"])

    def close(self) -> None:
        """Drop references to the stage and its groups (destroy_distributed frees the groups)."""
        self.engine = self.ddp = None  # type: ignore[assignment]
