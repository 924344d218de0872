"""torch DDP's private members that torch's own DDP tests reach, given where they are cheap.

torch's `distributed_test.py` calls members of `DistributedDataParallel` and of its C++ reducer
that no documented API offers (docs/ddp_compat.md lists those tests). Each one that costs little
is here, with torch's meaning (torch/nn/parallel/distributed.py, reducer.cpp), as mixins of
`DistributedDataParallel` and `Reducer`:

    member                                          torch's meaning, and ringtrain's
    ddp._register_buffer_comm_hook(state, hook,     `hook(state, {name: buffer})` replaces the
        comm_hook_location=POST_FORWARD)            broadcast of the buffers from rank 0, before
                                                    or after the module runs; futures it returns
                                                    are waited for when the synced backward ends
    ddp._default_broadcast_coalesced(bufs, ...)     that broadcast, for a hook to call
    ddp._build_params_for_reducer()                 (the parameters DDP averages, in the
                                                    reducer's order; whether each gets sparse
                                                    gradients: never, ringtrain refuses them)
    ddp._build_debug_param_to_name_mapping(params)  {index in that list: qualified name}
    ddp._errors_logged()                            torch's `_log_and_throw`: an error DDP raises
                                                    after construction (a bad comm hook, ...) is
                                                    what `_get_ddp_logging_data()` reports as
                                                    `error`, with `has_error`
    ddp._set_ddp_sink_clone(False)                  torch's `_DDPSink` clones the outputs of a
                                                    find_unused_parameters forward so that an
                                                    in-place edit of the loss works; ringtrain
                                                    passes outputs through untouched (no sink,
                                                    never a clone): the flag is only recorded
    reducer._get_local_used_map()                   how many ranks used each parameter in the last
                                                    synced backward (int32; None without
                                                    find_unused_parameters or static_graph)
    reducer._ddp_graph_static()                     whether the set of unused parameters was the
                                                    same in every synced backward so far
    reducer._install_post_backward_futures(futs)    futures the next synced backward waits for

The members that frameworks call are in `framework_members.py`. No private torch name is used
here: torch's `_BufferCommHookLocation` members are accepted by their names.

Tests: `.venv/bin/pytest -q tests/test_ddp_private_members.py` (each against torch's DDP).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.ddp import ignored
from ringtrain.ddp.init_sync import broadcast_coalesced


class BufferCommHookLocation(enum.Enum):
    """Where a buffer comm hook runs; torch's `_BufferCommHookLocation` works the same (by name)."""

    PRE_FORWARD = enum.auto()
    POST_FORWARD = enum.auto()


@dataclass
class BufferCommHook:
    """A registered buffer hook (torch's `_BufferCommHook`, the same field names)."""

    buffer_comm_hook: Callable[[Any, dict[str, torch.Tensor]], Any]
    buffer_comm_hook_state: Any
    buffer_comm_hook_location: BufferCommHookLocation


class BufferHookError(TypeError, AssertionError):
    """A buffer hook that is not callable (torch asserts it; an AssertionError too)."""


def _location(location: Any) -> BufferCommHookLocation:
    name = getattr(location, "name", None)
    if name not in BufferCommHookLocation.__members__:
        raise ValueError(f"comm_hook_location={location!r}: pass PRE_FORWARD or POST_FORWARD of "
                         "ringtrain.ddp.torch_members.BufferCommHookLocation (or torch's "
                         "_BufferCommHookLocation)")
    return BufferCommHookLocation[name]


class ReducerTorchMembers:
    """`reducer._get_local_used_map()`, `_ddp_graph_static()` and
    `_install_post_backward_futures()` (a base class of `Reducer`)."""

    # Set by Reducer.__init__ (graph_static by ReducerFrameworkMembers).
    params: list[nn.Parameter]
    world_size: int
    find_unused_parameters: bool
    graph_static: bool

    _local_used_map: torch.Tensor | None = None
    _post_backward_futures: list[torch.futures.Future] | None = None

    def _note_local_use(self, status: torch.Tensor) -> None:
        """Record a synced round's summed unused-parameter status (finalize.py): per parameter,
        on how many ranks it got no gradient. torch keeps its map only when it looks for
        unused parameters, so does this: three tiny in-place ops per backward, no collective."""
        if not self.find_unused_parameters:
            return
        used = self._get_local_used_map()
        assert used is not None
        # The status holds exact small integers (counts of ranks), whatever its dtype.
        used.copy_(status[: len(self.params)]).neg_().add_(self.world_size)

    def _get_local_used_map(self) -> torch.Tensor | None:
        """Per parameter, how many ranks used it in the last synced backward (int32).

        torch's summed `local_used_map`: a parameter that got a gradient on a rank, in that
        backward or in a `no_sync` step before it, counts for that rank. As torch's, one tensor
        updated in place by each synced backward (zeros before the first), and None without
        find_unused_parameters (or static_graph).
        """
        if not self.find_unused_parameters:
            return None
        if self._local_used_map is None:
            device = self.params[0].device if self.params else None
            self._local_used_map = torch.zeros(len(self.params), dtype=torch.int32, device=device)
        return self._local_used_map

    def _ddp_graph_static(self) -> bool:
        """Whether every synced backward so far left the same parameters unused (torch logs it,
        and `can_set_static_graph` comes from it)."""
        return self.graph_static

    def _install_post_backward_futures(self, futures: Sequence[torch.futures.Future]) -> None:
        """Futures (a buffer hook's) that the end of the next synced backward waits for."""
        if self._post_backward_futures is None:
            self._post_backward_futures = []
        self._post_backward_futures.extend(futures)

    def _wait_post_backward_futures(self) -> None:
        """Wait for the installed futures (finalize.py: after the gradients are averaged, as
        torch's finalize_backward)."""
        futures, self._post_backward_futures = self._post_backward_futures, None
        if futures:
            torch.futures.wait_all(futures)


class DDPTorchMembers:
    """`_register_buffer_comm_hook`, `_default_broadcast_coalesced`, `_build_params_for_reducer`,
    `_build_debug_param_to_name_mapping`, `_set_ddp_sink_clone` (a base class of
    `DistributedDataParallel`)."""

    # Set by DistributedDataParallel.__init__.
    module: nn.Module
    process_group: dist.ProcessGroup
    parameters_to_ignore: set[str]
    broadcast_bucket_size: int
    reducer: Any
    will_sync_module_buffers: Callable[[], bool]

    buffer_hook: BufferCommHook | None = None
    _ddp_sink_clone = True  # torch's default; ringtrain never clones either way

    @contextlib.contextmanager
    def _errors_logged(self) -> Iterator[None]:
        """An error raised inside becomes `_get_ddp_logging_data()`'s `error` (and `has_error`),
        written as torch's `_log_and_throw` writes it: "<class 'TypeError'>: message"."""
        try:
            yield
        except Exception as e:
            self.reducer.last_error = f"{type(e)}: {e}"
            raise

    # ---- buffers -----------------------------------------------------------------------------

    def _register_buffer_comm_hook(
        self, state: Any, hook: Callable[[Any, dict[str, torch.Tensor]], Any],
        comm_hook_location: Any = BufferCommHookLocation.POST_FORWARD,
    ) -> None:
        """Sync the buffers with `hook(state, named_buffers)` instead of broadcasting rank 0's.

        Args:
            state: passed to the hook unchanged (torch's tests pass the DDP module).
            hook: called with `state` and {name: buffer} of the buffers DDP syncs, wherever DDP
                would broadcast them (when `forward_sync_buffers`); it may reduce them any way
                it likes, in place. If it returns futures, the end of the next synced backward
                waits for them (so buffers are synced by the time backward returns).
            comm_hook_location: `PRE_FORWARD` (before the module runs: a hook that returns
                futures must then wait itself before the forward reads the buffers) or
                `POST_FORWARD` (after it; torch's default).
        """
        if not callable(hook):
            raise BufferHookError(f"hook must be callable, got {type(hook).__name__}: pass "
                                  "hook(state, named_buffers) -> None or a list of futures")
        self.buffer_hook = BufferCommHook(hook, state, _location(comm_hook_location))

    def _check_sync_bufs_pre_fwd(self) -> bool:
        """Whether buffers sync before this forward's module runs (torch's name)."""
        return self.will_sync_module_buffers() and (
            self.buffer_hook is None
            or self.buffer_hook.buffer_comm_hook_location is BufferCommHookLocation.PRE_FORWARD)

    def _check_sync_bufs_post_fwd(self) -> bool:
        """Whether buffers sync after this forward's module ran: a POST_FORWARD buffer hook."""
        # The hook first: without one (the usual case) no walk over the module's buffers.
        return (self.buffer_hook is not None
                and self.buffer_hook.buffer_comm_hook_location
                is BufferCommHookLocation.POST_FORWARD and self.will_sync_module_buffers())

    def _run_buffer_hook(self) -> None:
        """Call the buffer hook on the buffers DDP syncs (re-read: a module may reassign one)."""
        hook = self.buffer_hook
        assert hook is not None
        named = {n: b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore}
        futures = hook.buffer_comm_hook(hook.buffer_comm_hook_state, named)
        if futures is not None:
            self.reducer._install_post_backward_futures(futures)

    def _default_broadcast_coalesced(self, bufs: Sequence[torch.Tensor] | None = None,
                                     bucket_size: int | None = None,
                                     authoritative_rank: int = 0) -> None:
        """Broadcast `bufs` (default: the buffers DDP syncs) from `authoritative_rank`, a rank of
        DDP's group, in flat chunks of at most `bucket_size` bytes (default 250 MiB)."""
        if bufs is None:
            bufs = ignored.synced_buffers(self.module, self.parameters_to_ignore)
        with torch.no_grad():
            broadcast_coalesced(list(bufs), authoritative_rank, self.process_group,
                                bucket_size or self.broadcast_bucket_size)

    def _distributed_broadcast_coalesced(self, tensors: Sequence[torch.Tensor], buffer_size: int,
                                         authoritative_rank: int = 0) -> None:
        """torch's other name for the same broadcast (`buffer_size` bytes per chunk)."""
        self._default_broadcast_coalesced(tensors, buffer_size, authoritative_rank)

    # ---- the reducer's parameters --------------------------------------------------------------

    def _build_params_for_reducer(self) -> tuple[list[nn.Parameter], list[bool]]:
        """(the parameters DDP averages, in the reducer's order; for each, whether it gets
        sparse gradients: never here, as the constructor refuses such modules)."""
        params = [p for _, p in ignored.managed_parameters(self.module, self.parameters_to_ignore)]
        return params, [False] * len(params)

    def _build_debug_param_to_name_mapping(self, parameters: Sequence[nn.Parameter]
                                           ) -> dict[int, str]:
        """{index in `parameters`: qualified name}, for the list `_build_params_for_reducer`
        gives. Names as torch writes them: `{module_name}.{param_name}` (so `.weight` for a
        parameter of the root module itself). A ValueError, as torch's, if the list and the
        module's trained parameters differ."""
        with self._errors_logged():
            return self._param_names(parameters)

    def _param_names(self, parameters: Sequence[nn.Parameter]) -> dict[int, str]:
        index = {p: i for i, p in enumerate(parameters)}
        names: dict[int, str] = {}
        for module_name, module in self.module.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                fqn = f"{module_name}.{param_name}"
                if fqn in self.parameters_to_ignore or not param.requires_grad:
                    continue
                if param not in index:
                    raise ValueError(
                        f"Param with name {fqn} found in module parameters, but not DDP "
                        f"parameters: the list of {len(parameters)} parameters passed is not the "
                        "one _build_params_for_reducer() returns")
                names[index[param]] = fqn
        if len(index) != len(names):
            raise ValueError(
                "Expected param to name mapping to cover all parameters, but got conflicting "
                f"lengths: {len(index)} vs {len(names)}: the list passed holds parameters the "
                "module does not train; pass the list _build_params_for_reducer() returns")
        return names

    # ---- outputs --------------------------------------------------------------------------------

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """torch: whether its `_DDPSink` clones a forward's outputs (to let the loss be edited
        in place). ringtrain returns the module's outputs untouched, so they can be edited in
        place either way and nothing is cloned: the value is recorded, with no effect."""
        self._ddp_sink_clone = val
