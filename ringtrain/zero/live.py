"""The plan behind live ZeRO's redundancy: who holds a copy of whose shard, and who sends what
to rebuild the sharded state over a new set of members (`ringtrain train --strategy zero --live`).

The live step itself is `ringtrain.strategies.zero_live`; this module is its index math, pure
(no process group): `.venv/bin/pytest -q tests/test_zero_live.py`.

- `buddy_offset`: a member's optimizer shard is copied, after every step, to the member
  `offset` ranks on (its *buddy*); a host away where the members span several hosts, so a host
  that loses its link leaves its shards' copies on another.
- `rebuild_plan`: after the members changed, each shard of the last commit's layout (size S)
  comes from one member holding it (its own or a buddy copy); each new rank of W' needs the
  saved ranks `reshard.sources` names. A shard nobody holds (a member and its buddy both lost
  in one recovery) cannot be rebuilt from memory: `ZeroShardsLostError` names them.
- `buddy_part`: what a member keeps of its shard and sends its buddy. Stages 1 and 2: the
  moments only (the parameters are replicated on every member, so the buddy rebuilds that part
  from its own model: `with_params` puts the slice back, so the part loads as a snapshot's part
  does, `ZeroDataParallel.load_shard_state_dicts`). Stage 3: the fp32 parameter shard too, as
  it is saved (no member holds the parameters whole: the shard and its copy are all there is).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ringtrain.zero.reshard import shard_numel, sources


class ZeroShardsLostError(Exception):
    """Shards of the last commit and every copy of them are gone: the job restarts from its
    last snapshot. Not a `RuntimeError` on purpose: the live loop takes those for a failed
    collective and redoes the step, which would fail the same way."""


def buddy_offset(world_size: int, local_world_size: int) -> int:
    """How many ranks on a member's buddy is (0: alone, no copy): `local_world_size` where the
    members span hosts of that many (rank r and r + L are on different hosts), else 1."""
    if world_size < 2:
        return 0
    if 0 < local_world_size < world_size and local_world_size % world_size:
        return local_world_size
    return 1


def holders(held: Sequence[Sequence[int]], size: int, step: int) -> list[int]:
    """For each saved rank of a layout of `size` ranks, the first member holding its part
    (`held[m]`: the saved ranks member m holds, its own and its copies).

    Raises:
        ZeroShardsLostError: naming the saved ranks no member holds.
    """
    out, lost = [], []
    for r in range(size):
        who = next((m for m, parts in enumerate(held) if r in parts), None)
        if who is None:
            lost.append(r)
        out.append(-1 if who is None else who)
    if lost:
        raise ZeroShardsLostError(
            f"the ZeRO optimizer shards of ranks {lost} (of {size}) at the commit of step {step} "
            f"are gone with every copy of them (a member and its buddy lost in one recovery; the "
            f"members left hold {[sorted(p) for p in held]}): nothing in memory can rebuild "
            "them. The job fails so that it restarts from its last snapshot: run the same "
            "command again (with --live-wait S the survivors wait for replacements, and a "
            "second loss after the next step finds the copies made again)")
    return out


def rebuild_plan(held: Sequence[Sequence[int]], size: int, numels: Sequence[int],
                 world_size: int, step: int) -> tuple[list[list[int]], list[tuple[int, int, int]]]:
    """What to move to rebuild the sharded state of a layout of `size` ranks over `world_size`
    members holding `held` (member -> saved ranks it holds).

    Returns:
        needs: member m -> the saved ranks whose parts it loads (`reshard.sources`; a member
            holding only padding still reads one part, for the optimizer's settings).
        moves: (saved rank, from member, to member) for each part a member needs and does not
            hold, in one order every member computes alike (sent one after the other).
    """
    who = holders(held, size, step)
    needs = [sources(numels, size, world_size, m) or [0] for m in range(world_size)]
    moves = [(r, who[r], m) for m in range(world_size) for r in needs[m] if r not in held[m]]
    return needs, moves


def buddy_part(part: Mapping[str, Any]) -> dict[str, Any]:
    """A part (`ZeroDataParallel.shard_state_dict`) as a member keeps it and sends its buddy, in
    host memory: without its parameter slices at stages 1 and 2 (`moments_only`), whole at
    stage 3 (its parameter shard is the only copy of that slice of the model)."""
    if int(part["stage"]) == 3:
        return _to_host(dict(part))
    return moments_only(part)


def moments_only(part: Mapping[str, Any]) -> dict[str, Any]:
    """A part (`ZeroDataParallel.shard_state_dict`) without its parameter slices, in host
    memory: what a buddy is sent at stages 1 and 2 (the parameters are on every member
    already), and what a member keeps of its own (gloo's send/recv take host tensors; a
    commit in host memory costs no accelerator memory). Its tensors are copies: the part's
    moments are the optimizer's live buffers, and a commit must not change with the next step."""
    return _to_host({k: v for k, v in part.items() if k != "shards"})


def _to_host(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        # A copy, never `.cpu()`: on the CPU that returns the same tensor, and a part's moments
        # are the optimizer's own buffers (`zero.state.flat_moments`), which the next step
        # changes in place: a commit that aliased them would restore the failed step's state.
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_host(v) for v in obj)
    return obj


def with_params(part: Mapping[str, Any], flats: Sequence[torch.Tensor]) -> dict[str, Any]:
    """`part` (of saved rank r of `part["world_size"]`) with its parameter slices cut from each
    unit's flat parameters `flats` (unpadded, in the unit's layout): zeros past the end, as the
    padding of a saved shard is. A part that has them (stage 3's) is itself."""
    if "shards" in part:
        return dict(part)
    size, rank = int(part["world_size"]), int(part["rank"])
    shards = []
    for flat, numel in zip(flats, part["numels"], strict=True):
        n = shard_numel(int(numel), size)
        out = torch.zeros(n, dtype=flat.dtype)
        lo, hi = rank * n, min((rank + 1) * n, int(numel))
        if lo < hi:
            out[:hi - lo] = flat[lo:hi].detach().cpu()
        shards.append(out)
    return {**part, "shards": shards}
