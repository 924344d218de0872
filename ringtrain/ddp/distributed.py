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

from ringtrain import collectives  # checked first under RINGTRAIN_DEBUG=collectives
from ringtrain.ddp.broadcast import broadcast_coalesced
from ringtrain.ddp.buckets import (
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_FIRST_BUCKET_BYTES,
    SOLO_BYTES_CPU,
    GradBucket,
)
from ringtrain.ddp.join import JoinableDDP
from ringtrain.ddp.lanes import comm_lanes as comm_lanes_for
from ringtrain.ddp.reducer import Reducer
from ringtrain.ddp.static_graph import StaticGraphCheck
from ringtrain.ddp.unused_params import UnusedParametersError
from ringtrain.runtime import register_exit_grace
from ringtrain.torch_internals import (
    preserve_version_counter,
)
from ringtrain.trace import NO_TRACE, Tracer

__all__ = ["DistributedDataParallel", "GradBucket", "UnusedParametersError", "broadcast_coalesced",
           "verify_same_parameters"]

class ReplicaMismatchError(ValueError):
    """Ranks wrapped models whose parameters differ in name, shape or dtype."""


def _default_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if process_group is not None:
        return process_group
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "DistributedDataParallel needs an initialised process group: call "
            "ringtrain.init_distributed() (or torch.distributed.init_process_group) first, "
            "or pass process_group="
        )
    return dist.group.WORLD


def verify_same_parameters(module: nn.Module, process_group: dist.ProcessGroup) -> None:
    """Raise `ReplicaMismatchError` on every rank unless all ranks hold the same parameters.

    Compares names, shapes and dtypes in registration order; the error names the first
    mismatching parameter and what each rank has there.
    """
    mine = [(name, tuple(p.shape), str(p.dtype).replace("torch.", ""))
            for name, p in module.named_parameters()]
    world_size = process_group.size()
    everyone: list[Any] = [None] * world_size
    collectives.all_gather_object(everyone, mine, group=process_group)
    if all(sig == everyone[0] for sig in everyone):
        return
    longest = max(len(sig) for sig in everyone)
    for k in range(longest):
        at_k = [sig[k] if k < len(sig) else None for sig in everyone]
        if any(entry != at_k[0] for entry in at_k):
            break
    groups: dict[Any, list[int]] = {}
    for rank, entry in enumerate(at_k):
        groups.setdefault(entry, []).append(rank)
    described = "; ".join(
        f"ranks {ranks} have " + ("no parameter there" if entry is None else
                                  f"{entry[0]!r} shape={list(entry[1])} dtype={entry[2]}")
        for entry, ranks in groups.items()
    )
    counts = {len(sig) for sig in everyone}
    sizes = "" if len(counts) == 1 else (
        " Parameter counts per rank: " + str([len(sig) for sig in everyone]) + ".")
    raise ReplicaMismatchError(
        f"DistributedDataParallel needs the same parameters on every rank, but parameter #{k} "
        f"differs: {described}.{sizes} Build the same model (same config, same registration "
        "order) on every rank before wrapping it."
    )


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_to_device(o, device) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _to_device(v, device)) for k, v in obj.items())
    return obj


class DistributedDataParallel(nn.Module, JoinableDDP):
    """Data parallelism: one replica per rank, gradients averaged across ranks during backward.

    Args:
        module: the model, identically built on every rank (parameters are checked, then
            copied from rank 0).
        device_ids: CUDA modules: None or the one device this process uses (inputs are moved
            there). CPU and multi-device modules: must be None.
        output_device: accepted for torch compatibility; single-device modules leave outputs
            where the module puts them. CPU modules: must be None.
        dim: accepted for torch compatibility (it only mattered for torch's removed
            multi-device-per-process mode).
        broadcast_buffers: copy rank 0's buffers (BatchNorm statistics) to every rank at
            construction and before each forward that follows a synced one (a forward with
            grad enabled, outside `no_sync`), as torch does. None (torch's default) means True.
        init_sync: at construction, verify parameters across ranks and broadcast rank 0's
            parameters and buffers. If False, replicas must already be identical.
        process_group: the group to average over; default: the world group.
        bucket_cap_mb: bucket size in MiB (default 25); the first bucket is 1 MiB.
        find_unused_parameters: parameters that got no gradient in a synced backward are
            treated as zero gradients (same on every rank); parameters no rank used keep their
            `.grad`. When False, such parameters raise `UnusedParametersError` in that backward,
            on every rank, naming them.
        check_reduction: deprecated in torch; ignored.
        gradient_as_bucket_view: `.grad` of bucketed parameters become views into the bucket
            buffers, saving the copy back and the memory of a second gradient copy.
        static_graph: the set of used parameters does not change between steps; unused
            parameters are then handled as with find_unused_parameters=True, and a synced
            backward that uses other parameters than the first raises `StaticGraphError`
            (a RuntimeError, with torch's message) on every rank (`static_graph.py`).
        comm_lanes: (ringtrain only) how many groups over the same ranks carry the buckets
            side by side; default 3 on a gloo world group, else 1 (see `ringtrain/ddp/lanes.py`).
            Buckets a comm hook handles use the hook's own group.
        tracer: (ringtrain only) a `ringtrain.trace.Tracer` that records each bucket's
            communication during traced steps; default: none.

    .. warning::
        Like torch's DDP, whether a backward is synced is decided by the forward that built its
        graph: run that forward inside `no_sync()` to skip the sync.

    .. note::
        Where it differs from torch's, on purpose: a parameter without a gradient is
        reported in the backward that missed it, on every rank (torch reports it in the next
        iteration); a parameter accumulated only in a `no_sync` micro-step counts as used; on
        CPU, gradients of 1 MiB or more are reduced in place in `.grad` instead of being copied
        into a bucket and back.
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
        self.process_group = _default_group(process_group)
        self.dim = dim
        self.broadcast_buffers = True if broadcast_buffers is None else bool(broadcast_buffers)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True  # cleared by no_sync()
        self.require_forward_param_sync = True  # set by each forward: was it a synced one?
        register_exit_grace()  # gloo's threads must not abort this process's exit (runtime.py)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                f"DistributedDataParallel is not needed when a module has no parameter that "
                f"requires a gradient ({type(module).__name__} has none); use the module as is"
            )
        for name, sub in module.named_modules():
            if getattr(sub, "sparse", False) is True:
                raise ValueError(
                    f"{name or type(module).__name__} ({type(sub).__name__}) has sparse=True; "
                    "ringtrain's DistributedDataParallel reduces dense gradients only: build it "
                    "with sparse=False"
                )
        devices = {p.device for _, p in named}
        self.device_ids, self.output_device = self._check_devices(devices, device_ids,
                                                                  output_device)
        self.device = next(iter(devices))

        if init_sync and self.process_group.size() > 1:
            verify_same_parameters(module, self.process_group)
            synced = [p.data for p in module.parameters()]
            if self.broadcast_buffers:
                synced += [b for b in module.buffers()]
            with torch.no_grad():
                broadcast_coalesced(synced, 0, self.process_group)

        cap_mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        if cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb}: it must be positive (default 25)")
        self.bucket_bytes_cap = int(cap_mb * 1024 * 1024)
        on_cpu = all(d.type == "cpu" for d in devices)
        self.reducer = Reducer(
            [p for _, p in named], [n for n, _ in named], self.process_group,
            bucket_cap_bytes=self.bucket_bytes_cap,
            first_bucket_bytes=min(DEFAULT_FIRST_BUCKET_BYTES, self.bucket_bytes_cap),
            solo_bytes=SOLO_BYTES_CPU if on_cpu else self.bucket_bytes_cap,
            find_unused_parameters=find_unused_parameters or static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            lanes=comm_lanes_for(self.process_group, comm_lanes), tracer=tracer,
        )
        if static_graph:
            self.reducer.static_graph = StaticGraphCheck(self.reducer.names, self.reducer.rank)

    @staticmethod
    def _check_devices(devices: set[torch.device], device_ids, output_device):
        if device_ids is None or len(device_ids) == 0:
            if output_device is not None and (len(devices) > 1
                                              or next(iter(devices)).type == "cpu"):
                raise ValueError(
                    f"output_device={output_device!r} only works with single-device CUDA modules; "
                    f"this module's parameters are on {sorted(map(str, devices))}: pass "
                    "output_device=None"
                )
            return None, output_device
        if len(devices) > 1 or next(iter(devices)).type == "cpu":
            raise ValueError(
                f"device_ids={list(device_ids)} only works with a module on one CUDA device; this "
                f"module's parameters are on {sorted(map(str, devices))}: pass device_ids=None"
            )
        if len(device_ids) != 1:
            raise ValueError(
                f"device_ids={list(device_ids)}: one process drives one device, so device_ids can "
                "only be None or contain a single element"
            )
        index = (torch.device("cuda", device_ids[0]) if isinstance(device_ids[0], int)
                 else torch.device(device_ids[0]))
        device = next(iter(devices))
        if index != device:
            raise ValueError(
                f"device_ids={list(device_ids)} but the module's parameters are on {device}; "
                f"move the module there first (module.to({str(index)!r})) or pass "
                f"device_ids=[{device.index}]"
            )
        return [device.index], device.index if output_device is None else output_device

    # ---- forward ---------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # As in torch, the forward decides whether the backward of its graph syncs.
        syncs = torch.is_grad_enabled() and self.require_backward_grad_sync
        self._join_notify(syncs)  # under a Join context only (join.py), as the next two
        if self.will_sync_module_buffers():
            self._sync_buffers(self._buffer_source())
        self._join_announce(syncs)
        if self.device_ids:
            inputs, kwargs = _to_device(inputs, self.device), _to_device(kwargs, self.device)
        output = self.module(*inputs, **kwargs)
        self.require_forward_param_sync = syncs
        if syncs:
            self.reducer.prepare_for_backward()
        return output

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts the buffers: only after a synced forward, as in
        torch (`require_forward_param_sync`), so a rank that evaluates alone under no_grad
        issues no collective the others would have to match."""
        return (self.require_forward_param_sync and self.broadcast_buffers
                and self.process_group.size() > 1
                and next(iter(self.module.buffers()), None) is not None)

    def _sync_buffers(self, src: int = 0) -> None:
        buffers = list(self.module.buffers())  # re-read: a module may have reassigned one
        if not buffers:
            return
        # The broadcast writes in place into buffers a pending backward may have saved; keep
        # their version counters so autograd does not mistake it for a user's in-place edit.
        with torch.no_grad(), preserve_version_counter(tuple(buffers)):
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
        if not callable(hook):
            raise TypeError(f"hook={hook!r} is not callable; pass a function hook(state, bucket)")
        if self.reducer.comm_hook is not None:
            raise RuntimeError(
                f"a comm hook ({getattr(self.reducer.comm_hook, '__name__', '?')}) is already "
                "registered; register_comm_hook can only be called once, as in torch"
            )
        if self.reducer._queued:
            raise RuntimeError("register_comm_hook was called during backward; "
                               "call it before training")

        self.reducer.comm_hook, self.reducer.comm_hook_state = hook, state

    def train(self, mode: bool = True) -> DistributedDataParallel:
        super().train(mode)
        return self
