"""Tensor parallelism (Megatron-LM) inside each data-parallel replica: dp x tp.

    ringtrain train --strategy tp --tp 2 --nproc-per-node 2      # one replica split in two
    ringtrain train --strategy tp --tp 2 --nproc-per-node 4      # dp 2 x tp 2
    ringtrain train --strategy tp --tp 2 --zero-stage 2 --nproc-per-node 4   # + ZeRO 2 on dp

Ranks form a `ringtrain.grid.Grid` with pp=1 (tp innermost: a tp group is consecutive ranks, one
host). Each replica's GPT is parallelised by `gpt_plan()`: every rank holds 1/tp of each
matrix (heads, MLP width, vocabulary) and the loss is `vocab_parallel_cross_entropy` of the
vocab-sharded logits, which never gathers them. Gradients of the parameters every tp rank holds
whole (layer norms, position embedding, row-parallel biases) come out equal on every tp rank
(the region boundaries sum their inputs' gradients over the group; under --sequence-parallel
the plan sums the norms' over the group, as each rank saw its tokens only), so they need
nothing more; the data-parallel mean runs over the dp group only, on each rank's own slices.

`--zero-stage 1|2|3` shards along the data-parallel axis what each rank holds of its slices: the
tp-local module (this rank's slices and the whole parameters) goes into ZeRO's
`ZeroDataParallel` over the dp group, so the slices' AdamW moments (1) and gradients (2) are
cut dp ways (3: and the slices themselves, gathered over the dp group around each block's
forward and backward), the dp mean is ZeRO's reduce-scatter, and the updated parts are
all-gathered. The two axes never meet inside ZeRO: its collectives run on the dp group, tp's
inside autograd on the tp group (so recomputed blocks and sequence parallelism's gradient sums
work under it unchanged).

A separate strategy, not a `--tp` of ddp: its state is per rank and sharded (ddp's is one
replicated copy), its loss and eval logits go through the tp group, and its clip norm sums
slices; as a ddp option each of those would be an `if tp > 1` in ddp's methods.
Tied embeddings (--tie-embeddings) are one slice of rows on each rank, the vocab-parallel
embedding's and the column-parallel lm_head's (`parallelize` ties the slices again).
Dropout: the tp ranks of a replica draw one stream (`seed_rank`), so what they hold whole is
masked alike; their heads, and their tokens under --sequence-parallel, from streams of their
own (`tensor_parallel.rng`).
`--recompute-gather` (with --sequence-parallel): the column layers keep their input's shard for
backward and all-gather it again there, so every saved activation is 1/tp.
Not yet: with --pp (refused with --strategy tp; `--strategy pipeline --tp` is that layout).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ringtrain.errors import ConfigError
from ringtrain.grid import Grid, create_process_groups
from ringtrain.runtime import Runtime
from ringtrain.strategies import layouts, portable
from ringtrain.strategies.base import EvalShard, StepResult, Strategy, StrategyConfig
from ringtrain.strategies.figures import Figures, Workload, all_reduce_share
from ringtrain.strategies.step import accumulate, lr_into, optimizer_step
from ringtrain.strategies.tp_options import (
    check_recompute_gather,
    check_tp_model,
    recompute_gather_option,
    sequence_parallel_option,
    tp_option,
    zero_stage_option,
)
from ringtrain.tensor_parallel import (
    comm,
    gpt_plan,
    parallelize,
    vocab_parallel_cross_entropy,
)
from ringtrain.tensor_parallel.plan import PlanMismatchError
from ringtrain.tensor_parallel.state import Split, param_splits, shard_named, unshard, unshard_named
from ringtrain.types import LossFn, OptimizerFn
from ringtrain.zero import state as zero_state
from ringtrain.zero.shard import STAGES, expected_bytes
from ringtrain.zero.sharded import ZeroDataParallel


@dataclass(frozen=True, kw_only=True)
class TPFigures(Figures):
    """`--strategy tp`'s figures: the dp all-reduce of a rank's slices, and tp's activations."""

    tp: int
    zero_stage: int  # ZeRO on the dp axis (0: none)
    dp_sent_bytes: float  # this rank's gradients over the dp group (ring; ZeRO's collectives)
    tp_sent_bytes: float | None  # activations' all-reduces over the tp group (None: unknown)
    # Saved for backward per rank in one micro-batch (`volumes.activation_bytes`; None: unknown)
    activation_bytes: float | None


@dataclass(frozen=True, kw_only=True)
class TPConfig(StrategyConfig):
    """`--strategy tp`'s options."""

    chosen_by = ("tp",)  # --tp without --strategy (and without --pp, which picks pipeline)

    tp: int = tp_option(2)
    sequence_parallel: bool = sequence_parallel_option()
    recompute_gather: bool = recompute_gather_option()
    zero_stage: int = zero_stage_option(0, (0, *STAGES))

    def plan(self, world_size: int, step_batch: int) -> int:
        check_recompute_gather(self.recompute_gather, self.sequence_parallel)
        try:
            return Grid(world_size, tp=self.tp).dp
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def check_model(self, model: Any, sequence_length: int | None = None,
                    vocab_size: int | None = None) -> None:
        """Heads, the vocabulary and (SP) the sequence split across the tp ranks."""
        check_tp_model(model, self.tp, "--strategy tp",
                       sequence_length if self.sequence_parallel else None, vocab_size)

    def figures(self, workload: Workload) -> TPFigures:
        """`ringtrain plan`'s figures of this layout (`strategies.layouts`): per rank 1/tp of
        the split parameters and the whole ones (norms, position embedding, row biases), their
        gradients and AdamW moments, ZeRO dividing them by dp; the dp group's ring all-reduce of
        the gradients (ZeRO's reduce-scatter and all-gather, the same bytes); the tp group's
        activation collectives, per layer 2 forward and 2 backward of b x s x h
        (`tensor_parallel.volumes`), and the activations saved for backward. Where the workload
        lacks the GPT's shape: 1/tp of a replica, and no activation figures."""
        dp = self.plan(workload.world_size, workload.step_batch)
        w = workload
        if not (w.sample_numel and w.n_layer and w.block_size and w.vocab_size):
            own = {k: v / self.tp for k, v in w.replica().items()}
            if self.zero_stage:
                own = {f"{k}_bytes": v for k, v in
                       expected_bytes(w.params // self.tp, dp, self.zero_stage).items()}
            dp_sent = all_reduce_share(dp) * w.model_bytes / self.tp
            return TPFigures(data_ranks=dp, **own, sent_bytes=None, tp=self.tp,
                             zero_stage=self.zero_stage, dp_sent_bytes=dp_sent,
                             tp_sent_bytes=None, activation_bytes=None)
        shape = layouts.ModelShape(w.n_layer, w.sample_numel // w.block_size, self.tp,
                                   w.vocab_size, w.block_size, w.params, w.whole_params)
        layout = layouts.Layout(dp, 1, self.tp, self.zero_stage, self.sequence_parallel,
                                self.recompute_gather)
        f = layouts.layout_figures(layout, shape, batch=w.step_batch)
        micro = layouts.layout_figures(layout, shape, batch=w.step_batch // w.grad_accum)
        return TPFigures(data_ranks=dp, params_bytes=f.params_bytes, grads_bytes=f.grads_bytes,
                         optimizer_bytes=f.optimizer_bytes, sent_bytes=f.sent_bytes, tp=self.tp,
                         zero_stage=self.zero_stage, dp_sent_bytes=f.dp_sent_bytes,
                         tp_sent_bytes=f.tp_sent_bytes,
                         activation_bytes=micro.activation_sp_bytes)


class TPStrategy(Strategy):
    """dp x tp: Megatron-LM tensor parallelism in each replica, data parallelism across them.

    Args:
        runtime: this process's `Runtime` (rank, world_size, device, process_group).
        tp: the tensor-parallel degree (--tp); must divide the world size.
        sequence_parallel: `gpt_plan(sequence_parallel=True)` (--sequence-parallel).
        recompute_gather: with it, `gpt_plan(recompute_gather=True)` (--recompute-gather).
        zero_stage: 0 (no ZeRO), 1, 2 or 3: ZeRO over the dp group of this rank's module.
    """

    name = "tp"
    Config = TPConfig

    def __init__(self, runtime: Runtime, *, tp: int = 2, sequence_parallel: bool = False,
                 recompute_gather: bool = False, zero_stage: int = 0):
        self.runtime, self.tp, self.sequence_parallel = runtime, tp, sequence_parallel
        self.recompute_gather, self.zero_stage = recompute_gather, int(zero_stage)
        # The pre-launch checks again (a script builds the strategy without the command line).
        TPConfig(tp=tp, sequence_parallel=sequence_parallel, recompute_gather=recompute_gather,
                 zero_stage=self.zero_stage).plan(runtime.world_size, 1)
        self.grid = Grid(runtime.world_size, tp=tp)
        self.groups = None
        self.module: nn.Module | None = None
        self.zero: ZeroDataParallel | None = None  # --zero-stage 1, 2: the dp axis's wrapper

    # -- set-up ---------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer_fn: OptimizerFn, loss_fn: LossFn) -> None:
        self.groups = create_process_groups(self.grid, self.runtime.rank)
        try:
            plan = gpt_plan(sequence_parallel=self.sequence_parallel,
                            recompute_gather=self.recompute_gather)
            model = parallelize(model, plan, self.groups.tp_group)
        except PlanMismatchError as e:
            raise ConfigError(e.for_strategy(f"--strategy tp --tp {self.tp}")) from None
        except (TypeError, ValueError) as e:  # n_head or vocab not divisible
            raise ConfigError(f"--strategy tp --tp {self.tp}: {e}") from None
        self.module = model.to(self.runtime.device)
        self.splits = param_splits(self.module)
        if self.zero_stage:
            # ZeRO shards this rank's module (its slices, the whole parameters) over the ranks
            # holding the same slices; the tp collectives stay inside the module's autograd.
            self.zero = ZeroDataParallel(self.module, optimizer_fn, stage=self.zero_stage,
                                         process_group=self.groups.dp_group)
            self.zero.trace(self.tracer)
            self.optimizer = self.zero.optimizer
        else:
            self.optimizer = optimizer_fn(self.module.parameters())
        tp_group = self.groups.tp_group
        # The plan's lm_head leaves the logits split by vocabulary: the loss is the
        # cross-entropy of ringtrain's `loss_fn` (mean over targets, -1 ignored), computed
        # without gathering them (`vocab_parallel_cross_entropy`).
        self.loss_fn = lambda logits, y: vocab_parallel_cross_entropy(logits, y, tp_group)

    @property
    def data_rank(self) -> int | None:
        return self.grid.coords(self.runtime.rank).dp_rank  # the tp ranks of a replica read alike

    @property
    def data_world_size(self) -> int:
        return self.grid.dp

    def _tp_rank(self) -> int:
        return self.grid.coords(self.runtime.rank).tp_rank

    def seed_rank(self, rank: int) -> int:
        """The first rank of `rank`'s tp group: the tp ranks of a replica draw one stream, so
        a dropout of what they hold whole masks it alike (`tensor_parallel.rng` draws what
        each holds a part of from a stream of its own)."""
        return rank - self.grid.coords(rank).tp_rank

    # -- the step ----------------------------------------------------------------------------
    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, lr: float,
                   grad_clip: float | None) -> StepResult:
        assert self.module is not None and self.groups is not None, "setup() first"
        start = time.perf_counter()
        lr_into(self.optimizer, lr)
        acc = accumulate(micro_batches, self.zero or self.module, self.loss_fn,
                         device=self.runtime.device, tracer=self.tracer,
                         no_sync=self.zero.no_sync if self.zero else None)
        comm_s = 0.0  # ZeRO's reduce-scatters overlap backward: counted as compute, as zero's
        if self.grid.dp > 1 and self.zero is None:
            began = time.perf_counter()
            with self.tracer.span("all-reduce dp"):
                self._average_over_dp()
            comm_s = time.perf_counter() - began
        optimizer_step(self.optimizer, self.tracer, grad_clip=grad_clip, clip=self._clip)
        elapsed = time.perf_counter() - start
        # Every tp rank of a replica computed the same loss on the same samples: one counts it.
        first = self._tp_rank() == 0
        return StepResult(loss_sum=acc.loss_sum if first else 0.0, count=acc.count if first else 0,
                          compute_s=elapsed - comm_s, comm_s=comm_s)

    def _average_over_dp(self) -> None:
        """The mean of each rank's slices' gradients over its dp group, in one flat buffer (the
        naive form of a bucketed reducer: one all-reduce per step, after backward)."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat = comm.all_reduce(flat, self.groups.dp_group).div_(self.grid.dp)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def _clip(self, max_norm: float) -> torch.Tensor:
        """torch's `clip_grad_norm_` of the whole model: each slice's squares summed over the tp
        group, the parameters held whole counted once (they are equal on every tp rank).
        Under ZeRO each rank holds a dp shard of its slices: the squares of the world's shards
        are summed, the whole parameters' on tp rank 0 only."""
        first = self._tp_rank() == 0
        if self.zero is not None:
            whole = () if first else {n for n, s in self.splits.items() if s.dim is None}
            return self.zero.clip_grad_norm_(max_norm, skip=whole,
                                             norm_group=self.runtime.process_group)
        squares = torch.zeros((), device=self.runtime.device, dtype=torch.float32)
        for name, p in self.module.named_parameters():
            if p.grad is not None and (self.splits[name].dim is not None or first):
                squares += p.grad.detach().float().pow(2).sum()
        total = comm.all_reduce(squares, self.groups.tp_group).sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.detach().mul_(coef.to(p.grad.dtype))
        return total

    # -- evaluation and state -------------------------------------------------------------------
    def eval_shard(self) -> EvalShard | None:
        # Every tp rank of a replica runs the same batches (the forward is collective over the
        # tp group, so the shapes must match); only the first returns logits, so a sample is
        # scored once.
        return EvalShard(self.data_rank, self.grid.dp)

    @torch.no_grad()
    def eval_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        assert self.module is not None and self.groups is not None, "setup() first"
        was_training = self.module.training
        self.module.eval()
        try:
            local = (self.zero or self.module)(x.to(self.runtime.device))  # (B, T, V/tp)
        finally:
            self.module.train(was_training)
        logits = comm.all_gather(local, -1, self.groups.tp_group)  # (B, T, V)
        return logits if self._tp_rank() == 0 else None

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's tensors by the plain GPT's names (collective over the tp group)."""
        assert self.module is not None and self.groups is not None, "setup() first"
        out = {}
        # ZeRO: the parts updated by the other dp ranks gathered first.
        local = self.zero.full_state_dict() if self.zero else self.module.state_dict()
        for name, t in local.items():
            split = self.splits.get(name, Split(None))
            if split.dim is None:
                out[name] = t.clone()
            else:
                gathered = comm.all_gather(t.unsqueeze(0), 0, self.groups.tp_group)
                out[name] = unshard(list(gathered.unbind(0)), split)
        return out

    def _names(self) -> list[str]:
        return portable.optimizer_param_names(self.optimizer, portable.param_names(self.module))

    def state_dict(self) -> dict[str, Any]:
        assert self.module is not None, "setup() first"
        layout = {"tp": self.tp, "splits": {k: (s.dim, s.chunks) for k, s in self.splits.items()}}
        if self.zero is not None:  # this rank's dp shard of its slices (ZeRO's flat layout)
            return {"zero": self.zero.shard_state_dict(), **layout}
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "param_names": self._names(), **layout}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.module is not None, "setup() first"
        if state.get("tp") != self.tp:
            raise ConfigError(f"this tp state was saved with --tp {state.get('tp')}, this rank "
                              f"runs --tp {self.tp}: each rank holds other slices; resume with "
                              f"--tp {state.get('tp')} or through the layout-free form")
        if (self.zero is None) != ("zero" not in state):
            raise ConfigError("this tp state was saved with"
                              f"{'' if 'zero' in state else 'out'} ZeRO, this run has "
                              f"--zero-stage {self.zero_stage}: resume with the saved "
                              "--zero-stage or through the layout-free form")
        if self.zero is not None:
            self.zero.load_shard_state_dict(state["zero"])
            return
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def state_layout(self) -> dict[str, Any]:
        # Another tp degree or ZeRO stage resumes through the layout-free form.
        return {"tp": self.tp, **({"zero_stage": self.zero_stage} if self.zero_stage else {})}

    @classmethod
    def to_portable(cls, read_parts: Callable[[list[int]], dict[int, dict[str, Any]]],
                    shared: dict[str, Any] | None,
                    metadata: dict[str, Any]) -> dict[str, Any] | None:
        """The tp ranks' slices put back together: replica 0's (the replicas are equal), or
        under ZeRO each slice's dp shards first (`zero.state.to_named`)."""
        first = read_parts([0])[0]
        tp, splits = int(first["tp"]), {k: Split(*v) for k, v in first["splits"].items()}
        if "zero" in first:
            dp = int(metadata["world_size"]) // tp
            named = []
            for t in range(tp):  # tp rank t's slice is sharded over the ranks d * tp + t
                parts = read_parts([d * tp + t for d in range(dp)])
                try:
                    named.append(zero_state.to_named([p["zero"] for _, p in sorted(parts.items())]))
                except ValueError as e:
                    raise ConfigError(str(e)) from None
            model, optimizer = unshard_named([m for m, _ in named], [o for _, o in named], splits)
            return portable.make(model, {"state": optimizer})
        parts = read_parts(list(range(tp)))  # replica 0: ranks 0..tp-1 (tp innermost)
        states = [parts[r] for r in range(tp)]
        by_name = [portable.optimizer_by_name(s["optimizer"], s["param_names"])["state"]
                   for s in states]
        model, optimizer = unshard_named([s["model"] for s in states], by_name, splits)
        return portable.make(model, {"state": optimizer})

    def load_portable_state_dict(self, state: dict[str, Any]) -> None:
        assert self.module is not None, "setup() first"
        portable.check(state)
        sliced, opt = shard_named(state["model"], state["optimizer"]["state"], self.splits,
                                  self._tp_rank(), self.tp)
        if self.zero is not None:
            params = {n for n, _ in self.module.named_parameters()}
            self.zero.load_named_state({k: v for k, v in sliced.items() if k in params}, opt)
            return
        portable.load_model(self.module, sliced)
        portable.load_optimizer(self.optimizer, self._names(), {"state": opt})

    def stats(self) -> dict[str, Any]:
        if self.zero is None:
            return {}
        return {"zero_stage": self.zero_stage,
                **{f"zero_{k}": v for k, v in self.zero.memory().items()}}

    def close(self) -> None:
        if self.zero is not None:
            self.zero.remove_hooks()

