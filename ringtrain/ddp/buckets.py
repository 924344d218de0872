"""Which gradients travel together: the bucket plan, and the bucket a comm hook receives.

Planning is pure (sizes in, index lists out) so it is unit-tested without processes:

    .venv/bin/pytest -q tests/test_ddp.py -k bucket
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# torch's reducer makes the first bucket small (dist._DEFAULT_FIRST_BUCKET_BYTES, 1 MiB) so the
# first all-reduce starts early in backward instead of waiting for 25 MiB of gradients.
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25

# A gradient at least this large is a bucket of its own and is all-reduced in place, in its
# `.grad`, with no copy into a flat buffer and back. Coalescing exists to amortise the fixed cost
# of one collective over many small tensors; on gloo that cost is ~0.1-0.3 ms, while copying 1 MiB
# in and out costs about as much, so beyond this size the two copies are pure loss. On CUDA
# copies are nearly free and launches are not, so there only tensors past the cap go alone, as
# in torch.
SOLO_BYTES_CPU = 1024 * 1024


def assign_buckets(
    sizes: Sequence[int],
    keys: Sequence[Hashable],
    *,
    bucket_cap_bytes: int,
    first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
    solo_bytes: int | None = None,
    order: Sequence[int] | None = None,
    bucket_caps: Sequence[int] | None = None,
) -> list[list[int]]:
    """Group parameter indices into buckets, in the order their gradients should be reduced.

    Args:
        sizes: gradient bytes of each parameter, in registration order.
        keys: a bucket holds one kind only (dtype, device); parameters with different keys
            never share a bucket.
        bucket_cap_bytes: a bucket is closed once it holds at least this many bytes.
        first_bucket_bytes: the cap of the first bucket of each key (small, to start early).
        solo_bytes: parameters at least this large get a bucket of their own; None: never.
        order: the order in which gradients are produced, when it is known (observed in a
            backward). Default: reverse registration order, the last layer's gradients first,
            which is right for most models.
        bucket_caps: per-bucket caps instead of the two above (torch's bucket_cap_mb_list):
            the k-th bucket of a kind closes at bucket_caps[k], the last entry repeating.

    Buckets are filled walking the parameters in that order and sorted by the position of their
    last member: the order in which they become ready. Within a bucket, members keep the
    walking order.
    """
    if len(sizes) != len(keys):
        raise ValueError(f"sizes has {len(sizes)} entries but keys has {len(keys)}")
    if bucket_cap_bytes <= 0:
        raise ValueError(f"bucket_cap_bytes={bucket_cap_bytes}: it must be positive")
    n = len(sizes)
    walk = list(reversed(range(n))) if order is None else list(order)
    if sorted(walk) != list(range(n)):
        raise ValueError(f"order={walk} is not a permutation of the {n} parameter indices")
    position = {i: step for step, i in enumerate(walk)}
    open_buckets: dict[Hashable, list[int]] = {}
    open_bytes: dict[Hashable, int] = {}
    closed_count: dict[Hashable, int] = {}
    buckets: list[list[int]] = []
    for i in walk:
        if solo_bytes is not None and sizes[i] >= solo_bytes:
            buckets.append([i])
            continue
        key = keys[i]
        bucket = open_buckets.setdefault(key, [])
        bucket.append(i)
        open_bytes[key] = open_bytes.get(key, 0) + sizes[i]
        closed = closed_count.get(key, 0)
        if bucket_caps:
            cap = bucket_caps[min(closed, len(bucket_caps) - 1)]
        else:
            cap = first_bucket_bytes if closed == 0 else bucket_cap_bytes
        if open_bytes[key] >= cap:
            buckets.append(bucket)
            closed_count[key] = closed_count.get(key, 0) + 1
            del open_buckets[key]
            open_bytes[key] = 0
    buckets.extend(b for b in open_buckets.values() if b)
    # A bucket is ready when its last member (in walking order) is; sorting is stable.
    buckets.sort(key=lambda b: max(position[i] for i in b))
    return buckets


# Small integer counts (how many ranks missed a parameter) stay exact in a float sum up to the
# largest integer the format holds exactly: the unused-parameter status may ride in such a bucket.
_EXACT_COUNTS = {torch.float32: 2**24, torch.float64: 2**53, torch.float16: 2048,
                 torch.bfloat16: 256}


def status_carrier_last(plan: list[list[int]], sizes: Sequence[int], dtypes: Sequence[torch.dtype],
                        *, world_size: int, solo_bytes: int | None,
                        max_delay_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
                        ) -> tuple[list[list[int]], bool]:
    """Pick the bucket whose all-reduce also carries the unused-parameter status, and put it last.

    The status (which parameters got no gradient on which rank) is final only once every
    gradient is staged, so it can only travel with the last bucket launched. torch sends its
    `local_used_map` in an all-reduce of its own, and only with find_unused_parameters=True;
    riding along with a bucket costs nothing, so ringtrain checks every synced backward for the
    same number of collectives as torch's DDP without the check (one per bucket). The carrier is
    a bucket whose dtype sums `world_size` exactly and that is copied into a flat buffer anyway
    (not a solo gradient reduced in place in `.grad`): the last such bucket of the plan if it is
    last already, or if it is small (at most `max_delay_bytes`), so that launching it after the
    others delays little. Returns (plan, True) with the carrier last, or (plan, False) when no
    bucket qualifies: the status then goes in a small all-reduce of its own.
    """
    def can_carry(members: list[int]) -> bool:
        exact = _EXACT_COUNTS.get(dtypes[members[0]], 0) >= world_size
        solo = len(members) == 1 and solo_bytes is not None and sizes[members[0]] >= solo_bytes
        return exact and not solo

    for k in reversed(range(len(plan))):
        if can_carry(plan[k]):
            if k == len(plan) - 1:
                return plan, True
            if sum(sizes[i] for i in plan[k]) <= max_delay_bytes:
                return plan[:k] + plan[k + 1:] + [plan[k]], True
            break
    return plan, False


@dataclass(eq=False)
class Bucket:
    """One bucket's layout and this round's state (owned by the `Reducer`)."""

    index: int
    members: list[int]  # parameter indices, in expected gradient order
    views: list[torch.Tensor]  # per-member views into `payload`, shaped like the parameters
    flat: torch.Tensor  # coalesced storage: payload, then the status tail (if any)
    payload: torch.Tensor  # the gradients part of `flat`; a solo bucket uses it only as a fallback
    tail: torch.Tensor | None = None  # status slots riding along with this bucket's all-reduce
    pending: int = 0  # members not yet staged this round
    buffer: torch.Tensor | None = None  # the gradients this round's collective reduces
    in_place: bool = False  # buffer is the (solo) parameter's .grad itself
    scale_after: float | None = None  # averaging left for after the all-reduce
    tail_sent: bool = False  # the status tail went out with this round's all-reduce
    work: Any = None  # dist.Work of the default all-reduce
    fut: torch.futures.Future | None = None  # a comm hook's result
    gradients: list[torch.Tensor] = field(default_factory=list)

    @property
    def solo(self) -> bool:
        """One gradient reduced in place in its `.grad` (no copy), not through `flat`."""
        return len(self.members) == 1 and self.tail is None


def build_buckets(params: Sequence[torch.Tensor], plan: list[list[int]],
                  status_slots: int = 0) -> list[Bucket]:
    """Allocate the flat buffer of each bucket of `plan` and the per-parameter views into it.

    With `status_slots`, the last bucket gets that many extra elements (the plan's status
    carrier, see `status_carrier_last`), and is coalesced even with one member: the reducer
    sends per-parameter "got no gradient" flags in them, saving a collective per backward.
    """
    buckets = []
    for index, members in enumerate(plan):
        first = params[members[0]]
        extra = status_slots if index == len(plan) - 1 else 0
        coalesced = len(members) > 1 or extra > 0
        # Solo buckets reduce .grad in place; their flat buffer is only a fallback (for a
        # non-contiguous or stale gradient), allocated when first needed.
        numel = sum(params[i].numel() for i in members) if coalesced else 0
        flat = torch.empty(numel + extra, dtype=first.dtype, device=first.device)
        payload = flat[:numel]
        views, offset = [], 0
        if coalesced:
            for i in members:
                views.append(payload[offset:offset + params[i].numel()].view(params[i].shape))
                offset += params[i].numel()
        buckets.append(Bucket(index, members, views, flat, payload,
                              tail=flat[numel:] if extra else None, pending=len(members)))
    return buckets

def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


def stage(bucket: Bucket, slot: int, p: torch.Tensor, grad: torch.Tensor | None, *, used: bool,
          hot: bool, scale: float | None, as_view: bool) -> None:
    """Put parameter `p`'s gradient (slot `slot` of `bucket`) where the bucket's collective
    reads it.

    `scale`: 1 / world_size when averaging here (None: a comm hook averages); `hot`: called
    from backward, the gradient still in cache; `as_view`: gradient_as_bucket_view.
    """
    if bucket.solo:
        if (used and grad is not None and grad.layout == torch.strided
                and grad.dtype == p.dtype and grad.is_contiguous()):
            buffer = grad.view(-1)  # reduce .grad itself: no copy in, no copy out
            if scale is not None and (hot or buffer.element_size() < 4):
                # Divide now: in backward the gradient was just written by its matmul and
                # is still in cache, so this pass is cheap; 16-bit gradients are always
                # divided first, or their sum may overflow.
                buffer.mul_(scale)
            else:
                # A cold fp32/fp64 gradient (sync_gradients(), or accumulated under
                # no_sync): divide after the sum, where the scaling of one bucket overlaps
                # the buckets still in flight.
                bucket.scale_after = scale
            bucket.buffer, bucket.in_place, bucket.gradients = buffer, True, [grad]
            return
        if bucket.payload.numel() != p.numel():
            bucket.flat = bucket.payload = torch.empty(p.numel(), dtype=p.dtype, device=p.device)
            bucket.views = [bucket.payload.view(p.shape)]
    view = bucket.views[slot]
    if grad is None:
        view.zero_()
    elif same_tensor(grad, view):  # already a bucket view (gradient_as_bucket_view)
        if scale is not None:
            view.mul_(scale)
    elif scale is not None:
        # Detached: under backward(create_graph=True) the gradient requires grad, and an out=
        # op refuses it; the collective is not differentiated anyway (torch copies too).
        torch.mul(grad.detach(), scale, out=view)
    else:
        view.copy_(grad.detach())
    if as_view and used and grad is not None:
        p.grad = view
    bucket.buffer, bucket.in_place, bucket.gradients = bucket.payload, False, bucket.views


def write_back(buckets: Sequence[Bucket], params: Sequence[torch.Tensor], globally_unused: set[int],
               *, as_view: bool) -> None:
    """Copy each bucket's averaged gradients into `.grad` (in-place buckets are there already)."""
    for bucket in buckets:
        if bucket.in_place:
            continue  # the collective already wrote into .grad
        for slot, i in enumerate(bucket.members):
            if i in globally_unused:
                continue  # torch leaves the .grad of a parameter no rank used untouched
            p, view = params[i], bucket.views[slot]
            if as_view:
                p.grad = view
            elif p.grad is None:
                p.grad = torch.empty_like(p).copy_(view)  # keeps the parameter's strides
            elif not same_tensor(p.grad, view):
                p.grad.copy_(view)


class CommHookError(TypeError, RuntimeError):
    """A comm hook returned something else than a Future of the averaged bucket (a RuntimeError
    too: torch raises one for the same mistake)."""


def check_hook(hook: Any) -> None:
    """What torch's DDP checks when a comm hook is registered (same types, same messages)."""
    if not callable(hook):
        raise TypeError(f"Communication hook must be callable. Got hook={hook!r}: pass a "
                        "function hook(state, bucket) -> torch.futures.Future[torch.Tensor]")
    try:
        sig = inspect.signature(hook)
    except (TypeError, ValueError):
        return  # a builtin without a signature: nothing to check
    bucket = sig.parameters.get("bucket")
    # String annotations (`from __future__ import annotations`) are read by name.
    if bucket is not None and not _is_annotation(bucket.annotation, GradBucket, "GradBucket"):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    if not _is_annotation(sig.return_annotation, torch.futures.Future[torch.Tensor], "Future"):
        raise ValueError("Communication hook: return annotation should be "
                         "torch.futures.Future[torch.Tensor].")


def _is_annotation(annotation: Any, expected: Any, name: str) -> bool:
    if annotation is inspect.Parameter.empty or annotation is Any or annotation == expected:
        return True
    if isinstance(annotation, str):
        return name in annotation or annotation in ("Any", "typing.Any")
    if name == "GradBucket":
        return annotation in (dist.GradBucket, GradBucket)
    return False


def call_hook(hook: Any, state: Any, bucket: Bucket, params: list[torch.nn.Parameter], *,
              is_last: bool) -> torch.futures.Future:
    """Run comm hook `hook(state, GradBucket)` on `bucket`'s staged gradients; its future,
    checked."""
    grad_bucket = GradBucket(bucket.index, bucket.buffer, bucket.gradients, params, is_last=is_last)
    fut = hook(state, grad_bucket)
    if not callable(getattr(fut, "wait", None)):  # Future.then() gives a torch._C.Future
        raise CommHookError(
            f"comm hook {getattr(hook, '__name__', hook)!r} returned "
            f"{type(fut).__name__}; a comm hook must return a torch.futures.Future whose value "
            f"is the averaged bucket tensor ({bucket.buffer.numel()} elements)"
        )
    return fut


def hook_result(value: Any, buffer: torch.Tensor, hook: Any, index: int) -> torch.Tensor:
    """The averaged buffer a comm hook's Future gave, checked, flattened like `buffer`."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.Tensor) or value.numel() != buffer.numel():
        got = (f"a tensor of {value.numel()} elements" if isinstance(value, torch.Tensor)
               else type(value).__name__)
        raise CommHookError(
            f"comm hook {getattr(hook, '__name__', hook)!r}: its Future gave {got} for bucket "
            f"{index}; it must give one tensor of the bucket's {buffer.numel()} elements (the "
            "averaged `bucket.buffer()`)"
        )
    return value.reshape(-1)


class GradBucket:
    """What a comm hook receives: the methods of `torch.distributed.GradBucket`.

    `buffer()` is one flat 1-D tensor holding the gradients of `parameters()`; `gradients()`
    are views into it shaped like the parameters. A hook returns a `torch.futures.Future` whose
    value is a tensor of `buffer()`'s size (or a one-element list of it): the averaged gradients.
    torch's own hooks (`allreduce_hook`, `fp16_compress_hook`, `fp16_compress_wrapper`,
    PowerSGD) run unchanged against it.
    """

    __slots__ = ("_index", "_buffer", "_gradients", "_parameters", "_is_last")

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        gradients: list[torch.Tensor],
        parameters: list[torch.nn.Parameter],
        is_last: bool,
    ):
        self._index = index
        self._buffer = buffer
        self._gradients = gradients
        self._parameters = parameters
        self._is_last = is_last

    def index(self) -> int:
        """Position in the reduction order; 0 is reduced first."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat gradients of this bucket (1-D)."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Per-parameter views into the original buffer, shaped like `parameters()`."""
        return self._gradients

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._parameters

    def is_last(self) -> bool:
        """Whether this is the last bucket reduced in the iteration."""
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the tensor `buffer()` returns (torch's compression wrappers use this)."""
        self._buffer = buffer

    def __repr__(self) -> str:
        return (f"GradBucket(index={self._index}, numel={self._buffer.numel()}, "
                f"dtype={self._buffer.dtype}, params={len(self._parameters)}, "
                f"is_last={self._is_last})")

