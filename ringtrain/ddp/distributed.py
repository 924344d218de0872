"""`ringtrain.DistributedDataParallel`: torch's DDP, written in Python you can read.

Drop-in for `torch.nn.parallel.DistributedDataParallel`: same constructor arguments and
defaults, `.module`, `no_sync()`, `join()` for uneven inputs (`join.py`),
`register_comm_hook(state, hook)` and a `state_dict()` with the `module.` prefix. Replicas start
identical (checked, then broadcast from rank 0), buffers follow rank 0 before each forward that
follows a synced one, and gradients are averaged in buckets during backward
(`ringtrain/ddp/reducer.py`). `ringtrain/ddp/naive.py` is the one-all-reduce-per-parameter version
of the same idea.

    import ringtrain
    ringtrain.init_distributed()
    model = ringtrain.DistributedDataParallel(model)

Tests: `.venv/bin/pytest -q tests/test_ddp.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.ddp import ctor_args, ignored
from ringtrain.ddp import mixed_precision as mixed_precision_module
from ringtrain.ddp.buckets import (
    DEFAULT_FIRST_BUCKET_BYTES,
    SOLO_BYTES_CPU,
    GradBucket,
    check_hook,
)
from ringtrain.ddp.delayed import DelayedAllReduce, delayed_names
from ringtrain.ddp.eager import eager
from ringtrain.ddp.framework_members import DDPFrameworkMembers
from ringtrain.ddp.init_sync import (
    BROADCAST_BUCKET_BYTES,
    ReplicaMismatchError,
    broadcast_coalesced,
    verify_same_parameters,
)
from ringtrain.ddp.join import JoinableDDP
from ringtrain.ddp.lanes import comm_lanes as comm_lanes_for
from ringtrain.ddp.lanes import existing_lanes
from ringtrain.ddp.reducer import Reducer
from ringtrain.ddp.state_keys import accept_unwrapped_keys
from ringtrain.ddp.static_graph import StaticGraphCheck, set_static_graph
from ringtrain.ddp.torch_members import DDPTorchMembers
from ringtrain.ddp.unused_params import UnusedParametersError
from ringtrain.runtime import register_exit_grace
from ringtrain.torch_internals import preserve_version_counter
from ringtrain.trace import NO_TRACE, Tracer

__all__ = ["DistributedDataParallel", "GradBucket", "ReplicaMismatchError", "UnusedParametersError",
           "broadcast_coalesced", "verify_same_parameters"]


class DistributedDataParallel(nn.Module, JoinableDDP, DDPFrameworkMembers,
                              DDPTorchMembers):
    """Data parallelism: one replica per rank, gradients averaged across ranks during backward.

    Args:
        module: the model, identically built on every rank (parameters are checked, then
            copied from rank 0), on a device the group's backend moves (not the CPU under NCCL).
        device_ids: CUDA modules: None or the one device this process uses (inputs are moved
            there). CPU and multi-device modules: must be None.
        output_device: accepted for torch compatibility; single-device modules leave outputs
            where the module puts them. CPU modules: must be None.
        dim: accepted for torch compatibility (it only mattered for torch's removed
            multi-device-per-process mode).
        broadcast_buffers: deprecated in torch 2.13 for `forward_sync_buffers` (a FutureWarning,
            as torch's): the same, except that False also skips the construction sync.
        init_sync: at construction, verify parameters across ranks and broadcast rank 0's
            parameters and buffers. If False, replicas must already be identical.
        process_group: the group to average over; default: the world group.
        bucket_cap_mb: bucket size in MiB (default 25); the first bucket is 1 MiB.
        find_unused_parameters: parameters that got no gradient in a synced backward are
            treated as zero gradients (same on every rank); parameters no rank used keep their
            `.grad`. When False, such parameters raise `UnusedParametersError` as torch does:
            at the next forward with grad enabled, on every rank, naming them and the ranks.
        check_reduction: deprecated in torch; no effect (a FutureWarning when True, as torch).
        gradient_as_bucket_view: `.grad` of bucketed parameters become views into the bucket
            buffers, saving the copy back and the memory of a second gradient copy.
        static_graph: the set of used parameters does not change between steps; unused
            parameters are then handled as with find_unused_parameters=True, and a synced
            backward that uses other parameters than the first raises `StaticGraphError`
            (a RuntimeError, with torch's message) on every rank (`static_graph.py`).
        delay_all_reduce_named_params / param_to_hook_all_reduce: (name, parameter) pairs
            averaged in one all-reduce when the second's gradient is computed (`delayed.py`).
        mixed_precision: torch's `_MixedPrecision` (param_dtype, reduce_dtype, buffer_dtype):
            compute in param_dtype, sum gradients in reduce_dtype (`mixed_precision.py`).
        device_mesh: a 1-D `DeviceMesh` whose group to average over (not with process_group).
        skip_all_reduce_unused_params: a bucket whose parameters all got no gradient is not
            all-reduced; every rank must leave the same parameters unused, in every step.
        bucket_cap_mb_list: per-bucket sizes in MiB, in reduction order, the last repeating.
        batched_grad_copy / lazy_bucket_allocation: torch's speed and memory options; no
            effect on results here (a warning says so when True).
        forward_sync_buffers: copy rank 0's buffers (BatchNorm statistics) to every rank before
            each forward that follows a synced one (grad enabled, outside `no_sync`), as torch
            does (construction always does). None means True.
        comm_lanes: (ringtrain only) how many groups over the same ranks carry the buckets
            side by side; default 3 on a gloo world group, else 1 (see `ringtrain/ddp/lanes.py`).
            Buckets a comm hook handles use the hook's own group.
        tracer: (ringtrain only) a `ringtrain.trace.Tracer` that records each bucket's
            communication during traced steps; default: none.

    Parameters and buffers named by `_set_params_and_buffers_to_ignore_for_model` are left
    alone (`ignored.py`). Pickling and `copy.deepcopy` work as torch's: the group and the
    reducer are dropped and rebuilt on the default group (one comm lane unless this process
    has the lanes already).

    .. warning::
        Like torch's DDP, whether a backward is synced is decided by the forward that built its
        graph: run that forward inside `no_sync()` to skip the sync. It starts no watchdog in a
        script that made the group itself: see docs/fault_tolerance.md for why and how.

    .. note::
        Where it differs from torch's, on purpose: `optimizer.step()` raises a pending
        `UnusedParametersError` too, before the next forward (docs/ddp_compat.md); a parameter
        accumulated only in a `no_sync` micro-step counts as used; on CPU, gradients of 1 MiB
        or more are reduced in place in `.grad` instead of being copied into a bucket and
        back.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None = None,
        param_to_hook_all_reduce: nn.Parameter | None = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Sequence[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        lazy_bucket_allocation: bool = False,
        *,
        comm_lanes: int | None = None,
        tracer: Tracer = NO_TRACE,
    ):
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedDataParallel got {module!r} ({type(module).__name__}), "
                            "not a torch.nn.Module: pass the model itself")
        super().__init__()
        JoinableDDP.__init__(self)  # torch's Joinable: its join config, off outside a Join
        self.module = module
        accept_unwrapped_keys(self)  # load_state_dict takes the plain model's keys too
        self.process_group = ctor_args.process_group_from(process_group, device_mesh)
        if device_mesh is not None:
            self.device_mesh = device_mesh
        self.dim = dim
        self.forward_sync_buffers, init_sync_buffers = ctor_args.buffer_sync_flags(
            broadcast_buffers, forward_sync_buffers)
        ctor_args.warn_no_effect(check_reduction, batched_grad_copy, lazy_bucket_allocation)
        ctor_args.check_delay_args(delay_all_reduce_named_params, param_to_hook_all_reduce)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.require_backward_grad_sync = True  # cleared by no_sync()
        # torch's: whether the last forward prepared a synced backward (frameworks read and set
        # it: Lightning's manual optimization, accelerate's trigger_sync_in_backward).
        self.require_forward_param_sync = True
        register_exit_grace()  # gloo's threads must not abort this process's exit (runtime.py)

        self.parameters_to_ignore = ignored.ignored_names(module)
        self._delayed_names: list[str] = []
        self._delay_hook_name: str | None = None
        if delay_all_reduce_named_params is not None:
            self._delayed_names, self._delay_hook_name = delayed_names(
                module, list(delay_all_reduce_named_params), param_to_hook_all_reduce)
            self.parameters_to_ignore |= set(self._delayed_names)
        named = ignored.managed_parameters(module, self.parameters_to_ignore)
        if not named and self._delayed_names:
            raise ctor_args.DDPArgumentError(
                "delay_all_reduce_named_params names every parameter that requires a gradient; "
                "ringtrain's DistributedDataParallel needs at least one it reduces in buckets: "
                "leave one out of the list (torch then skips its reducer)")
        ctor_args.check_params(named, module)
        devices = {p.device for _, p in named}
        self.device_ids, self.output_device = ctor_args.check_devices(devices, device_ids,
                                                                      output_device)
        self.device = next(iter(devices))
        synced = ignored.synced_parameters(module, self.parameters_to_ignore)
        if (init_sync and init_sync_buffers) or self.forward_sync_buffers:  # buffers sent
            synced += ignored.named_synced_buffers(module, self.parameters_to_ignore)
        ctor_args.check_backend_devices(synced, self.process_group)

        self.broadcast_bucket_size = BROADCAST_BUCKET_BYTES  # torch's attribute, same value
        if self._delayed_names and self.process_group.size() > 1:  # as torch: init_sync or not
            with torch.no_grad():
                broadcast_coalesced([p.detach() for p in self._delayed_params()], 0,
                                    self.process_group)
        if init_sync and self.process_group.size() > 1:
            synced = ignored.synced_parameters(module, self.parameters_to_ignore)
            verify_same_parameters(synced, self.process_group)
            tensors = [p.detach() for _, p in synced]
            if init_sync_buffers:
                tensors += ignored.synced_buffers(module, self.parameters_to_ignore)
            with torch.no_grad():
                broadcast_coalesced(tensors, 0, self.process_group, self.broadcast_bucket_size)

        self.bucket_bytes_cap, self.bucket_bytes_cap_list = ctor_args.bucket_caps(
            bucket_cap_mb, bucket_cap_mb_list)
        self.mixed_precision = mixed_precision
        if mixed_precision is not None:
            mixed_precision_module.check_config(mixed_precision)
            mixed_precision_module.setup(module, mixed_precision, self.parameters_to_ignore)
        self._build(comm_lanes_for(self.process_group, comm_lanes), tracer)

    def _delayed_params(self) -> list[nn.Parameter]:
        by_name = dict(self.module.named_parameters())
        return [by_name[n] for n in self._delayed_names]

    def _build(self, lanes: list[dist.ProcessGroup], tracer: Tracer) -> None:
        """The reducer and the hooks: everything pickling drops and unpickling rebuilds."""
        named = ignored.managed_parameters(self.module, self.parameters_to_ignore)
        on_cpu = all(p.device.type == "cpu" for _, p in named)
        self.reducer = Reducer(
            [p for _, p in named], [n for n, _ in named], self.process_group,
            bucket_cap_bytes=self.bucket_bytes_cap,
            first_bucket_bytes=min(DEFAULT_FIRST_BUCKET_BYTES, self.bucket_bytes_cap),
            solo_bytes=SOLO_BYTES_CPU if on_cpu else self.bucket_bytes_cap,
            find_unused_parameters=self.find_unused_parameters or self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view, lanes=lanes, tracer=tracer,
            bucket_caps=self.bucket_bytes_cap_list or None,
            skip_all_reduce_unused_params=self.skip_all_reduce_unused_params,
            rebuild_buckets=self.static_graph or not self.find_unused_parameters,
        )
        if self.static_graph:
            self.reducer.static_graph = StaticGraphCheck(self.reducer.names, self.reducer.rank)
        self._comm_lane_count = len(lanes)
        self._delayed = None
        if self._delayed_names:
            hook_param = dict(self.module.named_parameters())[self._delay_hook_name]
            self._delayed = DelayedAllReduce(self._delayed_params(), hook_param,
                                             self.process_group)
        dtype = None if self.mixed_precision is None else mixed_precision_module.reduce_dtype(
            self.mixed_precision)
        if dtype is not None:
            self.register_comm_hook(mixed_precision_module.HookState(self.process_group, dtype),
                                    mixed_precision_module.mixed_precision_hook)

    # torch's way to keep parameters and buffers out of DDP (static, as in torch).
    _set_params_and_buffers_to_ignore_for_model = staticmethod(
        ignored.set_params_and_buffers_to_ignore_for_model)
    _get_data_parallel_params = staticmethod(ignored.get_data_parallel_params)

    @property
    def broadcast_buffers(self) -> bool:
        """torch 2.13's deprecated name for `forward_sync_buffers`."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def __getstate__(self) -> dict[str, Any]:
        # As torch: the group cannot be pickled; unpickling takes the default group, so only a
        # DDP on the default group can be pickled. The reducer and hooks are rebuilt.
        ctor_args.check_default_group(self.process_group)
        state = dict(self.__dict__)
        for name in ("process_group", "reducer", "_delayed", "_join_kept"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.process_group = ctor_args.process_group_from(None, None)
        # No collective here (a copy may be made on one rank): the lanes this process has.
        self._build(existing_lanes(self.process_group, self._comm_lane_count), NO_TRACE)

    # ---- forward ---------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        syncs = eager(self._before_module)()  # under torch.compile only the module is traced
        if self.device_ids:
            inputs, kwargs = ctor_args.to_device((inputs, kwargs), self.device)
        if self.mixed_precision is None:
            output = self.module(*inputs, **kwargs)
        else:
            output = mixed_precision_module.forward(self.module, self.mixed_precision,
                                                    self.parameters_to_ignore, inputs, kwargs)
        eager(self._after_module)(syncs)
        return output

    def _before_module(self) -> bool:
        # As in torch, the forward decides whether the backward of its graph syncs.
        grad = torch.is_grad_enabled()
        if grad:  # as torch: before any collective of this forward, on every rank alike
            self.reducer.raise_unfinished()
        syncs = grad and self.require_backward_grad_sync
        self._join_notify(syncs)  # under a Join context only (join.py), as _join_announce
        if self._check_sync_bufs_pre_fwd():  # unless a buffer hook runs after (torch_members.py)
            self._sync_buffers(self._buffer_source())
        self._join_announce(grad, syncs)
        if grad:  # as torch: once, before the forward's activations exist
            self.reducer._rebuild_buckets()
        return syncs

    def _after_module(self, syncs: bool) -> None:
        if self._delayed is not None:
            self._delayed.after_forward()
        if self._check_sync_bufs_post_fwd():  # a POST_FORWARD buffer hook (torch_members.py)
            self._sync_buffers(self._buffer_source())
        self.require_forward_param_sync = syncs
        if syncs:
            self.reducer.prepare_for_backward()

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts the buffers: only after a synced forward, as in
        torch (`require_forward_param_sync`), so a rank that evaluates alone under no_grad
        issues no collective the others would have to match."""
        return (self.require_forward_param_sync and self.forward_sync_buffers
                and self.process_group.size() > 1
                and bool(ignored.synced_buffers(self.module, self.parameters_to_ignore)))

    def _sync_buffers(self, src: int = 0) -> None:
        # Re-read: a module may have reassigned one.
        buffers = ignored.synced_buffers(self.module, self.parameters_to_ignore)
        if not buffers:
            return
        # The broadcast writes in place into buffers a pending backward may have saved; keep
        # their version counters so autograd does not mistake it for a user's in-place edit.
        with torch.no_grad(), preserve_version_counter(tuple(buffers)):
            if self.buffer_hook is not None:  # _register_buffer_comm_hook: the hook syncs them
                self._run_buffer_hook()
            else:
                broadcast_coalesced(buffers, src, self.process_group)

    # ---- the torch DDP surface -------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside this context accumulate gradients locally;
        the first synced backward after it averages everything accumulated.

        Example::

            with ddp.no_sync():
                for x in micro_batches[:-1]:
                    ddp(x).sum().backward()   # local only
            ddp(micro_batches[-1]).sum().backward()   # averages all of it
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: object,
                           hook: Callable[[Any, GradBucket], torch.futures.Future]) -> None:
        """Replace the default averaging all-reduce of each bucket with `hook(state, bucket)`.

        Args:
            state: passed to the hook unchanged (torch's hooks take a process group or None).
            hook: `hook(state, bucket) -> torch.futures.Future[Tensor]` whose value is the
                averaged `bucket.buffer()`; the hook divides by the world size itself. torch's
                hooks (`torch.distributed.algorithms.ddp_comm_hooks`) and
                `ringtrain.ddp.comm_hooks` both work.
        """
        with self._errors_logged():  # as torch, _get_ddp_logging_data() reports them
            check_hook(hook)
            if self.reducer.comm_hook is not None:
                raise RuntimeError(
                    "register_comm_hook or register_builtin_comm_hook can only be called once (as "
                    f"in torch): a comm hook ({getattr(self.reducer.comm_hook, '__name__', '?')})"
                    " is already registered (mixed_precision= registers mixed_precision_hook)"
                )
            if self.reducer._queued:
                raise RuntimeError("register_comm_hook was called during backward; "
                                   "call it before training")

        self.reducer.comm_hook, self.reducer.comm_hook_state = hook, state

    def train(self, mode: bool = True) -> DistributedDataParallel:
        super().train(mode)
        return self

    _set_static_graph = set_static_graph  # torch's private method (frameworks call it)
