"""Model parallelism: split the layers over devices, so that each holds only its share.

    .venv/bin/python examples/concepts/pipeline_split.py        # < 5 s, no processes

`ringtrain.pipeline.partition` (pure planning) cuts a model into `pp` stages of consecutive
layers, balanced by parameter count; `ringtrain train --strategy pipeline --pp N` puts one stage
on each rank and streams micro-batches through them (`ringtrain/pipeline/schedule.py`: GPipe,
the simple schedule, then 1F1B; `engine.py` runs one stage). This prints, for the `--data`
default GPT (4 layers x 128, vocabulary 65), what each stage holds: its layers, its parameters,
and the 16 bytes per parameter of weights, gradients and AdamW state that it alone keeps; and
what crosses each stage boundary per sample: one activation of block x width fp32 numbers.
"""

from __future__ import annotations

import torch

from ringtrain.models import GPT, GPTConfig
from ringtrain.pipeline.partition import partition


def main() -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_embd=128)
    model = GPT(config)
    total = sum(p.numel() for p in model.parameters())
    print(f"GPT {total:,} parameters: {total * 16 / 1e6:.1f} MB of weights, gradients and AdamW "
          "state on one device")
    for pp in (2, 4):
        stages = partition(model.to_sequential(), pp)
        print(f"--pp {pp}:")
        for s, stage in enumerate(stages):
            n = sum(p.numel() for p in stage.parameters())
            # Sequential keys: 0 the embedding, 1..n_layer the blocks, then the head.
            names = ", ".join(f"block {int(k) - 1}" if type(m).__name__ == "Block"
                              else type(m).__name__.lower() for k, m in stage.named_children())
            print(f"  stage {s}: {n:>7,} parameters ({n / total:4.0%}), "
                  f"{n * 16 / 1e6:4.1f} MB  [{names}]")
    boundary = config.block_size * config.n_embd * 4
    print(f"between stages, per sample: {config.block_size} x {config.n_embd} fp32 = {boundary:,} "
          "bytes forward (activation) and as many backward (its gradient)")


if __name__ == "__main__":
    main()
