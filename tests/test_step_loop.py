"""The one step loop (ringtrain/strategies/step.py) and the trainer's device-resident loss sums.

    .venv/bin/pytest -q tests/test_step_loop.py

CPU, gloo, one process. What is checked: the loss sum a strategy returns is a device tensor
equal, bit for bit, to the sum of Python floats the strategies computed before; the metrics
window gives the same numbers from tensors as from floats (also after a resume mid-window);
the trainer reads the loss back only on the steps it logs; AdamW is not fused off CUDA; and
`compile=True` trains the model in place (same parameter names, same first-step loss).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import Subset

from ringtrain.data.addition import AdditionDataset
from ringtrain.models import GPT, GPTConfig, loss_fn
from ringtrain.strategies import make_strategy
from ringtrain.strategies.step import accumulate, optimizer_step
from ringtrain.trace import NO_TRACE
from ringtrain.training.config import adamw
from ringtrain.training.state import LoopState, WindowSums
from ringtrain.training.trainer import Trainer, TrainerConfig

MODEL = GPTConfig(vocab_size=10, block_size=3, n_layer=1, n_head=2, n_embd=16)


def _micro_batches(sizes: list[int], seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 10, (n, 3), generator=g), torch.randint(0, 10, (n, 3), generator=g))
            for n in sizes]


def test_accumulate_keeps_the_loss_sum_on_the_device_equal_to_the_float_sum():
    torch.manual_seed(0)
    model = GPT(MODEL)
    micro = _micro_batches([5, 3, 4])
    acc = accumulate(micro, model, loss_fn, device=torch.device("cpu"), tracer=NO_TRACE)
    assert isinstance(acc.loss_sum, torch.Tensor) and acc.loss_sum.dtype == torch.float64
    assert acc.count == 12
    # What the four hand-written loops computed: each micro-batch's loss as a float, times its
    # samples, summed in order.
    torch.manual_seed(0)
    ref = GPT(MODEL)
    expected = 0
    for x, y in micro:
        loss = loss_fn(ref(x), y)
        (loss * (len(x) / 12)).backward()
        expected += float(loss.detach()) * len(x)
    assert float(acc.loss_sum) == expected  # bit for bit
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n


def test_accumulate_runs_all_but_the_last_micro_batch_under_no_sync():
    torch.manual_seed(0)
    model, seen = GPT(MODEL), []

    class NoSync:
        def __enter__(self):
            seen.append("no_sync")

        def __exit__(self, *exc):
            return False

    calls = []
    accumulate(_micro_batches([2, 2, 2]), model, loss_fn, device=torch.device("cpu"),
               tracer=NO_TRACE, no_sync=NoSync,
               before_last_backward=lambda: calls.append(len(seen)))
    assert seen == ["no_sync", "no_sync"] and calls == [2]


def test_optimizer_step_clips_steps_and_drops_the_gradients():
    torch.manual_seed(0)
    model = GPT(MODEL)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    accumulate(_micro_batches([4]), model, loss_fn, device=torch.device("cpu"), tracer=NO_TRACE)
    clipped = []
    optimizer_step(opt, NO_TRACE, grad_clip=1.0, clip=lambda m: clipped.append(m))
    assert clipped == [1.0] and all(p.grad is None for p in model.parameters())
    optimizer_step(opt, NO_TRACE, grad_clip=None, clip=lambda m: clipped.append(m))
    assert clipped == [1.0]  # no clip asked: not called


@pytest.mark.parametrize("resume_at", [None, 2])
def test_the_window_gives_the_same_numbers_from_tensors_as_from_floats(resume_at):
    steps = [(0.1 * (i + 1) / 3, 12, 36, 0.01, 0.0, 1.0, 12) for i in range(5)]
    floats, tensors = LoopState(), LoopState()
    for i, values in enumerate(steps):
        if i == resume_at:  # a resume mid-window: the saved numbers, then more device sums
            tensors.load_window_state(tensors.window_state())
        floats.add(WindowSums(*values), 0.5)
        tensors.add(WindowSums(torch.tensor(values[0], dtype=torch.float64), *values[1:]), 0.5)
    assert tensors.window == floats.window  # == on floats: bit for bit
    assert tensors.take_window()[0] == floats.take_window()[0]
    assert tensors.window == WindowSums() and list(tensors.window) == [0.0] * 7  # flat, by name


def test_a_window_saved_before_a_field_was_added_loads_with_it_zero():
    state = LoopState()  # the oldest snapshots saved the window as a list in field order
    state.load_window_state({"window": [0.5, 12, 36, 0.01, 0.0, 1.0], "window_s": 0.5,
                             "window_steps": 1})
    assert state.window == WindowSums(0.5, 12, 36, 0.01, 0.0, 1.0, id_samples=0.0)


def test_the_trainer_reads_the_loss_back_on_logged_steps_only(single_process):
    reads = []

    class Counted(torch.Tensor):
        """A loss sum that records each read back to the host."""

        def __float__(self):
            reads.append(1)
            return super().__float__()

        def item(self):
            reads.append(1)
            return super().item()

    train, test = AdditionDataset("train", 1), AdditionDataset("test", 1)
    strategy = make_strategy("ddp", runtime=single_process)
    step = strategy.train_step

    def counted_step(*args, **kwargs):
        res = step(*args, **kwargs)
        assert isinstance(res.loss_sum, torch.Tensor)  # not a float: no read in the step
        res.loss_sum = res.loss_sum.as_subclass(Counted)
        return res

    strategy.train_step = counted_step
    config = TrainerConfig(steps=12, batch_size=8, lr=3e-3, progress=False, log_every=4,
                           eval_every=12)
    trainer = Trainer(strategy, single_process, lambda: GPT(MODEL), train, Subset(test, range(4)),
                      loss_fn, config)
    trainer.fit()
    assert len(reads) == 3  # steps 4, 8 and 12 log; the other 9 read nothing back


def test_adamw_is_fused_on_cuda_only():
    params = list(GPT(MODEL).parameters())
    assert not adamw(0.1)(params).defaults.get("fused")


@pytest.mark.slow  # over the fast tier's 2 s (a bound it waits out, or a real run)
def test_compile_trains_the_model_in_place(single_process):
    try:
        torch.compile(lambda t: t + 1)(torch.ones(2))
    except Exception as e:  # no C++ toolchain for inductor here
        pytest.skip(f"torch.compile does not build here: {e}")
    train = AdditionDataset("train", 1)
    runs = {}
    for compiled in (False, True):
        config = TrainerConfig(steps=2, batch_size=8, lr=3e-3, progress=False, compile=compiled)
        trainer = Trainer(make_strategy("ddp", runtime=single_process), single_process,
                          lambda: GPT(MODEL), train, None, loss_fn, config)
        summary = trainer.fit()
        runs[compiled] = (list(trainer.strategy.model_state_dict()), summary["train_loss"])
        trainer.strategy.close()
    assert runs[True][0] == runs[False][0]  # no `_orig_mod.` in the names
    assert runs[True][1] == pytest.approx(runs[False][1], rel=1e-4)


def test_the_compile_option_reaches_the_trainer_and_the_workers():
    from ringtrain.cli.train_args import check_args, options_from, parse_options

    for argv, compiled in (([], False), (["--compile"], True)):
        opts = parse_options(argv)
        check_args(opts)
        assert opts.trainer.resolved().compile is compiled  # config.json's "trainer"
        again = options_from(json.loads(json.dumps(opts.flat())), parse_text=True)
        assert again.trainer.compile is compiled  # the workers read config.json's "args"


def test_metric_sums_go_flat_in_the_order_of_their_names_and_come_back():
    from ringtrain.training.evaluate import EvalSums

    w = WindowSums(loss_sum=1.5, count=4, tokens=12, compute_s=0.5, comm_s=0.25, worker_steps=2)
    assert WindowSums.of(w.flat()) == w and list(w) == w.flat()
    assert w.flat()[:2] == [1.5, 4]  # loss_sum, count: the fields' order
    ev = EvalSums(2.0, 4, {"accuracy": [3.0, 4.0], "other": [1.0, 2.0]})
    again = EvalSums.of(ev.flat(), ["accuracy", "other"])
    assert again == ev
    assert again.means() == {"eval_loss": 0.5, "eval_accuracy": 0.75, "eval_other": 0.5}
    state = LoopState()  # a snapshot's window by name, or a list from an older snapshot
    state.load_window_state({"window": w.flat(), "window_s": 1.0, "window_steps": 2})
    assert state.window == w and state.window_state()["window"]["tokens"] == 12


def test_a_model_of_float_inputs_reports_samples_per_second(single_process, tmp_path, capsys):
    """The rate counts tokens for token ids (the GPT's), samples otherwise: an image's 192
    floats per sample were counted as 192 tokens ("tok/s 5,452,895"). Decided from the steps'
    batches (summed: every rank alike), never by reading the dataset for it."""
    from torch import nn
    from torch.utils.data import TensorDataset

    from ringtrain.training.state import token_ids

    x = torch.randn(64, 3, 8, 8)
    images = TensorDataset(x, x.mean(dim=(1, 2, 3)).unsqueeze(1))
    assert not token_ids(images[0][0]) and token_ids(AdditionDataset("train", 1)[0][0])
    config = TrainerConfig(steps=4, batch_size=8, lr=1e-2, log_every=2, progress=True)
    trainer = Trainer(make_strategy("ddp", runtime=single_process), single_process,
                      lambda: nn.Sequential(nn.Flatten(), nn.Linear(192, 1)), images, images,
                      nn.functional.mse_loss, config, run_dir=str(tmp_path))
    summary = trainer.fit()
    assert "tokens_per_s" not in summary and summary["samples_per_s"] > 0
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("samples_per_s" in r and "tokens_per_s" not in r for r in lines)
    assert trainer.state.tokens == 4 * 8  # what the rate divides: samples, not 192 floats each
    out = capsys.readouterr()
    assert "samples/s" in out.out + out.err and "tok/s" not in out.out + out.err


def test_compile_without_a_cpu_toolchain_is_one_configerror(single_process, monkeypatch):
    """Each rank printed inductor's traceback from inside the first step; now the trainer says
    it before the model is built (`compile_problem`, compiling one tiny function)."""
    from ringtrain.errors import ConfigError

    monkeypatch.setattr("ringtrain.training.trainer.compile_problem",
                        lambda device: "InductorError: InvalidCxxCompiler: No working C++ compiler")
    config = TrainerConfig(steps=2, batch_size=8, progress=False, compile=True)
    with pytest.raises(ConfigError, match=r"--compile: torch\.compile cannot build a cpu kernel "
                       r"here \(InductorError: InvalidCxxCompiler.*\); install a C\+\+ compiler"):
        Trainer(make_strategy("ddp", runtime=single_process), single_process,
                lambda: GPT(MODEL), AdditionDataset("train", 1), None, loss_fn, config)


def test_compile_on_cuda_without_triton_names_triton(single_process, monkeypatch):
    """The same check for the device the ranks run on (a tiny kernel on it): on CUDA the
    toolchain is triton. Refused before anything touches the device."""
    import dataclasses

    from ringtrain.errors import ConfigError

    asked = []
    monkeypatch.setattr("ringtrain.training.trainer.compile_problem",
                        lambda device: asked.append(device) or "RuntimeError: Cannot find triton")
    gpu = dataclasses.replace(single_process, device=torch.device("cuda", 0))
    config = TrainerConfig(steps=2, batch_size=8, progress=False, compile=True)
    with pytest.raises(ConfigError, match=r"cannot build a cuda kernel here \(RuntimeError: "
                       r"Cannot find triton\); install triton, or leave out --compile"):
        Trainer(make_strategy("ddp", runtime=single_process), gpu, lambda: GPT(MODEL),
                AdditionDataset("train", 1), None, loss_fn, config)
    assert asked == [torch.device("cuda", 0)]
