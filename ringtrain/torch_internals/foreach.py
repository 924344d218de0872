"""torch's foreach ops: many tensors in one call (ringtrain.checkpoint's host copy).

- `copy_tensors`: a snapshot's ~500 storage copies (device staging in the step, the writer's
  copies to the host) queued as one `torch._foreach_copy_` call instead of one Python call each
  (~10 us apiece, and each a hand-over of the GIL on the writer's thread); a public loop of
  `copy_` where this torch lacks it (the same bytes, one call per tensor).

Each section says which names its feature needs and what it does without them
(`features.py`: how a name is looked up, a feature switched off).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from ringtrain.torch_internals.features import Feature, TorchFeatureWarning, lookup

# ---- many copies in one call (ringtrain.checkpoint.kept_views) ----------------------------------

_FOREACH_COPY = Feature("copying a snapshot's storages in one batched call "
                        "(ringtrain.checkpoint.kept_views)", None)
_foreach_copy = lookup("torch._foreach_copy_", _FOREACH_COPY)
_refused: list[str] = []  # what torch said when it refused a batch (warned once per process)


def copy_tensors(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor],
                 non_blocking: bool = False, batched: bool = True) -> bool:
    """`dst.copy_(src)` for each pair, in one batched call where this torch can (True), else one
    call per pair (False: `batched` off, the name missing, or torch refused these inputs).

    A refusal (a torch whose foreach copy rejects a device pair or a keyword) is said once per
    process, with torch's words; the per-pair loop then copies everything again, which is safe:
    the sources have not changed in between, and a copy writes the same bytes twice.
    """
    if len(dsts) != len(srcs):
        raise ValueError(f"{len(dsts)} destinations for {len(srcs)} sources: pair them one to one")
    if not dsts:
        return batched
    if batched and _foreach_copy is not None:
        try:
            _foreach_copy(list(dsts), list(srcs), non_blocking=non_blocking)
            return True
        except (RuntimeError, TypeError, NotImplementedError) as e:
            if not _refused:
                _refused.append(str(e))
                warnings.warn(f"torch {torch.__version__}: torch._foreach_copy_ refused a "
                              f"snapshot's copies ({str(e).splitlines()[0]}); they run one "
                              "call per tensor", TorchFeatureWarning, stacklevel=2)
    for dst, src in zip(dsts, srcs, strict=True):
        dst.copy_(src, non_blocking=non_blocking)
    return False


#: This module's features (`ringtrain.torch_internals.FEATURES` lists every one).
FEATURES = [_FOREACH_COPY]
