"""torch.nn's internals: the module classes ringtrain recognises (a BatchNorm, for pipeline's
warning that it normalises over micro-batches).

Where this torch lacks a name, the public classes it covers stand in (nothing is lost).
"""

from __future__ import annotations

import torch

from ringtrain.torch_internals.features import Feature, lookup

# ---- the BatchNorm warning of pipeline stages (ringtrain.pipeline.engine) -----------------------

_BATCHNORM = Feature("warning that BatchNorm normalises over micro-batches (ringtrain.pipeline)",
                     None)
#: The base class of every BatchNorm layer (1d/2d/3d, lazy and sync), for `isinstance`; where
#: this torch lacks it, the public classes it covers.
BatchNorm: type | tuple[type, ...] = lookup("torch.nn.modules.batchnorm._BatchNorm",
                                             _BATCHNORM) or (
    torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm,
    torch.nn.LazyBatchNorm1d, torch.nn.LazyBatchNorm2d, torch.nn.LazyBatchNorm3d)

#: This module's features (`ringtrain.torch_internals.FEATURES` lists every one).
FEATURES = [_BATCHNORM]
