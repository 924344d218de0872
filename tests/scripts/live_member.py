"""One live member for the link-loss test (tests/test_live_link.py), run inside a netns host.

    python live_member.py STORE_ADDR PORT WORLD_SIZE OUT_DIR PAUSE_AT PAUSE_FILE

Trains the tiny regression of tests/test_live.py with `train_live` (heartbeat 0.1 s, a member
lost after 1 s of silence, a 20 s collective timeout), appending each committed step's loss,
sample ids and group size to OUT_DIR/<pid>.jsonl. After committing step PAUSE_AT it waits for
PAUSE_FILE to exist (when PAUSE_AT >= 0): the test takes the other host's link down meanwhile,
so the next collective is the one that finds it gone. At the end it writes OUT_DIR/<pid>.done
with its pid then and now.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ringtrain.live import GlobalBatches, LiveGroup, LiveState, all_reduce_gradients, train_live

N, BATCH, STEPS = 60, 12, 8


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 8, generator=g)
    return x, x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(N, 1, generator=g)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


class Momentum:
    """SGD with momentum by hand: torch.optim's import of torch._dynamo costs ~4 s of CPU per
    process (tests/test_live.py trains with it too)."""

    def __init__(self, params, lr=0.05, beta=0.9):
        self.params, self.lr, self.beta = list(params), lr, beta
        self.buf = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self):
        for p, b in zip(self.params, self.buf, strict=True):
            p.sub_(self.lr * b.mul_(self.beta).add_(p.grad))

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def state_dict(self):
        return {"buf": self.buf}

    def load_state_dict(self, state):
        for b, v in zip(self.buf, state["buf"], strict=True):
            b.copy_(v)


def train_step(net, optimizer, x, y, ids, process_group, gradients=None
               ) -> tuple[float, list[int]]:
    """One live step on this member's share `ids`: the gradients summed over the generation's
    group (each share's loss is its part of the global mean), then the optimizer's step.
    With `gradients` (a `LiveGradients`), the loss rides in the gradients' all-reduce and a
    redone step adds what this member held of it from before the fault."""
    loss = (net(x[ids]) - y[ids]).pow(2).sum() / BATCH  # this share's part of the mean
    loss.backward()
    if gradients is not None:
        total = gradients.all_reduce(process_group, loss)
    else:
        all_reduce_gradients(net, process_group)
        total = loss.detach().reshape(1)
        dist.all_reduce(total, group=process_group)
    optimizer.step()
    optimizer.zero_grad()
    return float(total), ids


def main() -> None:
    addr, port, world_size, out_dir, pause_at, pause_file = sys.argv[1:7]
    torch.set_num_threads(1)
    store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=30))
    x, y = data()
    net = model()
    optimizer = Momentum(net.parameters())
    state = LiveState(net, optimizer, GlobalBatches(N, BATCH, seed=1))
    group = LiveGroup(store, int(world_size), timeout_s=20, heartbeat_s=0.1, dead_after_s=1)
    pid = os.getpid()
    records = open(Path(out_dir) / f"{pid}.jsonl", "a")  # noqa: SIM115

    def step(ids, process_group):
        return train_step(net, optimizer, x, y, ids, process_group)

    def on_commit(done, result):
        records.write(json.dumps({"step": done, "loss": result[0], "ids": result[1],
                                  "size": group.size}) + "\n")
        records.flush()
        if done == int(pause_at):
            deadline = time.monotonic() + 60
            while not os.path.exists(pause_file) and time.monotonic() < deadline:
                time.sleep(0.01)

    train_live(group, state, step, STEPS, on_commit=on_commit)
    (Path(out_dir) / f"{pid}.done").write_text(json.dumps({"pid": pid, "pid_now": os.getpid()}))


if __name__ == "__main__":
    main()
