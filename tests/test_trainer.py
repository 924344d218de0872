"""The training loop (`ringtrain.training.trainer`) with the DDP strategy: single process and
2 ranks."""

import json
import math
import os

import pytest
import torch
from torch.utils.data import Subset

from ringtrain.data.addition import AdditionDataset, exact_match
from ringtrain.launch.process_group import destroy_distributed, init_distributed
from ringtrain.models import GPT, GPTConfig, loss_fn
from ringtrain.runtime import get_runtime
from ringtrain.strategies import make_strategy
from ringtrain.testing import run_workers
from ringtrain.training.trainer import Trainer, TrainerConfig, lr_at, param_sha256, rank_seed

_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")
MODEL = GPTConfig(vocab_size=10, block_size=3, n_layer=1, n_head=2, n_embd=16)


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for v in _VARS:
        monkeypatch.delenv(v, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread only waits on a busy machine
    yield
    torch.set_num_threads(threads)
    destroy_distributed()


def make_trainer(runtime, *, batch_size=8, grad_accum=1, steps=8, dropout=0.0, seed=0,
                 eval_size=5, run_dir=None, loss=loss_fn, **config):
    """1-digit addition (80 train, 20 test sums); an eval set of 5 so 2 ranks get 3 and 2."""
    train, test = AdditionDataset("train", 1), AdditionDataset("test", 1)
    model_config = GPTConfig(**{**MODEL.__dict__, "dropout": dropout})
    cfg = TrainerConfig(steps=steps, batch_size=batch_size, grad_accum=grad_accum, lr=3e-3,
                        seed=seed, progress=False, eval_batch_size=2, **config)
    return Trainer(make_strategy("ddp", runtime=runtime), runtime, lambda: GPT(model_config),
                   train, Subset(test, range(eval_size)), loss, cfg,
                   eval_metrics={"accuracy": exact_match}, run_dir=run_dir)


def _fit_worker(rank, world_size, batch_size, grad_accum):
    trainer = make_trainer(get_runtime(), batch_size=batch_size, grad_accum=grad_accum)
    summary = trainer.fit()
    return trainer.strategy.model_state_dict(), summary


def _fit_here(**kw):
    rt = init_distributed()
    trainer = make_trainer(rt, **kw)
    summary = trainer.fit()
    state = {k: v.clone() for k, v in trainer.strategy.model_state_dict().items()}
    destroy_distributed()
    return state, summary, trainer


def test_two_ranks_batch_b_equal_one_rank_batch_2b():
    # Rank r's sampler shard of each global batch is every other sample of it, so 2 x B sees
    # exactly the 2B samples of one process; gradients averaged over ranks = the 2B mean.
    (s0, sum0), (s1, sum1) = run_workers(_fit_worker, 2, args=(4, 1), timeout_s=90)
    ref, ref_summary, _ = _fit_here(batch_size=8)
    assert sum0["param_sha256"] == sum1["param_sha256"]  # the replicas agree bit for bit
    for k in ref:
        torch.testing.assert_close(s0[k], ref[k], rtol=1e-4, atol=1e-5, msg=k)
    # Eval on the exact sampler: 3 + 2 samples over 2 ranks give the 1-rank metrics.
    assert math.isclose(sum0["eval_loss"], ref_summary["eval_loss"], rel_tol=1e-4)
    assert sum0["eval_accuracy"] == ref_summary["eval_accuracy"]
    assert sum0["world_size"] == 2 and sum0["steps"] == 8


def test_grad_accum_equals_the_unsplit_batch():
    split, _, _ = _fit_here(batch_size=4, grad_accum=2)
    whole, _, _ = _fit_here(batch_size=8)
    for k in whole:
        torch.testing.assert_close(split[k], whole[k], rtol=1e-4, atol=1e-5, msg=k)


def test_run_directory_files_and_summary(tmp_path):
    _, summary, _ = _fit_here(steps=12, log_every=4, eval_every=6, run_dir=str(tmp_path))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [4, 6, 8, 12]
    for r in lines:
        assert {"step", "loss", "lr", "tokens_per_s", "compute_s", "comm_s"} <= set(r)
    assert {"eval_loss", "eval_accuracy"} <= set(lines[1]) and "eval_loss" not in lines[0]
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    for key in ("steps", "world_size", "strategy", "train_loss", "eval_loss", "eval_accuracy",
                "tokens_per_s", "wall_s", "restarts", "param_sha256"):
        assert key in on_disk, key
    assert on_disk["param_sha256"] == summary["param_sha256"]
    # Seen missing once in a full fresh-clone run (session 10; not reproduced alone or with its
    # neighbours): say what the run said and what the directory held if it happens again.
    assert (tmp_path / "report.png").exists(), (summary.get("disk_full"), sorted(
        p.name for p in tmp_path.iterdir()))
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_same_seed_same_parameters_other_seed_differs():
    a = _fit_here(steps=4, dropout=0.1)[1]["param_sha256"]
    b = _fit_here(steps=4, dropout=0.1)[1]["param_sha256"]
    c = _fit_here(steps=4, dropout=0.1, seed=1)[1]["param_sha256"]
    assert a == b != c


def test_early_stop_and_resume_state():
    rt = init_distributed()
    trainer = make_trainer(rt, steps=20, eval_every=5)
    trainer.stop_when = lambda rec: rec["eval_loss"] < 100
    summary = trainer.fit()
    assert summary["steps"] == 5
    state = trainer.state.state_dict()
    assert state["step"] == 5
    assert state["sampler"]["samples_consumed"] == 5 * 8 and state["sampler"]["epoch"] == 0


def _stopping(run_dir, eval_loss_under, steps=20):
    """A trainer of `make_trainer`'s task with snapshots every 100 steps (none due before the
    end) under `run_dir`, stopping once eval_loss is under `eval_loss_under`."""
    rt = init_distributed()
    train, test = AdditionDataset("train", 1), AdditionDataset("test", 1)
    cfg = TrainerConfig(steps=steps, batch_size=8, lr=3e-3, progress=False, eval_every=5,
                        eval_batch_size=2, report=False)
    trainer = Trainer(make_strategy("ddp", runtime=rt), rt, lambda: GPT(MODEL), train,
                      Subset(test, range(5)), loss_fn, cfg, eval_metrics={"accuracy": exact_match},
                      run_dir=str(run_dir), snapshot_every=100,
                      stop_when=lambda rec: rec["eval_loss"] < eval_loss_under)
    return trainer


def test_an_early_stop_is_resumable_and_running_it_again_trains_nothing(tmp_path, caplog):
    """The stop step's snapshot (none was due): the same condition again trains nothing and
    says why (as a run resumed at its last step), each start told where it trains to; a
    condition not met there goes on from it, bit for bit the run that never stopped."""
    first = _stopping(tmp_path / "run", 100.0)
    starts = []
    first.on_start = lambda step, until: starts.append((step, until))
    stopped = first.fit()
    assert stopped["steps"] == 5 and starts == [(0, 20)]
    destroy_distributed()
    again = _stopping(tmp_path / "run", 100.0)
    again.on_start = lambda step, until: starts.append((step, until))
    with caplog.at_level("INFO", logger="ringtrain"):
        summary = again.fit()
    assert summary["steps"] == 5 and starts[-1] == (5, 5)
    assert summary["param_sha256"] == stopped["param_sha256"]
    assert "the run stopped early at step 5 (eval_loss" in caplog.text
    assert "nothing is left to train" in caplog.text
    destroy_distributed()
    on = _stopping(tmp_path / "run", -1.0)  # never met: trains to --steps from step 5
    on.on_start = lambda step, until: starts.append((step, until))
    went_on = on.fit()
    assert went_on["steps"] == 20 and starts[-1] == (5, 20)
    destroy_distributed()
    whole = _stopping(tmp_path / "whole", -1.0).fit()
    assert went_on["param_sha256"] == whole["param_sha256"]


def test_nan_loss_stops_on_the_reduced_value():
    rt = init_distributed()
    trainer = make_trainer(rt, steps=4, log_every=2, eval_every=4,
                           loss=lambda lo, y: loss_fn(lo, y) * float("nan"))
    with pytest.raises(FloatingPointError, match="became nan at step 2"):
        trainer.fit()


def _head_dtypes(dtype):
    """The dtypes the GPT's lm_head produced in training and in evaluation over a 2-step fit on
    the CPU (gloo), and the summary."""
    seen = {"train": set(), "eval": set()}

    def model_fn():
        model = GPT(MODEL)
        model.head.lm_head.register_forward_hook(
            lambda m, args, out: seen["train" if m.training else "eval"].add(out.dtype))
        return model

    rt = init_distributed()
    assert rt.device.type == "cpu"
    cfg = TrainerConfig(steps=2, batch_size=8, progress=False, eval_batch_size=2, dtype=dtype)
    trainer = Trainer(make_strategy("ddp", runtime=rt), rt, model_fn, AdditionDataset("train", 1),
                      Subset(AdditionDataset("test", 1), range(5)), loss_fn, cfg)
    summary = trainer.fit()
    destroy_distributed()
    return seen, summary


def test_bf16_autocast_runs_on_the_cpu():
    # The loss being finite proves nothing (fp32 gives one too): the head must see bf16
    # activations, in the training steps and in evaluation, and fp32 must not.
    bf16, summary = _head_dtypes("bf16")
    assert bf16 == {"train": {torch.bfloat16}, "eval": {torch.bfloat16}}
    assert math.isfinite(summary["train_loss"])
    fp32, _ = _head_dtypes("fp32")
    assert fp32 == {"train": {torch.float32}, "eval": {torch.float32}}


def test_lr_schedule_warmup_then_cosine():
    c = TrainerConfig(steps=100, lr=1.0, warmup_steps=10).resolved()
    assert lr_at(0, c) == pytest.approx(0.1) and lr_at(9, c) == pytest.approx(1.0)
    assert lr_at(10, c) == pytest.approx(1.0) and lr_at(100, c) == pytest.approx(0.1)
    assert lr_at(55, c) == pytest.approx(0.55)
    flat = TrainerConfig(steps=100, lr=1.0, warmup_steps=0, lr_schedule="constant").resolved()
    assert lr_at(0, flat) == lr_at(99, flat) == 1.0


@pytest.mark.parametrize("field,value,match", [("batch_size", 0, "batch_size=0"),
                                               ("lr_schedule", "step", "'cosine' or 'constant'"),
                                               ("dtype", "fp16", "'fp32' or 'bf16'")])
def test_config_errors(field, value, match):
    with pytest.raises(ValueError, match=match):
        TrainerConfig(**{field: value}).resolved()


def test_too_few_samples_for_one_batch():
    rt = init_distributed()
    with pytest.raises(ValueError, match="fewer than one batch of --batch-size 100"):
        make_trainer(rt, batch_size=100)


def test_param_sha256_and_rank_seed():
    state = {"a": torch.arange(4.0), "b": torch.ones(2, dtype=torch.bfloat16)}
    assert param_sha256(state) == param_sha256({k: v.clone() for k, v in state.items()})
    assert param_sha256(state) != param_sha256({"b": state["b"], "a": state["a"]})
    assert len({rank_seed(0, r) for r in range(4)} | {rank_seed(1, 0)}) == 5
    assert os.environ.get("RANK") is None


# -- sums through the store that leave out a departed rank (ringtrain.agreement.membership) --------
def _views(store, world_size=3, **kw):
    from ringtrain.agreement.membership import Membership

    return [Membership(store, r, world_size, scope="t", timeout_s=5, **kw)
            for r in range(world_size)]


def _in_threads(calls):
    """Run each zero-argument call on its own thread; results (or raised errors) in order."""
    import threading

    out: list = [None] * len(calls)

    def run(i, fn):
        try:
            out[i] = fn()
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out[i] = e
    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads), "a store reduction did not return"
    return out


def test_store_reduce_sums_every_rank_bit_identically():
    import torch.distributed as dist

    views = _views(dist.HashStore())
    values = [[0.1, 1.0], [0.2, 2.0], [0.3, 4.0]]
    out = _in_threads([lambda v=v, x=x: v.reduce("s", x)
                       for v, x in zip(views, values, strict=True)])
    assert out[0] == out[1] == out[2] == [0.1 + 0.2 + 0.3, 7.0]  # rank order, on every rank


def test_store_reduce_leaves_out_a_departed_rank_consistently():
    import time

    import torch.distributed as dist

    from ringtrain.agreement.membership import MemberDepartedError

    views = _views(dist.HashStore())
    # Rank 2 never arrives; the survivors wait until it is declared departed, then both
    # leave it out (its key is settled as DEPARTED by whichever reader gives up first).
    def depart_later():
        time.sleep(0.3)
        return views[0].depart(2, "worker rank 2 died")
    out = _in_threads([lambda: views[0].reduce("a", [1.0]), lambda: views[1].reduce("a", [2.0]),
                       depart_later])
    assert out[0] == out[1] == [3.0] and out[2] is True
    assert views[1].departed() == {2: "worker rank 2 died (seen by rank 0)"}
    assert views[1].depart(2, "again") is False  # the first report stands
    # It comes back late: it was given up on, so it cannot add to the sums it was left out of.
    with pytest.raises(MemberDepartedError, match="rank 2 reached 'a' after the others"):
        views[2].reduce("a", [4.0])
    # A rank that wrote before it departed is counted, by every reader alike.
    store = dist.HashStore()
    views = _views(store)
    dying, dying.timeout_s = views[2], 0.1
    with pytest.raises(TimeoutError):  # it writes its payload, then "dies" waiting for the others
        dying.gather("b", b"x")
    views[0].depart(2, "gone after writing")
    out = _in_threads([lambda: views[0].gather("b", b"y"), lambda: views[1].gather("b", b"z")])
    assert out == [{0: b"y", 1: b"z", 2: b"x"}] * 2


def test_store_reduce_names_a_silent_rank_that_has_not_departed():
    import torch.distributed as dist

    from ringtrain.agreement.membership import Membership

    views = [Membership(dist.HashStore(), 0, 2, scope="t", timeout_s=0.3)]
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not reach 'x' within 0.3 s"):
        views[0].reduce("x", [1.0])
