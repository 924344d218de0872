"""Why smaller per-device batches help a large model fit: activation memory scales with the batch.

    .venv/bin/python examples/concepts/batch_memory.py         # < 10 s, one process

A training step holds, per device, the weights, their gradients and the optimizer's state
(AdamW: two more tensors per weight), 16 bytes per fp32 parameter whatever the batch, plus the
activations autograd saves during forward for backward, which grow with the per-device batch.
This counts both for the `--data` default GPT (4 layers x 128, block 64; vocabulary 65, as for
Shakespeare) at several batch sizes: the saved activations are measured with
`torch.autograd.graph.saved_tensors_hooks` (a storage saved twice counts once, weights not at
all). Splitting a global batch of 64 over 2 data-parallel ranks (32 each) or into 2
accumulation micro-batches (`--grad-accum 2`) halves the activations each device holds;
pipeline parallelism (`--strategy pipeline`) splits the fixed part instead.
"""

from __future__ import annotations

import torch

from ringtrain.models import GPT, GPTConfig, loss_fn


def saved_activation_bytes(model: torch.nn.Module, batch: int, block: int, vocab: int) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    g = torch.Generator().manual_seed(0)
    x = torch.randint(vocab, (batch, block), generator=g)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model(x), torch.randint(vocab, (batch, block), generator=g))
    loss.backward()
    return sum(seen.values())


def main() -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_embd=128)
    model = GPT(config)
    params = sum(p.numel() for p in model.parameters())
    fixed = params * 16  # weights + gradients + AdamW's two moments, fp32
    print(f"GPT {params:,} parameters: weights, gradients and AdamW state {fixed / 1e6:.1f} MB per "
          "device, whatever the batch")
    print(f"{'batch per device':>17}{'saved activations':>19}{'total':>10}")
    for batch in (64, 32, 16, 8):
        act = saved_activation_bytes(model, batch, config.block_size, config.vocab_size)
        print(f"{batch:>17}{act / 1e6:>16.1f} MB{(act + fixed) / 1e6:>7.1f} MB")


if __name__ == "__main__":
    main()
