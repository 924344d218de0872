"""`static_graph=True`: the parameters each rank uses may not change after the first backward.

torch's DDP with `static_graph=True` records in the first synced backward which parameters got a
gradient and plans the later iterations on it, so a graph that changes afterwards is an error
there: a parameter unused in the first iteration that gets a gradient ("Your training graph
has changed in this iteration"), or one used in the first that gets none ("Expected to have
finished reduction in the prior iteration ..."). ringtrain's reducer would average either case
correctly (it treats static_graph as find_unused_parameters=True), but a drop-in must refuse what
torch refuses, with the same exception type and words, so code written against one behaves the
same against the other.

The check reads the status every synced backward already exchanges (`unused_params.py`): how
many ranks missed each parameter. A change of those counts from the first iteration's is seen
by every rank at once, so the error is raised on all ranks in the same backward (torch raises
it on the rank that changed, and the others wait in their next collective); each rank's message
names the parameters that changed on it. A change that keeps every count (two ranks swapping
which one uses a parameter) goes unnoticed; it cannot make ringtrain's averages wrong. As in
torch, whose reducer is left with an unfinished iteration, the next synced forward after such an
error raises too ("Expected to have finished reduction in the prior iteration ...").
Tests: `.venv/bin/pytest -q tests/test_ddp_static_graph.py`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ringtrain.ddp.unused_params import short_list

# torch's words (its reducer's REDUCER_CHECK messages), so that code matching them keeps working.
NEWLY_USED = ("Your training graph has changed in this iteration, e.g., one parameter is unused "
              "in first iteration, but then got used in the second iteration. this is not "
              "compatible with static_graph set to True.")
NEWLY_UNUSED = ("Expected to have finished reduction in the prior iteration before starting a "
                "new one. This error indicates that your training graph has changed in this "
                "iteration, e.g., one parameter is used in first iteration, but then got unused "
                "in the second iteration. this is not compatible with static_graph set to True.")
_FIX = ("static_graph=True needs every rank to use the same parameters in every synced backward "
        "as in its first; if the set of used parameters changes between iterations, wrap with "
        "static_graph=False and find_unused_parameters=True.")


class StaticGraphError(RuntimeError):
    """A synced backward under static_graph=True used other parameters than the first one."""


def set_static_graph(ddp: Any) -> None:
    """torch's private `DistributedDataParallel._set_static_graph()`: static_graph=True, late.

    Frameworks call it (Lightning's `static_graph` option, torch's own tests); as in torch it
    must come before the first synced forward, and is a warning when the graph is static already.
    """
    if ddp.static_graph:
        warnings.warn("You've set static_graph to be True, no need to set it again.", stacklevel=3)
        return
    reducer = ddp.reducer
    if reducer.num_iterations:
        reducer.last_error = (  # torch's words; torch's DDP logging reports it
            "set_static_graph() should be called before training loop starts and after "
            f"DistributedDataParallel is constructed; {reducer.num_iterations} synced forward(s) "
            "ran already: call _set_static_graph() right after wrapping, or pass "
            "static_graph=True to the constructor")
        raise StaticGraphError(reducer.last_error)
    ddp.static_graph = True
    reducer.find_unused_parameters = True  # static_graph implies it (see the constructor)
    reducer.static_graph = StaticGraphCheck(reducer.names, reducer.rank)


class StaticGraphCheck:
    """Compares each synced backward's unused-parameter counts with the first one's.

    Args:
        names: the reducer's parameter names, in its order.
        rank: this rank, for messages.
    """

    def __init__(self, names: Sequence[str], rank: int):
        self.names, self.rank = list(names), rank
        self._first_counts: list[int] | None = None
        self._first_mine: set[int] = set()
        self._failed: list[int] | None = None  # what changed here in a backward that raised

    def before_round(self) -> None:
        """Called by a synced forward: raise once after a backward that raised."""
        if self._failed is not None:
            here, self._failed = self._failed, None
            raise StaticGraphError(self._unfinished(here) + (
                f"\nrank {self.rank}: the previous synced backward raised because the training "
                f"graph changed; it was not averaged. {_FIX}"))

    def _unfinished(self, here: list[int]) -> str:
        return (f"{NEWLY_UNUSED}\nParameter indices which did not receive grad for rank "
                f"{self.rank}: {' '.join(map(str, here))}")

    def check(self, status: torch.Tensor, mine: Sequence[int]) -> None:
        """Raise `StaticGraphError` if this backward's counts differ from the first one's.

        Args:
            status: the summed status of this backward (per parameter: ranks that missed it).
            mine: the parameters this rank missed in this backward.
        """
        n = len(self.names)
        counts = [round(v) for v in status[:n].tolist()]
        if self._first_counts is None:
            self._first_counts, self._first_mine = counts, set(mine)
            return
        if counts == self._first_counts:
            return
        first = self._first_counts
        now_used = [i for i in range(n) if counts[i] < first[i]]
        mine_now = set(mine)
        if now_used:
            here = sorted(self._first_mine - mine_now)
            head, what = NEWLY_USED, "now got a gradient, having got none in the first iteration"
        else:
            here = sorted(mine_now - self._first_mine)
            head = self._unfinished(here)
            what = "got no gradient, having got one in the first iteration"
        self._failed = here
        changed = now_used or [i for i in range(n) if counts[i] > first[i]]
        where = (f"on rank {self.rank}, {short_list([self.names[i] for i in here])} {what}"
                 if here else
                 f"rank {self.rank}'s parameters did not change; on other ranks "
                 f"{short_list([self.names[i] for i in changed])} did")
        raise StaticGraphError(f"{head}\nrank {self.rank}: {where}. {_FIX}")
