r"""The DDP tutorial's fault-tolerance pattern on ringtrain: snapshot each epoch, rank 1 dies in
the first attempt, the launcher restarts the group, the script reloads its snapshot.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 \
        tests/scripts/restart_from_snapshot.py SNAP
"""

import os
import sys

import torch
import torch.distributed as dist

import ringtrain

torch.set_num_threads(1)
snapshot = sys.argv[1]
rt = ringtrain.init_distributed()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
first_epoch = 0
if os.path.exists(snapshot):
    state = torch.load(snapshot)
    model.load_state_dict(state["model"])
    first_epoch = state["epoch"] + 1
ddp = ringtrain.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
for epoch in range(first_epoch, 4):
    for _ in range(5):
        loss = ddp(torch.randn(16, 32)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rt.rank == 0:
        torch.save({"model": model.state_dict(), "epoch": epoch}, snapshot + ".tmp")
        os.replace(snapshot + ".tmp", snapshot)
    if epoch == 1 and rt.rank == 1 and restarts == 0:
        os._exit(1)  # a worker dies
    dist.barrier()
print(f"rank {rt.rank} done after {restarts} restarts", flush=True)
ringtrain.destroy_distributed()
