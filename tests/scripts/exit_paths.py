"""A 2-rank user script with ringtrain's DDP that ends by one of the exit paths users take.

    torchrun --standalone --nproc-per-node 2 tests/scripts/exit_paths.py torch_destroy

Exit paths: `torch_destroy` (torch's dist.destroy_process_group()), `rt_destroy`
(ringtrain.destroy_distributed()), `none` (interpreter exit with neither), `raise` (an
exception on rank 1 after the last step). Unused parameters, no_sync and a tiny bucket cap:
many small collectives, some launched from backward, some on temporaries.
"""

import sys

import torch
import torch.distributed as dist

import ringtrain

torch.set_num_threads(1)
path = sys.argv[1]
rt = ringtrain.init_distributed()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


torch.manual_seed(0)
model = ringtrain.DistributedDataParallel(Net(), find_unused_parameters=True, bucket_cap_mb=0.0001)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss = model(torch.randn(8, 16)).sum().detach()
dist.all_reduce(loss)  # a temporary handed to a collective, as logging code does
print(f"rank {rt.rank} finished", flush=True)
for step in range(10):  # the exit follows the last backward at once: the widest window
    x = torch.randn(8, 16)
    if step % 2 == 0:
        with model.no_sync():
            model(x).sum().backward()
    else:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
if path == "torch_destroy":
    dist.destroy_process_group()
elif path == "rt_destroy":
    ringtrain.destroy_distributed()
elif path == "raise" and rt.rank == 1:
    raise RuntimeError("raised on purpose after the last step")
