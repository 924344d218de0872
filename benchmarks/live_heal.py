"""Heal a replacement from a live peer: a ~100 M-parameter GPT with AdamW state, 2 gloo ranks.

    .venv/bin/python benchmarks/live_heal.py            # n_layer 14, n_embd 768: 99.6 M params
    .venv/bin/python benchmarks/live_heal.py --quick    # n_layer 2, n_embd 256

Rank 0 holds a committed `LiveState` (weights + AdamW's moments after one step); rank 1 starts
fresh (other weights, an AdamW with no state) and heals from it over a new gloo group, in two
side by side: `heal` (the large tensors broadcast in place, ringtrain/live/heal.py) and its
anchor, the previous way (the whole state `torch.save`d into one buffer, broadcast, loaded).
Each figure is the receiver's wall time from the call until its state is loaded and committed;
the receiver's weights and optimizer state are checked equal to the source's. Each way runs
--repeats times in a pair of processes of its own: the first heal (`first_s`) is a
replacement's, in a process that has never held the state; the later ones (`min_s`,
`median_s`) reuse memory a heal freed. Before it heals, the replacement makes its AdamW's state
(`LiveState.prepare_heal`, as `LiveGroup.join` does before a replacement's first heartbeat),
so the moments are received into memory it has touched; `--unprepared` skips that (the A/B:
0.8-1.6 GB of new pages then, inside the heal, for 1.2 GB healed; on this VM such pages fault
in several times slower when they have lain unused a while).
`--in-place`: the members commit in place (`LiveState(in_place=True)`, what `ringtrain train
--live` does for ddp): one copy of the state fewer to place. A table, then one JSON line.
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


def _member(rank, world_size, port, n_layer, n_embd, ways, in_place, prepared):
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
    state = LiveState(model, optimizer, GlobalBatches(1024, 8), step=1 if rank == 0 else 0,
                      in_place=in_place)
    params = sum(p.numel() for p in model.parameters())
    rows: dict[str, list[dict]] = {}
    for i, way in enumerate(ways):  # the first heal is this process's first: a replacement's
        group = WatchedGroup(dist.ProcessGroupGloo(dist.PrefixStore(f"{way}{i}", store),
                                                   rank, world_size, timedelta(seconds=120)),
                             lambda: None)
        if rank == 1:  # fresh again: other weights, an AdamW with no state
            fresh = GPT(config)
            state = LiveState(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-4),
                              GlobalBatches(1024, 8), in_place=in_place)
            if prepared:  # as `LiveGroup.join` does before a replacement's first heartbeat
                state.prepare_heal()
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
        rows.setdefault(way, []).append({"seconds": round(seconds, 3), "bytes": nbytes,
                                         "equal": same})
    return {"params": params, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n_layer 2, n_embd 256")
    parser.add_argument("--repeats", type=int, default=3, help="heals of each way")
    parser.add_argument("--in-place", action="store_true",
                        help="commit in place (LiveState(in_place=True): ringtrain train "
                             "--live's ddp)")
    parser.add_argument("--unprepared", action="store_true",
                        help="the replacement heals without `LiveState.prepare_heal` first "
                             "(its optimizer's state made before it is let in): the A/B")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1 heal of each way (the first is a "
                     "replacement's; 2 or more to read later ones)")
    n_layer, n_embd = (2, 256) if args.quick else (14, 768)
    summary, params = {}, 0
    print(f"{'way':<9}{'first s':>9}{'min s':>8}{'median s':>10}{'MB':>9}{'GB/s (first)':>14}"
          f"  equal  in order (s)")
    for way in ("heal", "pickled"):  # each in processes of its own: its first heal is cold
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=120))
        receiver = run_workers(_member, 2, args=(store.port, n_layer, n_embd,
                                                 [way] * args.repeats, args.in_place,
                                                 not args.unprepared),
                               init=False, timeout_s=600)[1]
        params = receiver["params"]
        runs = receiver["rows"][way]
        seconds = [r["seconds"] for r in runs]
        later = seconds[1:] or seconds
        nbytes = runs[0]["bytes"]
        row = summary[way] = {
            "first_s": seconds[0], "min_s": min(later),
            "median_s": round(statistics.median(later), 3), "bytes": nbytes,
            "gb_per_s_first": round(nbytes / seconds[0] / 1e9, 2),
            "equal": all(r["equal"] for r in runs), "seconds": seconds}
        print(f"{way:<9}{row['first_s']:>9.2f}{row['min_s']:>8.2f}{row['median_s']:>10.2f}"
              f"{nbytes / 1e6:>9.1f}{row['gb_per_s_first']:>14.2f}  {str(row['equal']):<6} "
              f"{seconds}")
    print(f"({params / 1e6:.1f} M params + AdamW, 2 gloo ranks on localhost, "
          f"{'commits in place' if args.in_place else 'commits copied'}, "
          f"{'unprepared' if args.unprepared else 'prepared'}; first: a replacement's "
          f"heal, its process's first; min and median: the later ones)")
    print(json.dumps({"benchmark": "live_heal", "params": params, "in_place": args.in_place,
                      "prepared": not args.unprepared,
                      "ways": summary}))


if __name__ == "__main__":
    main()
