"""One worker of benchmarks/live_recovery.py, run inside a network-namespace host.

    python live_recovery_worker.py CONFIG_JSON         (started by the benchmark, not by hand)

CONFIG_JSON: mode ("live" or "restart"), store (addr, port), job, world_size, steps, out_dir, model
(n_layer, n_embd, block_size), global_batch, tokens and device_s (`make_step`); for "restart" also
rank, attempt and snapshot_every. Both modes train the same GPT on the same synthetic tokens, each
step on `GlobalBatches`' global batch (the loss summed over the shares, the gradients summed):
- "live": `train_live` (heartbeat 0.1 s, lost after dead_after_s of silence; commits in place, as
  `ringtrain train --live` does for ddp); a worker started after
  the job began joins as a replacement, healing from a peer (with "renice", started at nice 19,
  it returns to 0 once its model is built); with "spare" true it is a warm
  spare (`LiveGroup(spare=True)`): built and registered before any fault, it waits to take a
  lost member's place;
- "restart": today's path, a fixed gloo group of world_size ranks; it loads the newest
  snapshot (written by rank 0 every snapshot_every steps: weights, AdamW, step) and trains on
  from it; on any fault the benchmark kills every worker and starts them all again.
Each committed step appends {step, t (wall clock), ids, size, pid} to OUT_DIR/<job>-<pid>.jsonl;
a heal appends {heal_s, heal_bytes}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ringtrain.live import (  # noqa: E402
    GlobalBatches,
    LiveGradients,
    LiveGroup,
    LiveState,
    all_reduce_gradients,
    train_live,
)
from ringtrain.models.gpt import GPT, GPTConfig  # noqa: E402

DATASET = 4096  # synthetic sequences: an epoch is long enough for any run here


def build(c: dict):
    torch.manual_seed(0)
    m = c["model"]
    config = GPTConfig(vocab_size=256, block_size=m["block_size"], n_layer=m["n_layer"],
                       n_head=max(1, m["n_embd"] // 64), n_embd=m["n_embd"], dropout=0.0)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    tokens = torch.randint(0, 256, (DATASET, m["block_size"] + 1),
                           generator=torch.Generator().manual_seed(1))
    return model, optimizer, tokens, GlobalBatches(DATASET, c["global_batch"], seed=2)


def make_step(model, optimizer, tokens, c: dict, gradients=None):
    """One step on a share; with `gradients` (live mode's `LiveGradients`) the loss rides in
    the gradients' all-reduce (the global mean comes back) and a redo after a fault trains
    only the samples nobody holds.

    With c["device_s"] > 0 the step emulates a device of its own per worker: it trains each
    sample's first c["tokens"] tokens on the CPU (a few ms), then sleeps device_s per sample of
    its share, as a GPU's forward and backward would take, leaving the host's cores free. A
    share of 3 members is then 4/3 as long as one of 4, as on devices."""
    global_batch, length, device_s = c["global_batch"], c["tokens"], c["device_s"]

    def step(ids: list[int], process_group: dist.ProcessGroup) -> float:
        x, y = tokens[ids, :length], tokens[ids, 1:length + 1]
        logits = model(x)  # (b, T, vocab)
        # Summed over this share, divided by the global count: the shares' sum is the mean.
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        loss = loss / (global_batch * y.size(1))
        loss.backward()
        if device_s:
            time.sleep(device_s * len(ids))
        if gradients is not None:
            loss = gradients.all_reduce(process_group, loss)
        else:
            all_reduce_gradients(model, process_group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())
    return step


def renice() -> None:
    """Back to nice 0, every thread (Linux keeps a nice value per thread): the process was
    started at nice 19 to build (`--niced-start`) and trains, or heals a peer, at 0. Its
    session's autogroup too (the benchmark set it to 19): between sessions the kernel shares
    the CPU by the autogroups' nice, not the processes'."""
    for task in os.listdir("/proc/self/task"):
        os.setpriority(os.PRIO_PROCESS, int(task), 0)
    if os.access("/proc/self/autogroup", os.W_OK):
        with open("/proc/self/autogroup", "w") as autogroup:
            autogroup.write("0")


def live(c: dict, store: dist.Store, records) -> None:
    model, optimizer, tokens, batches = build(c)
    if c.get("renice"):
        renice()
    # In place: the step's all-reduce is its last collective, the optimizer steps after it
    # (make_step), so a commit keeps the live tensors rather than a copy (`LiveState`).
    state = LiveState(model, optimizer, batches, in_place=True)
    group = LiveGroup(store, c["world_size"], name=c["job"], timeout_s=30, heartbeat_s=0.1,
                      dead_after_s=c["dead_after_s"], spare=bool(c.get("spare")))
    gradients = LiveGradients(model)
    inner = make_step(model, optimizer, tokens, c, gradients)
    trained = [0]  # samples the last attempt trained (a redo: only what nobody held)

    def step(ids: list[int], process_group: dist.ProcessGroup) -> float:
        trained[0] = len(ids)
        return inner(ids, process_group)
    first = True

    def on_commit(done: int, loss: float) -> None:
        nonlocal first
        if first and group.generation > 0 and group.last_heal and group.last_heal.nbytes:
            # This process's first step, in a later generation: it joined as a replacement.
            records.write(json.dumps({"heal_s": group.last_heal.seconds,
                                      "heal_bytes": group.last_heal.nbytes}) + "\n")
        first = False
        ids = gradients.ids  # its share, or after a fault: what it held and what it trained again
        records.write(json.dumps({"step": done, "t": time.time(), "ids": ids, "loss": loss,
                                  "trained": trained[0], "rank": group.rank,
                                  "size": group.size, "gen": group.generation}) + "\n")
        records.flush()

    train_live(group, state, lambda ids, pg: step(ids, pg), c["steps"], on_commit=on_commit,
               gradients=gradients)


def restart(c: dict, store: dist.Store, records) -> None:
    model, optimizer, tokens, batches = build(c)
    rank, world = c["rank"], c["world_size"]
    snapshot = Path(c["out_dir"]) / f"{c['job']}-snapshot.pt"
    first = 0
    if snapshot.exists():
        saved = torch.load(snapshot, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        first = saved["step"]
    group = dist.ProcessGroupGloo(dist.PrefixStore(f"{c['job']}/attempt{c['attempt']}", store),
                                  rank, world, timedelta(seconds=30))
    step = make_step(model, optimizer, tokens, c)
    for s in range(first, c["steps"]):
        ids = batches.share(s, rank, world)
        loss = step(ids, group)
        records.write(json.dumps({"step": s, "t": time.time(), "ids": ids, "loss": loss,
                                  "rank": rank, "size": world, "attempt": c["attempt"]}) + "\n")
        records.flush()
        if rank == 0 and (s + 1) % c["snapshot_every"] == 0:  # atomic: written, then renamed
            tmp = snapshot.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": s + 1}, tmp)
            os.replace(tmp, snapshot)


def main() -> None:
    c = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    store = dist.TCPStore(c["store"][0], c["store"][1], is_master=False,
                          timeout=timedelta(seconds=60))
    path = Path(c["out_dir"]) / f"{c['job']}-{os.getpid()}.jsonl"
    with open(path, "a") as records:
        (live if c["mode"] == "live" else restart)(c, store, records)


if __name__ == "__main__":
    main()
