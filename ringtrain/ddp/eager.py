"""What torch.compile must run as written, not trace: a wrapper's bookkeeping around the module.

    syncs = eager(self._before_module)()   # in a wrapper's forward
    module.register_forward_pre_hook(functools.partial(call_eagerly, _pre_forward, ref, k))

`torch.compile(wrapper)` (torch's spelling of a compiled DDP or FSDP) traces the wrapper's
forward and every module hook it reaches. The wrappers' bookkeeping there (DDP's reducer
counters and flags; ZeRO's gathers, frees and the tensor hooks it registers for backward) is
not a computation to put in a graph: traced, DDP's counters became guards that changed every
step (a recompile per step up to dynamo's limit, 8, with warnings), and ZeRO 3's backward hook,
a partial holding a weakref, was rebuilt with the module in its place (its backward called the
module). `torch.compiler.disable` makes dynamo break the graph at each such call and run it
eagerly; the user's module between them is traced. Outside a trace both are the plain call and
import nothing (torch._dynamo takes about a second to import).
Tests: tests/test_compile_wrappers.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def eager(fn: Callable) -> Callable:
    """`fn`, or under a torch.compile trace `fn` run eagerly (a graph break)."""
    return torch.compiler.disable(fn) if torch.compiler.is_compiling() else fn


def call_eagerly(fn: Callable, *args: Any) -> Any:
    """`fn(*args)`, eagerly under a torch.compile trace: for hooks (`functools.partial`)."""
    return eager(fn)(*args)
