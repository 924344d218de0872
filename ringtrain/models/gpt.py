"""A minGPT-style GPT: token + position embedding, pre-LayerNorm causal blocks, LM head.

The model returns logits; the loss is separate (`loss_fn`) so strategies can split forward and
loss (a pipeline computes the loss on its last stage only). It imports nothing from the
distributed parts of ringtrain: parallelism is applied from outside.

    python -c "from ringtrain.models import GPT, GPTConfig; \
import torch; m = GPT(GPTConfig(vocab_size=10, block_size=6)); \
print(m(torch.zeros(2, 6).long()).shape)"


The model is built from three kinds of stage module, so that `to_sequential()` can hand a
pipeline the very same parameter objects:

    model.embed        Embedding: wte (token), wpe (position), dropout
    model.blocks[i]    Block i of n_layer
    model.head         Head: ln_f (final LayerNorm), lm_head

Parameter-name mapping between `model.to_sequential()` and `model` (see `sequential_name`):

    seq "0.<rest>"              <-> model "embed.<rest>"
    seq "<i>.<rest>", 1<=i<=L   <-> model "blocks.<i-1>.<rest>"
    seq "<L+1>.<rest>"          <-> model "head.<rest>"
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT. Validates itself and says what to change.

    Args:
        vocab_size: number of token ids.
        block_size: longest sequence the position embedding covers.
        n_layer, n_head, n_embd: depth, attention heads, width (n_embd % n_head == 0).
        dropout: on embeddings, attention weights and residual branches (0 for exact tests).
        tie_embeddings: share the token embedding with lm_head (off by default, as minGPT;
            tying makes the first and last pipeline stages hold one tensor).
        bias: biases in Linear and LayerNorm.
        activation_checkpointing: keep only each block's input in forward and recompute the
            block in backward (`torch.utils.checkpoint`, non-reentrant): less memory for
            activations, about one more forward of the blocks per step; same gradients.
    """

    vocab_size: int
    block_size: int
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    tie_embeddings: bool = False
    bias: bool = True
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r}: it must be a positive integer")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                "choose n_embd as a multiple of n_head "
                f"(e.g. {self.n_head * max(1, self.n_embd // self.n_head)})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout}: it must be in [0, 1)")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t only."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        # q, k, v at once
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # is_causal applies the lower-triangular mask without storing it as a buffer, so the
        # model has no buffers for DDP to broadcast and its state_dict is parameters only.
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias),
            nn.Dropout(config.dropout),
        )
        self.checkpoint = config.activation_checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint and torch.is_grad_enabled():
            # Non-reentrant: parameter hooks (DDP's, ZeRO's gathers) and no_sync see the
            # recompute like any backward; the RNG is replayed, so dropout masks match.
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    """First stage: token ids (B, T) -> token + position embeddings (B, T, C)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.block_size = config.block_size
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        if T > self.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size={self.block_size}; crop the input to the "
                "last block_size tokens or build the model with a larger block_size"
            )
        pos = torch.arange(T, device=idx.device)  # (T,)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)


class Head(nn.Module):
    """Last stage: hidden states (B, T, C) -> logits (B, T, vocab_size)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(nn.Module):
    """The GPT language model: `model(idx)` maps token ids (B, T) to logits (B, T, vocab_size)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.head = Head(config)
        if config.tie_embeddings:
            self.head.lm_head.weight = self.embed.wte.weight  # one Parameter, two users
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer) so the residual stream's
        # variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("attn.c_proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def to_sequential(self) -> nn.Sequential:
        """[embed, blocks..., head] as an `nn.Sequential` holding this model's own parameters.

        `seq(idx)` equals `self(idx)`; training either trains both. Names map as described in
        the module docstring (`sequential_name` converts).
        """
        return nn.Sequential(self.embed, *self.blocks, self.head)

    def sequential_name(self, seq_name: str) -> str:
        """Model parameter name for a `to_sequential()` parameter name, e.g. '1.ln_1.weight' ->
        'blocks.0.ln_1.weight'."""
        index, _, rest = seq_name.partition(".")
        i, n = int(index), self.config.n_layer
        if i == 0:
            return f"embed.{rest}"
        if i <= n:
            return f"blocks.{i - 1}.{rest}"
        if i == n + 1:
            return f"head.{rest}"
        raise ValueError(f"{seq_name!r}: stage index {i} is outside 0..{n + 1} for n_layer={n}")

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 vocab: int | None = None) -> torch.Tensor:
        """Append `max_new_tokens` sampled tokens to `idx` (B, T); temperature 0 means greedy.

        Args:
            vocab: draw only ids below it: the tokenizer's size, where the model's vocabulary
                is padded (its extra rows are no token; training only pushes their logits down,
                so a warm sample could still draw one). None: every row.
            generator: the draws' generator. They are made on its device (a CPU generator, the
                usual one, samples a CUDA model's probabilities on the CPU): torch refuses a
                generator of another device, and the same seed then gives the same text on
                either device wherever the probabilities agree.
        """
        idx = idx.to(self.embed.wte.weight.device)
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size:])[:, -1, :vocab]  # (B, vocab)
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits.float(), dim=-1)
                if generator is not None:
                    probs = probs.to(generator.device)
                nxt = torch.multinomial(probs, 1, generator=generator).to(idx.device)
            idx = torch.cat((idx, nxt), dim=1)
        return idx


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over target positions; targets of -1 are ignored (minGPT's adder)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1),
                           ignore_index=-1)
