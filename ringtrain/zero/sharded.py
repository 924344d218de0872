"""`ZeroDataParallel`: sharded data parallelism (ZeRO stages 1, 2, 3) for a plain module.

    model = ZeroDataParallel(module, lambda ps: torch.optim.AdamW(ps, lr=1e-3), stage=2)
    loss_fn(model(x), y).backward()      # gradients reduce-scattered during backward
    model.clip_grad_norm_(1.0)            # global norm over every rank's shard
    model.optimizer.step()                # updates this rank's shard, then all-gathers (1, 2)
    model.optimizer.zero_grad()

How one step goes. Each unit (`units.py`: a GPT block, or what is left) has a post-accumulate
-grad hook on each parameter; when the last gradient of a unit arrives during backward, its
gradients are scaled by 1/N into one flat vector and a ring reduce-scatter starts
(`ringtrain.rings`), overlapping the rest of backward. Units launch in one fixed order on every
rank (the reverse of registration, the order backward produces them). A callback at the end of
backward reduces what never fired (unused parameters count as zero) and waits for every unit;
`backward()` returns with this rank's shard of the averaged gradient. After `step()`, stages 1
and 2 start the all-gather of every unit at once and wait for each in its forward pre-hook, so
the parameters travel while earlier units compute. Stage 3 gathers a unit's parameters in its
forward pre-hook (and starts the next unit's: a prefetch), frees them after its forward, gathers
them again from a hook on its output's gradient just before its backward (prefetching the
previous unit) and frees them once its gradients are in; the root unit (embeddings, head) stays
gathered from forward to the end of backward. Under `no_sync()` nothing is reduced: `.grad`
accumulates in full, as in torch.

This file builds the units and holds the wrapper's surface (forward, no_sync, clipping, state
dicts, counted bytes); the hooks and the schedule they drive (gather, free, reduce in order,
the end-of-backward callback) are in `hooks.py`, a base class of the wrapper.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain import collectives as checked  # agreed first under RINGTRAIN_DEBUG=collectives
from ringtrain.ddp import lanes as ddp_lanes
from ringtrain.ddp.ctor_args import check_backend_devices
from ringtrain.ddp.eager import eager
from ringtrain.ddp.state_keys import accept_unwrapped_keys
from ringtrain.trace import Tracer
from ringtrain.zero import state as zero_state
from ringtrain.zero.hooks import UnitHooks
from ringtrain.zero.optimizer import OptimizerFactory, ZeroOptimizer
from ringtrain.zero.shard import STAGES, expected_bytes, plan_units
from ringtrain.zero.units import FlatUnit


def default_units(module: nn.Module) -> list[nn.Module]:
    """The submodules gathered one at a time: `module.blocks` (a GPT), the children of a
    Sequential/ModuleList, else none (one unit: the whole model)."""
    blocks = getattr(module, "blocks", None)
    if isinstance(blocks, nn.ModuleList | nn.Sequential):
        return list(blocks)
    if isinstance(module, nn.ModuleList | nn.Sequential):
        return list(module)
    return []


class ZeroDataParallel(UnitHooks, nn.Module):
    """Data parallelism with optimizer state (stage 1), gradients (2) and parameters (3) sharded.

    Args:
        module: the plain model, identically initialised on every rank (rank 0's is broadcast).
        optimizer_fn: builds the optimizer from parameters, as for a plain model (parameter
            groups and their options are kept); it is called once on the module's parameters,
            then rebuilt over this rank's parts of them. `self.optimizer` steps it.
        stage: 1, 2 or 3.
        process_group: the ranks sharing the model (default: the world).
        units: the submodules gathered and reduced one at a time (default: `default_units`).
        comm_lanes: gloo groups to spread units over (`ringtrain.ddp.lanes`; default 3 on the
            world group, 1 on a subgroup).

    .. warning:: At stage 3 the module's parameters have no data between uses (their storage is
       resized to 0): reading or writing them outside this wrapper's forward/backward crashes.
       Use `full_state_dict()` (`keep_gathered=True` to use the plain module afterwards).

    .. warning:: Stage 1 reduce-scatters too: `.grad` holds the average only in this rank's
       part of each unit; the other parts hold this rank's own (scaled) gradient.
    """

    def __init__(self, module: nn.Module, optimizer_fn: OptimizerFactory, *, stage: int = 2,
                 process_group: dist.ProcessGroup | None = None,
                 units: Iterable[nn.Module] | None = None, comm_lanes: int | None = None):
        if not isinstance(module, nn.Module):
            raise TypeError(f"ZeroDataParallel got {module!r} ({type(module).__name__}), not a "
                            "torch.nn.Module: pass the model itself")
        if not callable(optimizer_fn):
            raise TypeError(f"ZeroDataParallel(optimizer_fn={optimizer_fn!r}): it must be a "
                            "function from parameters to an optimizer, e.g. "
                            "lambda ps: torch.optim.AdamW(ps, lr=3e-4)")
        super().__init__()
        if stage not in STAGES:
            raise ValueError(f"stage={stage!r}: ZeRO has stages {STAGES}; use 1 (optimizer state "
                             "sharded), 2 (+ gradients) or 3 (+ parameters)")
        self.module, self.stage = module, stage
        accept_unwrapped_keys(self)  # load_state_dict takes the plain model's keys too
        self._loading: contextlib.ExitStack | None = None  # a load_state_dict in progress
        self.register_load_state_dict_pre_hook(ZeroDataParallel._begin_load)
        self.register_load_state_dict_post_hook(ZeroDataParallel._end_load)
        self.process_group = process_group or dist.group.WORLD
        self.rank, self.world_size = self.process_group.rank(), self.process_group.size()
        unit_modules = default_units(module) if units is None else list(units)
        owner: dict[int, int] = {}
        for u, m in enumerate(unit_modules, start=1):
            for p in m.parameters():
                owner.setdefault(id(p), u)
        groups: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(len(unit_modules) + 1)]
        for name, p in module.named_parameters():  # shared parameters appear once
            if p.requires_grad:
                groups[owner.get(id(p), 0)].append((name, p))
        kept = [(i, g) for i, g in enumerate(groups) if g]
        if not kept:
            raise ValueError("ZeroDataParallel got a module with no parameter that requires grad")
        check_backend_devices([*module.named_parameters(), *module.named_buffers()],
                              self.process_group, "ZeroDataParallel")
        self._broadcast_from_rank0(module)
        plans = plan_units([[(n, tuple(p.shape)) for n, p in g] for _, g in kept], self.world_size)
        lanes = (ddp_lanes.comm_lanes(self.process_group, comm_lanes) if self.world_size > 1
                 else [self.process_group])
        self.units = [FlatUnit(plan, [p for _, p in g], self.process_group,
                               lanes[k % len(lanes)], stage)
                      for k, (plan, (_, g)) in enumerate(zip(plans, kept, strict=True))]
        self._root = self.units[0] if kept[0][0] == 0 else None
        self.numel = sum(u.plan.numel for u in self.units)
        self._order = list(reversed(self.units))  # launch order: the order backward makes them
        self._next = 0
        self._queued = False
        self._sync = True  # False inside no_sync()
        self._sync_this_backward = True
        self._held_gathered = 0
        self._in_forward = False  # the unit hooks act only inside this wrapper's forward
        self.peak_gathered_bytes = 0  # stage 3's working set: the most unit bytes gathered at once
        self._handles = self._register_hooks(module, unit_modules, kept)
        self.optimizer = ZeroOptimizer(module, self.units, optimizer_fn, self._after_step)

    def trace(self, tracer: Tracer) -> None:
        """Record each unit's all-gather and reduce-scatter waits into `tracer`."""
        for k, unit in enumerate(self.units):
            unit.tracer, unit.label = tracer, str(k)

    def remove_hooks(self) -> None:
        """Take this wrapper's hooks off the module (the parameters stay views of the units)."""
        while self._handles:
            self._handles.pop().remove()

    def _broadcast_from_rank0(self, module: nn.Module) -> None:
        if self.world_size == 1:
            return
        src = dist.get_global_rank(self.process_group, 0)
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                checked.broadcast(t.data, src, group=self.process_group)

    # ---- forward ------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        eager(self._before_module)()  # under torch.compile only the module is traced
        try:
            out = self.module(*args, **kwargs)
        finally:
            eager(self._after_module)()
        return out

    def _before_module(self) -> None:
        self._sync_this_backward = self._sync
        if self._root is not None:
            self._gather(self._root)
        self._in_forward = True

    def _after_module(self) -> None:
        self._in_forward = False
        if not torch.is_grad_enabled():
            for unit in self.units:  # no backward will need them
                self._free(unit)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside accumulate `.grad` locally (in full)."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    # ---- the step -----------------------------------------------------------------------------

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, *, skip: Collection[str] = (),
                        norm_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Scale the averaged gradients so their global 2-norm is at most `max_norm`; return the
        norm before clipping (collective: the squares of every rank's shard are summed).

        Args:
            max_norm: the bound on the norm.
            skip: parameters (by name in the module) whose gradient this rank leaves out of the
                sum, as another rank counts it (tensor parallelism: a parameter every tp rank
                holds whole is counted by one of them); they are scaled all the same.
            norm_group: the ranks whose squares make the norm (default: `process_group`;
                tensor parallelism: the world, each tp slice's shards on its own dp group).
        """
        grads = [u.shard_grad for u in self.units]
        if skip:
            parts = [g[s:e] for u in self.units for g, s, e, name in self._owned_parts(u)
                     if name not in skip]
            sq = sum((p.square().sum() for p in parts), torch.zeros((), device=grads[0].device))
        else:
            sq = torch.stack([torch.linalg.vector_norm(g) for g in grads]).square().sum()
        group = norm_group or self.process_group
        if group.size() > 1:
            checked.all_reduce(sq, group=group)
        total = sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        return total

    @staticmethod
    def _owned_parts(unit: FlatUnit) -> list[tuple[torch.Tensor, int, int, str]]:
        """(the unit's shard gradient, start, end, parameter name) of each part this rank owns."""
        out = []
        for slot_i, a, b in unit.plan.owned(unit.rank):
            slot = unit.plan.slots[slot_i]
            out.append((unit.shard_grad, slot.offset + a - unit.lo, slot.offset + b - unit.lo,
                        slot.name))
        return out

    def _after_step(self) -> None:
        # Stages 1 and 2: every rank updated its own part of `full`; spread the parts. All the
        # gathers start now and each unit's is waited for just before its forward, so they
        # travel while the forward of the units before it computes.
        if self.stage < 3:
            for u in self.units:
                u.stale()
                u.start_gather()

    # ---- state --------------------------------------------------------------------------------

    def full_state_dict(self, *, keep_gathered: bool = False) -> dict[str, torch.Tensor]:
        """The unwrapped module's state, equal on every rank (collective at stage 3).

        Copies, unless `keep_gathered`: then stage 3 leaves every unit gathered, so the plain
        module can be used as it is (sampling at the end of a run), and the state is the
        module's own tensors (no second copy of the model: the end of a run under a memory
        limit); the next forward through this wrapper frees them again.
        """
        with torch.no_grad():
            for u in self.units:
                self._gather(u)
            state = {k: v.detach() if keep_gathered else v.detach().clone()
                     for k, v in self.module.state_dict().items()}
            if not keep_gathered:
                for u in self.units:
                    self._free(u)
        return state

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """torch's form, as from a DDP wrapper: `module.` keys, whole tensors. Stage 3: a
        collective (call it on every rank, then save on one) returning copies; stages 1 and 2
        wait for the parameters' gather in flight first (torn values otherwise)."""
        with self._whole_parameters(write=False):
            out = super().state_dict(*args, **kwargs)
            if self.stage == 3:  # the gathered storage is freed again on the way out
                flat = {u.full.untyped_storage().data_ptr() for u in self.units}
                out.update((k, v.detach().clone()) for k, v in out.items()
                           if isinstance(v, torch.Tensor)
                           and v.untyped_storage().data_ptr() in flat)
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load whole parameters and buffers (torch's `module.` keys, or the plain model's), on
        every rank alike; the optimizer state stays. Stage 3: a collective."""
        if assign:
            raise ValueError("ZeroDataParallel.load_state_dict(assign=True): the parameters are "
                             "views of the flat units, which assigning would detach; load with "
                             "assign=False (the default)")
        try:
            return super().load_state_dict(state_dict, strict=strict)
        finally:
            self._end_load()  # when the load raised before the post-hook

    # A parent module's load_state_dict reaches this one through these hooks, not the method.
    def _begin_load(self, *_: Any) -> None:
        self._loading = contextlib.ExitStack()
        self._loading.enter_context(self._whole_parameters(write=True))

    def _end_load(self, *_: Any) -> None:
        loading, self._loading = self._loading, None
        if loading is not None:
            loading.close()

    @contextlib.contextmanager
    def _whole_parameters(self, *, write: bool) -> Iterator[None]:
        """Every unit's full parameters present (no gather in flight); at stage 3 gathered for
        the duration (every rank), then, after a `write`, copied into this rank's shard."""
        self._wait_all_gathers()
        gathered = [u for u in self.units if self.stage == 3 and not u.gathered]
        with torch.no_grad():
            for u in gathered:
                self._gather(u)
            try:
                yield
            finally:
                for u in self.units if self.stage == 3 else ():
                    if write:  # the full copy is what the load wrote; the shard is kept
                        u.shard.copy_(u.full[u.lo:u.hi])
                for u in gathered:
                    self._free(u)

    def shard_state_dict(self) -> dict[str, Any]:
        """This rank's part: its shard of every unit and of the optimizer state, in the flat
        layout any number of ranks can load (`reshard.py`)."""
        self._wait_all_gathers()  # (stages 1, 2) the shard is a view of `full`: no write pending
        return zero_state.shard_state(self.units, self.optimizer, stage=self.stage,
                                      world_size=self.world_size, rank=self.rank)

    def load_shard_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `shard_state_dict` on the same number of ranks, on every rank."""
        if int(state["world_size"]) != self.world_size or int(state["rank"]) != self.rank:
            raise ValueError(f"this ZeRO part was saved by rank {state['rank']} of world_size="
                             f"{state['world_size']}; this is rank {self.rank} of "
                             f"{self.world_size}: pass the parts of the saved ranks "
                             "`reshard.sources` names to load_shard_state_dicts")
        self.load_shard_state_dicts({self.rank: state})

    def load_shard_state_dicts(self, parts: dict[int, dict[str, Any]]) -> None:
        """Load the parts saved by any number of ranks (saved rank -> its `shard_state_dict`;
        at least those `reshard.sources` names for this rank), on every rank (a stage can differ
        from the saved one: the layout is the same). Stages 1, 2 all-gather afterwards."""
        self._wait_all_gathers()
        for u in self.units:
            self._free(u)  # stage 3: a unit left gathered would hold the old values
        zero_state.load_parts(self.units, self.optimizer, parts, world_size=self.world_size,
                              rank=self.rank)
        self._after_step()

    def load_named_state(self, model: dict[str, torch.Tensor],
                         state: dict[str, dict[str, Any]]) -> None:
        """Load whole parameters and their optimizer state by name (the layout-free form of
        `ringtrain.strategies.portable`), on every rank: re-sliced as from one saved rank."""
        part = zero_state.from_named(self.units, self.optimizer, model, state, stage=self.stage)
        self.load_shard_state_dicts({0: part})

    def memory(self) -> dict[str, int | float]:
        """Bytes held now on this rank (counted from the tensors) next to the ZeRO formula."""
        self._wait_all_gathers()
        params = grads = 0
        for u in self.units:
            held = u.held_bytes()
            params, grads = params + held["params"], grads + held["grads"]
        # Each storage once: after a state_dict the moments are views of one flat buffer per
        # unit and key (`state.flat_moments`), which every part's view would count again.
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for st in self.optimizer.state.values() for t in st.values()
                    if isinstance(t, torch.Tensor)}
        opt = sum(storages.values())
        want = expected_bytes(self.numel, self.world_size, self.stage)
        return {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": opt,
                "expected_param_bytes": want["params"], "expected_grad_bytes": want["grads"],
                "expected_optimizer_bytes": want["optimizer"],
                "peak_gathered_bytes": self.peak_gathered_bytes}
