"""The split backward (`ringtrain.pipeline.backward`) in one process, against a plain backward.

    .venv/bin/pytest -q tests/test_pipeline_backward.py
"""

import collections
import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ringtrain.errors import ConfigError
from ringtrain.models.gpt import GPT, GPTConfig, loss_fn
from ringtrain.pipeline.backward import backward_input, tensor_hooks_held
from ringtrain.pipeline.partition import partition
from ringtrain.strategies import pipeline_config
from ringtrain.strategies.pipeline_config import SPLIT_BACKWARD, check_schedule


class _CountMatmuls(TorchDispatchMode):
    """Counts the matrix products run inside it (CPU, any dtype)."""

    OPS = {"mm", "addmm", "bmm", "baddbmm"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ in self.OPS
        return func(*args, **(kwargs or {}))


class _Reused(nn.Module):
    """The same Linear twice along the input's path (a parameter with two consumers, one
    below the other), then a LayerNorm."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.lin(torch.tanh(self.lin(x))))


class _Scale(torch.autograd.Function):
    """x * w with its own backward: a parameter consumed by a custom autograd Function, as
    tensor parallelism's regathering column layer is."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


class _CustomOnTop(nn.Module):
    """The stage's output made by a custom Function's node: nothing of the graph but the output
    holds that node, which the caller drops between the input and the weight pass."""

    def __init__(self):
        super().__init__()
        self.lin, self.w = nn.Linear(8, 8), nn.Parameter(torch.randn(8))

    def forward(self, x):
        return _Scale.apply(self.lin(x), self.w)


def _split_vs_plain(stage: nn.Module, x: torch.Tensor, grad: torch.Tensor | None,
                    head=None) -> None:
    """Two micro-batches through `stage`: split backward (both input passes, then both weight
    passes, as ZB-H1 orders them) against a plain backward on a copy; equal input and weight
    gradients, accumulated."""
    ref = copy.deepcopy(stage)
    ref_grads, split_grads, passes = [], [], []
    for mb in range(2):
        inp = (x + mb).detach().requires_grad_()
        out = ref(inp) if head is None else head(ref(inp))
        torch.autograd.backward(out, grad)
        ref_grads.append(inp.grad)
        inp = (x + mb).detach().requires_grad_()
        out = stage(inp) if head is None else head(stage(inp))
        g, weight_pass = backward_input(out, grad, inp, list(stage.parameters()))
        assert inp.grad is None and all(p.grad is None for p in stage.parameters())
        split_grads.append(g)
        passes.append(weight_pass)
    for weight_pass in passes:
        weight_pass.run()
    for a, b in zip(split_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(stage.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_split_backward_equals_plain_backward_gpt_blocks_head_and_reused_weight():
    """CPU: GPT blocks (middle stage), the head with the loss (last stage: scalar, no incoming
    gradient), and a weight used twice along the path (the clamp on kept gradients)."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=4, n_embd=32))
    embed, *blocks, head = partition(gpt.to_sequential(), 4)
    x = torch.randn(3, 8, 32)
    _split_vs_plain(nn.Sequential(*blocks), x, torch.randn(3, 8, 32))
    y = torch.randint(0, 11, (3, 8))
    _split_vs_plain(head, x, None, head=lambda logits: loss_fn(logits, y) / 2)
    _split_vs_plain(_Reused(), torch.randn(4, 8), torch.randn(4, 8))


def test_weight_pass_reaches_a_custom_functions_node_after_the_output_is_dropped():
    """The weight pass hooks the custom Function's node; the output, its only owner, is gone
    by then (`_split_vs_plain` reuses the name). torch 2.11 and 2.12 refused that hook ("a
    legacy access pattern") until the pass held the output: --recompute-gather was refused with
    the zero-bubble schedules there."""
    torch.manual_seed(0)
    _split_vs_plain(_CustomOnTop(), torch.randn(4, 8), torch.randn(4, 8))


def test_weight_pass_runs_one_matmul_per_linear_and_fires_hooks_once():
    """CPU: the weight pass of n Linear layers costs n matmuls (d W = grad^T x), not the
    2n - 1 that re-walking the graph from the output would (it recomputes the input
    gradients between layers); each parameter's post-accumulate hook fires once."""
    torch.manual_seed(0)
    n = 4
    stage = nn.Sequential(*[m for _ in range(n) for m in (nn.Linear(16, 16), nn.ReLU())])
    inp = torch.randn(5, 16, requires_grad=True)
    fired = []
    for name, p in stage.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: fired.append(name))
    grad = torch.randn(5, 16)
    out = stage(inp)
    _, weight_pass = backward_input(out, grad, inp, list(stage.parameters()))
    with _CountMatmuls() as count:
        weight_pass.run()
    assert count.count == n
    assert sorted(fired) == sorted(n for n, _ in stage.named_parameters())
    rewalk = stage(inp)
    with _CountMatmuls() as count:
        torch.autograd.backward(rewalk, grad, inputs=list(stage.parameters()))
    assert count.count == 2 * n - 1


def _hooked_stage(seed: int) -> tuple[nn.Module, list]:
    """A stage whose every parameter has a tensor hook that changes its gradient (as sequence
    parallelism's sum over tp does) and a post-accumulate hook, both logged; hooks that change
    the gradients of the Linear's and the LayerNorm's outputs (the consumers' outputs) too."""
    torch.manual_seed(seed)
    stage = _Reused()
    calls = []
    for name, p in stage.named_parameters():
        p.register_hook(lambda g, name=name: calls.append(("tensor", name)) or g * 3)
        p.register_post_accumulate_grad_hook(lambda _, name=name: calls.append(("post", name)))

    def hook_output(_module, _args, out):
        out.register_hook(lambda g: g * 2)  # once in value; the engine calls it again in W
    stage.lin.register_forward_hook(hook_output)
    stage.norm.register_forward_hook(hook_output)
    return stage, calls


def test_split_backward_runs_each_parameters_hooks_once_as_a_plain_backward():
    """CPU: per micro-batch, a parameter's tensor hooks (`register_hook`) and post-accumulate
    hooks run as often as in a plain backward (the weight pass used to run the tensor hooks
    twice: in its `autograd.grad` and in the backward rooted at the accumulators), last
    parameter first (before, in an order set by node addresses: not the same on every rank),
    and the accumulated gradients, hooks applied, are equal; so is a hook on a consumer's
    output, applied once in value."""
    x, grad = torch.randn(4, 8), torch.randn(4, 8)
    plain, plain_calls = _hooked_stage(0)
    split, split_calls = _hooked_stage(0)
    passes = []
    for mb in range(2):
        inp = (x + mb).requires_grad_()
        torch.autograd.backward(plain(inp), grad)
        ref = inp.grad
        inp = (x + mb).requires_grad_()
        g, weight_pass = backward_input(split(inp), grad, inp, list(split.parameters()))
        torch.testing.assert_close(g, ref)
        passes.append(weight_pass)
    assert not split_calls  # the input pass reaches no parameter
    for weight_pass in passes:
        weight_pass.run()
    assert collections.Counter(split_calls) == collections.Counter(plain_calls)
    # each hook, once per micro-batch
    assert set(collections.Counter(plain_calls).values()) == {2} and len(plain_calls) == 16
    names = [n for n, _ in split.named_parameters()]
    assert [n for kind, n in split_calls if kind == "post"] == names[::-1] * 2
    for (name, p), q in zip(split.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_ddp_delayed_all_reduce_launches_once_after_its_gradients(single_process,
                                                                   monkeypatch):
    """CPU, gloo, one rank: our DDP under a split backward. Its reducer stages from
    post-accumulate hooks, which ran once before too; `param_to_hook_all_reduce` is a tensor
    hook, which launched the delayed all-reduce twice, the first time before any delayed
    gradient had arrived. Now: once, with the delayed gradients in, equal to a plain backward."""
    from ringtrain.ddp.delayed import DelayedAllReduce
    from ringtrain.ddp.distributed import DistributedDataParallel

    seen = []
    launch = DelayedAllReduce.launch
    monkeypatch.setattr(DelayedAllReduce, "launch",
                        lambda self: seen.append(self.buffer.abs().sum().item()) or launch(self))
    grads = []
    for split in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        ddp = DistributedDataParallel(
            model, delay_all_reduce_named_params=[("2.weight", model[2].weight)],
            param_to_hook_all_reduce=model[0].weight)
        inp = torch.ones(4, 8, requires_grad=True)
        out = ddp(inp)
        if split:
            backward_input(out, torch.ones(4, 8), inp, list(model.parameters()))[1].run()
        else:
            out.backward(torch.ones(4, 8))
        grads.append([p.grad.clone() for p in model.parameters()])
    assert len(seen) == 2 and seen[0] > 0 and seen[1] == seen[0]  # one launch each, filled
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_hooks_held_come_back_in_order_and_removable():
    """CPU: `tensor_hooks_held` holds a leaf's hooks for its body only; after it, they run in
    their order, a handle still removes its hook, and one registered meanwhile stays last."""
    p = torch.zeros(2, requires_grad=True)
    order = []
    h1 = p.register_hook(lambda g: order.append(1))
    p.register_hook(lambda g: order.append(2))
    with tensor_hooks_held([p]):
        (p * 1).sum().backward()
        assert order == []
        p.register_hook(lambda g: order.append(3))
    (p * 1).sum().backward()
    assert order == [1, 2, 3]
    h1.remove()
    (p * 1).sum().backward()
    assert order == [1, 2, 3, 2, 3]


def test_sequence_parallel_with_a_split_backward_runs_or_is_refused_by_torch(monkeypatch):
    """zb-h1 / zb-v run with --sequence-parallel where torch lets the weight pass hold hooks,
    and are refused before launch, with the fix, where it does not."""
    for schedule in SPLIT_BACKWARD:
        check_schedule(schedule, 2, 1, 4, sequence_parallel=True)
    monkeypatch.setattr(pipeline_config, "holds_tensor_hooks", lambda: False)
    with pytest.raises(ConfigError, match=r"--schedule zb-h1 does not run with "
                       r"--sequence-parallel on torch .*use --schedule in \['gpipe', '1f1b', "
                       r"'interleaved'\]"):
        check_schedule("zb-h1", 2, 1, 4, sequence_parallel=True)


def test_output_without_graph_is_an_error():
    inp = torch.randn(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="no autograd graph"):
        backward_input(inp.detach() * 2, None, inp, [])
