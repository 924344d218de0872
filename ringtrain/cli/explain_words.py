"""The words of `ringtrain explain`, strategy by strategy, around the figures they take from
the run (config.json, summary.json) and from the strategy's config.

    ringtrain explain runs/a      # cli/explain.py picks WORDS[strategy], else `generic`

Each function gets the `RunFacts` of a run and returns an `Explanation`: who did what, who read
the data, what travelled between ranks per step, and what its "communication" time is made of.
A strategy without words here is explained from its docstring's first line (`generic`); the
numbers a strategy alone knows are methods of its config (`LocalSGDConfig.meeting_bytes`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ringtrain.strategies import StrategyConfig
from ringtrain.zero.shard import expected_bytes

FP32_BYTES = 4  # gradients, parameters and activations travel in fp32 (under bf16 autocast too)


@dataclass(frozen=True)
class RunFacts:
    """A run, as far as a strategy's explanation needs it."""

    name: str  # --strategy
    cls: Any  # its Strategy class; None for one this ringtrain does not know
    config: StrategyConfig | None  # its options (its Config, defaults filled in); None: unknown
    world: int
    params: int
    step_batch: int  # samples per data rank per step: --batch-size x --grad-accum
    data_ranks: int
    model: dict[str, Any] = field(default_factory=dict)  # config.json's model section
    summary: dict[str, Any] = field(default_factory=dict)  # summary.json ({}: did not finish)

    def option(self, name: str) -> Any:
        """One of the strategy's options (as given, else its default)."""
        return getattr(self.config, name)

    @property
    def grad_bytes(self) -> int:
        """The model's gradients (or parameters) in fp32."""
        return self.params * FP32_BYTES

    def ring_share(self, ranks: int | None = None) -> float:
        """Bytes a rank sends in a ring all-reduce, per byte of the buffer: 2(N-1)/N."""
        n = self.world if ranks is None else ranks
        return 2 * (n - 1) / n


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


def ranks(first: int, last: int) -> str:  # 'rank 2', 'ranks 0..1'
    return f"rank {first}" if first == last else f"ranks {first}..{last}"


def generic(facts: RunFacts) -> Explanation:
    """What can be said of any strategy: its docstring's first line, the model's size."""
    what = (inspect.getdoc(facts.cls) or "").splitlines()[0] if facts.cls else \
        "not known to this ringtrain"
    return Explanation(
        roles=[f"{facts.world} ranks, --strategy {facts.name}: {what}"],
        traffic=[f"not estimated for --strategy {facts.name}; the model has {n(facts.params)} "
                 f"parameters ({nbytes(facts.grad_bytes)} in fp32)."])


# ---- the strategies ------------------------------------------------------------------------------


def ddp(f: RunFacts) -> Explanation:
    waiting = ("the wait after the last local gradient; the buckets all-reduced before it "
               "overlapped the rest of backward")
    if f.world == 1:
        return Explanation(
            roles=[f"1 rank holds the whole GPT ({n(f.params)} parameters): single-device "
                   "training: no one to average with, so the plain module runs unwrapped (a "
                   "--grad-compress hook keeps the DistributedDataParallel wrapper)."],
            traffic=["nothing: one rank has no one to send to."], reader="every rank",
            waiting=waiting)
    roles = [f"{f.world} ranks, each a full replica of the GPT ({n(f.params)} parameters "
             "each): every rank runs forward and backward on its own shard of each batch, "
             "then the ranks average their gradients (DistributedDataParallel), so every "
             "replica takes the same optimizer step and the weights stay identical."]
    share, compress, s = f.ring_share(), f.option("grad_compress"), f.summary
    if compress.startswith("powersgd"):  # what it sent is counted, not estimated
        sent = s.get("powersgd_bytes_sent") and s["powersgd_bytes_sent"] / (s.get("steps") or 1)
        traffic = [f"PowerSGD (--grad-compress {compress}): low-rank factors of each gradient "
                   f"matrix, all-reduced by ring, instead of {nbytes(f.grad_bytes)} of fp32 "
                   "gradients" + (f": {nbytes(sent)} sent per rank per step (summary.json), "
                                  f"{share * f.grad_bytes / sent:.1f} x fewer than a ring of "
                                  "the full gradients." if sent else ".")]
        return Explanation(roles, traffic, "every rank", waiting)
    kind, size = (compress, f.grad_bytes // 2) if compress in ("fp16", "bf16") else \
        ("fp32", f.grad_bytes)
    traffic = [f"the gradients of {n(f.params)} parameters in {kind}: {nbytes(size)}, once "
               "per optimizer step (the --grad-accum micro-batches before the last run under "
               "no_sync), in buckets launched while backward still runs.",
               f"algorithm: ring all-reduce (gloo's default): a reduce-scatter then an "
               f"all-gather, each N-1 steps around the ring, so each rank sends 2(N-1)/N = "
               f"{share:.3g} x the buffer (N = {f.world}) = {nbytes(share * size)} per step, "
               "and receives as much."]
    return Explanation(roles, traffic, "every rank", waiting)


def pipeline(f: RunFacts) -> Explanation:
    pp = f.option("pp")
    dp, m = f.world // pp, f.config.microbatches_for(f.step_batch)
    roles = [f"{f.world} ranks = {plural(dp, 'pipeline')} x {pp} stages (model parallelism, "
             f"--pp {pp}): each stage holds a contiguous run of the GPT's layers (embedding, "
             f"blocks, head) balanced by parameter count, about {n(f.params / pp)} of the "
             f"{n(f.params)} parameters; rank = dp_rank x {pp} + pp_rank."]
    roles += [f"pipeline {d}: " + ", ".join(f"stage {s} on rank {d * pp + s}" for s in range(pp))
              for d in range(dp)]
    roles.append(f"each step's {f.step_batch} samples flow through the stages as {m} "
                 f"micro-batches of {f.step_batch // m} (--schedule {f.option('schedule')}): "
                 "the stages work at once on different micro-batches, except in the bubble "
                 "at the start and the end of the step.")
    if dp > 1:
        roles.append(f"each stage's {dp} replicas average their gradients "
                     "(DistributedDataParallel on the stage's data-parallel group).")
    block, width = f.model.get("block_size", 0), f.model.get("n_embd", 0)
    act = f.step_batch * block * width * FP32_BYTES
    traffic = [f"estimate: between consecutive stages, the activations of a step's "
               f"{f.step_batch} samples ({block} tokens x {width} channels each, fp32) = "
               f"{nbytes(act)} forward, one micro-batch at a time, and as many bytes of their "
               "gradients backward; plus one number per stage (the gradient norm, for "
               "clipping)."]
    if dp > 1:
        traffic.append(f"estimate: each stage also all-reduces the gradients of its "
                       f"~{n(f.params / pp)} parameters among its {dp} replicas: about "
                       f"{nbytes(f.ring_share(dp) * f.grad_bytes / pp)} sent per rank per "
                       "step (ring).")
    return Explanation(roles, traffic, reader="the stages of a pipeline read the same shard",
                       waiting="waiting for the neighbouring stages, the pipeline bubble included")


PS_RULES = {"sync": "the servers wait for every worker's gradient each step: data parallel on the "
                    "same global batch.",
            "async": "each gradient is applied as it arrives; a worker may compute on stale "
                     "parameters.",
            "ssp": "as async, but no worker runs more steps ahead of the slowest than the bound."}


def ps(f: RunFacts) -> Explanation:
    servers, mode = f.option("servers"), f.option("mode")
    workers = f.world - servers
    bound = f" (--staleness {f.option('staleness')})" if mode == "ssp" else ""
    held = "hold the parameters (split between them) and run" if servers > 1 else \
        "holds the parameters and runs"
    roles = [f"{f.world} ranks: {plural(workers, 'worker')} ({ranks(0, workers - 1)}) "
             f"compute{'s' if workers == 1 else ''} gradients on the data; "
             f"{plural(servers, 'parameter server')} ({ranks(workers, f.world - 1)}) {held} "
             f"the optimizer. Mode {mode}{bound}: {PS_RULES.get(mode, '')}"]
    g = nbytes(f.grad_bytes)
    traffic = [f"estimate: each worker pushes its gradients ({g}) to the servers and pulls the "
               f"new parameters ({g}) back, every step, point to point (no all-reduce); each "
               f"server receives {nbytes(workers * f.grad_bytes / servers)} per step (its "
               "share of every worker's push) and sends as much back."]
    return Explanation(roles, traffic, reader="the workers; servers read none",
                       waiting="the wait for the servers' answer (the new parameters)")


def _local_sgd(f: RunFacts, meeting: str) -> Explanation:
    h = f.option("sync_every")
    roles = [f"{f.world} ranks, each a full replica of the GPT ({n(f.params)} parameters) "
             f"with its own optimizer, training alone on its own shard for {h} steps "
             f"(--sync-every {h}); then the replicas meet: {meeting} Evaluation and the final "
             "model use the weights of the last meeting, the same on every rank."]
    if f.world == 1:
        return Explanation(roles, ["nothing: one rank has no one to meet."], "every rank",
                           "nothing: one rank")
    s = f.summary
    counted = (f" Counted (summary.json): {nbytes(s['meeting_bytes_sent'])} sent by rank 0 "
               f"over {plural(s['meetings'], 'meeting')}." if s.get("meetings") else "")
    per_meeting = f.config.meeting_bytes(f.params, f.world)
    traffic = [f"nothing in {h - 1} steps out of {h}; at each meeting "
               f"{nbytes(per_meeting)} sent per rank, {nbytes(per_meeting / h)} per step on "
               f"average, against {nbytes(f.ring_share() * f.grad_bytes)} every step for "
               f"DDP's gradients.{counted}"]
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
    stage = int(f.option("zero_stage"))
    b = expected_bytes(f.params, f.world, stage)
    roles = [f"{f.world} ranks, each reading its own shard of every batch as in ddp, each "
             f"holding 1/{f.world} of {ZERO_HELD[stage]}.",
             f"between steps a rank holds {nbytes(b['params'])} of parameters, "
             f"{nbytes(b['grads'])} of gradients and {nbytes(b['optimizer'])} of optimizer "
             f"state: {nbytes(sum(b.values()))}, against {nbytes(4 * f.grad_bytes)} for a "
             "DDP replica (fp32 AdamW, 16 bytes per parameter)."]
    if f.world == 1:
        return Explanation(roles, ["nothing: one rank has no one to send to."], "every rank",
                           "nothing: one rank")
    share = (f.world - 1) / f.world
    moves = ("an all-gather of the parameters for forward and another for backward, and a "
             "reduce-scatter of the gradients" if stage == 3 else "a reduce-scatter of the "
             "gradients (each rank gets the sum of its own 1/N) and, after the step, an "
             "all-gather of the updated parameters: together as many bytes as DDP's one "
             "all-reduce")
    times = 3 if stage == 3 else 2
    traffic = [f"{moves}; each sends (N-1)/N = {share:.3g} x the {nbytes(f.grad_bytes)} of "
               f"fp32 model per collective (N = {f.world}): {times} x = "
               f"{nbytes(times * share * f.grad_bytes)} sent per rank per step, and received."]
    return Explanation(roles, traffic, "every rank",
                       "not reported apart: ZeRO's collectives run inside forward, backward "
                       "and the step, so their time is counted as compute")


# --strategy name -> its words; a strategy missing here gets `generic`.
WORDS: dict[str, Callable[[RunFacts], Explanation]] = {
    "ddp": ddp, "pipeline": pipeline, "ps": ps, "localsgd": localsgd, "diloco": diloco,
    "zero": zero}
