"""PowerSGD: gradients compressed to rank-r factors before they travel (Vogels et al. 2019).

    state = PowerSGDState(process_group=None, rank=4)
    ddp.register_comm_hook(state, powersgd_hook)  # or `ringtrain train --grad-compress powersgd:4`


For each gradient matrix M (n x m; a conv or embedding weight is flattened to its first
dimension) with error feedback E from the last step: M += E; P = M Q (Q: m x r, kept from the
last step: warm start); all-reduce P; orthonormalise P; Q = M^T P; all-reduce Q; the average
is approximated by P Q^T / N, and E = M - P Q^T / N keeps what the approximation lost for the
next step. Two all-reduces of (n + m) r numbers instead of one of n m: for a 128 x 512 weight
and r = 4, 2,560 numbers instead of 65,536. Vectors (biases, norms) and matrices too small
to gain are all-reduced as they are, in one flat fp32 buffer. Every rank draws the first Q from
the same seed, and P, Q are all-reduced, so the replicas stay identical.

The hook is synchronous (it returns a finished Future): it runs its three collectives in the
backward hook of the bucket. torch's own `powerSGD_hook` (asynchronous, batched) runs unchanged
on `ringtrain.DistributedDataParallel` too (tests/test_comm_hooks.py); this one is the readable
version and what `--grad-compress powersgd:R` uses. For the first `start_iter` steps it
all-reduces plainly, as torch's does, so the error feedback starts from trained gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class PowerSGDState:
    """What the hook keeps between steps: Q per matrix (warm start), the error feedback, bytes.

    Args:
        process_group: the group to average over (None: the default group).
        rank: r, the rank of the approximation.
        start_iter: plain all-reduces for this many steps first.
        error_feedback: add what the last approximation lost to the next gradient.
        warm_start: start each step's power iteration from the last step's Q.
        seed: seeds the first Q; the same on every rank.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, rank: int = 4, *,
                 start_iter: int = 10, error_feedback: bool = True, warm_start: bool = True,
                 seed: int = 0):
        if rank < 1:
            raise ValueError(f"rank={rank}: PowerSGD's rank must be 1 or more")
        self.process_group = dist.group.WORLD if process_group is None else process_group
        self.rank, self.start_iter = rank, start_iter
        self.error_feedback, self.warm_start = error_feedback, warm_start
        self.generator = torch.Generator().manual_seed(seed)
        self.q: dict[int, torch.Tensor] = {}  # id(parameter) -> Q
        self.error: dict[int, torch.Tensor] = {}  # id(parameter) -> E
        self.iteration = 0  # steps seen (counted on the last bucket)
        self.bytes_sent = 0  # payload this rank sent, as a ring all-reduce sends it

    def state_dict(self, params: list[torch.Tensor]) -> dict[str, Any]:
        """Q and error feedback by parameter index (`params`: the model's, in order)."""
        index = {id(p): i for i, p in enumerate(params)}
        return {"q": {index[k]: v.clone() for k, v in self.q.items()},
                "error": {index[k]: v.clone() for k, v in self.error.items()},
                "iteration": self.iteration, "bytes_sent": self.bytes_sent,
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any], params: list[torch.Tensor]) -> None:
        self.q = {id(params[i]): v.clone() for i, v in state["q"].items()}
        self.error = {id(params[i]): v.clone() for i, v in state["error"].items()}
        self.iteration, self.bytes_sent = int(state["iteration"]), int(state["bytes_sent"])
        self.generator.set_state(state["generator"])

    def _all_reduce(self, t: torch.Tensor) -> None:
        n = self.process_group.size()
        self.bytes_sent += t.numel() * t.element_size() * 2 * (n - 1) // n
        dist.all_reduce(t, group=self.process_group)


def _compressible(shape: torch.Size, r: int) -> bool:
    if len(shape) < 2:
        return False
    n, m = shape[0], shape.numel() // shape[0]
    return (n + m) * r < n * m


def _orthonormalise(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning p's (QR; the same input gives the same output on every rank)."""
    return torch.linalg.qr(p, mode="reduced").Q


@torch.no_grad()
def powersgd_hook(state: PowerSGDState, bucket: Any) -> torch.futures.Future:
    """Average `bucket.buffer()` through rank-r factors; see the module docstring."""
    buffer = bucket.buffer()
    world = state.process_group.size()
    if bucket.is_last():
        state.iteration += 1
    if state.iteration < state.start_iter:
        state._all_reduce(buffer)
        return _finished(buffer.div_(world))
    grads, params = bucket.gradients(), bucket.parameters()
    matrices, plain = [], []
    for g, p in zip(grads, params, strict=True):
        (matrices if _compressible(g.shape, state.rank) else plain).append((g, p))
    if plain:  # vectors and small matrices: one flat fp32 all-reduce
        flat = torch.cat([g.reshape(-1) for g, _ in plain])
        state._all_reduce(flat)
        flat.div_(world)
        offset = 0
        for g, _ in plain:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    if matrices:
        ms, qs = [], []
        for g, p in matrices:
            m = g.reshape(g.shape[0], -1)
            if state.error_feedback:
                e = state.error.get(id(p))
                if e is not None:
                    m.add_(e)
            q = state.q.get(id(p)) if state.warm_start else None
            if q is None:
                q = torch.randn(m.shape[1], state.rank, generator=state.generator).to(m)
                state.q[id(p)] = q
            ms.append(m)
            qs.append(_orthonormalise(q))
        ps = [m @ q for m, q in zip(ms, qs, strict=True)]
        flat_p = torch.cat([p.reshape(-1) for p in ps])
        state._all_reduce(flat_p)
        ps = [_orthonormalise(p) for p in _split(flat_p, [p.shape for p in ps])]
        new_qs = [m.t() @ p for m, p in zip(ms, ps, strict=True)]
        flat_q = torch.cat([q.reshape(-1) for q in new_qs])
        state._all_reduce(flat_q)
        new_qs = _split(flat_q, [q.shape for q in new_qs])
        for (_, p), m, pm, q in zip(matrices, ms, ps, new_qs, strict=True):
            approx = (pm @ q.t()).div_(world)
            if state.error_feedback:
                state.error[id(p)] = m - approx  # what this rank's gradient lost
            m.copy_(approx)  # m is a view of the gradient in the bucket
            state.q[id(p)] = q
    return _finished(buffer)


def _split(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    out, offset = [], 0
    for s in shapes:
        n = s.numel()
        out.append(flat[offset:offset + n].view(s))
        offset += n
    return out


def _finished(value: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut
