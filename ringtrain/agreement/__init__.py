"""Agreement between ranks: sums, votes and digests that every rank sees the same way.

Read in this order:
- `base.py`: `Agreement`, what the trainer asks for (sum values, vote on a flag, gather a
  digest, are all ranks present), and `CollectiveAgreement`, its lockstep form (collectives
  over the world group).
- `membership.py`: which ranks are still in the job, kept in the rendezvous store.
- `store.py`: `StoreAgreement`, the same questions answered through the store over the ranks
  still in the job, for strategies whose ranks drift apart (async/SSP parameter server).
- `generations.py`: `GenerationAgreement`, over a live job's current generation (its group
  changes as members are lost and let in: `ringtrain train --live`).

A strategy hands out its agreement (`Strategy.agreement`); the trainer never picks one.
May import: torch, `ringtrain.runtime`, `ringtrain.store_keys`, `ringtrain.collectives`.
"""

from ringtrain.agreement.base import Agreement, CollectiveAgreement

__all__ = ["Agreement", "CollectiveAgreement"]
