"""Reading several saved ranks' parts of one snapshot: a resume on another number of ranks.

A strategy whose state is sharded (ZeRO) names, through `Strategy.reshard_sources`, the saved
ranks whose parts overlap this rank's new share; `Checkpointer.resume` reads their files here
(each checked against the manifest's SHA-256 first) and hands their strategy state to
`Strategy.load_resharded_state_dict`. Files are memory-mapped: a rank pages in only the slices
it copies, not every saved rank's whole part.
"""

from __future__ import annotations

from typing import Any

import torch

from ringtrain.checkpoint.files import Snapshot, SnapshotError, verify


def load_strategy_parts(snapshot: Snapshot, ranks: list[int]) -> dict[int, dict[str, Any]]:
    """Saved rank -> the strategy state in its `rank{r}.pt`, for each of `ranks`."""
    out = {}
    for r in ranks:
        name = f"rank{r}.pt"
        if name not in snapshot.manifest["files"]:
            raise SnapshotError(f"{snapshot.path} has no {name} (saved by world_size="
                                f"{snapshot.metadata.get('world_size')}): a part this rank needs")
        verify(snapshot.path, snapshot.manifest, [name])
        part = torch.load(snapshot.path / name, map_location="cpu", weights_only=True, mmap=True)
        out[r] = part["strategy"]
    return out
