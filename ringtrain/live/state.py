"""`LiveState`: what a member commits in memory after each step, and goes back to on a failure.

    state = LiveState(model, optimizer, GlobalBatches(len(dataset), 12))
    ... one step ...
    state.step += 1
    state.commit()          # a copy in memory: no disk, no peer
    ...
    state.restore()         # a step failed half way: back to the last commit

Horovod elastic's `hvd.elastic.State` (commit / restore / sync) in ringtrain's terms. A step
that fails half way (a peer died inside the gradient all-reduce; the optimizer may even have
stepped on some members) leaves the model between two steps; `restore()` puts back the copy
taken at the last `commit()`, so the survivors redo the step from where the fault-free run
did it. `state_dict()` is the committed state: what a member that heals a replacement sends
(`ringtrain/live/heal.py`), so a peer never receives half a step.

The committed copy costs one model and one optimizer state of memory, and a copy per commit:
into the previous commit's tensors (`copy_reusing`), not into new ones. `copy.deepcopy` of the
state at every step (the reference, still taken where the structure changed) was 3.4 % of a
~0.7 s step in benchmarks/live_recovery.py (py-spy): allocating, faulting in and filling 40 MB;
the copy alone is ~10 ms a step there (1 % of the job's CPU, 2.3 % with 4 members on 2 cores).

`in_place=True` keeps no copy: the commit holds the live tensors themselves (and copies of the
rest: structure, plain values, RNG), so committing costs ~1 ms. That is exact for a step whose
failures all come before it changes the model and optimizer: ddp's (forward, backward and the
gradients' all-reduce, where a lost peer is found; then the optimizer's step, local; then the
commit, `LiveHooks.commits_in_place`). A step that fails finds them as committed, so
restoring them loads nothing; a heal sends them, as committed, from a member at a step
boundary.

A replacement's heal receives the peer's state into memory it made before it was let in
(`prepare_heal`: its optimizer's state, and the commit's copy of it), and a restore or a heal
loads a torch optimizer's state into the optimizer's own tensors: a heal or a restore places
no new memory inside the stall.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

import torch
from torch import nn

from ringtrain.checkpoint.rng import get_rng_state, set_rng_state
from ringtrain.live.batches import GlobalBatches


class Stateful(Protocol):
    """A torch optimizer, or anything else with its `state_dict` / `load_state_dict`."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class LiveState:
    """A member's training state with an in-memory commit point.

    Args:
        model: the module every member replicates (the plain module, not a wrapper).
        optimizer: its optimizer (or any `Stateful`), or None.
        batches: the step -> global batch layout (its position is `step`).
        step: the number of steps committed so far (0 for a fresh run).
        in_place: commit the live tensors, not a copy (see the module docstring).

    .. warning:: With `in_place`, nothing may change the model or the optimizer between a
        commit and a failure that restores it: the steps' collectives (which is where a lost
        peer fails them) come first, then the optimizer's step, and an error after that must
        not be recovered (ddp's hooks raise `LiveStepError`). Restoring after the optimizer
        stepped would go on from half a step, without a word.

    .. warning:: RNG state (Python, NumPy, torch) is committed and healed as one state for the
        whole group: a replacement takes its healer's generators. Randomness that must differ
        per member (dropout) should be seeded from (step, rank) so that it survives a change
        of members; per-member generators are not carried over.
    """

    def __init__(self, model: nn.Module, optimizer: Stateful | None,
                 batches: GlobalBatches, *, step: int = 0, in_place: bool = False):
        self.model, self.optimizer, self.batches = model, optimizer, batches
        self.in_place = in_place
        self.step = step
        # The step this member trains next: `step` but while the steps since the last commit
        # are being redone (a local SGD round), when it is ahead. A heal takes the members'
        # newest, so a replacement redoes those steps with them (`heal`).
        self.target = step
        self._committed: dict[str, Any] | None = None
        self.commit()

    def _capture(self) -> dict[str, Any]:
        live = {"model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None}
        previous = self._committed or {}
        taken = {k: copy_reusing(v, previous.get(k), keep_tensors=self.in_place)
                 for k, v in live.items()}
        return {"step": self.step, **taken, "batches": self.batches.state_dict(),
                "rng": get_rng_state()}

    def commit(self) -> None:
        """Remember the state as it is now (call it at a step boundary, after `step` moved)."""
        self._committed = self._capture()

    @property
    def committed_step(self) -> int:
        assert self._committed is not None
        return int(self._committed["step"])

    def restore(self) -> None:
        """Go back to the last commit: model, optimizer, step, RNG; gradients dropped."""
        assert self._committed is not None
        self._load(self._committed, own=True)
        self.model.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        """The last committed state (not the live one, which may be half a step on)."""
        assert self._committed is not None
        return self._committed

    def load_state_dict(self, state: dict[str, Any], *, adopt: bool = False) -> None:
        """Take `state` (a peer's `state_dict()`) as the live state and commit it.

        Args:
            state: the state to take.
            adopt: keep `state` itself as the commit instead of a copy of what was loaded
                (`heal` hands over tensors it has just received and nothing else holds: one
                copy of the model and optimizer state fewer).
        """
        self.batches.load_state_dict(state["batches"])
        self._load(state, own=adopt)
        self.model.zero_grad(set_to_none=True)
        if adopt and not self.in_place:
            self._committed = state
        else:  # in place: the commit holds the tensors just loaded (no copy either way)
            self.commit()

    def _load(self, state: dict[str, Any], *, own: bool = False) -> None:
        # own: nothing but this object holds `state`'s tensors (its commit, or a heal's)
        given_back = self.in_place and own
        # In place, the commit's model tensors are the live ones: nothing to load, unless one
        # was swapped for another (`p.data = ...`) since.
        if not (given_back and _same_tensors(state["model"], self.model.state_dict())):
            self.model.load_state_dict(state["model"])
        if self.optimizer is not None and state["optimizer"] is not None:
            # A copy: the optimizer keeps the tensors it is given (`.to()` of a tensor already
            # on its device and dtype is the tensor itself), and would then step the commit.
            # In place that is the point: the commit's tensors are the optimizer's own.
            self.optimizer.load_state_dict(state["optimizer"] if given_back
                                           else self._optimizer_copy(state["optimizer"]))
        set_rng_state(state["rng"])
        self.step = int(state["step"])

    def _optimizer_copy(self, state: dict[str, Any]) -> dict[str, Any]:
        # A torch optimizer's copy goes into its own state tensors, which it loads as they are:
        # memory touched already, where a new copy would fault in pages inside the stall (a
        # restore, a heal: 0.8 GB of AdamW moments for 100 M parameters). Any other `Stateful`
        # gets a new copy: what its load keeps of what it is given is its own business.
        if isinstance(self.optimizer, torch.optim.Optimizer):
            return copy_reusing(state, self.optimizer.state_dict())
        return copy.deepcopy(state)

    def prepare_heal(self) -> None:
        """Make the memory a heal will receive into, before this process waits to be let in
        (`LiveGroup.join` calls it in a replacement or a spare, before its first heartbeat).

        A torch optimizer with no state gets its state (`make_optimizer_state`), then it is
        committed: the heal receives the peer's moments into the commit's copies and loads
        them into the optimizer's own, with no page placed inside the stall (issue 26: 3.8-
        5.5 s for a replacement's first heal of 100 M parameters with copied commits, most of
        it faulting in 1.6 GB on a VM that takes idle memory back). What it makes is never
        trained with: the heal overwrites every value.
        """
        if isinstance(self.optimizer, torch.optim.Optimizer) and \
                make_optimizer_state(self.optimizer):
            self.commit()


def make_optimizer_state(optimizer: torch.optim.Optimizer) -> bool:
    """Give `optimizer` its state if it has none: one step with zero gradients at lr 0, as
    `torch.distributed.checkpoint` does before loading into a fresh optimizer. The parameters
    do not change (lr 0) but the state's values (its step count) do: call it only where that
    state is loaded over afterwards. Returns whether it made any (False: it had state already,
    a parameter has a gradient, or its step needs a closure)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if optimizer.state or any(p.grad is not None for p in params):
        return False
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = [group.get("lr") for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    except (TypeError, RuntimeError):  # LBFGS and its kind: a closure is required
        return False
    finally:
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            if "lr" in group:
                group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
    return bool(optimizer.state)


def _same_tensors(committed: dict[str, Any], live: dict[str, Any]) -> bool:
    """Whether a module's committed state dict holds its live tensors (same keys, storages)."""
    return committed.keys() == live.keys() and all(
        committed[k].data_ptr() == t.data_ptr() for k, t in live.items()
        if isinstance(t, torch.Tensor))


def copy_reusing(obj: Any, previous: Any, memo: dict[int, Any] | None = None, *,
                 keep_tensors: bool = False) -> Any:
    """`copy.deepcopy(obj)` (a state dict: dicts, lists, tuples, tensors, plain values) that
    fills `previous`'s tensors where one at the same place matches (a plain tensor of the same
    shape, dtype and device, not `obj`'s storage): no allocation once the structure is stable.

    A tensor met twice (tied weights) is copied once, as deepcopy's memo does. `previous` must
    be a copy nothing else uses (a `LiveState` commit: its model and optimizer load copies).
    `keep_tensors`: the tensors themselves, not copies (a commit in place): only the
    containers and the plain values are copied (~0.3 ms for a GPT's 212 tensors with AdamW).
    """
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return memo[id(obj)]
    if keep_tensors and isinstance(obj, torch.Tensor):
        out: Any = obj
    elif type(obj) is torch.Tensor:
        if (type(previous) is torch.Tensor and previous.shape == obj.shape
                and previous.dtype == obj.dtype and previous.device == obj.device
                and previous.data_ptr() != obj.data_ptr()):
            out = previous.copy_(obj)
        else:
            out = copy.deepcopy(obj)
    elif isinstance(obj, dict):
        before = previous if isinstance(previous, dict) else {}
        out = type(obj)((k, copy_reusing(v, before.get(k), memo, keep_tensors=keep_tensors))
                        for k, v in obj.items())
        if hasattr(obj, "_metadata"):  # a module's state_dict: load_state_dict reads it
            out._metadata = copy.deepcopy(obj._metadata)
    elif type(obj) in (list, tuple):  # not a namedtuple: deepcopy below rebuilds those
        same = type(previous) is type(obj) and len(previous) == len(obj)
        out = type(obj)(copy_reusing(v, previous[i] if same else None, memo,
                                     keep_tensors=keep_tensors) for i, v in enumerate(obj))
    else:
        out = copy.deepcopy(obj)
    memo[id(obj)] = out
    return out
