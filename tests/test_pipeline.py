"""Pipeline parallelism on real gloo ranks against the unsplit single-process model.

Every worker builds the same model from the same seed, computes the single-process reference
itself, runs its stage, and asserts allclose (fp32). Each multi-process test is one spawn.

    .venv/bin/pytest -q tests/test_pipeline.py
"""

import copy
import json
import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ringtrain.cli.train import main as train_main
from ringtrain.grid import Grid, create_process_groups
from ringtrain.launch.process_group import destroy_distributed
from ringtrain.models.gpt import GPT, GPTConfig, loss_fn
from ringtrain.pipeline import PipelineStage, ScheduleError, partition
from ringtrain.pipeline.schedule import (
    Backward,
    Forward,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    placement,
)
from ringtrain.runtime import get_runtime
from ringtrain.testing import run_workers

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _gpt(n_layer: int, tie: bool = False) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=n_layer, n_head=4, n_embd=32,
                         tie_embeddings=tie))


def _batch(n: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 11, (n, 8), generator=g), torch.randint(0, 11, (n, 8), generator=g)


def _grads_match(model: nn.Module, stage: nn.Module, ref: nn.Module, what: str) -> None:
    """Every parameter of `stage` (which shares `model`'s objects) has the reference's grad."""
    names = {id(p): n for n, p in model.named_parameters()}
    ref_params = dict(ref.named_parameters())
    for p in stage.parameters():
        name = names[id(p)]
        torch.testing.assert_close(p.grad, ref_params[name].grad, **TOL,
                                   msg=lambda m, n=name: f"{what}: grad of {n}: {m}")


def _check_gpt_engine(rank: int, world_size: int) -> dict:
    """A GPT split over `world_size` ranks: every schedule (interleaved and zb-v: 2 chunks),
    M = pp and M = 4 (2 x pp for interleaved, which needs a multiple of pp), and M = 2 < pp
    on 3 ranks, equal to the unsplit model's loss and gradients; forward_only equals its
    logits."""
    pp = world_size
    g = create_process_groups(Grid(world_size, pp=pp))
    x, y = _batch(12)
    losses = {}
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2),
                        ("zb-v", 2)):
        model = _gpt(n_layer=pp * v)
        ref = copy.deepcopy(model)
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        stages = partition(model.to_sequential(), pp * v)
        place = placement(schedule, pp, v)
        chunks = [stages[place.stage(g.pp_rank, c)] for c in range(v)]
        # M < pp (2 of 3 stages) runs too, for every schedule but interleaved
        for m in ((pp, 2 * pp) if schedule == "interleaved" else (pp, 4, 2)[:2 + (pp > 2)]):
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
            engine = PipelineStage(chunks if v > 1 else chunks[0], pp_rank=g.pp_rank, pp=pp,
                                   pp_ranks=g.pp_ranks, pp_group=g.pp_group, loss_fn=loss_fn,
                                   schedule=schedule)
            stats = engine.train_step(x, y, m)
            for c, chunk in enumerate(chunks):
                _grads_match(model, chunk, ref, f"{schedule} M={m} chunk {c}")
            if engine.is_last:
                assert stats.count == 12
                torch.testing.assert_close(torch.tensor(stats.loss_sum / stats.count),
                                           ref_loss.detach(), **TOL)
                losses[(schedule, m)] = stats.loss_sum / stats.count
        logits = engine.forward_only(x)
        if engine.is_last:
            torch.testing.assert_close(logits, ref(x).detach(), **TOL, msg=schedule)
        else:
            assert logits is None
    return {"pp_rank": g.pp_rank, "losses": losses}


def _check_two_linear(rank: int, world_size: int) -> None:
    """The seeds' example: Linear(1000, 10000) on rank 0, Linear(10000, 1000) on rank 1; and
    a deadlocking hand-made schedule, rejected on both ranks before anything is sent."""
    g = create_process_groups(Grid(2, pp=2))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1000, 10000), nn.Linear(10000, 1000))
    x, y = torch.randn(4, 1000), torch.randn(4, 1000)
    ref = copy.deepcopy(model)
    nn.functional.mse_loss(ref(x), y).backward()
    stage = partition(model, 2)[rank]
    assert len(stage) == 1 and stage[0] is model[rank]
    engine = PipelineStage(stage, pp_rank=rank, pp=2, pp_ranks=g.pp_ranks, pp_group=g.pp_group,
                           loss_fn=nn.functional.mse_loss, schedule="1f1b")
    engine.train_step(x, y, 2)
    _grads_match(model, stage, ref, "two Linear")

    deadlock = [
        [Forward(0), SendActivation(0), Forward(1), RecvGrad(0), Backward(0), SendActivation(1),
         RecvGrad(1), Backward(1)],
        [RecvActivation(0), Forward(0), RecvActivation(1), Forward(1), Backward(0), SendGrad(0),
         Backward(1), SendGrad(1)],
    ]
    bad = PipelineStage(stage, pp_rank=rank, pp=2, pp_ranks=g.pp_ranks, pp_group=g.pp_group,
                        loss_fn=nn.functional.mse_loss, schedule=deadlock)
    with pytest.raises(ScheduleError, match="deadlocks: stage 0 waits at step 3 on RecvGrad"):
        bad.train_step(x, y, 2)


def test_single_stage_equals_model_and_batchnorm_warns():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    engine = PipelineStage(partition(model, 1)[0], pp_rank=0, pp=1, pp_ranks=[0], pp_group=None,
                           loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    with pytest.warns(UserWarning, match=r"BatchNorm layers \['1'\] normalise over micro-batches "
                                         r"of 4 samples, not the batch of 8"):
        engine.train_step(x, y, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per stage, not every step
        engine.train_step(x, y, 2)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    ref = copy.deepcopy(plain)
    stats = PipelineStage(plain, pp_rank=0, pp=1, pp_ranks=[0], pp_group=None,
                          loss_fn=nn.functional.mse_loss, schedule="gpipe").train_step(x, y, 4)
    ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    assert stats.loss_sum / stats.count == pytest.approx(ref_loss.item(), rel=1e-6)
    for p, q in zip(plain.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


# -- the strategy: dp x pp, tied weights, clipping, full state ---------------------------------
def _train_reference(model: nn.Module, batches, steps: int, lr: float, clip: float) -> nn.Module:
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x, y = batches(step)
        loss_fn(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
    return ref


def _check_strategy(rank: int, world_size: int, pp: int, schedule: str, tie: bool,
                    virtual_stages: int = 1) -> dict:
    from ringtrain.strategies.pipeline import PipelineStrategy

    strategy = PipelineStrategy(get_runtime(), pp=pp, schedule=schedule, microbatches=2,
                                virtual_stages=virtual_stages)
    dp = world_size // pp
    assert strategy.data_world_size == dp and strategy.data_rank == rank // pp
    # gloo: gradients go back on a group of their own (grid.create_pp_grad_groups), so the
    # results below are checked with them there.
    assert strategy.grad_group is not strategy.groups.pp_group
    assert dist.get_process_group_ranks(strategy.grad_group) == list(strategy.groups.pp_ranks)
    model = _gpt(n_layer=2, tie=tie)
    steps, lr, clip = 3, 0.1, 0.5  # SGD: AdamW's m/sqrt(v) would amplify 1e-7 noise near 0
    full = [_batch(4 * dp, seed=10 + s) for s in range(steps)]
    ref = _train_reference(model, lambda s: full[s], steps, lr, clip)
    strategy.setup(model, lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9), loss_fn)
    shard = slice(4 * strategy.data_rank, 4 * (strategy.data_rank + 1))
    for s in range(steps):
        x, y = full[s]
        # The trainer's gradient accumulation: two halves, concatenated by the strategy.
        result = strategy.train_step([(x[shard][:2], y[shard][:2]), (x[shard][2:], y[shard][2:])],
                                     lr=lr, grad_clip=clip)
        assert result.count == (4 if strategy.engine.is_last else 0)
    state = strategy.model_state_dict()
    ref_state = ref.state_dict()
    assert list(state) == list(ref_state)
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], **TOL,
                                   msg=lambda m, n=name: f"rank {rank}: {n}: {m}")
    x, _ = full[0]
    logits = strategy.eval_logits(x[shard])
    if strategy.engine.is_last:  # zb-v: rank 0 holds the last stage
        torch.testing.assert_close(logits, ref(x[shard]).detach(), **TOL)
    else:
        assert logits is None
    return strategy.state_dict()["layout"]


# -- one spawn per world size; each check's outcome per rank ----------------------------------
CHECKS = {
    2: {"gpt_engine": (_check_gpt_engine, ()), "two_linear": (_check_two_linear, ()),
        "strategy_tied": (_check_strategy, (2, "gpipe", True)),
        "strategy_tied_interleaved": (_check_strategy, (2, "interleaved", True, 2)),
        "strategy_tied_zb": (_check_strategy, (2, "zb-h1", True)),
        "strategy_tied_zbv": (_check_strategy, (2, "zb-v", True))},
    3: {"gpt_engine": (_check_gpt_engine, ())},
    4: {"strategy_dp2_pp2": (_check_strategy, (2, "1f1b", False)),
        "strategy_dp2_pp2_interleaved": (_check_strategy, (2, "interleaved", False, 2)),
        "strategy_dp2_pp2_zb": (_check_strategy, (2, "zb-h1", False)),
        "strategy_dp2_pp2_zbv": (_check_strategy, (2, "zb-v", False))},
}


def _run_checks(rank: int, world_size: int) -> dict:
    """Run every check of this world size in order; a failure is recorded, not raised, so the
    other checks still report (a failure mid-communication ends in run_workers' timeout)."""
    import traceback

    outcome = {}
    for name, (check, args) in CHECKS[world_size].items():
        try:
            outcome[name] = ("ok", check(rank, world_size, *args))
        except Exception:  # noqa: BLE001 - reported by the test that owns the check
            outcome[name] = ("failed", f"rank {rank}:\n{traceback.format_exc()}")
    return outcome


_spawned: dict[int, list[dict]] = {}


def _outcome(world_size: int, name: str) -> list:
    if world_size not in _spawned:
        _spawned[world_size] = run_workers(_run_checks, world_size, timeout_s=60 + 15 * world_size)
    results = [per_rank[name] for per_rank in _spawned[world_size]]
    failures = [detail for status, detail in results if status == "failed"]
    assert not failures, failures[0]
    return [detail for _, detail in results]


@pytest.mark.parametrize("pp", [2, 3])
def test_gpt_pipeline_equals_unsplit_model_both_schedules(pp):
    results = _outcome(pp, "gpt_engine")
    assert [r["pp_rank"] for r in results] == list(range(pp))
    fewer = {(name, 2) for name in ("gpipe", "1f1b", "zb-h1", "zb-v")} if pp > 2 else set()
    losses = set(results[-1]["losses"]) | set(results[0]["losses"])  # zb-v: loss on rank 0
    assert losses == {
        ("gpipe", pp), ("gpipe", 4), ("1f1b", pp), ("1f1b", 4), ("zb-h1", pp), ("zb-h1", 4),
        ("interleaved", pp), ("interleaved", 2 * pp), ("zb-v", pp), ("zb-v", 4), *fewer}


def test_two_linear_split_over_two_ranks_and_deadlock_rejected():
    _outcome(2, "two_linear")


def test_strategy_tied_embeddings_two_stages_equals_single_process():
    layouts = _outcome(2, "strategy_tied")
    assert layouts[1] == {"world_size": 2, "pp": 2, "dp": 1, "pp_rank": 1}


def test_strategy_tied_embeddings_interleaved_zb_h1_and_zb_v_equal_single_process():
    layouts = _outcome(2, "strategy_tied_interleaved")
    assert layouts[0] == {"world_size": 2, "pp": 2, "dp": 1, "pp_rank": 0, "virtual_stages": 2}
    _outcome(2, "strategy_tied_zb")
    # zb-v: 4 stages in a V, rank 0 holds the embedding and the tied head (one parameter)
    assert _outcome(2, "strategy_tied_zbv") == [
        {"world_size": 2, "pp": 2, "dp": 1, "pp_rank": r, "virtual_stages": 2} for r in (0, 1)]


@pytest.mark.parametrize("name", ["strategy_dp2_pp2", "strategy_dp2_pp2_interleaved",
                                  "strategy_dp2_pp2_zb", "strategy_dp2_pp2_zbv"])
def test_strategy_dp2_x_pp2_equals_single_process(name):
    layouts = _outcome(4, name)
    assert [(lay["dp"], lay["pp_rank"]) for lay in layouts] == [(2, 0), (2, 1), (2, 0), (2, 1)]


def test_strategy_rejects_bad_options_before_any_collective():
    from types import SimpleNamespace

    from ringtrain.strategies.pipeline import PipelineStrategy

    rt = SimpleNamespace(rank=0, world_size=3, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="world_size=3 is not divisible by pp=2"):
        PipelineStrategy(rt, pp=2)
    with pytest.raises(ValueError, match="--microbatches 1 is fewer than --pp 2 stages: "
                                         "interleaved runs micro-batches in rounds of pp"):
        PipelineStrategy(rt, pp=2, microbatches=1, schedule="interleaved", virtual_stages=2)
    with pytest.raises(ValueError, match="--schedule 'zigzag' is not known"):
        PipelineStrategy(rt, pp=2, schedule="zigzag")
    with pytest.raises(ValueError, match="--virtual-stages 2 needs --schedule interleaved"):
        PipelineStrategy(rt, pp=2, schedule="1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match=r"--microbatches 3 is not a multiple of --pp 2.*"
                                         r"--microbatches in \[2, 4\]"):
        PipelineStrategy(rt, pp=2, schedule="interleaved", microbatches=3, virtual_stages=2)


# -- the main job ------------------------------------------------------------------------------
def test_ringtrain_train_pipeline_end_to_end_equals_one_process(tmp_path, monkeypatch):
    """`ringtrain train --strategy pipeline --pp 2` on 2 processes: the usual run directory and
    summary, and the same losses as one process training the same global batch."""
    tiny = ["--steps", "6", "--n-layer", "2", "--n-embd", "32", "--batch-size", "16",
            "--eval-every", "6", "--no-progress"]
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain", "train", "--strategy", "pipeline", "--pp", "2",
         "--schedule", "1f1b", "--microbatches", "4", "--nproc-per-node", "2", *tiny,
         "--run-dir", str(tmp_path / "pp")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ({"config.json", "metrics.jsonl", "report.png", "summary.json"}
            <= set(os.listdir(tmp_path / "pp")))
    pp = json.loads((tmp_path / "pp" / "summary.json").read_text())
    assert (pp["strategy"], pp["world_size"], pp["steps"]) == ("pipeline", 2, 6)
    assert "param_sha256 differs" not in proc.stderr

    for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
              "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(v, raising=False)
    logger = logging.getLogger("ringtrain")
    saved = (list(logger.handlers), logger.level, logger.propagate, torch.get_num_threads())
    try:
        assert train_main([*tiny, "--threads", "1", "--run-dir", str(tmp_path / "one")]) == 0
    finally:  # leave no trace for other tests
        destroy_distributed()
        logger.handlers[:], logger.level, logger.propagate = saved[:3]
        torch.set_num_threads(saved[3])
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    for key in ("train_loss", "eval_loss", "eval_accuracy"):
        assert pp[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
