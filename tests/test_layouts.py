"""`ringtrain plan`'s layouts (dp x pp x tp, ZeRO on dp) and `ringtrain explain`'s tp figures.

    .venv/bin/pytest -q tests/test_layouts.py

In one process (no workers; CPU): the parameters tp keeps whole, counted three ways; the
activation formula against the bytes measured in docs/tensor_parallel.md; a layout's figures
against the formulas written out by hand; a pipeline stage's bytes on the tp and pp axes
against those counted by benchmarks/tensor_parallel.py; the recommendation following its rule
on three memory budgets; `TPConfig.figures` (explain) equal to the plan's row; the command's
table.
"""

from __future__ import annotations

import pytest
import torch

from ringtrain.cli.plan import main, model_shape
from ringtrain.models import GPT, GPTConfig
from ringtrain.strategies.figures import Workload
from ringtrain.strategies.layouts import (
    Layout,
    ModelShape,
    layout_figures,
    layouts,
    pp_sent_bytes,
    recommend,
    whole_numel,
)
from ringtrain.strategies.tp import TPConfig
from ringtrain.tensor_parallel import gpt_plan, parallelize
from ringtrain.tensor_parallel.volumes import (
    activation_bytes,
    expected_bytes,
    ring_bytes_per_rank,
    whole_params,
)

MIB = 2**20
# docs/tensor_parallel.md's model: GPT 4 x 256, 8 heads, vocabulary 1024, batch 4 x 256.
DOC = GPTConfig(vocab_size=1024, block_size=256, n_layer=4, n_head=8, n_embd=256)


def test_unit_whole_parameters_are_what_gpt_plan_leaves_unsplit(single_process):
    cfg = GPTConfig(vocab_size=10, block_size=6, n_layer=2, n_head=2, n_embd=16)
    model = parallelize(GPT(cfg), gpt_plan(), torch.distributed.group.WORLD)
    unsplit = sum(p.numel() for p in model.parameters() if getattr(p, "tp_shard_dim", None)
                  is None)
    assert unsplit == whole_numel(GPT(cfg)) == whole_params(n_layer=2, n_embd=16, block_size=6)
    nobias = GPTConfig(**{**cfg.__dict__, "bias": False})
    assert whole_numel(GPT(nobias)) == whole_params(n_layer=2, n_embd=16, block_size=6,
                                                    bias=False)


@pytest.mark.parametrize("tp, sp, recompute, measured_mib", [
    (1, False, False, 74.21), (2, False, False, 46.16), (2, True, False, 41.62),
    (2, True, True, 37.12), (4, False, False, 32.13), (4, True, False, 25.32),
    (4, True, True, 18.57)])
def test_unit_activation_formula_is_the_measured_table(tp, sp, recompute, measured_mib):
    got = activation_bytes(n_layer=4, n_embd=256, batch=4, seq=256, vocab_size=1024, tp=tp,
                           sequence_parallel=sp, recompute_gather=recompute)
    # Left out by the formula: the norms' mean/rstd and attention's logsumexp (b*s floats).
    assert got / MIB == pytest.approx(measured_mib, rel=0.005)
    a = 4 * 256 * 256 * 4
    if not sp:  # the textbook split: 13a per layer and the logits / t, the norms' 4a + 2 whole
        assert got == (13 * 4 * a + 4 * 256 * 1024 * 4) / tp + (4 * 4 + 2) * a


def test_unit_a_layouts_figures_are_the_formulas():
    shape = model_shape(DOC, 8)
    P, W = shape.params, shape.whole
    f = layout_figures(Layout(dp=2, tp=4, zero_stage=2, sequence_parallel=True), shape, batch=4)
    held = (P - W) / 4 + W
    assert (f.params_bytes, f.grads_bytes, f.optimizer_bytes) == (4 * held, 4 * held / 2,
                                                                   8 * held / 2)
    assert f.dp_sent_bytes == 2 * (2 - 1) / 2 * 4 * held  # ZeRO 2: one all-reduce's bytes
    volumes = expected_bytes(n_layer=4, n_embd=256, batch=4, seq=256, sequence_parallel=True)
    assert f.tp_sent_bytes == sum(ring_bytes_per_rank(op, b, 4) for op, b in volumes.items())
    assert f.activation_sp_bytes == activation_bytes(n_layer=4, n_embd=256, batch=4, seq=256,
                                                     vocab_size=1024, tp=4,
                                                     sequence_parallel=True)
    assert f.total_bytes == f.state_bytes + f.activation_sp_bytes and f.pp_sent_bytes == 0
    z3 = layout_figures(Layout(dp=8, zero_stage=3), shape, batch=4)
    assert z3.params_bytes == 4 * P / 8 and z3.dp_sent_bytes == (2 + 1) * 7 / 8 * 4 * P
    # A pipeline stage: the heaviest's parameters, its activations out and gradients back.
    p2 = layout_figures(Layout(dp=4, pp=2), shape, batch=4)
    assert p2.params_bytes == 4 * max(s[0] for s in shape.stages[2])
    assert p2.pp_sent_bytes == 4 * 256 * 256 * 4


# benchmarks/tensor_parallel.py --quick, tp 2 x pp 2, 1F1B (4 micro-batches of 1): bytes counted
# by wrapping torch.distributed's calls on tp rank 0 of each stage, one step.
QUICK = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)
COUNTED_TP = {  # (sequence parallel, stage) -> bytes by collective over the tp group
    (False, 0): {"all_reduce": 327680}, (False, 1): {"all_reduce": 330752},
    (True, 0): {"all_reduce": 71680, "all_gather": 327680, "reduce_scatter": 262144},
    (True, 1): {"all_reduce": 11264, "all_gather": 327680, "reduce_scatter": 327680}}
COUNTED_PP = {False: 65536, True: 32768}  # isend bytes per rank, either stage


@pytest.mark.parametrize("sp", [False, True])
def test_unit_pipeline_stages_bytes_are_the_counted_ones(sp):
    shape = model_shape(QUICK, 4)
    assert [layers for _, _, layers in shape.stages[2]] == [1, 1]
    # Per stage: its own layers, the embedding on the first, the head on the last; under SP
    # the replicated parameters' gradients are summed after each of the 4 backwards.
    for k in (0, 1):
        got = expected_bytes(n_layer=1, n_embd=64, batch=4, seq=64, sequence_parallel=sp,
                             embedding=k == 0, head=k == 1, backwards=4)
        assert {op: b for op, b in got.items() if b} == COUNTED_TP[sp, k]
    # The stages add up to the whole model's, the gradients' sums once per step.
    stages = [expected_bytes(n_layer=1, n_embd=64, batch=4, seq=64, sequence_parallel=sp,
                             embedding=k == 0, head=k == 1) for k in (0, 1)]
    whole = expected_bytes(n_layer=2, n_embd=64, batch=4, seq=64, sequence_parallel=sp)
    assert {op: stages[0][op] + stages[1][op] for op in whole} == whole
    # pp: every micro-batch's boundary (b x s x h in all) one way, its slice of it under SP.
    f = layout_figures(Layout(1, 2, 2, 0, sp), shape, batch=4)
    assert f.pp_sent_bytes == pp_sent_bytes(f.layout, shape, batch=4) == COUNTED_PP[sp]
    assert layout_figures(Layout(1, 4, 2, 0, sp), model_shape(QUICK, 8),
                          batch=4).pp_sent_bytes == 2 * COUNTED_PP[sp]  # a middle stage


def test_unit_recommendation_follows_its_rule():
    shape = model_shape(DOC, 4)
    rows = [layout_figures(lay, shape, batch=4) for lay in layouts(4, shape, host=4)]
    assert {(r.layout.dp, r.layout.pp, r.layout.tp) for r in rows} >= {
        (4, 1, 1), (2, 2, 1), (2, 1, 2), (1, 1, 4), (1, 2, 2), (1, 4, 1)}
    # Anything fits: no model parallelism, and of dp's ZeRO stages the one holding least
    # among those sending least (2: as many bytes as 0 and 1; 3 sends more).
    best, rule = recommend(rows)
    assert (best.layout.tp, best.layout.pp, best.layout.zero_stage) == (1, 1, 2)
    assert "least model parallelism" in rule and "tp before pp" in rule
    # Pure data parallelism does not fit, tp 2 and pp 2 both do: tp 2 (tp before pp).
    dp_only = max(r.total_bytes for r in rows if r.layout.tp * r.layout.pp == 1)
    tp2 = min(r.total_bytes for r in rows if (r.layout.tp, r.layout.pp) == (2, 1))
    pp2 = min(r.total_bytes for r in rows if (r.layout.tp, r.layout.pp) == (1, 2))
    budget = max(tp2, pp2)
    assert min(r.total_bytes for r in rows if r.layout.tp * r.layout.pp == 1) > budget
    best, _ = recommend(rows, budget)
    assert (best.layout.tp, best.layout.pp) == (2, 1) and best.total_bytes <= budget < dp_only
    # --recompute-gather (listed beside each SP layout) only where it is what fits: it sends more.
    tp2 = [r for r in rows if (r.layout.tp, r.layout.pp, r.layout.zero_stage) == (2, 1, 3)]
    plain, again = sorted(tp2, key=lambda r: r.layout.recompute_gather)
    assert again.layout.recompute_gather and again.tp_sent_bytes > plain.tp_sent_bytes
    assert again.total_bytes < plain.total_bytes
    assert recommend(rows, plain.total_bytes)[0].layout.recompute_gather is False
    best, _ = recommend(rows, (again.total_bytes + plain.total_bytes) / 2)
    assert (best.layout.tp, best.layout.recompute_gather) == (2, True)
    assert best.layout.flags().endswith("--sequence-parallel --recompute-gather")
    # Nothing fits.
    assert recommend(rows, 1.0)[0] is None
    # The flags that run a layout.
    assert Layout(2, 1, 2, 3, True).flags() == "--strategy tp --tp 2 --zero-stage 3 " \
                                                "--sequence-parallel"
    assert Layout(1, 2, 2, 0, True).flags() == "--strategy pipeline --pp 2 --tp 2 " \
                                                "--sequence-parallel"
    assert Layout(4, 1, 1, 1).flags() == "--strategy zero --zero-stage 1"


def test_unit_explain_gives_the_plans_figures_for_tp():
    shape = model_shape(DOC, 4)
    work = Workload(world_size=4, params=shape.params, step_batch=4, sample_numel=256 * 256,
                    n_layer=4, block_size=256, vocab_size=1024, whole_params=shape.whole)
    fig = TPConfig(tp=2, zero_stage=1, sequence_parallel=True).figures(work)
    row = layout_figures(Layout(2, 1, 2, 1, True), ModelShape(
        4, 256, 8, 1024, 256, shape.params, shape.whole), batch=4)
    assert (fig.params_bytes, fig.grads_bytes, fig.optimizer_bytes, fig.sent_bytes) == (
        row.params_bytes, row.grads_bytes, row.optimizer_bytes, row.sent_bytes)
    assert fig.activation_bytes == row.activation_sp_bytes
    assert fig.dp_sent_bytes + fig.tp_sent_bytes == fig.sent_bytes
    # --recompute-gather: the column inputs (2 per layer and lm_head's, a = b*s*h*4 bytes
    # each) saved as 1/tp, and all-gathered once more each in backward.
    again = TPConfig(tp=2, zero_stage=1, sequence_parallel=True,
                     recompute_gather=True).figures(work)
    a = 4 * 256 * 256 * 4
    assert fig.activation_bytes - again.activation_bytes == (2 * 4 + 1) * a / 2
    assert again.tp_sent_bytes - fig.tp_sent_bytes == (2 * 4 + 1) * a / 2  # (t-1)/t of each
    assert Layout(2, 1, 2, 1, True, True).flags() == \
        "--strategy tp --tp 2 --zero-stage 1 --sequence-parallel --recompute-gather"


def test_plan_command_lists_the_layouts_and_recommends_one(capsys):
    assert main(["--nproc-per-node", "4", "--n-layer", "4", "--n-embd", "256", "--n-head", "8",
                 "--vocab-size", "1024", "--block-size", "256", "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "dp x pp x tp" in out and "2 x 1 x 2" in out and "1 x 1 x 4" in out
    assert "not listed" not in out
    # A character text's vocabulary (tiny Shakespeare's 65) keeps tp out; the note says how in.
    assert main(["--nproc-per-node", "4", "--n-layer", "4", "--n-embd", "128",
                 "--vocab-size", "65", "--block-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "x 1 x 2 " not in out
    assert "not listed: tp 2, 4, which divide n_head but not vocab_size 65; `ringtrain train " \
        "--pad-vocab 4` pads the vocabulary to 68 rows (`ringtrain plan --vocab-size 68` lists " \
        "them)" in out
    assert "recommended: dp 4 x pp 1 x tp 1, ZeRO 2: ringtrain train --nproc-per-node 4 " \
           "--strategy zero --zero-stage 2" in out and "rule: the layout that fits" in out
    assert main(["--nproc-per-node", "4", "--n-layer", "4", "--n-embd", "256", "--n-head", "8",
                 "--vocab-size", "1024", "--block-size", "256", "--batch-size", "4",
                 "--memory-gb", "0.06"]) == 0
    # dp 4 (74 MB of activations per rank) does not fit; tp 2 with ZeRO 2 does, sending less
    # than ZeRO 3 (which fits too).
    assert "recommended: dp 2 x pp 1 x tp 2, ZeRO 2: ringtrain train --nproc-per-node 4 " \
           "--strategy tp --tp 2 --zero-stage 2 --sequence-parallel" in capsys.readouterr().out


@pytest.mark.parametrize("argv, error", [
    (["--memory-gb", "-1"], "--memory-gb -1: it must be positive"),
    (["--memory-gb", "0", "--nproc-per-node", "0"],
     "--nproc-per-node 0, --memory-gb 0: each must be positive"),
    (["--tflops", "0"], "--tflops 0: it must be positive"),
    (["--n-embd", "100", "--n-head", "3"], "--n-embd 100 is not divisible by --n-head 3; choose "
     "--n-embd as a multiple of --n-head (e.g. 99)"),  # was GPTConfig's words, on stdout
])
def test_plan_refuses_a_figure_that_is_not_positive_or_a_shape_in_flags(argv, error, capsys):
    """--memory-gb -1 printed "no layout fits in -1 GiB"; 0 was taken as no budget at all."""
    assert main([*argv, "--n-layer", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"ringtrain plan: error: {error}\n" and captured.out == ""
