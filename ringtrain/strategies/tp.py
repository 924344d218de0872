"""Tensor parallelism (Megatron-LM) inside each data-parallel replica: dp x tp.

    ringtrain train --strategy tp --tp 2 --nproc-per-node 2      # one replica split in two
    ringtrain train --strategy tp --tp 2 --nproc-per-node 4      # dp 2 x tp 2

Ranks form a `ringtrain.grid.Grid` with pp=1 (tp innermost: a tp group is consecutive ranks, one
host). Each replica's GPT is parallelised by `gpt_plan()`: every rank holds 1/tp of each
matrix (heads, MLP width, vocabulary) and the loss is `vocab_parallel_cross_entropy` of the
vocab-sharded logits, which never gathers them. Gradients of the parameters every tp rank holds
whole (layer norms, position embedding, row-parallel biases) come out equal on every tp rank
(the region boundaries sum their inputs' gradients over the group; under --sequence-parallel
the plan sums the norms' over the group, as each rank saw its tokens only), so they need
nothing more; the data-parallel mean runs over the dp group only, on each rank's own slices.

A separate strategy, not a `--tp` of ddp: its state is per rank and sharded (ddp's is one
replicated copy), its loss and eval logits go through the tp group, and its clip norm sums
slices; as a ddp option each of those would be an `if tp > 1` in ddp's methods.
Not yet: with --pp, ZeRO (other strategies: their flags are refused with --strategy tp),
dropout > 0 (needs the same RNG on every tp rank), tied embeddings, `recompute_gather`.
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
from ringtrain.strategies import portable
from ringtrain.strategies.base import EvalShard, StepResult, Strategy, StrategyConfig
from ringtrain.strategies.figures import Figures, Workload, all_reduce_share
from ringtrain.strategies.step import accumulate, lr_into, optimizer_step
from ringtrain.strategies.tp_options import sequence_parallel_option, tp_option
from ringtrain.tensor_parallel import (
    comm,
    gpt_plan,
    parallelize,
    vocab_parallel_cross_entropy,
)
from ringtrain.tensor_parallel.state import Split, param_splits, shard, unshard
from ringtrain.types import LossFn, OptimizerFn


@dataclass(frozen=True, kw_only=True)
class TPFigures(Figures):
    """`--strategy tp`'s figures: the dp all-reduce of a rank's slices, and tp's activations."""

    tp: int
    dp_sent_bytes: float  # ring all-reduce of this rank's gradients over the dp group
    tp_sent_bytes: float | None  # activations' all-reduces over the tp group (None: unknown)


@dataclass(frozen=True, kw_only=True)
class TPConfig(StrategyConfig):
    """`--strategy tp`'s options."""

    chosen_by = ("tp",)  # --tp without --strategy (and without --pp, which picks pipeline)

    tp: int = tp_option(2)
    sequence_parallel: bool = sequence_parallel_option()

    def plan(self, world_size: int, step_batch: int) -> int:
        try:
            return Grid(world_size, tp=self.tp).dp
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def check_model(self, model: Any) -> None:
        """Heads split across the tp ranks; what the strategy does not do yet, refused. (The
        vocabulary comes from the data: a --tp that does not divide it is refused by `setup`.)"""
        if model.n_head % self.tp:
            divisors = [d for d in range(1, model.n_head + 1) if model.n_head % d == 0]
            raise ConfigError(f"--n-head {model.n_head} is not divisible by --tp {self.tp}: each "
                              f"tp rank computes n_head / tp heads; use --tp in {divisors} or "
                              f"--n-head a multiple of {self.tp}")
        if model.tie_embeddings:
            raise ConfigError("--strategy tp does not split tied embeddings yet (the token "
                              "embedding and lm_head would need one vocab-parallel weight): "
                              "drop --tie-embeddings")
        if model.dropout > 0:
            raise ConfigError(f"--strategy tp does not support dropout yet (--dropout "
                              f"{model.dropout}): the activations every tp rank holds whole "
                              "would need the same dropout mask on each; use --dropout 0")

    def figures(self, workload: Workload) -> TPFigures:
        """1/tp of the parameters, gradients and AdamW moments per rank (the norms and the
        position embedding, held whole, are left out of the count); the dp group all-reduces
        those gradients; the tp group all-reduces activations: per layer 2 forward and 2
        backward of b x s x h (`tensor_parallel.volumes`, where the workload gives the shape);
        under sequence parallelism the same bytes as all-gathers and reduce-scatters (the norms'
        gradient sums and the loss's (b x s) floats are left out)."""
        dp = self.plan(workload.world_size, workload.step_batch)
        own = {k: v / self.tp for k, v in workload.replica().items()}
        dp_sent = all_reduce_share(dp) * workload.model_bytes / self.tp
        tp_sent = None
        if workload.sample_numel and workload.n_layer:
            a = workload.step_batch * workload.sample_numel * 4  # b*s*h fp32, whole step
            tp_sent = all_reduce_share(self.tp) * a * (4 * workload.n_layer + 2)
        sent = None if tp_sent is None else dp_sent + tp_sent
        return TPFigures(data_ranks=dp, **own, sent_bytes=sent, tp=self.tp,
                         dp_sent_bytes=dp_sent, tp_sent_bytes=tp_sent)


class TPStrategy(Strategy):
    """dp x tp: Megatron-LM tensor parallelism in each replica, data parallelism across them.

    Args:
        runtime: this process's `Runtime` (rank, world_size, device, process_group).
        tp: the tensor-parallel degree (--tp); must divide the world size.
        sequence_parallel: `gpt_plan(sequence_parallel=True)` (--sequence-parallel).
    """

    name = "tp"
    Config = TPConfig

    def __init__(self, runtime: Runtime, *, tp: int = 2, sequence_parallel: bool = False):
        self.runtime, self.tp, self.sequence_parallel = runtime, tp, sequence_parallel
        try:
            self.grid = Grid(runtime.world_size, tp=tp)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.groups = None
        self.module: nn.Module | None = None

    # -- set-up ---------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer_fn: OptimizerFn, loss_fn: LossFn) -> None:
        _refuse_not_yet(model)
        self.groups = create_process_groups(self.grid, self.runtime.rank)
        try:
            model = parallelize(model, gpt_plan(sequence_parallel=self.sequence_parallel),
                                self.groups.tp_group)
        except (TypeError, ValueError) as e:  # n_head or vocab not divisible, tied embeddings
            raise ConfigError(f"--strategy tp --tp {self.tp}: {e}") from None
        self.module = model.to(self.runtime.device)
        self.splits = param_splits(self.module)
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

    # -- the step ----------------------------------------------------------------------------
    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, lr: float,
                   grad_clip: float | None) -> StepResult:
        assert self.module is not None and self.groups is not None, "setup() first"
        start = time.perf_counter()
        lr_into(self.optimizer, lr)
        acc = accumulate(micro_batches, self.module, self.loss_fn, device=self.runtime.device,
                         tracer=self.tracer)
        comm_s = 0.0
        if self.grid.dp > 1:
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
        group, the parameters held whole counted once (they are equal on every tp rank)."""
        first = self._tp_rank() == 0
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
            local = self.module(x.to(self.runtime.device))  # (B, T, V/tp)
        finally:
            self.module.train(was_training)
        logits = comm.all_gather(local, -1, self.groups.tp_group)  # (B, T, V)
        return logits if self._tp_rank() == 0 else None

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's tensors by the plain GPT's names (collective over the tp group)."""
        assert self.module is not None and self.groups is not None, "setup() first"
        out = {}
        for name, t in self.module.state_dict().items():
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
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "param_names": self._names(), "tp": self.tp,
                "splits": {k: (s.dim, s.chunks) for k, s in self.splits.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.module is not None, "setup() first"
        if state.get("tp") != self.tp:
            raise ConfigError(f"this tp state was saved with --tp {state.get('tp')}, this rank "
                              f"runs --tp {self.tp}: each rank holds other slices; resume with "
                              f"--tp {state.get('tp')} or through the layout-free form")
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def state_layout(self) -> dict[str, Any]:
        return {"tp": self.tp}  # another tp degree resumes through the layout-free form

    @classmethod
    def to_portable(cls, read_parts: Callable[[list[int]], dict[int, dict[str, Any]]],
                    shared: dict[str, Any] | None,
                    metadata: dict[str, Any]) -> dict[str, Any] | None:
        """Replica 0's tp ranks' slices put back together (the replicas are equal)."""
        tp = int(read_parts([0])[0]["tp"])
        parts = read_parts(list(range(tp)))  # replica 0: ranks 0..tp-1 (tp innermost)
        states = [parts[r] for r in range(tp)]
        splits = {k: Split(*v) for k, v in states[0]["splits"].items()}
        model = {k: unshard([s["model"][k] for s in states], splits.get(k, Split(None)))
                 for k in states[0]["model"]}
        by_name = [portable.optimizer_by_name(s["optimizer"], s["param_names"])["state"]
                   for s in states]
        optimizer = {name: {key: unshard([b[name][key] for b in by_name], splits[name])
                            if isinstance(v, torch.Tensor) else v
                            for key, v in entry.items()}
                     for name, entry in by_name[0].items()}
        return portable.make(model, {"state": optimizer})

    def load_portable_state_dict(self, state: dict[str, Any]) -> None:
        assert self.module is not None, "setup() first"
        portable.check(state)
        r = self._tp_rank()
        sliced = {k: shard(v, self.splits.get(k, Split(None)), r, self.tp)
                  for k, v in state["model"].items()}
        portable.load_model(self.module, sliced)
        opt = {name: {key: shard(v, self.splits[name], r, self.tp)
                      if isinstance(v, torch.Tensor) else v for key, v in entry.items()}
               for name, entry in state["optimizer"]["state"].items() if name in self.splits}
        portable.load_optimizer(self.optimizer, self._names(), {"state": opt})


def _refuse_not_yet(model: nn.Module) -> None:
    """What the strategy does not do yet, refused before any process group is made."""
    drop = [n for n, m in model.named_modules()
            if (isinstance(m, nn.Dropout) and m.p > 0)
            or (isinstance(getattr(m, "dropout", None), float) and m.dropout > 0)]
    if drop:
        raise ConfigError(f"--strategy tp does not support dropout yet ({drop[:3]} have p > 0): "
                          "the replicated activations would need the same RNG on every tp rank; "
                          "use --dropout 0")
