"""The words of `ringtrain explain`, strategy by strategy, around the numbers the strategy gives.

    ringtrain explain runs/a      # cli/explain.py picks WORDS[strategy], else `generic`

Each function gets the `RunFacts` of a run and returns an `Explanation`: who did what, who read
the data, what travelled between ranks per step, and what its "communication" time is made of.
Every number comes from the strategy's `Config.figures` (`ringtrain.strategies.figures`: bytes
held and sent, a pipeline's bubble, a parameter server's staleness bound) or from the run's
files; these functions only format them, so tests check the figures and, here, that the text
carries them. A strategy without words here is explained from its docstring's first line and
its figures (`generic`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ringtrain.strategies import StrategyConfig
from ringtrain.strategies.ddp import DDPFigures
from ringtrain.strategies.figures import FP32_BYTES, Figures
from ringtrain.strategies.localsgd import LocalSGDFigures
from ringtrain.strategies.pipeline import PipelineFigures
from ringtrain.strategies.ps_config import PSFigures
from ringtrain.strategies.tp import TPFigures
from ringtrain.strategies.zero import ZeroFigures


@dataclass(frozen=True)
class RunFacts:
    """A run, as far as a strategy's explanation needs it."""

    name: str  # --strategy
    cls: Any  # its Strategy class; None for one this ringtrain does not know
    config: StrategyConfig | None  # its options (its Config, defaults filled in); None: unknown
    world: int
    params: int
    step_batch: int  # samples per data rank per step: --batch-size x --grad-accum
    figures: Figures | None  # the strategy's numbers; None: not estimated (see `refused`)
    model: dict[str, Any] = field(default_factory=dict)  # config.json's model section
    summary: dict[str, Any] = field(default_factory=dict)  # summary.json ({}: did not finish)
    refused: str = ""  # why the strategy gave no figures: its options do not fit this run

    def option(self, name: str) -> Any:
        """One of the strategy's options (as given, else its default)."""
        return getattr(self.config, name)

    @property
    def data_ranks(self) -> int:
        """Ranks that read data, as the strategy plans them; every rank when it cannot say."""
        return self.figures.data_ranks if self.figures else self.world


@dataclass(frozen=True)
class Explanation:
    """The strategy's part of `ringtrain explain`'s text; each line is wrapped by the command."""

    roles: list[str]  # "who did what"
    traffic: list[str]  # "what travelled between ranks, per step"
    reader: str = "as the strategy plans"  # who reads data, in the data section
    waiting: str = "what the strategy reports as waiting"  # "communication is ..."


def n(x: float) -> str:
    return f"{x:,.0f}"


def nbytes(x: float) -> str:
    return f"{n(x)} bytes" if x < 1e6 else f"{x / 1e6:,.2f} MB"


def plural(count: int, word: str) -> str:  # '1 rank', '2 ranks'
    return f"{count} {word}{'' if count == 1 else 's'}"


def ranks(which: tuple[int, ...]) -> str:  # 'rank 2', 'ranks 0..1' (consecutive ranks)
    return f"rank {which[0]}" if len(which) == 1 else f"ranks {which[0]}..{which[-1]}"


def held(fig: Figures, who: str = "a rank") -> str:
    """What `who` holds between steps, by kind and in all."""
    return (f"between steps {who} holds {nbytes(fig.params_bytes)} of parameters, "
            f"{nbytes(fig.grads_bytes)} of gradients and {nbytes(fig.optimizer_bytes)} of "
            f"optimizer state: {nbytes(fig.held_bytes)}")


def generic(facts: RunFacts) -> Explanation:
    """What can be said of any strategy: its docstring's first line, its figures if it has
    them, else the model's size."""
    what = (inspect.getdoc(facts.cls) or "").splitlines()[0] if facts.cls else \
        "not known to this ringtrain"
    roles = [f"{facts.world} ranks, --strategy {facts.name}: {what}"]
    fig = facts.figures
    if fig is None or fig.sent_bytes is None:
        why = f" ({facts.refused})" if facts.refused else ""
        return Explanation(roles, [f"not estimated for --strategy {facts.name}{why}; the model "
                                   f"has {n(facts.params)} parameters "
                                   f"({nbytes(facts.params * FP32_BYTES)} in fp32)."])
    return Explanation(roles + [held(fig) + "."],
                       [f"estimate: {nbytes(fig.sent_bytes)} sent per rank per step."])


# ---- the strategies ------------------------------------------------------------------------------


def ddp(f: RunFacts) -> Explanation:
    fig: DDPFigures = f.figures
    waiting = ("the wait after the last local gradient; the buckets all-reduced before it "
               "overlapped the rest of backward")
    memory = held(fig, "each rank") + " (fp32 AdamW, 16 bytes per parameter)."
    if f.world == 1:
        return Explanation(
            roles=[f"1 rank holds the whole GPT ({n(f.params)} parameters): single-device "
                   "training: no one to average with, so the plain module runs unwrapped (a "
                   "--grad-compress hook keeps the DistributedDataParallel wrapper).", memory],
            traffic=["nothing: one rank has no one to send to."], reader="every rank",
            waiting=waiting)
    roles = [f"{f.world} ranks, each a full replica of the GPT ({n(f.params)} parameters "
             "each): every rank runs forward and backward on its own shard of each batch, "
             "then the ranks average their gradients (DistributedDataParallel), so every "
             "replica takes the same optimizer step and the weights stay identical.", memory]
    compress, s = f.option("grad_compress"), f.summary
    if fig.buffer_bytes is None:  # PowerSGD: what it sent is counted, not estimated
        sent = s.get("powersgd_bytes_sent") and s["powersgd_bytes_sent"] / (s.get("steps") or 1)
        traffic = [f"PowerSGD (--grad-compress {compress}): low-rank factors of each gradient "
                   f"matrix, all-reduced by ring, instead of {nbytes(fig.params_bytes)} of fp32 "
                   "gradients" + (f": {nbytes(sent)} sent per rank per step (summary.json), "
                                  f"{fig.dense_sent_bytes / sent:.1f} x fewer than a ring of "
                                  "the full gradients." if sent else ".")]
        return Explanation(roles, traffic, "every rank", waiting)
    traffic = [f"the gradients of {n(f.params)} parameters in {fig.wire}: "
               f"{nbytes(fig.buffer_bytes)}, once per optimizer step (the --grad-accum "
               "micro-batches before the last run under no_sync), in buckets launched while "
               "backward still runs.",
               f"algorithm: ring all-reduce (gloo's default): a reduce-scatter then an "
               f"all-gather, each N-1 steps around the ring, so each rank sends 2(N-1)/N = "
               f"{fig.ring_share:.3g} x the buffer (N = {f.world}) = {nbytes(fig.sent_bytes)} "
               "per step, and receives as much."]
    return Explanation(roles, traffic, "every rank", waiting)


def pipeline(f: RunFacts) -> Explanation:
    fig: PipelineFigures = f.figures
    pp, dp, m = fig.pp, fig.dp, fig.microbatches
    tp = fig.tp
    roles = [f"{f.world} ranks = {plural(dp * tp, 'pipeline')} x {pp} stages (model "
             f"parallelism, --pp {pp}): each stage holds a contiguous run of the GPT's layers "
             f"(embedding, blocks, head) balanced by parameter count, about "
             f"{n(fig.stage_params)} of the {n(f.params)} parameters; "
             + (f"rank = dp_rank x {pp} + pp_rank." if tp == 1 else
                f"each stage's matrices are split over {tp} consecutive ranks (--tp {tp}, "
                f"Megatron-LM), a pipeline per tp rank; rank = (dp_rank x {pp} + pp_rank) x "
                f"{tp} + tp_rank.")]
    roles += [f"pipeline {d}: " + ", ".join(f"stage {s} on rank {r}" for s, r in enumerate(line))
              for d, line in enumerate(fig.pipelines)]
    roles.append(f"each step's {f.step_batch} samples flow through the stages as {m} "
                 f"micro-batches of {fig.microbatch_size} (--schedule {f.option('schedule')}): "
                 "the stages work at once on different micro-batches, except in the bubble at "
                 f"the start and the end of the step, "
                 f"{fig.bubble_formula} = {fig.bubble:.1%} of it.")
    if dp > 1:
        roles.append(f"each stage's {dp} replicas average their gradients "
                     "(DistributedDataParallel on the stage's data-parallel group).")
    roles.append(held(fig, "a stage") + ", on average.")
    block, width = f.model.get("block_size", 0), f.model.get("n_embd", 0)
    traffic = [f"estimate: between consecutive stages, the activations of a step's "
               f"{f.step_batch} samples ({block} tokens x {width} channels each, fp32) = "
               f"{nbytes(fig.boundary_bytes)} forward, one micro-batch at a time, and as many "
               "bytes of their gradients backward; plus one number per stage (the gradient "
               "norm, for clipping)."]
    if dp > 1:
        traffic.append(f"estimate: each stage also all-reduces the gradients of its "
                       f"~{n(fig.stage_params)} parameters among its {dp} replicas: about "
                       f"{nbytes(fig.dp_sent_bytes)} sent per rank per step (ring).")
    traffic.append(f"estimate, in all: {nbytes(fig.sent_bytes)} sent per step by the busiest "
                   "stage" + (" (a middle one: it sends both ways)." if fig.pp > 2 else "."))
    return Explanation(roles, traffic, reader="the stages of a pipeline read the same shard",
                       waiting="waiting for the neighbouring stages, the pipeline bubble included")


PS_RULES = {"sync": "the servers wait for every worker's gradient each step: data parallel on the "
                    "same global batch.",
            "async": "each gradient is applied as it arrives; a worker may compute on stale "
                     "parameters.",
            "ssp": "as async, but no worker runs more steps ahead of the slowest than the bound."}


def ps(f: RunFacts) -> Explanation:
    fig: PSFigures = f.figures
    servers, workers, mode = fig.servers, fig.workers, f.option("mode")
    flag = f" (--staleness {fig.staleness_bound})" if mode == "ssp" else ""
    holds = "hold the parameters (split between them) and run" if servers > 1 else \
        "holds the parameters and runs"
    roles = [f"{f.world} ranks: {plural(workers, 'worker')} ({ranks(fig.worker_ranks)}) "
             f"compute{'s' if workers == 1 else ''} gradients on the data; "
             f"{plural(servers, 'parameter server')} ({ranks(fig.server_ranks)}) {holds} "
             f"the optimizer. Mode {mode}{flag}: {PS_RULES.get(mode, '')}",
             held(fig, "a worker") + f"; a server {nbytes(fig.server_held_bytes)} (its share "
             "of parameters, gradients and AdamW state)."]
    bound = fig.staleness_bound
    staleness = ("staleness: no bound" if bound is None else "staleness: none (every worker "
                 "waits for the others)" if mode == "sync" else
                 f"staleness: at most {plural(bound, 'step')} ahead of the slowest worker")
    lag = ("" if not fig.update_lag else f"; update lag about {fig.update_lag:g} (the other "
           "updates applied between a gradient's read of the parameters and its write, with "
           "workers at equal speed)")
    roles.append(f"{staleness}{lag}.")
    traffic = [f"estimate: each worker pushes its gradients ({nbytes(fig.sent_bytes)}) to the "
               f"servers and pulls the new parameters ({nbytes(fig.pull_bytes)}) back, every "
               f"step, point to point (no all-reduce); each server receives "
               f"{nbytes(fig.server_received_bytes)} per step (its share of every worker's "
               "push) and sends as much back."]
    return Explanation(roles, traffic, reader="the workers; servers read none",
                       waiting="the wait for the servers' answer (the new parameters)")


def _local_sgd(f: RunFacts, meeting: str) -> Explanation:
    fig: LocalSGDFigures = f.figures
    h = fig.sync_every
    roles = [f"{f.world} ranks, each a full replica of the GPT ({n(f.params)} parameters) "
             f"with its own optimizer, training alone on its own shard for {h} steps "
             f"(--sync-every {h}); then the replicas meet: {meeting} Evaluation and the final "
             "model use the weights of the last meeting, the same on every rank.",
             held(fig, "each rank") + " (the parameters twice: the replica and the weights "
             "of the last meeting)."]
    if f.world == 1:
        return Explanation(roles, ["nothing: one rank has no one to meet."], "every rank",
                           "nothing: one rank")
    s = f.summary
    counted = (f" Counted (summary.json): {nbytes(s['meeting_bytes_sent'])} sent by rank 0 "
               f"over {plural(s['meetings'], 'meeting')}." if s.get("meetings") else "")
    traffic = [f"nothing in {h - 1} steps out of {h}; at each meeting "
               f"{nbytes(fig.meeting_bytes)} sent per rank, {nbytes(fig.sent_bytes)} per step "
               f"on average, against {nbytes(fig.ddp_sent_bytes)} every step for DDP's "
               f"gradients.{counted}"]
    return Explanation(roles, traffic, "every rank",
                       "the meetings only (steps between them wait on no one)")


def localsgd(f: RunFacts) -> Explanation:
    return _local_sgd(f, "their parameters are all-reduced (ring, fp32) and divided by N: "
                         "the mean.")


def diloco(f: RunFacts) -> Explanation:
    codec = f.option("outer_compress")
    how = ("all-reduced in fp32" if codec == "fp32" else f"all-gathered in {codec}"
           + (" with one fp32 scale per tensor" if codec == "int8" else "")
           + " and summed in fp32 in rank order")
    return _local_sgd(f, f"each rank's pseudo-gradient (the weights of the last outer step minus "
                         f"its weights now) is {how}, and the mean moves the shared weights by an "
                         f"outer SGD with Nesterov momentum (--outer-lr {f.option('outer_lr')}, "
                         f"--outer-momentum {f.option('outer_momentum')}), the same step on "
                         "every rank (DiLoCo).")


ZERO_HELD = {1: "the AdamW moments (stage 1); every rank keeps the full parameters and gradients",
             2: "the AdamW moments and the gradients (stage 2); every rank keeps the full "
                "parameters",
             3: "the AdamW moments, the gradients and the parameters (stage 3): a unit's "
                "parameters are all-gathered just before its forward and again before its "
                "backward, and freed after"}


def zero(f: RunFacts) -> Explanation:
    fig: ZeroFigures = f.figures
    roles = [f"{f.world} ranks, each reading its own shard of every batch as in ddp, each "
             f"holding 1/{f.world} of {ZERO_HELD[fig.stage]}.",
             held(fig) + f", against {nbytes(fig.replica_bytes)} for a DDP replica (fp32 "
             "AdamW, 16 bytes per parameter)."]
    if f.world == 1:
        return Explanation(roles, ["nothing: one rank has no one to send to."], "every rank",
                           "nothing: one rank")
    moves = ("an all-gather of the parameters before each micro-batch's forward and another "
             "before its backward, and a reduce-scatter of the gradients" if fig.stage == 3
             else "a reduce-scatter of the gradients (each rank gets the sum of its own 1/N) "
             "and, after the step, an all-gather of the updated parameters: together as many "
             "bytes as DDP's one all-reduce")
    traffic = [f"{moves}; each sends (N-1)/N = {fig.gather_share:.3g} x the "
               f"{nbytes(fig.model_bytes)} of fp32 model per collective (N = {f.world}): "
               f"{fig.collectives} x = {nbytes(fig.sent_bytes)} sent per rank per step, and "
               "received."]
    return Explanation(roles, traffic, "every rank",
                       "not reported apart: ZeRO's collectives run inside forward, backward "
                       "and the step, so their time is counted as compute")


_ZERO_SHARDS = ["", "optimizer state", "optimizer state and gradients",
                "optimizer state, gradients and parameters"]


def tp(f: RunFacts) -> Explanation:
    fig: TPFigures = f.figures
    t, dp = fig.tp, fig.data_ranks
    roles = [f"{f.world} ranks as {dp} replica{'s' if dp > 1 else ''} of the GPT "
             f"({n(f.params)} parameters), each split over {t} consecutive ranks (Megatron-LM "
             "tensor parallelism): every rank holds 1/tp of each matrix (attention heads, MLP "
             "width, vocabulary), the tp ranks of a replica read the same batch, and the loss "
             "is computed on vocab-sharded logits without gathering them.",
             held(fig, "each rank") + " (fp32 AdamW's 16 bytes per parameter of its slices and "
             "of the norms, position embedding and row biases, held whole"
             + (f"; ZeRO {fig.zero_stage} divides the {_ZERO_SHARDS[fig.zero_stage]} by "
                f"the {dp} ranks of each data-parallel group" if fig.zero_stage else "")
             + "; `ringtrain plan` gives the same figures for every layout)."]
    if fig.activation_bytes is not None:
        roles.append(f"activations saved for backward: {nbytes(fig.activation_bytes)} per rank "
                     "per micro-batch (the formula of docs/tensor_parallel.md"
                     + (", sequence parallelism on" if f.option("sequence_parallel") else "")
                     + (", the column layers' inputs kept as 1/tp and gathered again in "
                        "backward (--recompute-gather)" if f.option("recompute_gather") else "")
                     + "; without --activation-checkpointing, which keeps only each block's "
                     "input).")
    traffic = []
    if fig.tp_sent_bytes is not None:
        how = ("as all-gathers and reduce-scatters (--sequence-parallel: the same bytes, the "
               "norms on 1/tp of the tokens" + ("; --recompute-gather: one more all-gather per "
                                              "column layer in backward" if
                                              f.option("recompute_gather") else "") + ")"
               if f.option("sequence_parallel") else "")
        traffic.append(f"within each tp group: 4 all-reduces of the activations (batch x "
                       f"block_size x n_embd in fp32) per layer{', ' + how if how else ''}, 2 in "
                       f"forward and 2 in backward, plus the embedding's and lm_head's: "
                       f"{nbytes(fig.tp_sent_bytes)} sent per rank per step by ring (2(t-1)/t "
                       f"of each, t = {t}).")
    how = (f"reduce-scattered over its data-parallel group as they are made and the updated "
           f"parts all-gathered (ZeRO {fig.zero_stage}"
           + (", and each block's slices gathered before its forward and backward" if
              fig.zero_stage == 3 else ": the bytes of one all-reduce") + ")"
           if fig.zero_stage else "all-reduced over its data-parallel group")
    traffic.append(f"across the {dp} replica{'s' if dp > 1 else ''}: each rank's gradient "
                   f"slices {how}: {nbytes(fig.dp_sent_bytes)} per rank per step."
                   if dp > 1 else "no data-parallel traffic: one replica.")
    return Explanation(roles, traffic, reader="one per replica: its tp ranks read the same samples",
                       waiting="the data-parallel all-reduce after backward "
                       "(the tp collectives run inside forward and backward, counted as compute)")


# --strategy name -> its words; a strategy missing here gets `generic`.
WORDS: dict[str, Callable[[RunFacts], Explanation]] = {
    "ddp": ddp, "pipeline": pipeline, "ps": ps, "localsgd": localsgd, "diloco": diloco,
    "zero": zero, "tp": tp}
