"""Data for `ringtrain train`: the embedded addition task, text, and token files.

Read in this order:
- `sampler.py`: `DistributedSampler`, resumable and re-shardable (every sample once an epoch).
- `addition.py`: the embedded default task (2-digit addition).
- `prepare.py`: `ringtrain prepare`, text -> train.bin / val.bin token files, streaming.
- `tokens.py`: a prepared directory memory-mapped as training and validation windows.
- `chars.py`: character-level text held in memory (the library's `CharDataset`, `TextData`).
- `sample_log.py`: `--record-samples`, which samples each step consumed, checked exactly-once.
"""

from ringtrain.data.addition import AdditionDataset, exact_match
from ringtrain.data.chars import CharDataset, TextData, load_text

__all__ = ["AdditionDataset", "CharDataset", "TextData", "exact_match", "load_text"]
