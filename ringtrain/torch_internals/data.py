"""torch.utils.data's internals: how many batches a DataLoader iterator has handed out.

A DataLoader with workers draws a sampler's indices ahead of use (`prefetch_factor` batches per
worker), so a `DistributedSampler` that counts the indices drawn is ahead of the training loop,
and a state saved mid-epoch would skip the prefetched samples on resume. The sampler finds the
DataLoader iterator that drives it (`driving_loader`, once per epoch, from its caller's frames)
and asks it for the batches it yielded (`samples_handed_out`), which is what the loop used.

Where this torch lacks a name, the sampler counts the indices drawn, as before, and warns once
that `state_dict(consumed=...)` is then needed with workers.
"""

from __future__ import annotations

import sys
from typing import Any

from ringtrain.torch_internals.features import Feature, lookup, set_by_init

_LOADER = Feature(
    "DistributedSampler.state_dict() counting the batches a DataLoader handed out, not the "
    "indices its workers prefetched (ringtrain.data.sampler)",
    "DistributedSampler.state_dict() counts the indices a DataLoader's workers prefetched: "
    "with num_workers > 0 pass consumed= (batches taken this epoch x batch size), or a resume "
    "skips them")
_ITER = lookup("torch.utils.data.dataloader._BaseDataLoaderIter", _LOADER)
for _name in ("_num_yielded", "_index_sampler"):
    set_by_init(_ITER, _name, _LOADER)


def driving_loader(depth: int = 6) -> Any | None:
    """The DataLoader iterator whose call is starting the caller's iteration (the caller is a
    sampler's `__iter__`), or None: the sampler is iterated by hand, or this torch lacks the
    names. BatchSampler's generator sits between them: a few frames up at most."""
    if not _LOADER.on:
        return None
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        if isinstance(frame.f_locals.get("self"), _ITER):
            return frame.f_locals["self"]
        frame = frame.f_back
    return None


def samples_handed_out(loader_iter: Any, sampler: Any) -> int | None:
    """Indices of `sampler` in the batches `loader_iter` has yielded so far (the last batch of
    an epoch may be short: callers take the min with what was drawn), or None where that cannot
    be told: a batch sampler of the user's own, or batches delivered out of order."""
    batches = loader_iter._index_sampler
    if batches is sampler:  # batch_size=None: one sample per "batch"
        size = 1
    elif getattr(batches, "sampler", None) is sampler and isinstance(
            getattr(batches, "batch_size", None), int):  # torch's BatchSampler around it
        size = batches.batch_size
    else:
        return None
    if getattr(loader_iter, "_in_order", True) is False:  # DataLoader(in_order=False)
        return None
    return loader_iter._num_yielded * size


#: This module's features (`ringtrain.torch_internals.FEATURES` lists every one).
FEATURES = [_LOADER]
