"""Which server holds which parameters: a pure plan, plus packing to and from flat buffers.

    python -c "from ringtrain.ps.sharding import plan_shards; \
print(plan_shards([('w', (1000, 10)), ('b', (10,))], servers=2, split_numel=4000))"

Parameters go to servers balanced by size with the greedy "largest first" rule (LPT
scheduling: place each piece, biggest first, on the least loaded server; its makespan is
within 4/3 of optimal). A tensor with more than `split_numel` elements is first cut into row
chunks along dim 0, as MXNet's kvstore splits arrays above its big-array bound, so one huge
embedding cannot unbalance the servers. Row chunks keep the tensor's rank, so an optimizer
that treats matrices and vectors differently (weight decay on `p.dim() >= 2`) sees the same
kinds, and element-wise optimizers (SGD with momentum, AdamW) give the same numbers split or not.

Each server's pieces are laid out in one flat buffer in parameter order: a worker pushes one
flat gradient buffer per server and pulls one flat parameter buffer back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ringtrain.ranges import even_ranges

DEFAULT_SPLIT_NUMEL = 1 << 20  # ~ MXNet's MXNET_KVSTORE_BIGARRAY_BOUND (1e6 elements)
DEFAULT_BUCKET_NUMEL = 1 << 18  # 1 MB of fp32 per push bucket (DDP's first bucket is 1 MB)


@dataclass(frozen=True)
class Piece:
    """Rows [row_start, row_end) of parameter `name` (all rows when unsplit), held by `server`.

    `offset` is where the piece starts in its server's flat buffer.
    """

    name: str
    server: int
    row_start: int
    row_end: int
    shape: tuple[int, ...]  # the piece's own shape
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ShardPlan:
    """Pieces of every parameter, grouped per server in flat-buffer order."""

    servers: int
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # every parameter, in model order
    pieces: tuple[Piece, ...]

    def for_server(self, server: int) -> tuple[Piece, ...]:
        if not 0 <= server < self.servers:
            raise ValueError(f"server {server} is not in [0, {self.servers - 1}]")
        return tuple(p for p in self.pieces if p.server == server)

    def server_numel(self, server: int) -> int:
        return sum(p.numel for p in self.for_server(server))

    def loads(self) -> list[int]:
        """Elements held by each server."""
        return [self.server_numel(s) for s in range(self.servers)]


def plan_shards(shapes: Sequence[tuple[str, Sequence[int]]], servers: int,
                split_numel: int | None = DEFAULT_SPLIT_NUMEL) -> ShardPlan:
    """Assign parameters (or row chunks of large ones) to `servers` servers, balanced by numel.

    Args:
        shapes: (name, shape) of every parameter, in model order (e.g. from `named_parameters`).
        servers: number of server ranks, at least 1.
        split_numel: tensors with more elements than this are cut into
            ceil(numel / split_numel) row chunks (at most one per row); None never splits.

    Ties (equal sizes, equal loads) break by model order and lowest server index, so every
    rank computes the same plan from the same shapes.
    """
    if not isinstance(servers, int) or servers < 1:
        raise ValueError(f"servers={servers!r}: a parameter server job needs at least 1 server")
    if split_numel is not None and split_numel < 1:
        raise ValueError(f"split_numel={split_numel}: use a positive element count, or None to "
                         "keep every tensor whole")
    names = [name for name, _ in shapes]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"parameter names must be unique; repeated: {dup}")
    norm = tuple((name, tuple(int(d) for d in shape)) for name, shape in shapes)

    # Candidate pieces: (name, row_start, row_end, shape), in model order.
    candidates: list[tuple[str, int, int, tuple[int, ...]]] = []
    for name, shape in norm:
        numel = math.prod(shape)
        rows = shape[0] if shape else 1
        chunks = 1
        if split_numel is not None and shape and numel > split_numel:
            chunks = min(rows, math.ceil(numel / split_numel))
        for start, end in even_ranges(rows, chunks):
            piece_shape = (end - start, *shape[1:]) if shape else ()
            candidates.append((name, start, end, piece_shape))

    # LPT: biggest first (stable, so equal sizes keep model order), onto the least loaded server.
    order = sorted(range(len(candidates)), key=lambda i: -math.prod(candidates[i][3]))
    loads = [0] * servers
    owner = [0] * len(candidates)
    for i in order:
        server = min(range(servers), key=lambda s: (loads[s], s))
        owner[i] = server
        loads[server] += math.prod(candidates[i][3])

    # Lay each server's pieces out in model order.
    offsets = [0] * servers
    pieces = []
    for i, (name, start, end, piece_shape) in enumerate(candidates):
        s = owner[i]
        pieces.append(Piece(name, s, start, end, piece_shape, offsets[s]))
        offsets[s] += math.prod(piece_shape)
    return ShardPlan(servers, norm, tuple(pieces))


def piece_view(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The rows of `tensor` (a whole parameter or its gradient) that `piece` covers."""
    if tensor.dim() == 0:
        return tensor
    return tensor[piece.row_start:piece.row_end]


def pack(tensors: Mapping[str, torch.Tensor | None], pieces: Sequence[Piece],
         out: torch.Tensor) -> torch.Tensor:
    """Copy each piece of `tensors` (by name) into the flat buffer `out`; None packs zeros."""
    for p in pieces:
        dst = out[p.offset:p.offset + p.numel]
        src = tensors[p.name]
        if src is None:  # a parameter that got no gradient this step
            dst.zero_()
        else:
            dst.copy_(piece_view(src, p).reshape(-1))
    return out


def unpack(flat: torch.Tensor, pieces: Sequence[Piece],
           into: Mapping[str, torch.Tensor]) -> None:
    """Copy each piece from the flat buffer into the matching rows of `into[name]`."""
    for p in pieces:
        piece_view(into[p.name], p).copy_(flat[p.offset:p.offset + p.numel].view(p.shape))


def bucket_bounds(pieces: Sequence[Piece], cap_numel: int) -> list[tuple[int, int]]:
    """Cut a server's flat buffer into [start, end) buckets of whole pieces, in flat order.

    A bucket closes before the piece that would take it past `cap_numel` (a piece larger
    than the cap is a bucket of its own). A worker sends each bucket as soon as its pieces'
    gradients are ready, so smaller buckets start sending earlier in backward.
    """
    if cap_numel < 1:
        raise ValueError(f"bucket cap {cap_numel}: use a positive element count")
    bounds: list[tuple[int, int]] = []
    start = size = 0
    for p in pieces:
        if size and size + p.numel > cap_numel:
            bounds.append((start, start + size))
            start, size = start + size, 0
        size += p.numel
    if size:
        bounds.append((start, start + size))
    return bounds


def piece_views(flat: torch.Tensor, pieces: Sequence[Piece]) -> list[torch.Tensor]:
    """Views of `flat` shaped like each piece (a server's parameters share its flat buffer)."""
    return [flat[p.offset:p.offset + p.numel].view(p.shape) for p in pieces]
