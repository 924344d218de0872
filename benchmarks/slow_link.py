"""DDP, PowerSGD, local SGD and DiLoCo on two hosts joined by a slow link, side by side.

    .venv/bin/python benchmarks/slow_link.py                          # 50mbit, 300 steps, 5 ways
    .venv/bin/python benchmarks/slow_link.py --rate 50mbit --delay 20ms --steps 300
    .venv/bin/python benchmarks/slow_link.py --quick                  # the reduced run of the tests

Two "hosts" are network namespaces joined by a veth pair (198.18.0.1 and .2, removed
afterwards); each sends through `tc` at `--rate` (tbf), plus `--delay` each way where the
kernel has netem, else through a relay namespace that holds every frame for `--delay`
(tests/scripts/delay_relay.py; needs ethtool). One
worker per host trains the text GPT (`ringtrain train --data`, nanoGPT's CPU recipe: 4 x 128,
block 64, batch 12 per worker) on a corpus made of this repository's docs and sources, the
same steps and samples for every way (the corpus is shipped: benchmarks/data/corpus.txt.gz):
- `ddp`: a gradient all-reduce every step;
- `powersgd:R`: DDP with rank-R PowerSGD (`--grad-compress powersgd:R`);
- `localsgd:H`, `diloco:H`: a meeting every H steps (`--strategy localsgd|diloco --sync-every H`;
  `diloco:H:LR:M` also sets `--outer-lr LR --outer-momentum M`).
Per way: bytes each host sent on its link (the kernel's counter, TCP/IP headers and the
rendezvous store's traffic included), wall time of the run, time to reach `--target` (default:
DDP's final validation loss x 1.03), and the final validation loss; then the same on an
unconstrained link for reference. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from netns import can_delay, two_hosts, unavailable  # noqa: E402 - the tests' namespace helper

WAYS = {
    "ddp": ["--strategy", "ddp"],
    "powersgd": ["--strategy", "ddp", "--grad-compress", "powersgd:{}"],
    "localsgd": ["--strategy", "localsgd", "--sync-every", "{}"],
    "diloco": ["--strategy", "diloco", "--sync-every", "{}"],
}
DILOCO_EXTRA = ["--outer-lr", "--outer-momentum"]  # diloco:H:LR:MOMENTUM


def corpus(path: Path) -> Path:
    """The text every way trains on: benchmarks/data/corpus.txt.gz, this repository's README,
    docs and Python sources as of session 4 (0.5 MB): shipped, so runs stay comparable."""
    path.write_bytes(gzip.decompress((REPO / "benchmarks" / "data" / "corpus.txt.gz").read_bytes()))
    return path


def way_args(way: str) -> list[str]:
    """`ddp`, `powersgd:R`, `localsgd:H`, `diloco:H` or `diloco:H:OUTER_LR:OUTER_MOMENTUM`."""
    kind, *params = way.split(":")
    args = [a.format(*params[:1]) for a in WAYS[kind]]
    for flag, value in zip(DILOCO_EXTRA, params[1:], strict=False):
        args += [flag, value]
    return args


def run_way(way: str, hosts, data: Path, out: Path, common: list[str], timeout_s: float) -> dict:
    """One training run across the two hosts; its summary, metrics and link bytes."""
    run_dir = out / way.replace(":", "_")
    sent0 = [h.tx_bytes() for h in hosts]
    started = time.monotonic()
    procs, rid, port = [], uuid.uuid4().hex[:8], 29500 + os.getpid() % 1000
    # Each host's workers pick their own interface: an inherited GLOO_SOCKET_IFNAME (lo) would
    # keep gloo off the link between the hosts.
    env = ({k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
           | {"PYTHONUNBUFFERED": "1"})
    for node, h in enumerate(hosts):
        cmd = [sys.executable, "-m", "ringtrain", "train", "--data", str(data), "--nnodes", "2",
               "--node-rank", str(node), "--nproc-per-node", "1", "--rdzv-id", rid,
               "--rdzv-endpoint", f"{hosts[0].addr}:{port}", "--run-dir", str(run_dir),
               *common, *way_args(way)]
        log = open(out / f"{way.replace(':', '_')}.node{node}.log", "w")
        procs.append(h.popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, timeout_s - (time.monotonic() - started))))
        except subprocess.TimeoutExpired:
            codes.append(None)
    wall = time.monotonic() - started
    if codes != [0, 0]:
        for h in hosts:
            h.kill_all()
        logs = "".join(f"\n--- node {i} ---\n" + (out / f"{way.replace(':', '_')}.node{i}.log")
                       .read_text()[-3000:] for i in range(2))
        raise RuntimeError(f"{way}: exit codes {codes}; the logs' ends:{logs}")
    sent = [h.tx_bytes() - s for h, s in zip(hosts, sent0, strict=True)]
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["time_s"], r["eval_loss"]) for r in records if "eval_loss" in r]
    return {"way": way, "bytes_per_host": sum(sent) / 2, "wall_s": wall,
            "train_s": summary["wall_s"], "final_eval_loss": summary["eval_loss"],
            "evals": evals, "param_sha256": summary["param_sha256"]}


def time_to(evals: list, target: float) -> float | None:
    return next((t for _, t, loss in evals if loss <= target), None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="50mbit",
                   help="each host's send rate (tc tbf/netem); none: no limit")
    p.add_argument("--delay", default="20ms", help="one-way delay, where netem exists")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--ways", default="ddp,powersgd:4,localsgd:50,diloco:10,diloco:50")
    p.add_argument("--target", type=float,
                   help="validation loss to time (default: DDP's final x 1.03)")
    p.add_argument("--no-reference", action="store_true", help="skip the unconstrained runs")
    p.add_argument("--extra", default="", help="more `ringtrain train` options for every way")
    p.add_argument("--quick", action="store_true", help="tiny model and steps (the test's run)")
    args = p.parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"slow_link: skipped: network namespaces are not available here ({reason})")
        return 0
    delay = args.delay or None
    no_delay = can_delay() if delay else None  # then a relay namespace delays the frames
    if no_delay and shutil.which("ethtool") is None:
        print(f"slow_link: no netem here ({no_delay}) and no ethtool for the relay that would "
              "replace it (apt-get install ethtool); measuring with --rate only")
        delay = None
    elif no_delay:
        print(f"slow_link: no netem here ({no_delay}); the delay comes from a relay namespace "
              "(tests/scripts/delay_relay.py)")
    ways = args.ways.split(",")
    common = ["--steps", str(args.steps), "--eval-every", str(max(1, args.steps // 6)),
              "--log-every", str(max(1, args.steps // 30)), "--snapshot-every", "0",
              "--no-progress", "--threads", "1", "--watchdog-timeout", "60"]
    common += args.extra.split()
    if args.quick:
        common += ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
                   "--batch-size", "4", "--eval-batch-size", "64"]
    load_before = os.getloadavg()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="slow_link") as tmp:
        out = Path(tmp)
        data = corpus(out / "corpus.txt")
        # Generous: a loaded machine (the test suite beside it) starts workers slowly.
        timeout = 60 + args.steps * 3 if not args.quick else 300
        rate = None if args.rate in ("0", "none") else args.rate  # none: tuning on a free link
        links = [("slow", rate, delay)] + ([] if args.no_reference else [("free", None, None)])
        for label, rate, d in links:
            with two_hosts(rate=rate, delay=d) as hosts:
                for way in ways:
                    r = run_way(way, hosts, data, out, common, timeout)
                    results[f"{label}/{way}"] = r
                    print(f"{label:4s} {way:12s} sent {r['bytes_per_host'] / 1e6:9.2f} MB/host  "
                          f"wall {r['wall_s']:7.1f} s  final eval loss {r['final_eval_loss']:.4f}",
                          flush=True)
    base = results["slow/ddp"] if "slow/ddp" in results else next(iter(results.values()))
    target = args.target or base["final_eval_loss"] * 1.03
    table = {}
    for key, r in results.items():
        table[key] = {
            "bytes_per_host": int(r["bytes_per_host"]),
            "bytes_vs_ddp": round(base["bytes_per_host"] / r["bytes_per_host"], 2),
            "wall_s": round(r["wall_s"], 1), "train_s": round(r["train_s"], 1),
            "time_to_target_s": time_to(r["evals"], target),
            "final_eval_loss": round(r["final_eval_loss"], 4),
            "loss_vs_ddp": round(r["final_eval_loss"] / base["final_eval_loss"] - 1, 4),
        }
    print(f"\ntarget validation loss {target:.4f} (DDP's final x 1.03)")
    print(f"{'link/way':22s} {'MB/host':>9s} {'x fewer':>8s} {'wall s':>7s} "
          f"{'to target':>9s} {'loss':>7s}")
    for key, t in table.items():
        tt = "-" if t["time_to_target_s"] is None else f"{t['time_to_target_s']:.1f}"
        print(f"{key:22s} {t['bytes_per_host'] / 1e6:9.2f} {t['bytes_vs_ddp']:8.1f} "
              f"{t['wall_s']:7.1f} {tt:>9s} {t['final_eval_loss']:7.4f}")
    print(json.dumps({"rate": args.rate, "delay": delay,
                      "delay_by": None if not delay else ("relay" if no_delay else "netem"),
                      "steps": args.steps, "quick": args.quick,
                      "target_eval_loss": round(target, 4),
                      "results": table, "loadavg_before": [round(x, 2) for x in load_before],
                      "loadavg_after": [round(x, 2) for x in os.getloadavg()]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
