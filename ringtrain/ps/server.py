"""One server rank: holds a shard of the parameters and runs the optimizer on it.

Started by `PSStrategy` on the server ranks (`ringtrain train --strategy ps --servers 1
--nproc-per-node 3`); tests drive it directly: `.venv/bin/pytest -q tests/test_ps.py`.

Each worker is served by its own thread on its own pair group (see `protocol.py`), so pushes
from different workers arrive concurrently and a slow or dead worker blocks only its thread.
The modes differ only in when an update is applied and when a pull is answered:

- sync:  the pushes of one step wait for each other; the mean of the live workers' gradients
         (summed in worker-rank order, so the result is deterministic) is applied once and every
         worker gets the new parameters: data-parallel SGD on the same global batch.
- async: each push is applied as it arrives and answered at once (MXNet's dist_async).
- ssp:   like async, but the answer to a worker whose clock is more than `staleness` ahead of
         the slowest live worker waits (Ho et al., "More Effective Distributed ML via a Stale
         Synchronous Parallel Parameter Server", NIPS 2013).

Staleness is measured as SSP defines it, in steps: when a pull is answered, how many steps the
worker is ahead of the slowest live worker (0 in sync, at most k in SSP). The update lag, in
updates, is how many other updates were applied between a gradient's read and its write.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.errors import is_connection_lost
from ringtrain.ps.protocol import Kind, PSError, recv_request, send_params
from ringtrain.ps.sharding import DEFAULT_BUCKET_NUMEL, Piece, bucket_bounds, piece_views
from ringtrain.ps.stats import Tally
from ringtrain.types import OptimizerFn

MODES = ("sync", "async", "ssp")


class WorkerLostWarning(UserWarning):
    """A worker stopped answering (async/ssp): the server dropped it and trains on."""


class ParameterServer:
    """Serve one shard to every worker until each is done or lost.

    Args:
        rank: this server's global rank (for messages).
        pieces: this server's pieces, in flat-buffer order (`ShardPlan.for_server`).
        initial: the shard's initial values as one flat fp32 tensor.
        optimizer_fn: builds the optimizer over the shard's parameters (one per piece).
        mode: "sync", "async" or "ssp".
        staleness: SSP's bound k (steps a worker may run ahead of the slowest).
        pair_groups: worker rank -> the group this server shares with it.
        server_group: all servers (sync mode clips the gradient by its global norm), or None.
        timeout_s: longest wait for a sync round or an SSP release before the job is failed.
        bucket_numel: the workers' push bucket size (it must be the workers' value).
        on_lost: async/ssp: called with (worker rank, message) when a worker is dropped, outside
            the server's lock; the `WorkerLostWarning` is issued only if it returns True (so a
            job with several servers warns once). Default: always warn.
    """

    def __init__(self, rank: int, pieces: Sequence[Piece], initial: torch.Tensor,
                 optimizer_fn: OptimizerFn, *, mode: str, staleness: int,
                 pair_groups: Mapping[int, dist.ProcessGroup],
                 server_group: dist.ProcessGroup | None = None, timeout_s: float = 300.0,
                 bucket_numel: int = DEFAULT_BUCKET_NUMEL,
                 on_lost: Callable[[int, str], bool] | None = None):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: use one of {MODES} (--ps-mode)")
        if staleness < 0:
            raise ValueError(f"staleness={staleness}: SSP's bound must be 0 or more (--staleness)")
        self.rank, self.pieces, self.mode, self.staleness = rank, tuple(pieces), mode, staleness
        self.pair_groups = dict(pair_groups)
        self.server_group, self.timeout_s = server_group, timeout_s
        self.on_lost = on_lost
        self.buckets = bucket_bounds(self.pieces, bucket_numel)
        self.flat = initial.detach().to(torch.float32).clone()
        self.grad = torch.zeros_like(self.flat)
        # The optimizer sees one Parameter per piece, each a view of the flat buffer: an update
        # changes `flat` in place, and a pull sends it as one message.
        self.params = [nn.Parameter(v) for v in piece_views(self.flat, self.pieces)]
        for p, g in zip(self.params, piece_views(self.grad, self.pieces), strict=True):
            p.grad = g
        self.optimizer = optimizer_fn(self.params)
        self.version = 0  # updates applied (a sync update averages several gradients)
        self.applied = 0  # gradients applied, from every worker
        workers = sorted(self.pair_groups)
        self.clocks = {w: 0 for w in workers}  # pushes received per worker
        self.live = set(workers)  # neither done nor lost
        self.at_sync: set[int] = set()  # live workers waiting at an end-of-run sync point
        self.lost: dict[int, str] = {}  # worker rank -> why it was dropped
        self.error: PSError | None = None
        self.gap = Tally()  # steps ahead of the slowest, per answered pull
        self.lag = Tally()  # updates between a gradient's read and its write
        self._bufs = {w: torch.zeros_like(self.flat) for w in workers}
        self._arrived: dict[int, Any] = {}  # sync: worker -> header of this round's push
        self._round = 0
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._reporting = 0  # workers dropped whose warning is not out yet: wait() waits for it

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Serve every worker from its own daemon thread."""
        for w in sorted(self.pair_groups):
            t = threading.Thread(target=self._serve_worker, args=(w,), daemon=True,
                                 name=f"ps-server{self.rank}-worker{w}")
            t.start()
            self._threads.append(t)

    def wait(self, *, until_sync: bool = False, timeout_s: float | None = None) -> None:
        """Block until every worker is done or lost (or, with `until_sync`, at a sync point).

        Raises PSError if the job failed (sync mode lost a worker) or the wait timed out.
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self.error is not None or (
                    self.live <= (self.at_sync if until_sync else set()) and not self._reporting),
                timeout=timeout_s)
            if self.error is not None:
                raise self.error
            if not ok:
                raise PSError(f"server rank {self.rank}: workers {sorted(self.live)} still "
                              f"training after {timeout_s:g} s (clocks {self.clocks})")

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop serving: threads of workers that already left end at once."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=timeout_s)

    def snapshot_flat(self) -> torch.Tensor:
        """A consistent copy of the shard (taken between updates)."""
        with self._cond:
            return self.flat.clone()

    # -- one worker's thread -----------------------------------------------------------------
    def _serve_worker(self, w: int) -> None:
        group = self.pair_groups[w]
        try:
            while True:
                header, sq_norm = recv_request(self._bufs[w], self.buckets, worker=w, group=group)
                if header.kind == Kind.DONE:
                    self._leave(w)
                    return
                if header.kind == Kind.SYNC:
                    with self._cond:
                        self.at_sync.add(w)
                        self._cond.notify_all()
                    continue
                if header.kind == Kind.PULL:
                    kind, params, version, gap, applied = self._answer(w, record=False)
                else:
                    kind, params, version, gap, applied = self._push(w, header, sq_norm)
                send_params(params, kind=kind, version=version, clock=self.clocks[w], gap=gap,
                            applied=applied, worker=w, group=group)
        except RuntimeError as e:  # gloo: the worker's connection closed, or the pair timed out
            self._lose(w, e)
        except ValueError:  # this process tore its groups down (teardown without close())
            return
        except Exception as e:  # a bug: fail the job (other workers get ABORT) and show it
            with self._cond:
                self._fail(PSError(f"server rank {self.rank}: the thread serving worker rank {w} "
                                   f"failed: {e!r}"))
            raise

    def _push(self, w: int, header, sq_norm: float) -> tuple[Kind, torch.Tensor, int, int, int]:
        with self._cond:
            self.at_sync.discard(w)
            if self.error is None and w in self.live:
                self.clocks[w] = header.clock
                if self.mode == "sync":
                    self._arrived[w] = header
                    my_round = self._round
                    self._complete_round()
                    self._wait(lambda: self._round > my_round,
                               f"the sync round of step {header.clock}")
                else:
                    if header.grad_clip > 0:  # this push is an update of its own: its own norm
                        _clip(self._bufs[w], header.grad_clip, sq_norm)
                    self.lag.add(self.version - header.version)
                    self._apply(self._bufs[w], header.lr)
                    self._cond.notify_all()  # a clock moved: SSP waiters re-check
                    if self.mode == "ssp":
                        self._wait(lambda: self.clocks[w] <= self._min_clock() + self.staleness,
                                   f"an SSP release at clock {header.clock}")
            return self._answer(w, record=True, locked=True)

    def _answer(self, w: int, *, record: bool, locked: bool = False):
        """(kind, parameters, version, gap, applied) for a pull by worker `w`."""
        if not locked:
            with self._cond:
                return self._answer(w, record=record, locked=True)
        gap = self.clocks[w] - self._min_clock()
        if record:
            self.gap.add(gap)
        kind = Kind.ABORT if self.error is not None else Kind.PARAMS
        return kind, self.flat.clone(), self.version, gap, self.applied

    # -- updates (called with the lock held) --------------------------------------------------
    def _min_clock(self) -> int:
        live = [self.clocks[w] for w in self.live]
        return min(live) if live else max(self.clocks.values(), default=0)

    def _wait(self, ready, what: str) -> None:
        ok = self._cond.wait_for(lambda: ready() or self.error is not None or self._closing,
                                 timeout=self.timeout_s)
        if not ok and self.error is None:
            self._fail(PSError(f"server rank {self.rank}: waited {self.timeout_s:g} s for {what}; "
                               f"live workers {sorted(self.live)}, clocks {self.clocks}"))

    def _complete_round(self) -> None:
        """Sync: once every live worker has pushed, apply the mean of their gradients."""
        if not self._arrived or not self.live <= set(self._arrived):
            return
        workers = sorted(self._arrived)
        mean = self._bufs[workers[0]].clone()
        for w in workers[1:]:
            mean.add_(self._bufs[w])
        mean.div_(len(workers))
        first = self._arrived[workers[0]]
        for w in workers:
            self.lag.add(self.version - self._arrived[w].version)
        if first.grad_clip > 0:
            self._clip(mean, first.grad_clip)
        self._apply(mean, first.lr)
        self.applied += len(workers) - 1  # _apply counted one
        self._arrived.clear()
        self._round += 1
        self._cond.notify_all()

    def _clip(self, grad: torch.Tensor, max_norm: float) -> None:
        """Sync: clip the mean gradient by its norm over the whole model (all servers)."""
        sq = grad.double().pow(2).sum().reshape(1)
        if self.server_group is not None:
            dist.all_reduce(sq, group=self.server_group)  # every server completes rounds in order
        _clip(grad, max_norm, float(sq))

    def _apply(self, grad: torch.Tensor, lr: float) -> None:
        self.grad.copy_(grad)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.version += 1
        self.applied += 1

    # -- workers leaving -------------------------------------------------------------------------
    def _leave(self, w: int) -> None:
        with self._cond:
            self.live.discard(w)
            self.at_sync.discard(w)
            if self.mode == "sync":
                self._complete_round()  # the others' round no longer waits for w
            self._cond.notify_all()

    def drop(self, w: int, reason: str) -> None:
        """Drop worker `w` that another rank found dead (its watchdog), as if its pair failed.

        Its thread may stay blocked on the pair until the connection closes; SSP's bound
        and the end-of-run wait stop counting the worker at once.
        """
        self._lose(w, PSError(reason))

    def _lose(self, w: int, exc: BaseException) -> None:
        if is_connection_lost(exc):  # gloo's text names an address and a C++ file, not the cause
            reason = "its connection closed: the process exited or was killed"
        else:
            reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        with self._cond:
            if w not in self.live or self._closing:
                return  # it had left already: its connection closing is expected
            self.live.discard(w)
            self.at_sync.discard(w)
            self.lost[w] = reason
            self._cond.notify_all()
            if self.mode == "sync":
                self._fail(PSError(
                    f"server rank {self.rank}: worker rank {w} was lost at step {self.clocks[w]} "
                    f"({reason}); sync mode needs every worker's gradient. Restart from the last "
                    "snapshot, or use --ps-mode async / ssp to train on without lost workers"))
                return
            message = (f"worker rank {w} died ({reason}) at step ~{self.clocks[w]}; "
                       f"parameter-server {self.mode} training goes on with workers "
                       f"{sorted(self.live)} (dropped by server rank {self.rank})")
            self._reporting += 1
        # Outside the lock: the callback may talk to the store (a round trip that a loaded
        # machine stretches); wait() holds until the warning is out, so no caller that saw
        # the worker dropped returns before it.
        try:
            if self.on_lost is None or self.on_lost(w, message):
                warnings.warn(message, WorkerLostWarning, stacklevel=2)
        finally:
            with self._cond:
                self._reporting -= 1
                self._cond.notify_all()

    def _fail(self, error: PSError) -> None:
        if self.error is None:
            self.error = error
        self._cond.notify_all()

    # -- state -------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        with self._cond:
            return {"updates": self.version, "gradients": self.applied,
                    "workers_lost": len(self.lost),
                    **self.gap.summary("staleness"), **self.lag.summary("update_lag")}

    def stats_tensor(self) -> torch.Tensor:
        """[gap count, sum, max, lag count, sum, max, updates, workers lost], for broadcasting."""
        with self._cond:
            return torch.tensor(self.gap.as_list() + self.lag.as_list()
                                + [self.version, len(self.lost)], dtype=torch.float64)

    def state_dict(self) -> dict[str, Any]:
        """The shard, its optimizer state, the version and the workers' clocks."""
        with self._cond:
            return {"flat": self.flat.clone(), "optimizer": self.optimizer.state_dict(),
                    "version": self.version, "applied": self.applied, "clocks": dict(self.clocks),
                    "pieces": [[p.name, p.row_start, p.row_end, list(p.shape)]
                               for p in self.pieces],
                    # each optimizer parameter's piece: makes it convertible (ps_portable)
                    "param_pieces": self.param_pieces()}

    def param_pieces(self) -> list[int]:
        """The piece of each optimizer parameter, in the optimizer's numbering (its groups)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        return [index[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def load_pieces(self, rows: Sequence[torch.Tensor], state: Mapping[int, Any]) -> None:
        """Another layout's state (`strategies.ps_portable.piece_state`): each piece's rows and the
        optimizer's state. The version and clocks stay at their start, as the workers' clocks do."""
        with self._cond, torch.no_grad():
            for p, r in zip(self.params, rows, strict=True):
                p.copy_(r)
            self.optimizer.load_state_dict({"state": dict(state), "param_groups":
                                            self.optimizer.state_dict()["param_groups"]})

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        mine = [[p.name, p.row_start, p.row_end, list(p.shape)] for p in self.pieces]
        if [list(map(_plain, p)) for p in state["pieces"]] != mine:
            raise ValueError(
                f"server rank {self.rank}: the snapshot's shard {state['pieces'][:3]}... does not "
                f"match this server's {mine[:3]}...; resume with the same --servers, number of "
                "workers and model as the run that saved it")
        with self._cond:
            self.flat.copy_(state["flat"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.version, self.applied = int(state["version"]), int(state["applied"])
            self.clocks.update({int(w): int(c) for w, c in state["clocks"].items()})


def _clip(grad: torch.Tensor, max_norm: float, sq_norm: float) -> None:
    """Scale by max_norm / norm when the norm is larger, as `clip_grad_norm_` does."""
    coef = max_norm / (sq_norm ** 0.5 + 1e-6)
    if coef < 1.0:
        grad.mul_(coef)


def _plain(x: Any) -> Any:
    return [int(v) for v in x] if isinstance(x, (list, tuple)) else x
