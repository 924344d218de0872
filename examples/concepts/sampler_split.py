"""What the DistributedSampler is for: each rank reads its own, disjoint shard of every epoch.

    .venv/bin/python examples/concepts/sampler_split.py         # < 5 s, no processes

Without a sampler every rank would read the same samples and N ranks would do the work of one.
`ringtrain.data.DistributedSampler` (torch's, plus resume) shuffles the indices with a seed
every rank shares, then rank r takes every N-th index from r. When N does not divide the
dataset, the first indices are repeated (padding) so that every rank takes the same number of
steps; `drop_last=True` drops the tail instead, `exact=True` (evaluation) neither pads nor drops.
"""

from __future__ import annotations

from ringtrain.data.addition import train_size
from ringtrain.data.sampler import DistributedSampler


def shards(n: int, num_replicas: int, **kwargs) -> list[list[int]]:
    data = range(n)  # a sampler needs only len(); the indices are the samples
    return [list(DistributedSampler(data, num_replicas=num_replicas, rank=r, seed=0, **kwargs))
            for r in range(num_replicas)]


def main() -> None:
    print("10 samples on 3 ranks:")
    for kwargs in ({}, {"drop_last": True}, {"exact": True}):
        parts = shards(10, 3, **kwargs)
        seen = [i for part in parts for i in part]
        label = ", ".join(f"{k}=True" for k in kwargs) or "default (pad)"
        print(f"  {label:<15} " + "  ".join(f"rank {r}: {p}" for r, p in enumerate(parts))
              + f"  -> {len(seen)} read, {len(seen) - len(set(seen))} repeated, "
              f"{10 - len(set(seen))} never read")
    n = train_size(2)
    print(f"the addition task's {n:,} training sums (ringtrain train's default task):")
    for ranks in (1, 2, 3, 4, 6):
        parts = shards(n, ranks)
        pad = sum(map(len, parts)) - n
        assert set().union(*map(set, parts)) == set(range(n))  # every sample is read
        print(f"  {ranks} rank{'s' if ranks > 1 else ' '}: {len(parts[0]):,} each, {pad} padded")


if __name__ == "__main__":
    main()
