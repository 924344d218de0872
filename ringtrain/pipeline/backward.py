"""The two halves of a split backward (zero-bubble schedules, Qi et al., 2023).

`backward_input(out, grad, inp, params)` computes d loss / d input (what the previous stage
waits for) and, on the way, keeps the gradient that arrives at each *consumer* of the
parameters: an autograd node that depends on the stage input and reads a parameter (the
`AddmmBackward` of a Linear, the `NativeLayerNormBackward` of a LayerNorm). It returns a
`WeightPass`; `WeightPass.run()` later starts from those kept gradients and goes only down to
the parameters, so it costs what the weight gradients cost (a Linear: one matmul, not the
two that re-walking the graph from the output needs). This is torch's
`stage_backward_input` / `stage_backward_weight` (torch/distributed/pipelining/_backward.py),
with two differences: parameters are grouped by union of shared consumers (a parameter is in
exactly one group), and the weight gradients are accumulated by one `autograd.backward` call
rooted at the parameters, so `.grad` accumulation and post-accumulate hooks (our DDP reducer
averages from them, ending its round at the end of that call) run as in a plain backward.

Hooks, per micro-batch, as in a plain backward: a parameter's tensor hooks (`register_hook`;
sequence parallelism's sum over tp) and post-accumulate hooks run once, last parameter first,
in the same order on every rank. A hook on a consumer's output tensor (a Linear's output)
changes the gradient once, but the engine calls it twice (in the input pass and again, its
result discarded, when the weight pass starts at that consumer; torch gives no handle on a
non-leaf's hooks from its node), and `retain_grad()` on such a tensor sums both calls.

    .venv/bin/pytest -q tests/test_pipeline_backward.py
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

from ringtrain.torch_internals import tensor_hooks, tensor_hooks_held_off


def _accumulator(t: torch.Tensor) -> Node:
    """A leaf's AccumulateGrad node (made on demand, so reach it through a view), else its
    grad_fn. Held by the graph while the graph lives, so the same node the graph points to."""
    if t.grad_fn is not None:
        return t.grad_fn
    node = t.view_as(t).grad_fn
    assert node is not None, "a leaf that requires grad has a view with a grad_fn"
    return node.next_functions[0][0]


@contextlib.contextmanager
def tensor_hooks_held(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Run the body with the `register_hook` hooks of the leaf `tensors` taken out, then put
    them back in their order (their handles still remove them; one registered meanwhile goes
    last). Where torch keeps them out of reach (`torch_internals`), it holds none."""
    held = [(d, list(d.items())) for t in tensors if (d := tensor_hooks(t))]
    for d, _ in held:
        d.clear()
    try:
        yield
    finally:
        for d, items in held:
            added = list(d.items())
            d.clear()
            d.update(items)
            d.update(added)


@dataclass(eq=False)
class _Group:
    """Parameters whose gradients flow only through `consumers` (merged when they share one)."""

    params: list[Node]  # AccumulateGrad nodes
    consumers: list[Node]
    grads: dict[Node, tuple] = field(default_factory=dict)  # consumer -> its grad_outputs


def holds_tensor_hooks() -> bool:
    """Whether the weight pass runs each parameter's tensor hooks once on this torch (it holds
    them while it captures the gradients); where not, a hook that sums over a group (sequence
    parallelism's) would run twice."""
    return not tensor_hooks_held_off()


def _postorder(root: Node) -> list[Node]:
    """Every node below `root`, children before parents (iterative: graphs can be deep)."""
    order, seen, stack = [], {root}, [(root, iter(root.next_functions))]
    while stack:
        node, children = stack[-1]
        for child, _ in children:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append((child, iter(child.next_functions)))
                break
        else:
            order.append(node)
            stack.pop()
    return order


def _groups(root: Node, inp: Node, params: Sequence[Node]) -> list[_Group]:
    """Find each parameter's consumers below `root` and group parameters that share one."""
    order = _postorder(root)
    wanted = set(params)
    depends: dict[Node, bool] = {}  # does the node's gradient lead to the input?
    below: dict[Node, frozenset] = {}  # parameters under a node, through input-free nodes only
    for node in order:
        kids = [c for c, _ in node.next_functions if c is not None]
        depends[node] = node is inp or any(depends[c] for c in kids)
        mine = {node} & wanted
        for c in kids:
            if not depends[c]:
                mine |= below[c]
        below[node] = frozenset(mine)
    # A consumer: depends on the input and has an input-free child over some parameters.
    owner: dict[Node, _Group] = {}  # parameter -> its group
    groups: list[_Group] = []
    for node in order:
        if not depends[node] or node is inp:
            continue
        reads = {p for c, _ in node.next_functions
                 if c is not None and not depends[c] for p in below[c]}
        if not reads:
            continue
        merged = {id(owner[p]): owner[p] for p in reads if p in owner}
        group = _Group(params=[], consumers=[node])
        for other in merged.values():
            group.params += other.params
            group.consumers += other.consumers
            groups.remove(other)
        group.params += [p for p in reads if p not in owner]
        for p in group.params:
            owner[p] = group
        groups.append(group)
    return groups


@dataclass
class WeightPass:
    """What `backward_input` kept for the weight gradients; `run()` once, then it is spent."""

    groups: list[_Group]
    params: list[Node]  # AccumulateGrad nodes, in the caller's order
    # The stage's output, held until `run`: it owns the graph between the input and weight
    # passes. A custom autograd Function's node (the regathering column layer's) is only
    # weakly held by its Python object, and on torch 2.11 and 2.12 a node freed with the
    # output refuses the weight pass's hook ("a legacy access pattern").
    root: torch.Tensor | None = None

    def run(self) -> None:
        """Accumulate the weight gradients into `.grad`: each parameter's tensor hooks and
        post-accumulate hooks run once, in one autograd call, last parameter first."""
        # The engine runs a leaf's `register_hook` hooks where `autograd.grad` captures its
        # gradient and again where the final backward accumulates it: twice per micro-batch, so
        # a hook that sums over tp (sequence parallelism's norms) summed tp times. Hold them
        # while capturing: they run once, on the raw gradient, where a plain backward runs them.
        with tensor_hooks_held([p.variable for p in self.params]):
            dws = self._weight_grads()
        self.groups, self.root = [], None
        # Rooted at a fresh view of each parameter, made in the caller's order: the engine runs
        # the newest node first, so the parameters accumulate (and their hooks run) last layer
        # first, as in a plain backward (DDP's buckets fill in the order it plans), and in the
        # same order on every rank, which sequence parallelism's all-reduce hooks need. Rooted
        # at the accumulators themselves, the engine's queue mixes them (one priority for all).
        params = [p for p in self.params if p in dws]
        if params:
            with torch.enable_grad():
                roots = [p.variable.view_as(p.variable) for p in params]
            torch.autograd.backward(roots, [dws[p] for p in params])

    def _weight_grads(self) -> dict[Node, torch.Tensor]:
        """Each parameter's gradient for this micro-batch, by group (run no hook of theirs)."""
        dws: dict[Node, torch.Tensor] = {}
        for group in self.groups:
            edges, outs = [], []
            for node in group.consumers:
                for i, g in enumerate(group.grads.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        outs.append(g)
            if not edges:
                continue
            # Clamp each consumer to the gradient it kept in the input pass. A consumer below
            # another consumer of the same parameter (a weight used twice along the input's
            # path) would get the upper one's gradient a second time on top of it (torch clamps
            # too); and the engine runs a consumer's tensor hooks (hooks on a Linear's output)
            # again on the kept gradient, which already went through them: the clamp discards
            # that second result, so a hook that changes the gradient changes it once.
            handles = [node.register_prehook(lambda _, kept=group.grads[node]: kept)
                       for node in group.consumers if node in group.grads]
            try:
                got = torch.autograd.grad(edges, [GradientEdge(p, 0) for p in group.params],
                                          outs, allow_unused=True)
            finally:
                for h in handles:
                    h.remove()
            dws |= {p: dw for p, dw in zip(group.params, got, strict=True) if dw is not None}
        return dws


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor,
                   params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, WeightPass]:
    """d loss / d `inp` (returned, not accumulated into `inp.grad`), and the weight pass.

    Args:
        out: the stage's output (or scaled loss, on the last stage; then `grad` is None).
        grad: d loss / d `out` from the next stage.
        inp: the stage's input, a leaf that requires grad.
        params: the stage's parameters that require grad.
    """
    if out.grad_fn is None:
        raise RuntimeError("the stage output has no autograd graph: it does not depend on its "
                           "input or parameters differentiably (detach()? no_grad?)")
    accumulators = [_accumulator(p) for p in params]
    groups = _groups(out.grad_fn, _accumulator(inp), accumulators)

    def keep(group: _Group, node: Node):
        def hook(grad_outputs: tuple) -> None:
            group.grads[node] = grad_outputs
        return hook

    handles = [node.register_prehook(keep(group, node))
               for group in groups for node in group.consumers]
    try:
        (grad_in,) = torch.autograd.grad(out, inp, grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return grad_in, WeightPass(groups, accumulators, out)
