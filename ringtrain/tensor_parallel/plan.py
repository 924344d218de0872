"""`parallelize(model, plan, group)`: replace a model's modules by their tensor-parallel versions.

A plan maps module names to styles, as torch's `parallelize_module` does
(`torch.distributed.tensor.parallel`); a name may hold `*` per dotted part ("blocks.*.attn").

    from ringtrain.tensor_parallel import parallelize, gpt_plan, vocab_parallel_cross_entropy
    model = parallelize(GPT(config), gpt_plan(sequence_parallel=True), group)
    loss = vocab_parallel_cross_entropy(model(idx), targets, group)

Styles, by what they take:

    ColwiseParallel    nn.Linear        -> ColumnParallelLinear (chunks=3 for fused q, k, v)
    RowwiseParallel    nn.Linear        -> RowParallelLinear
    VocabParallel      nn.Embedding     -> VocabParallelEmbedding
    HeadParallel       attention        -> HeadParallelAttention (c_attn, c_proj, n_head)
    SequenceParallel   a norm/dropout   kept; runs on this rank's tokens, its parameters'
                                        gradients summed over the group
    SplitSequence      any module       kept; its output split along the sequence (where a
                                        sequence-parallel stretch begins)

The model is changed in place and returned; every rank must apply the same plan to the same
model (same seed), since each keeps its slice of the weights it was given.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
from torch import nn

from ringtrain.tensor_parallel import comm
from ringtrain.tensor_parallel.attention import HeadParallelAttention
from ringtrain.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from ringtrain.tensor_parallel.rng import ShardedDropout


class ParallelStyle:
    """How one module becomes tensor-parallel: `apply` returns its replacement (or itself)."""

    takes: type | None = None  # the module type the style expects (None: any)

    def apply(self, module: nn.Module, group) -> nn.Module:
        raise NotImplementedError

    def check(self, name: str, module: nn.Module) -> None:
        if self.takes is not None and not isinstance(module, self.takes):
            raise TypeError(f"plan entry {name!r}: {type(self).__name__} takes "
                            f"nn.{self.takes.__name__} modules, but {name!r} is a "
                            f"{type(module).__name__}; name a module of that type in the plan")


@dataclass(frozen=True)
class ColwiseParallel(ParallelStyle):
    """Split a Linear's output features. `chunks`: fused blocks split one by one;
    `recompute_gather`: see `ColumnParallelLinear`."""

    sequence_parallel: bool = False
    gather_output: bool = False
    chunks: int = 1
    recompute_gather: bool = False
    takes = nn.Linear

    def apply(self, module, group):
        return ColumnParallelLinear.from_linear(module, group, chunks=self.chunks,
                                                gather_output=self.gather_output,
                                                sequence_parallel=self.sequence_parallel,
                                                recompute_gather=self.recompute_gather)


@dataclass(frozen=True)
class RowwiseParallel(ParallelStyle):
    """Split a Linear's input features; the output is summed over the group."""

    sequence_parallel: bool = False
    input_is_parallel: bool = True
    takes = nn.Linear

    def apply(self, module, group):
        return RowParallelLinear.from_linear(module, group,
                                             input_is_parallel=self.input_is_parallel,
                                             sequence_parallel=self.sequence_parallel)


@dataclass(frozen=True)
class VocabParallel(ParallelStyle):
    """Split an Embedding's rows (the vocabulary); the lookup is summed over the group."""

    takes = nn.Embedding

    def apply(self, module, group):
        return VocabParallelEmbedding.from_embedding(module, group)


@dataclass(frozen=True)
class HeadParallel(ParallelStyle):
    """Split an attention module's heads (ringtrain's CausalSelfAttention layout)."""

    sequence_parallel: bool = False
    recompute_gather: bool = False

    def check(self, name, module):
        missing = [a for a in ("c_attn", "c_proj", "n_head", "dropout", "resid_drop")
                   if not hasattr(module, a)]
        if missing:
            raise TypeError(f"plan entry {name!r}: HeadParallel needs an attention module with a "
                            f"fused c_attn, c_proj, n_head, dropout and resid_drop; "
                            f"{type(module).__name__} lacks {missing}")

    def apply(self, module, group):
        return HeadParallelAttention.from_attention(module, group,
                                                    sequence_parallel=self.sequence_parallel,
                                                    recompute_gather=self.recompute_gather)


@dataclass(frozen=True)
class SequenceParallel(ParallelStyle):
    """Keep a module that works token by token (LayerNorm, dropout) on this rank's slice of the
    sequence; its replicated parameters' gradients are summed over the group, and a dropout
    draws masks of this rank's own (`rng.ShardedDropout`: its tokens are not the others')."""

    def apply(self, module, group):
        for p in module.parameters():
            comm.sum_grad_over_group(p, group)
        return ShardedDropout.from_dropout(module, group)


@dataclass(frozen=True)
class SplitSequence(ParallelStyle):
    """Keep the module; split its (B, T, C) output along T (backward: all-gather)."""

    def apply(self, module, group):
        module.register_forward_hook(lambda _m, _args, out: comm.split_to_sequence(out, group))
        return module


def _matches(pattern: str, name: str) -> bool:
    """torch's rule: the same number of dotted parts, each matched with fnmatch."""
    parts, want = name.split("."), pattern.split(".")
    return len(parts) == len(want) and all(fnmatchcase(p, w) for p, w in zip(parts, want,
                                                                             strict=True))


def parallelize(module: nn.Module, plan: dict[str, ParallelStyle], group) -> nn.Module:
    """Apply `plan` ({module name or pattern: style}) to `module` in place; return it.

    Args:
        module: a plain model, the same (same seed, same weights) on every rank of `group`.
        plan: styles by module name, applied in the plan's order; `*` matches one name part.
        group: the tensor-parallel process group (its size is the tp degree).
    """
    shared = _shared_parameters(module)
    slices: dict[int, nn.Parameter] = {}  # a tied parameter's slice, by the whole one's id
    for pattern, style in plan.items():
        names = [n for n, _ in module.named_modules() if n and _matches(pattern, n)]
        if not names:
            some = [n for n, _ in module.named_modules() if n][:8]
            raise PlanMismatchError(f"plan entry {pattern!r} matches no module of "
                             f"{type(module).__name__}; its modules include {some}")
        for name in names:
            child = module.get_submodule(name)
            style.check(name, child)
            tied = {n: p for n, p in child.named_parameters() if id(p) in shared}
            new = style.apply(child, group)
            if new is not child:
                _tie_slices(new, tied, slices, name)
                parent, _, attr = name.rpartition(".")
                setattr(module.get_submodule(parent) if parent else module, attr, new)
    for names in shared.values():  # each user of a tied parameter holds one and the same
        held = {id(module.get_parameter(n)) for n in names}
        if len(held) > 1:
            raise ValueError(f"{names} are one parameter (tied embeddings?), and the plan splits "
                             "it for some of them only; tensor parallelism splits a tied "
                             "parameter only where every user splits it alike (a vocab-parallel "
                             "embedding and a column-parallel lm_head): build the model untied, "
                             "or split every user")
    return module


def _tie_slices(new: nn.Module, tied: dict[str, nn.Parameter], slices: dict[int, nn.Parameter],
                name: str) -> None:
    """Tie `new`'s slices of tied parameters again: the first user's slice is kept, a later one
    takes it (after checking it cut the same slice: a vocab-parallel embedding's rows are a
    column-parallel lm_head's output rows, as the GPT ties them)."""
    for pname, whole in tied.items():
        mine = new.get_parameter(pname)
        first = slices.setdefault(id(whole), mine)
        if first is mine:
            continue
        if first.shape != mine.shape or getattr(first, "tp_shard_dim", None) != getattr(
                mine, "tp_shard_dim", None) or not torch.equal(first, mine):
            raise ValueError(f"{name}.{pname} is tied to a parameter the plan split otherwise "
                             f"(this slice {tuple(mine.shape)}, the first "
                             f"{tuple(first.shape)}); build the model untied")
        owner, _, leaf = pname.rpartition(".")
        setattr(new.get_submodule(owner) if owner else new, leaf, first)


def _shared_parameters(module: nn.Module) -> dict[int, list[str]]:
    """The names of each parameter held under more than one name, by its id."""
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return {i: ns for i, ns in names.items() if len(ns) > 1}


class PlanMismatchError(ValueError):
    """A plan entry names no module of the model: the plan is another model's."""

    def for_strategy(self, flags: str) -> str:
        """What a strategy that applies `gpt_plan` says to a user with another model."""
        return (f"{flags} parallelises ringtrain's GPT (tensor_parallel.gpt_plan): {self}. For "
                "another model, split its layers with your own plan in your script, "
                "ringtrain.tensor_parallel.parallelize(model, {name: ColwiseParallel(), ...}, "
                "tp_group) (docs/tensor_parallel.md), or use a strategy that takes any model "
                "(ddp, zero, pipeline without --tp)")


def gpt_plan(sequence_parallel: bool = False,
             recompute_gather: bool = False) -> dict[str, ParallelStyle]:
    """The plan for ringtrain's GPT (`ringtrain.models.GPT`; tied embeddings: one slice of rows,
    the embedding's and the lm_head's).

    Without sequence parallelism: vocab-parallel token embedding, head-parallel attention,
    column-then-row MLP, a column-parallel lm_head whose vocab-sharded logits go to
    `vocab_parallel_cross_entropy`. Norms, dropouts and the position embedding are replicated.
    With it, the embedding's output is split along the sequence (Megatron-core's way: the
    vocab-parallel lookup is all-reduced, positions added, then split), the norms and residual
    stream run on T/t tokens, and every column layer all-gathers / row layer reduce-scatters.
    `recompute_gather` (with sequence parallelism): the column layers keep only their input's
    shard for backward and all-gather it again there.
    """
    sp, rg = sequence_parallel, recompute_gather
    plan: dict[str, ParallelStyle] = {
        "embed.wte": VocabParallel(),
        "blocks.*.attn": HeadParallel(sequence_parallel=sp, recompute_gather=rg),
        "blocks.*.mlp.0": ColwiseParallel(sequence_parallel=sp, recompute_gather=rg),
        "blocks.*.mlp.2": RowwiseParallel(sequence_parallel=sp),
        "head.lm_head": ColwiseParallel(sequence_parallel=sp, recompute_gather=rg),
    }
    if sp:
        plan |= {"embed": SplitSequence(), "blocks.*.ln_1": SequenceParallel(),
                 "blocks.*.ln_2": SequenceParallel(), "head.ln_f": SequenceParallel(),
                 "blocks.*.mlp.3": SequenceParallel()}  # the MLP's dropout, after its row layer
    return plan
