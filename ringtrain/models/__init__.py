"""Models trained by `ringtrain train`. They import nothing from ringtrain's distributed parts."""

from ringtrain.models.gpt import GPT, GPTConfig, loss_fn

__all__ = ["GPT", "GPTConfig", "loss_fn"]
