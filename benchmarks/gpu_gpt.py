"""ringtrain's trainer against a plain PyTorch loop on one device, the same GPT, side by side.

    .venv/bin/python benchmarks/gpu_gpt.py                    # CUDA if present, else the CPU
    .venv/bin/python benchmarks/gpu_gpt.py --compile          # eager, then both torch.compiled
    .venv/bin/python benchmarks/gpu_gpt.py --batch-size 16 --peak-flops 989e12   # fill an H100/H200

Both sides train `ringtrain.models.GPT` on tiny Shakespeare (char level, 65 tokens, prepared
with `ringtrain prepare`), same initial weights, batch, AdamW (decay on matrices, betas 0.9 /
0.95, fused on CUDA), grad clip 1.0, LR schedule (`lr_at`), bf16 autocast on CUDA and fp32 on
the CPU, no evaluation on either side:
- `trainer`: `ringtrain.Trainer` with the `ddp` strategy in this one process, as
  `ringtrain train` runs it (sampler, metrics window, a metrics line every --log-every steps);
  with --compile, `TrainerConfig(compile=True)` (`ringtrain train --compile`);
- `plain`: nanoGPT's train.py loop: `get_batch` from the np.memmap (pinned, non_blocking on
  CUDA) fetched right after forward, `loss.item()` every --log-every steps; with --compile,
  `torch.compile(model)`.

The two run interleaved in one process: the trainer's `on_step` hands the device to the plain
loop between its rounds of --steps steps, in the order T P P T T P P T ... (drift hits both
alike); the first round of each is a warm-up (compilation, allocator) and is not counted. A
round is timed from a device synchronisation to another. Figures: the median ms/step over
--rounds rounds of each side, `ratio` = trainer / plain (goal <= 1.02), `ratio_paired` the
median of the per-pair ratios, and MFU on CUDA (nanoGPT's `estimate_mfu`: 6N + 12 L H Q T
flops per token, N without the position embedding, against --peak-flops).

Shapes: on CUDA GPT-2 small (12 layers, 12 heads, 768 wide, block 1024, batch 8); on the CPU
nanoGPT's CPU recipe (4 x 128, 4 heads, block 64, batch 12, 1 thread). The last line is JSON:
{"device", "torch", "shape", "ratio", "trainer_ms", "plain_ms", "mfu_trainer", "mfu_plain",
"compiled": {the same for the compiled pair} or null, "compile_skipped", ...}.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
TEXT = REPO / "benchmarks" / "data" / "tinyshakespeare.txt.gz"
SHAPES = {  # per device type: the model and a batch that keeps the device busy
    "cuda": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "batch_size": 8},
    "cpu": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "batch_size": 12},
}
OPTIM = {"lr": 6e-4, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0,
         "seed": 1337}


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU: no CUDA call there)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prepared(work: Path) -> Path:
    from ringtrain.data.prepare import prepare

    text = work / "input.txt"
    text.write_bytes(gzip.decompress(TEXT.read_bytes()))
    prepare(str(text), str(work / "data"), tokenizer="char", progress=False)
    return work / "data"


def mfu(model, shape: dict, ms_per_step: float, peak_flops: float) -> float:
    """nanoGPT's `estimate_mfu`: model flops per step over the device's peak."""
    n = sum(p.numel() for p in model.parameters()) - model.embed.wpe.weight.numel()
    L, H, T = shape["n_layer"], shape["n_head"], shape["block_size"]
    per_token = 6 * n + 12 * L * H * (shape["n_embd"] // H) * T
    return per_token * T * shape["batch_size"] / (ms_per_step / 1e3) / peak_flops


class PlainLoop:
    """nanoGPT's train.py loop (no evaluation) on the same GPT, data and settings."""

    def __init__(self, data: Path, shape: dict, config, device: torch.device, compiled: bool):
        from ringtrain.data.tokens import read_meta
        from ringtrain.models import GPT, loss_fn
        from ringtrain.training.config import adamw

        self.device, self.config, self.loss_fn = device, config, loss_fn
        torch.manual_seed(config.seed)
        self.model = GPT(model_config(data, shape)).to(device)
        make_optimizer = adamw(config.weight_decay, (config.beta1, config.beta2))
        self.optimizer = make_optimizer(self.model.parameters())
        self.forward = torch.compile(self.model) if compiled else self.model
        self.train = np.memmap(data / "train.bin", dtype=read_meta(str(data))["dtype"], mode="r")
        self.T, self.B = shape["block_size"], shape["batch_size"]
        self.step = 0
        self.batch = self.get_batch()

    def get_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(self.train) - self.T, (self.B,))
        x = torch.stack([torch.from_numpy(self.train[i:i + self.T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(self.train[i + 1:i + 1 + self.T].astype(np.int64))
                         for i in ix])
        if self.device.type == "cuda":
            return (x.pin_memory().to(self.device, non_blocking=True),
                    y.pin_memory().to(self.device, non_blocking=True))
        return x, y

    def autocast(self):
        if self.config.dtype != "bf16":
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def round(self, steps: int) -> float:
        """`steps` steps; seconds from a synchronised start to a synchronised end."""
        from ringtrain.training.config import lr_at

        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            lr = lr_at(self.step, self.config)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            x, y = self.batch
            with self.autocast():
                loss = self.loss_fn(self.forward(x), y)
            self.batch = self.get_batch()  # while the device runs forward, as nanoGPT does
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            if self.step % self.config.log_every == 0:
                loss.item()  # the logged loss: the one synchronisation per metrics line
        sync(self.device)
        return time.perf_counter() - t0


def model_config(data: Path, shape: dict):
    from ringtrain.data.tokens import read_meta
    from ringtrain.models import GPTConfig

    return GPTConfig(vocab_size=int(read_meta(str(data))["vocab_size"]),
                     block_size=shape["block_size"], n_layer=shape["n_layer"],
                     n_head=shape["n_head"], n_embd=shape["n_embd"])


def order(rounds: int) -> list[str]:
    """Warm-ups first, then pairs in alternating order: T P | P T | T P | ..."""
    return ["T", "P"] + [x for i in range(rounds) for x in (("T", "P") if i % 2 else ("P", "T"))]


def paired_run(data: Path, shape: dict, args, runtime, compiled: bool) -> dict:
    """One trainer and one plain loop, interleaved by the trainer's `on_step`; their figures."""
    from ringtrain.data.tokens import load_tokens
    from ringtrain.models import GPT, loss_fn
    from ringtrain.strategies import make_strategy
    from ringtrain.training.trainer import Trainer, TrainerConfig

    n, device = args.steps, runtime.device
    seq = order(args.rounds)
    config = TrainerConfig(
        steps=n * seq.count("T"), batch_size=shape["batch_size"], lr=OPTIM["lr"],
        weight_decay=OPTIM["weight_decay"], beta1=OPTIM["beta1"], beta2=OPTIM["beta2"],
        grad_clip=OPTIM["grad_clip"], seed=OPTIM["seed"],
        dtype="bf16" if device.type == "cuda" else "fp32",
        log_every=args.log_every, progress=False, compile=compiled).resolved()
    plain = PlainLoop(data, shape, config, device, compiled)
    tokens = load_tokens(str(data), shape["block_size"])
    trainer = Trainer(make_strategy("ddp", runtime=runtime), runtime,
                      lambda: GPT(model_config(data, shape)), tokens.train_set, None, loss_fn,
                      config)
    times: dict[str, list[float]] = {"T": [], "P": []}
    queue = list(seq[1:])  # the trainer's first round starts with fit()
    mark = [0.0]

    def on_step(step: int) -> None:
        if step % n:
            return
        sync(device)
        times["T"].append(time.perf_counter() - mark[0])
        while queue and queue[0] == "P":
            queue.pop(0)
            times["P"].append(plain.round(n))
        if queue:
            queue.pop(0)  # the trainer's next round
        sync(device)
        mark[0] = time.perf_counter()

    trainer.on_step = on_step
    sync(device)
    mark[0] = time.perf_counter()
    trainer.fit()
    trainer.strategy.close()
    t_ms = [1e3 * s / n for s in times["T"][1:]]  # the first round of each: warm-up
    p_ms = [1e3 * s / n for s in times["P"][1:]]
    out = {"compile": compiled,
           "trainer_ms": statistics.median(t_ms), "plain_ms": statistics.median(p_ms),
           "trainer_ms_rounds": [round(x, 3) for x in t_ms],
           "plain_ms_rounds": [round(x, 3) for x in p_ms],
           "warmup_ms": {"trainer": 1e3 * times["T"][0] / n, "plain": 1e3 * times["P"][0] / n}}
    out["ratio"] = out["trainer_ms"] / out["plain_ms"]
    out["ratio_paired"] = statistics.median(t / p for t, p in zip(t_ms, p_ms, strict=True))
    peak = args.peak_flops if device.type == "cuda" else None
    out["mfu_trainer"] = mfu(plain.model, shape, out["trainer_ms"], peak) if peak else None
    out["mfu_plain"] = mfu(plain.model, shape, out["plain_ms"], peak) if peak else None
    out["params"] = sum(p.numel() for p in plain.model.parameters())
    return out


def show(r: dict) -> None:
    what = "torch.compile" if r["compile"] else "eager"
    mfu_text = (f", MFU trainer {100 * r['mfu_trainer']:.1f} % / plain {100 * r['mfu_plain']:.1f} %"
                if r["mfu_trainer"] is not None else "")
    print(f"{what:14s} trainer {r['trainer_ms']:8.2f} ms/step   "
          f"plain {r['plain_ms']:8.2f} ms/step   "
          f"ratio {r['ratio']:.3f} (paired {r['ratio_paired']:.3f}){mfu_text}")
    print(f"{'':14s} rounds trainer {r['trainer_ms_rounds']}")
    print(f"{'':14s} rounds plain   {r['plain_ms_rounds']}")


def main(argv: list[str] | None = None) -> dict:
    from ringtrain.launch.network import free_port
    from ringtrain.launch.process_group import destroy_distributed, init_distributed

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compile", action="store_true", help="also the torch.compiled pair")
    p.add_argument("--steps", type=int, default=20, help="steps per round (default: 20)")
    p.add_argument("--rounds", type=int, default=8, help="timed rounds per side (default: 8)")
    p.add_argument("--log-every", type=int, default=10,
                   help="steps between metrics lines / loss.item() (default: 10, nanoGPT's "
                   "Shakespeare config; 1 syncs every step as nanoGPT's default)")
    for key in SHAPES["cpu"]:
        p.add_argument("--" + key.replace("_", "-"), type=int,
                       help=f"default: {SHAPES['cuda'][key]} on CUDA, "
                       f"{SHAPES['cpu'][key]} on the CPU")
    p.add_argument("--threads", type=int, help="torch threads on the CPU (default: 1)")
    p.add_argument("--peak-flops", type=float, default=989e12,
                   help="the device's peak for MFU (default: 989e12, H100/H200 dense bf16)")
    args = p.parse_args(argv)
    if args.steps % args.log_every:
        p.error(f"--steps {args.steps} is not a multiple of --log-every {args.log_every}: every "
                "round must hold the same number of metrics lines")
    before = os.getloadavg()
    runtime = init_distributed(
        rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port()
    )
    device = runtime.device
    if device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    defaults = SHAPES["cuda" if device.type == "cuda" else "cpu"]
    shape = {k: getattr(args, k) or v for k, v in defaults.items()}
    from ringtrain.training.config import compile_problem

    skipped = compile_problem() if args.compile else None
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_gpt_") as tmp:
            data = prepared(Path(tmp))
            for compiled in ([False, True] if args.compile and skipped is None else [False]):
                results.append(paired_run(data, shape, args, runtime, compiled))
                show(results[-1])
                gc.collect()  # the pair's models and optimizers
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the next pair gets the memory back
    finally:
        destroy_distributed()
    if skipped:
        print(f"torch.compile skipped: {skipped}")
    eager, comp = results[0], (results[1] if len(results) > 1 else None)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = {"device": name, "torch": torch.__version__, "shape": shape, "params": eager["params"],
           "steps_per_round": args.steps, "rounds": args.rounds, "log_every": args.log_every,
           "dtype": "bf16" if device.type == "cuda" else "fp32",
           "threads": torch.get_num_threads() if device.type == "cpu" else None,
           **{k: eager[k] for k in ("ratio", "ratio_paired", "trainer_ms", "plain_ms",
                                     "mfu_trainer", "mfu_plain", "trainer_ms_rounds",
                                     "plain_ms_rounds")},
           "compile": bool(comp), "compiled": comp, "compile_skipped": skipped,
           "peak_flops": args.peak_flops if device.type == "cuda" else None,
           "loadavg_before": before, "loadavg_after": os.getloadavg()}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
