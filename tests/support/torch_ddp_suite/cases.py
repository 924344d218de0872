"""torch's DDP test class, built as test/distributed/test_distributed_spawn.py builds it.

`TestDistBackend` + `DistributedTest._DistTestBase` (torch's `MultiProcessTestCase`: gloo, world
size 2, a file:// init per test, torch's barrier, its return-code verdicts), with the DDP class
chosen per subclass and the ranks started one of two ways:

- spawned (`TorchDDPSpawned`, `RingtrainDDPSpawned`): torch's own `_spawn_processes`, a fresh
  interpreter per rank per test that imports torch and this suite again (~10 s a test here);
- forked from a forkserver that has imported all of it once (`TorchDDP`, `RingtrainDDP`, the
  default): each rank is still a fresh process per test, so no state is shared between tests,
  but it starts in ~0.1 s. The only difference a rank can see is its environment: a forked rank
  starts with the server's, so setUp writes the parent's next to the init file and `_run` loads
  it, which is what a spawned rank inherits.

Importing this module imports distributed_test, after `retarget.patch_skips()`.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os

# distributed_test reads these at import; test_distributed_spawn.py is run with them set.
os.environ["BACKEND"] = "gloo"
os.environ["WORLD_SIZE"] = "2"

import torch  # noqa: E402

from . import retarget  # noqa: E402

retarget.patch_skips()
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

import ringtrain.ddp  # noqa: E402, F401  (imported once here, so the forkserver preloads it)


def _forkserver() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # read when the server starts (the first test)
    return ctx


class _Case(TestDistBackend, DistributedTest._DistTestBase):
    ddp = "torch"
    spawned = False

    def setUp(self):
        super().setUp()  # TEMP_DIR, INIT_METHOD: set in os.environ per test
        with open(self.file_name + ".env", "w") as f:
            json.dump(dict(os.environ), f)
        if self.spawned:
            self._spawn_processes()
        else:
            self._start_processes(_forkserver().Process)
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    def tearDown(self):
        for p in self.processes:  # torch terminates (SIGTERM); a rank stuck in C++ may not hear it
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
        super().tearDown()
        for path in (self.file_name, self.file_name + ".env"):
            try:
                os.remove(path)
            except OSError:
                pass

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        with open(file_name + ".env") as f:
            env = json.load(f)
        os.environ.clear()
        os.environ.update(env)
        torch.set_num_threads(1)  # two ranks on a shared 2-core machine; same for both classes
        retarget.install(cls.ddp, int(os.environ["WORLD_SIZE"]))
        super()._run(rank, test_name, file_name, pipe, **kwargs)


class TorchDDP(_Case):
    ddp = "torch"


class RingtrainDDP(_Case):
    ddp = "ringtrain"


class TorchDDPSpawned(_Case):
    ddp, spawned = "torch", True


class RingtrainDDPSpawned(_Case):
    ddp, spawned = "ringtrain", True


def case_class(ddp: str, spawned: bool = False) -> type[_Case]:
    classes = {("torch", False): TorchDDP, ("ringtrain", False): RingtrainDDP,
               ("torch", True): TorchDDPSpawned, ("ringtrain", True): RingtrainDDPSpawned}
    if (ddp, spawned) not in classes:
        raise ValueError(f"ddp={ddp!r}: choose one of {retarget.DDP_CHOICES}")
    return classes[ddp, spawned]
