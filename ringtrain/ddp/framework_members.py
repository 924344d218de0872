"""The private members of torch's DDP that training frameworks call: part of the drop-in.

Lightning and accelerate reach past DDP's documented surface into members torch never made
public; a wrapper without them breaks those frameworks however well it trains. Found by grepping
lightning 2.6 and accelerate 1.15 for attribute accesses on the DDP module and its reducer, and
by running them (`tests/test_frameworks.py`):

    member                                  who calls it, where
    ddp._get_ddp_logging_data()             Lightning DDPStrategy.teardown, for
                                            .get("can_set_static_graph")
    ddp.require_forward_param_sync          Lightning manual optimization, accelerate
                                            trigger_sync_in_backward (read and set)
    ddp.reducer._rebuild_buckets()          Lightning manual optimization (before manual_backward)
    ddp.reducer.prepare_for_backward(outs)  Lightning manual optimization, accelerate
                                            trigger_sync_in_backward (with [])
    ddp.reducer._delay_all_reduce()         Lightning manual optimization with static_graph=True,
                                            after the first backward

and what torch's own tests call besides, where cheap: `_set_ddp_runtime_logging_sample_rate`,
`_register_builtin_comm_hook`, `_remove_autograd_hooks` (the rest of those: `torch_members.py`).

Both also use the public surface: `module`, `no_sync()`, `register_comm_hook`,
`require_backward_grad_sync`, `find_unused_parameters`, `static_graph`.
`require_forward_param_sync` is a plain attribute (`distributed.py`); `prepare_for_backward`
is the reducer's own (`reducer.py`); the rest is here, as mixins of `DistributedDataParallel`
and `Reducer`, each with torch's meaning (torch/nn/parallel/distributed.py, reducer.cpp).

Tests: `.venv/bin/pytest -q tests/test_framework_members.py` (the frameworks' calls replayed
against torch's DDP, no framework needed) and tests/test_frameworks.py (the frameworks).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# torch's sampling of runtime statistics (reducer.cpp, should_collect_runtime_stats): the first
# 10 iterations, then every 100th (`_set_ddp_runtime_logging_sample_rate`); the logging data
# shows the last sample.
_SAMPLED_FIRST, _SAMPLE_RATE = 10, 100

# The names torch's logger gives dtypes (c10's scalar type names).
_DTYPE_NAMES = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
                torch.bfloat16: "c10::BFloat16"}


class ReducerFrameworkMembers:
    """`reducer._rebuild_buckets()`, `_delay_all_reduce()` and the figures behind
    `_get_ddp_logging_data()` (a base class of `Reducer`)."""

    # Set by Reducer.__init__ (and its method `_rebuild`).
    params: list[nn.Parameter]
    _next_order: list[int] | None
    _ready: bytearray
    _queued: bool
    _deferred: bool
    _rebuild: Callable[[list[int]], None]
    num_buckets_reduced: int  # in this round so far (reset when a round begins)
    comm_hook: Callable | None
    last_error: str | None  # the last error a synced round raised (finalize.py)

    def _init_framework_members(self) -> None:
        self.num_iterations = 0  # synced rounds begun (prepare_for_backward calls)
        self.has_rebuilt_buckets = False
        self.graph_static = True  # the set of unused parameters never changed between rounds
        self._last_unused: list[int] | None = None
        self.last_unused_bytes = 0  # of the last finished round
        # What torch's logger sampled last: at the start of a round, the rounds done so far and
        # the previous round's figures (0: nothing sampled yet).
        self.sampled = {"iteration": 0, "has_rebuilt_buckets": 0, "unused_parameter_size": 0,
                        "num_buckets_reduced": 0}
        self.sample_rate = _SAMPLE_RATE
        self.last_buckets_reduced = 0  # by the last finished round
        self.comm_hook_name: str | None = None  # a built-in hook's, as torch logs it

    def _count_round(self) -> None:
        """A synced round begins (prepare_for_backward): sample as torch's logger does.

        torch samples at the start of a synced forward, before counting it, when the rounds done
        so far are 1 to 10 or a multiple of the sample rate, 100 by default (reducer.cpp:
        should_collect_runtime_stats).
        """
        done = self.num_iterations
        if done > 0 and (done <= _SAMPLED_FIRST or done % self.sample_rate == 0):
            self.sampled = {"iteration": done, "has_rebuilt_buckets": int(self.has_rebuilt_buckets),
                            "unused_parameter_size": self.last_unused_bytes,
                            "num_buckets_reduced": self.last_buckets_reduced}
        self.num_iterations += 1

    def _rebuild_buckets(self) -> bool:
        """Rebuild the buckets from the order gradients arrived in the first synced backward.

        Returns True in the one call that rebuilds, as torch's does; False before that order is
        known, after the rebuild, and while a round is in flight. A collective (rank 0's order
        is broadcast): call it on every rank. DDP's forward calls it with grad enabled, before
        the module runs (as torch's, to rebuild before activations take memory), and
        `prepare_for_backward` calls it too, so callers need not.
        """
        if (self._next_order is None or self._queued or self._deferred
                or any(self._ready)):
            return False
        order, self._next_order = self._next_order, None
        self._rebuild(order)
        self.has_rebuilt_buckets = True
        return True

    def _delay_all_reduce(self) -> None:
        """torch's end of a static graph's first backward; nothing to do here.

        torch's reducer only counts gradient hooks in a static graph's first iteration and
        all-reduces everything in this call, which its DDP queues at the end of that backward
        (Lightning's manual optimization calls it itself). This reducer reduces the first
        backward like every other one, and has finished it when backward returns.
        """

    def _note_round(self, unused: list[int]) -> None:
        """Record a finished synced round's unused parameters (for `can_set_static_graph`)."""
        if self._last_unused is not None and unused != self._last_unused:
            self.graph_static = False
        self._last_unused = list(unused)
        self.last_buckets_reduced = self.num_buckets_reduced
        params = self.params
        self.last_unused_bytes = sum(params[i].numel() * params[i].element_size()
                                     for i in unused)


class DDPFrameworkMembers:
    """`ddp._get_ddp_logging_data()` (a base class of `DistributedDataParallel`)."""

    # Set by DistributedDataParallel.__init__ (and its method register_comm_hook).
    register_comm_hook: Callable[[object, Callable], None]
    module: nn.Module
    process_group: dist.ProcessGroup
    reducer: Any
    device_ids: list[int] | None
    output_device: int | torch.device | None
    broadcast_buffers: bool
    bucket_bytes_cap: int
    find_unused_parameters: bool
    gradient_as_bucket_view: bool
    static_graph: bool
    _uneven_input_join: bool

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch's dictionary of DDP's configuration and state, for debugging and frameworks.

        The keys and values torch 2.13 gives on CPU (strings, then integers), from the same
        facts: constructor arguments, environment, process group, parameters, bucket plan, and
        what torch's logger samples at the start of a round (`iteration`, `has_rebuilt_buckets`,
        `unused_parameter_size`). `can_set_static_graph` is present, and 0, once the set of
        unused parameters changed between two iterations with find_unused_parameters=True
        (Lightning's teardown reads it). Absent: torch's timing keys (`avg_forward_compute_time`,
        ...; ringtrain times steps with `ringtrain.trace`, not in the wrapper), its rebuild
        details (`rebuilt_bucket_sizes`, `prev_iteration_grad_ready_order_indices`, ...) and
        `gloo_num_threads`. As torch, ringtrain rebuilds its buckets (`has_rebuilt_buckets`)
        only without find_unused_parameters, or with static_graph.
        """
        reducer = self.reducer
        params = reducer.params
        strs = {
            "backend_name": dist.get_backend(self.process_group),
            "module_name": type(self.module).__name__,
            "device_ids": ", ".join(map(str, self.device_ids or [])),
            "dtypes": ", ".join(sorted({_DTYPE_NAMES.get(p.dtype, str(p.dtype).split(".")[-1])
                                        for p in params})),
            "bucket_sizes": ", ".join(str(sum(params[i].numel() * params[i].element_size()
                                              for i in bucket.members))
                                      for bucket in reducer.buckets),
        }
        for key, var in (("master_addr", "MASTER_ADDR"), ("master_port", "MASTER_PORT"),
                         ("torch_distributed_debug", "TORCH_DISTRIBUTED_DEBUG"),
                         ("cuda_visible_devices", "CUDA_VISIBLE_DEVICES"),
                         ("gloo_socket_ifname", "GLOO_SOCKET_IFNAME"),
                         ("gloo_device_transport", "GLOO_DEVICE_TRANSPORT")):
            strs[key] = os.environ.get(var, "N/A")
        if reducer.comm_hook is not None:  # torch: the hook's __qualname__, once registered
            hook = reducer.comm_hook
            strs["comm_hook"] = reducer.comm_hook_name or getattr(
                hook, "__qualname__", type(hook).__qualname__)
        output_device = self.output_device
        ints = {
            "world_size": self.process_group.size(),
            "rank": self.process_group.rank(),
            "output_device": -1 if output_device is None else (
                output_device if isinstance(output_device, int)
                else torch.device(output_device).index),
            "broadcast_buffers": int(self.broadcast_buffers),
            "bucket_cap_bytes": self.bucket_bytes_cap,
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "is_multi_device_module": int(len({p.device for p in params}) > 1),
            "has_sync_bn": int(any(isinstance(m, nn.SyncBatchNorm)
                                   for m in self.module.modules())),
            "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
        }
        if self.static_graph:
            ints["static_graph"] = 1
        if reducer.sampled["iteration"] > 0:
            ints |= reducer.sampled
        else:
            ints["iteration"] = 0
        if self.find_unused_parameters and not self.static_graph and not reducer.graph_static:
            ints["can_set_static_graph"] = 0
        if self._uneven_input_join:  # a Join was built with this DDP (join.py)
            ints["join_uneven_inputs"] = 1
        if reducer.last_error is not None:  # as torch's logger, once DDP raised
            strs["error"], ints["has_error"] = reducer.last_error, 1
        return {**strs, **ints}

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Sample `_get_ddp_logging_data()`'s runtime figures every `sample_rate` iterations
        after the first 10 (torch's default: 100)."""
        if sample_rate < 1:
            raise ValueError(f"sample_rate={sample_rate}: DDP runtime logging sample rate should "
                             "be equal or greater than 1")
        self.reducer.sample_rate = sample_rate

    def _register_builtin_comm_hook(self, comm_hook_type: dist.BuiltinCommHookType) -> None:
        """torch's C++ hooks, ALLREDUCE and FP16_COMPRESS, as the Python hooks of the same name
        in torch's `DDPCommHookType` (the same arithmetic: divide by the group size,
        all-reduce; fp16 in transit for FP16_COMPRESS)."""
        from torch.distributed.algorithms.ddp_comm_hooks import (
            DDPCommHookType,
            register_ddp_comm_hook,
        )

        name = getattr(comm_hook_type, "name", None)
        if name not in ("ALLREDUCE", "FP16_COMPRESS"):
            raise ValueError(f"comm_hook_type={comm_hook_type!r}: the built-in hooks are "
                             "ALLREDUCE and FP16_COMPRESS (torch.distributed.BuiltinCommHookType)")
        register_ddp_comm_hook(DDPCommHookType[name], self, state=self.process_group)
        self.reducer.comm_hook_name = str(comm_hook_type)

    def _remove_autograd_hooks(self) -> None:
        """Remove the gradient hooks this wrapper put on the module's parameters (torch's: so a
        new DDP can wrap the same module after a backward of this one failed)."""
        self.reducer.remove_hooks()
