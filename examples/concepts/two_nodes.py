"""Multi-node training, rehearsed on one machine: two "nodes" of one worker each, then one node.

    .venv/bin/python examples/concepts/two_nodes.py             # ~25 s

Starts `ringtrain train --nnodes 2 --node-rank 0|1 --nproc-per-node 1 --rdzv-endpoint
127.0.0.1:PORT` twice at once, as you would on two machines (there, PORT is a free port on node
0's address and --run-dir a shared path). Each node's launcher joins the rendezvous at the
endpoint (`ringtrain/launch/launcher.py`, `rendezvous.py`), the job gets ranks 0 and 1 across
the two nodes, and training is the same 2-rank DDP as `--nproc-per-node 2` on one node: the same
param_sha256. docs/multinode.md covers addresses, firewalls and a lost node.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from ringtrain.launch.network import reserve_port

ARGS = ["--steps", "60", "--threads", "1", "--no-progress"]


def command(run_dir: Path, *launch: str) -> list[str]:
    return [sys.executable, "-m", "ringtrain", "train", *launch, *ARGS, "--run-dir", str(run_dir)]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        two, one = Path(tmp) / "two_nodes", Path(tmp) / "one_node"
        with reserve_port() as port:  # held until node 0's rendezvous store listens on it
            endpoint = f"127.0.0.1:{port}"
            nodes = [subprocess.Popen(command(two, "--nnodes", "2", "--node-rank", str(n),
                                              "--nproc-per-node", "1", "--rdzv-endpoint",
                                              endpoint),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                     for n in (0, 1)]
            for n, node in enumerate(nodes):
                _, err = node.communicate(timeout=300)
                if node.returncode:
                    raise SystemExit(f"node {n} exited with {node.returncode}:\n{err[-2000:]}")
        subprocess.run(command(one, "--nproc-per-node", "2"), check=True, capture_output=True,
                       timeout=300)
        for name, run_dir in (("2 nodes x 1 worker", two), ("1 node x 2 workers", one)):
            s = json.loads((run_dir / "summary.json").read_text())
            print(f"{name}: world_size {s['world_size']}, eval_loss {s['eval_loss']:.4f}, "
                  f"param_sha256 {s['param_sha256'][:16]}")


if __name__ == "__main__":
    main()
