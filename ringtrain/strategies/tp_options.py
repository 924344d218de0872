"""The options strategies share (`--tp`, `--sequence-parallel`: tp and pipeline; `--zero-stage`:
zero and tp), each one field defined once
(their help is the same wherever they appear; only the default is each strategy's, and
--help shows each).

    ringtrain train --strategy tp --tp 2 --nproc-per-node 2
    ringtrain train --pp 2 --tp 2 --sequence-parallel --nproc-per-node 4
"""

from __future__ import annotations

import math
from typing import Any

from ringtrain.config import int_at_least, option
from ringtrain.errors import ConfigError


def tp_option(default: int) -> Any:
    """`--tp`: the tensor-parallel degree (`ringtrain.grid`'s innermost axis)."""
    return option(default, "tensor-parallel degree: ranks that split every matrix (consecutive "
                  "ranks, one host; with --pp, each stage's); must divide the world size, "
                  "n_head and the vocabulary", type=int_at_least(1))


def sequence_parallel_option() -> Any:
    """`--sequence-parallel`: Megatron's sequence parallelism on the tp group."""
    return option(False, "sequence parallelism: the norms and the residual stream on "
                  "block_size / tp tokens per rank, all-gather and reduce-scatter instead of "
                  "all-reduce (block_size must be divisible by --tp)")


def recompute_gather_option() -> Any:
    """`--recompute-gather`: the SP column layers keep their input's shard, gathered again."""
    return option(False, "with --sequence-parallel: the column layers keep only their input's "
                  "block_size / tp tokens for backward and all-gather them again there (every "
                  "saved activation 1/tp, as Megatron-LM's; one more all-gather per column layer)")


def check_recompute_gather(recompute_gather: bool, sequence_parallel: bool) -> None:
    """`--recompute-gather` regathers what sequence parallelism split: refused without it."""
    if recompute_gather and not sequence_parallel:
        raise ConfigError("--recompute-gather gathers the sequence-parallel column layers' "
                          "input again in backward: add --sequence-parallel, or drop it")


def zero_stage_option(default: int, choices: tuple[int, ...]) -> Any:
    """`--zero-stage`: what ZeRO shards over the data-parallel ranks (`ringtrain.zero`); 0 (none)
    is a choice only where the strategy runs without ZeRO too."""
    return option(default, "ZeRO: what is sharded over the data-parallel ranks: 0 nothing "
                  "(--strategy tp only), 1 optimizer state, 2 + gradients, 3 + parameters (with "
                  "--strategy tp: of each rank's slices)", type=int,
                  choices=choices)


def check_tp_model(model: Any, tp: int, who: str, split_sequence: int | None = None,
                   vocab_size: int | None = None) -> None:
    """Refuse, before launch, a model --tp cannot split, every reason in one error: n_head or
    the vocabulary's rows (`vocab_size`, where known) not divisible by `tp`, and with sequence
    parallelism (`split_sequence`: the task's tokens per sample) a sequence tp does not divide
    (`who` names the option: "--tp", "--strategy tp"). Tied embeddings and dropout are taken
    (`tensor_parallel.plan` ties the slices again; `Strategy.seed_rank`, `tensor_parallel.rng`)."""
    problems: list[str] = []
    if model.n_head % tp:
        divisors = [d for d in range(1, model.n_head + 1) if model.n_head % d == 0]
        problems.append(f"--n-head {model.n_head} is not divisible by --tp {tp}: each "
                        f"tp rank computes n_head / tp heads; use --tp in {divisors} or "
                        f"--n-head a multiple of {tp}")
    if vocab_size is not None and vocab_size % tp:
        fits = [d for d in range(2, model.n_head + 1)
                if vocab_size % d == 0 and model.n_head % d == 0]
        other = f", or use --tp in {fits}" if fits else ""
        padded = f", padded to a multiple of {model.pad_vocab}" if model.pad_vocab > 1 else ""
        problems.append(f"--tp {tp} splits the vocabulary's rows over the tp ranks, and the "
                        f"model has {vocab_size} (the data's tokens{padded}), not a multiple "
                        f"of {tp}: {'use' if padded else 'add'} --pad-vocab "
                        f"{math.lcm(model.pad_vocab, tp)} (rows no token uses: never sampled, "
                        f"trained only to stay unlikely){other}")
    if split_sequence is not None and split_sequence % tp:
        fits = [d for d in range(2, split_sequence + 1)
                if split_sequence % d == 0 and model.n_head % d == 0]
        other = f"use --tp in {fits}, " if fits else ""
        problems.append(f"--sequence-parallel splits each sample's {split_sequence} tokens "
                        f"over the --tp {tp} ranks, and {split_sequence} is not a multiple of "
                        f"{tp}: {other}make it a multiple of {tp} (--block-size with --data, "
                        "3 x --digits on the addition task), or drop --sequence-parallel")
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:  # all at once: a model can need several changes (heads, vocabulary, sequence)
        raise ConfigError(f"{len(problems)} things keep {who} from splitting this model: "
                          + "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1)))
