"""Named store keys: objects that must match across ranks take their keys from a caller's name.

    claim_key(store, "ringtrain/watchdog/local/0/train", rank, "Watchdog", "train")

A `Watchdog`, a `SnapshotManager` or a `Membership` talks to its peers on other ranks through
keys in the rendezvous store, so rank r's object must find rank s's under the same key. The key
comes from a name the caller gives (`Watchdog(name="train")`, `Membership.of(runtime,
"trainer")`), never from how many such objects this process made before: a per-process counter
agrees across ranks only while every rank builds every object in the same order.

Two objects of one process that would use the same keys (the same name, on the same store, for
the same rank) would read each other's keys, or a finished one's stale keys, without a word:
`claim_key` makes the second one raise instead. A key is held for as long as its store lives
(a new process group's store starts with every name free), never released earlier: the first
object's keys stay in the store after it is done. Tests:
`.venv/bin/pytest -q tests/test_store_keys.py`.

"""

from __future__ import annotations

import weakref

import torch.distributed as dist

# store -> (key, rank) pairs claimed on it by this process. Weak: a store that is gone (a
# destroyed process group's) takes its claims with it.
_claimed: weakref.WeakKeyDictionary[dist.Store, set[tuple[str, int]]] = weakref.WeakKeyDictionary()


def claim_key(store: dist.Store, key: str, rank: int, what: str, name: str) -> None:
    """Reserve `key` on `store` for `rank`'s `what` in this process; ValueError if already taken.

    Args:
        store: the store the keys live in, as the caller got it (before any clone).
        key: the object's key prefix, its name included.
        rank: the rank the object speaks for (a test may play several ranks in one process).
        what, name: the class and the caller's name, for the message.
    """
    taken = _claimed.setdefault(store, set())
    if (key, rank) in taken:
        raise ValueError(
            f"a {what} named {name!r} (store keys {key!r}) already exists for rank {rank} in this "
            f"process: two would read each other's keys; pass a distinct name= to the second one")
    taken.add((key, rank))
