"""Heal a replacement from a live peer: a ~100 M-parameter GPT with AdamW state, 2 gloo ranks.

    .venv/bin/python benchmarks/live_heal.py            # n_layer 14, n_embd 768: 99.6 M params
    .venv/bin/python benchmarks/live_heal.py --quick    # n_layer 2, n_embd 256

Rank 0 holds a committed `LiveState` (weights + AdamW's moments after one step); rank 1 starts
fresh (other weights, an AdamW with no state) and heals from it over a new gloo group, in two
side by side: `heal` (the large tensors broadcast in place, ringtrain/live/heal.py) and its
anchor, the previous way (the whole state `torch.save`d into one buffer, broadcast, loaded).
Each figure is the receiver's wall time from the call until its state is loaded and committed;
the receiver's weights and optimizer state are checked equal to the source's. Each way runs
--repeats times, alternated (a loaded host slows some heals many times over: the minimum is
the machine's figure, the median the load's). A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import statistics
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ringtrain.live import GlobalBatches, LiveState, WatchedGroup, heal  # noqa: E402
from ringtrain.live.heal import _broadcast  # noqa: E402
from ringtrain.models.gpt import GPT, GPTConfig  # noqa: E402
from ringtrain.testing import run_workers  # noqa: E402


def _digest(state: LiveState) -> str:
    h = hashlib.sha256()
    for v in state.model.state_dict().values():
        h.update(v.numpy().tobytes())
    for s in state.optimizer.state_dict()["state"].values():
        for v in s.values():
            h.update(v.numpy().tobytes())
    return h.hexdigest()


def _pickled_heal(state: LiveState, group: dist.ProcessGroup, rank: int) -> int:
    """The anchor: the committed state as one torch.save buffer, source rank 0."""
    if rank == 0:
        buf = io.BytesIO()
        torch.save(state.state_dict(), buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    _broadcast(group, size, 0)
    if rank != 0:
        payload = torch.empty(int(size), dtype=torch.uint8)
    _broadcast(group, payload, 0)
    if rank != 0:
        state.load_state_dict(torch.load(io.BytesIO(payload.numpy().tobytes()),
                                         weights_only=True))
    return int(size)


def _member(rank, world_size, port, n_layer, n_embd, repeats):
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    torch.manual_seed(rank)  # the receiver's weights differ until healed
    config = GPTConfig(vocab_size=256, block_size=256, n_layer=n_layer, n_head=max(1, n_embd // 64),
                       n_embd=n_embd, dropout=0.0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if rank == 0:  # one step: the moments exist, as in a run under way
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    state = LiveState(model, optimizer, GlobalBatches(1024, 8), step=1 if rank == 0 else 0)
    params = sum(p.numel() for p in model.parameters())
    rows: dict[str, list[dict]] = {"in_place": [], "pickled": []}
    for i, way in enumerate(("in_place", "pickled") * repeats):  # alternated: the same load
        group = WatchedGroup(dist.ProcessGroupGloo(dist.PrefixStore(f"{way}{i}", store),
                                                   rank, world_size, timedelta(seconds=120)),
                             lambda: None)
        if rank == 1:  # fresh again: other weights, an AdamW with no state
            fresh = GPT(config)
            state = LiveState(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-4),
                              GlobalBatches(1024, 8))
        group.barrier().wait()
        t0 = time.perf_counter()
        if way == "pickled":
            nbytes = _pickled_heal(state, group, rank)
        else:
            nbytes = heal(state, group, rank, committed_step=-1 if rank == 1 else None).nbytes
        seconds = time.perf_counter() - t0
        store.set(f"digest/{i}/{rank}", _digest(state))
        group.barrier().wait()
        same = store.get(f"digest/{i}/0") == store.get(f"digest/{i}/1")
        rows[way].append({"seconds": round(seconds, 3), "bytes": nbytes, "equal": same})
    return {"params": params, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n_layer 2, n_embd 256")
    parser.add_argument("--repeats", type=int, default=3, help="heals of each way, alternated")
    args = parser.parse_args()
    n_layer, n_embd = (2, 256) if args.quick else (14, 768)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    results = run_workers(_member, 2, args=(store.port, n_layer, n_embd, args.repeats), init=False,
                          timeout_s=600)
    receiver = results[1]
    print(f"heal of {receiver['params'] / 1e6:.1f} M params + AdamW, 2 gloo ranks, localhost")
    print(f"{'way':<10}{'min s':>8}{'median s':>10}{'MB':>9}{'GB/s (min)':>12}  equal  all (s)")
    summary = {}
    for way, runs in receiver["rows"].items():
        seconds = sorted(r["seconds"] for r in runs)
        nbytes = runs[0]["bytes"]
        summary[way] = {"min_s": seconds[0], "median_s": round(statistics.median(seconds), 3),
                        "bytes": nbytes, "gb_per_s": round(nbytes / seconds[0] / 1e9, 2),
                        "equal": all(r["equal"] for r in runs), "seconds": seconds}
        row = summary[way]
        print(f"{way:<10}{row['min_s']:>8.2f}{row['median_s']:>10.2f}{nbytes / 1e6:>9.1f}"
              f"{row['gb_per_s']:>12.2f}  {str(row['equal']):<6} {seconds}")
    print(json.dumps({"benchmark": "live_heal", "params": receiver["params"], "ways": summary}))


if __name__ == "__main__":
    main()
