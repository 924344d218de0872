"""A snapshot file's write: hashed beside the write and written back early, against the
reference (hashed in line, all of it flushed by the final fsync), alternated in one process.

    .venv/bin/python benchmarks/snapshot_write.py               # ~1.2 GB, 3 rounds
    python3 benchmarks/snapshot_write.py --dir /some/disk       # where the snapshots would go

The state: snapshot_stall.py's GPT (14 layers, 768 wide, 99 M parameters) and its AdamW state
after one step, on the CPU, as a writer reads it from its host buffers. Each round writes it
with `files.write_durably` four ways, in an order that rotates: `reference` (parallel=False,
writeback=False: sessions 8-17's write), `parallel` (sha256 on a second thread beside each large
write), `writeback` (the disk's write started every 64 MB, not all in the fsync), `both` (the
default since session 18). A background snapshot's write is what bounds `--snapshot-every`:
a save waits for the one before (snapshot_stall.py's `waited_for_write`), so its seconds are
the shortest interval at which snapshots cost a step nothing but their copy. The last line is
JSON: seconds per way (median, all rounds), MB/s, each way's digest equal to the reference's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ringtrain.checkpoint.files import write_durably
from ringtrain.models import GPT, GPTConfig

WAYS = {"reference": (False, False), "parallel": (True, False), "writeback": (False, True),
        "both": (True, True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--n-layer", type=int, default=14)
    p.add_argument("--dir", help="where the files go (default: a temporary directory here)")
    args = p.parse_args()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=args.n_layer, n_head=12,
                          n_embd=768, dropout=0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 65, (2, 64))
    model(x).float().pow(2).mean().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    root = Path(tempfile.mkdtemp(prefix="snapshot_write-", dir=args.dir or os.getcwd()))
    seconds: dict[str, list[float]] = {w: [] for w in WAYS}
    digests: dict[str, str] = {}
    size = 0
    try:
        names = list(WAYS)
        for r in range(args.rounds):
            for way in names[r % len(names):] + names[:r % len(names)]:
                parallel, writeback = WAYS[way]
                path = root / f"{way}-{r}.pt"
                t0 = time.perf_counter()
                out = write_durably(path, state, parallel=parallel, writeback=writeback)
                seconds[way].append(time.perf_counter() - t0)
                digests.setdefault(way, out["sha256"])
                size = out["bytes"]
                path.unlink()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {w: statistics.median(s) for w, s in seconds.items()}
    for w in WAYS:
        print(f"{w:10s} {med[w]:7.3f} s median  {size / med[w] / 1e6:7.1f} MB/s  "
              f"{med[w] / med['reference']:.3f}x reference  rounds "
              f"{', '.join(f'{s:.3f}' for s in seconds[w])}")
    print(json.dumps({"benchmark": "snapshot_write", "mb": round(size / 1e6, 1),
                      "rounds": args.rounds, "cpus": os.cpu_count(),
                      "seconds": {w: round(m, 3) for w, m in med.items()},
                      "all_s": {w: [round(s, 3) for s in v] for w, v in seconds.items()},
                      "ratio_vs_reference": {w: round(med[w] / med["reference"], 3)
                                             for w in WAYS},
                      "same_digest": all(d == digests["reference"] for d in digests.values()),
                      "loadavg": os.getloadavg()}))


if __name__ == "__main__":
    main()
