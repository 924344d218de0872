"""Layouts of a GPT over a world of ranks (dp x pp x tp, ZeRO on dp): what a rank holds and sends.

    rows = [layout_figures(layout, shape, batch=8) for layout in layouts(8, shape, host=8)]
    best, rule = recommend(rows, memory_bytes=16 * 2**30)

The figures of `ringtrain plan`'s layout table and of `ringtrain explain` for `--strategy tp`
(`TPConfig.figures`): the same functions, so the two never disagree. Pure (no process group,
no model built: the caller counts the parameters, `ringtrain.cli.plan` on the meta device).

Per rank, in bytes (fp32 AdamW, the textbook count of `figures.py`):
- parameters 4, gradients 4, AdamW moments 8 per parameter the rank holds: its pipeline stage's,
  of which the tp-split ones / tp (`tensor_parallel.volumes.whole_params` stay whole); ZeRO on
  the dp axis divides the moments (1), the gradients (2) and the parameters (3) by dp.
- activations saved for backward: `tensor_parallel.volumes.activation_bytes` of the stage's
  layers on the samples it holds at once (a replica's batch; a pipeline stage: 1F1B keeps up to
  pp of its 4 x pp micro-batches, a quarter of the batch; its head counted on every stage, an
  upper bound), with and without sequence parallelism.
- sent per step: the dp group's ring all-reduce of the rank's gradients (ZeRO 1, 2: a
  reduce-scatter and an all-gather, the same bytes; ZeRO 3: one more all-gather); the tp
  group's activation collectives (`tensor_parallel.volumes.expected_bytes`, ring share per op);
  a pipeline stage's activations out and gradients back (b x s x h each, b x s/tp x h under
  sequence parallelism: each tp rank sends its own slice of the sequence, the same tp rank of
  the next stage receives it; a middle stage both). Counted to the byte by
  `benchmarks/tensor_parallel.py` (tp 2 x pp 2, 1F1B, with and without sequence parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ringtrain.strategies.figures import ADAMW_BYTES, FP32_BYTES, all_reduce_share, gather_share
from ringtrain.tensor_parallel.volumes import (
    activation_bytes,
    expected_bytes,
    ring_bytes_per_rank,
)

ZERO_STAGES = (0, 1, 2, 3)  # 0: no ZeRO


@dataclass(frozen=True)
class ModelShape:
    """The GPT's sizes, and its parameters per pipeline degree.

    Args:
        n_layer, n_embd, n_head, vocab_size, block_size: the GPT's.
        params: all its parameters.
        whole: those tp keeps whole on every rank (`volumes.whole_params`).
        stages: pp -> per stage (parameters, whole ones, transformer layers), as the pipeline
            splits it; pp 1 need not be given.
    """

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    block_size: int
    params: int
    whole: int
    stages: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)

    def stage(self, pp: int) -> tuple[int, int, int]:
        """(parameters, whole ones, layers) of the pipeline stage with the most parameters."""
        if pp == 1:
            return self.params, self.whole, self.n_layer
        return max(self.stages[pp])

    def heaviest(self, pp: int) -> int:
        """Index of that stage: 0 holds the embedding, pp - 1 the head."""
        return 0 if pp == 1 else self.stages[pp].index(self.stage(pp))


@dataclass(frozen=True)
class Layout:
    """dp x pp x tp ranks, ZeRO `zero_stage` on the dp axis (0: none), sequence parallelism
    (and its column layers' inputs gathered again in backward, `recompute_gather`)."""

    dp: int
    pp: int = 1
    tp: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    recompute_gather: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def flags(self) -> str:
        """The `ringtrain train` options that run it."""
        if self.tp == 1 and self.pp == 1:
            return f"--strategy zero --zero-stage {self.zero_stage}" if self.zero_stage else \
                "--strategy ddp"
        sp = " --sequence-parallel" if self.sequence_parallel else ""
        sp += " --recompute-gather" if self.recompute_gather else ""
        if self.pp > 1:  # each pipeline stage split over its tp group (issue 27's one grid)
            tp = f" --tp {self.tp}{sp}" if self.tp > 1 else ""
            return f"--strategy pipeline --pp {self.pp}{tp}"
        zero = f" --zero-stage {self.zero_stage}" if self.zero_stage else ""
        return f"--strategy tp --tp {self.tp}{zero}{sp}"


@dataclass(frozen=True)
class LayoutFigures:
    """One layout's bytes per rank: held between steps, activations, sent per step."""

    layout: Layout
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float  # tensor parallelism alone
    activation_sp_bytes: float  # with sequence parallelism (= the above where the layout has none)
    dp_sent_bytes: float
    tp_sent_bytes: float
    pp_sent_bytes: float

    @property
    def state_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> float:
        """State and activations (with sequence parallelism where the layout has it)."""
        return self.state_bytes + self.activation_sp_bytes

    @property
    def sent_bytes(self) -> float:
        return self.dp_sent_bytes + self.tp_sent_bytes + self.pp_sent_bytes


def layout_figures(layout: Layout, shape: ModelShape, *, batch: int) -> LayoutFigures:
    """The figures of `layout` for `shape`, `batch` samples per replica per step."""
    dp, pp, tp, stage = layout.dp, layout.pp, layout.tp, layout.zero_stage
    params, whole, layers = shape.stage(pp)
    held = (params - whole) / tp + whole  # parameters this rank holds
    p_bytes = FP32_BYTES * held / (dp if stage >= 3 else 1)
    g_bytes = FP32_BYTES * held / (dp if stage >= 2 else 1)
    o_bytes = ADAMW_BYTES * held / (dp if stage >= 1 else 1)
    samples = batch if pp == 1 else batch / 4  # 1F1B: pp of 4 x pp micro-batches in flight
    again = layout.recompute_gather
    act = {sp: activation_bytes(n_layer=layers, n_embd=shape.n_embd, batch=samples,
                                seq=shape.block_size, vocab_size=shape.vocab_size, tp=tp,
                                sequence_parallel=sp, recompute_gather=sp and again)
           for sp in (False, True)}
    dp_sent = all_reduce_share(dp) * FP32_BYTES * held
    if stage == 3:
        dp_sent += gather_share(dp) * FP32_BYTES * held  # the parameters gathered again
    tp_sent = 0.0
    if tp > 1:  # the heaviest stage's: the embedding's and the head's only where it has them
        k = shape.heaviest(pp)
        volumes = expected_bytes(n_layer=layers, n_embd=shape.n_embd, batch=batch,
                                 seq=shape.block_size, sequence_parallel=layout.sequence_parallel,
                                 recompute_gather=again, embedding=k == 0, head=k == pp - 1,
                                 backwards=4 * pp if pp > 1 else 1)  # micro-batches, as `samples`
        tp_sent = sum(ring_bytes_per_rank(op, b, tp) for op, b in volumes.items())
    pp_sent = pp_sent_bytes(layout, shape, batch=batch)
    return LayoutFigures(layout, p_bytes, g_bytes, o_bytes, act[False],
                         act[layout.sequence_parallel], dp_sent, tp_sent, pp_sent)


def pp_sent_bytes(layout: Layout, shape: ModelShape, *, batch: int) -> float:
    """Bytes a pipeline rank sends per step: every micro-batch's boundary activation forward
    (all but the last stage) and its gradient back (all but the first), b x s x h in all over
    the step's micro-batches, each tp rank its own copy, or under sequence parallelism its
    slice of the sequence (s/tp). The heaviest of them: a middle stage's where pp > 2."""
    if layout.pp == 1:
        return 0.0
    boundary = batch * shape.block_size * shape.n_embd * FP32_BYTES
    if layout.sequence_parallel:
        boundary /= layout.tp
    return boundary * (2 if layout.pp > 2 else 1)


def layouts(world_size: int, shape: ModelShape, *, host: int) -> list[Layout]:
    """Every dp x pp x tp of `world_size` ranks ringtrain's GPT can be split into: tp divides
    n_head and the vocabulary and fits in one host (`host` ranks: tp's collectives run inside
    every layer), pp at most the stages given in `shape`; ZeRO 1-3 where dp > 1 and pp is 1;
    sequence parallelism wherever tp > 1 divides block_size (it sends no more bytes), each such
    layout also with `--recompute-gather` (less activation memory for more bytes sent)."""
    out = []
    for tp in range(1, world_size + 1):
        if world_size % tp or shape.n_head % tp or shape.vocab_size % tp or tp > host:
            continue
        for pp in range(1, world_size // tp + 1):
            if (world_size // tp) % pp or (pp > 1 and pp not in shape.stages):
                continue
            dp = world_size // tp // pp
            stages = ZERO_STAGES if dp > 1 and pp == 1 else (0,)
            sp = tp > 1 and shape.block_size % tp == 0
            regather = (False, True) if sp else (False,)
            out += [Layout(dp, pp, tp, z, sp, again) for again in regather for z in stages]
    return out


RULE = ("the layout that fits with the least model parallelism (tp x pp: its collectives sit "
        "inside every layer or in a bubble, where data parallelism's overlap backward), tp "
        "before pp (no bubble, inside one host), then the fewest bytes sent, then the least "
        "memory (so ZeRO 2 before ZeRO 0 or 1, which send as much, and ZeRO 3 only where "
        "needed)")


def recommend(rows: list[LayoutFigures],
              memory_bytes: float | None = None) -> tuple[LayoutFigures | None, str]:
    """The layout `RULE` picks among `rows` whose `total_bytes` fit `memory_bytes` (None: all
    fit), and the rule in words; None where nothing fits."""
    fit = [r for r in rows if memory_bytes is None or r.total_bytes <= memory_bytes]
    if not fit:
        return None, RULE
    best = min(fit, key=lambda r: (r.layout.tp * r.layout.pp, r.layout.pp, round(r.sent_bytes),
                                   r.total_bytes))
    return best, RULE


# Where `gpt_plan` keeps a parameter whole: the norms' (any LayerNorm), the position embedding,
# the row-parallel layers' biases. The names are the GPT's and its pipeline stages' alike.
_WHOLE_SUFFIXES = ("wpe.weight", "attn.c_proj.bias", "mlp.2.bias")


def whole_numel(module: nn.Module) -> int:
    """Parameters of (a stage of) ringtrain's GPT that tp keeps whole on every rank; works on
    the meta device. Equals `tensor_parallel.volumes.whole_params` for the whole GPT."""
    norms = {id(p) for m in module.modules() if isinstance(m, nn.LayerNorm)
             for p in m.parameters()}
    return sum(p.numel() for name, p in module.named_parameters()
               if id(p) in norms or name.endswith(_WHOLE_SUFFIXES))
