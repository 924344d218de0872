"""The global batch of every step, and each member's share of it, computed from the step alone.

    batches = GlobalBatches(len(dataset), global_batch_size=12, seed=0)
    ids = batches.share(step, rank, world_size)     # this member's sample ids for `step`

A fault-free run and a run that lost a member must train every step on the same global batch
(exactly once: no sample of a committed step skipped or seen twice). A per-rank sampler cannot
promise it once the members change: its position is "k samples into *my* shard", and the shards
are those of a world that no longer exists. Here the position is the step: step s of epoch e is
the slice `[i * B, (i + 1) * B)` of the epoch's order (i = s mod steps per epoch), whoever is
left to train it, and a member's share is every `world_size`-th id of that slice from its
`rank`. The interrupted step is redone by the survivors over the same slice, re-split.

With a fixed world size the shares are exactly `DistributedSampler(drop_last=True)`'s batches:
rank r's step-s batch under torch's layout is the slice's ids at offsets r, r + W, r + 2W, ...
The epoch's order is ringtrain's `DistributedSampler` with one replica (torch's seeding:
`randperm(N)` seeded with `seed + epoch`); the tail that does not fill a whole global batch is
dropped, as `drop_last` does. Pure: tested without processes (`tests/test_live_batches.py`).
"""

from __future__ import annotations

from typing import Any

from ringtrain.data.sampler import DistributedSampler


class GlobalBatches:
    """Sample ids of each step's global batch; `share` splits one over the current members.

    Args:
        dataset_len: samples in the dataset (constant, as for a sampler).
        global_batch_size: samples per step over all members (the fault-free run's
            per-rank batch size times its world size).
        shuffle: a new order each epoch (seeded with `seed + epoch`, as torch's sampler).
        seed: the order's seed, the same on every member.
    """

    def __init__(self, dataset_len: int, global_batch_size: int, *, shuffle: bool = True,
                 seed: int = 0):
        if global_batch_size < 1 or dataset_len < global_batch_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} with dataset_len={dataset_len}: need "
                "1 <= global_batch_size <= dataset_len (an epoch holds at least one step)")
        self.dataset_len, self.global_batch_size = dataset_len, global_batch_size
        self.shuffle, self.seed = shuffle, seed
        self.steps_per_epoch = dataset_len // global_batch_size
        self._epoch: int | None = None
        self._order: list[int] = []

    def order(self, epoch: int) -> list[int]:
        """Every sample id of `epoch`, in the order its steps take them."""
        if epoch != self._epoch:  # a step's neighbours share the epoch: one randperm per epoch
            sampler = DistributedSampler(range(self.dataset_len), num_replicas=1, rank=0,
                                         shuffle=self.shuffle, seed=self.seed)
            sampler.set_epoch(epoch)
            self._epoch, self._order = epoch, list(sampler)
        return self._order

    def batch(self, step: int) -> list[int]:
        """The global batch of `step` (0-based, counted over epochs)."""
        if step < 0:
            raise ValueError(f"step={step}: steps count from 0")
        epoch, i = divmod(step, self.steps_per_epoch)
        b = self.global_batch_size
        return self.order(epoch)[i * b:(i + 1) * b]

    def share(self, step: int, rank: int, world_size: int) -> list[int]:
        """Member `rank` of `world_size`'s ids of `step`'s global batch (shares differ by <= 1).

        A member whose share is empty (more members than samples in a step) still takes part
        in the step's collectives, with a zero contribution.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval "
                             f"[0, {world_size - 1}]")
        return self.batch(step)[rank::world_size]

    def redo_shares(self, step: int, held: list[list[int]]) -> list[list[int]]:
        """Each member's ids to train when `step` is redone and member r holds `held[r]`.

        After a fault the survivors still hold what they computed of the failed step (their
        gradients before the all-reduce, `LiveHooks.contribution`): only the ids nobody holds
        (the lost members' shares) are trained again, in the batch's order. Members holding
        nothing (a spare or a replacement let in) take them when they fit in one share each:
        a spare in a lost member's place then trains exactly that member's share, so with the
        world size restored the sums are the fault-free run's bit for bit. Otherwise every
        member takes a part (the survivors closing ranks: a third of a share each, for 4 -> 3).
        """
        batch = self.batch(step)
        taken = [i for ids in held for i in ids]
        if len(set(taken)) != len(taken) or not set(taken) <= set(batch):
            raise ValueError(f"held ids {held} of step {step}: each must be in the step's "
                             f"global batch {batch} and held by one member only")
        missing = [i for i in batch if i not in set(taken)]
        empty = [r for r, ids in enumerate(held) if not ids]
        one_share = -(-len(batch) // len(held))
        takers = empty if empty and len(missing) <= len(empty) * one_share else \
            list(range(len(held)))
        out: list[list[int]] = [[] for _ in held]
        for k, r in enumerate(takers):
            out[r] = missing[k::len(takers)]
        return out

    def state_dict(self) -> dict[str, Any]:
        """What fixes the order; the position is the step, which the `LiveState` holds."""
        return {"dataset_len": self.dataset_len, "global_batch_size": self.global_batch_size,
                "shuffle": self.shuffle, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Refuse a state of other batches: a peer's steps would not be this member's steps."""
        if state != self.state_dict():
            raise ValueError(f"the batches of the state being loaded ({state}) differ from this "
                             f"member's ({self.state_dict()}): start every member with the same "
                             "dataset, global_batch_size, shuffle and seed")
