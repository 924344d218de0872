"""Data for `ringtrain train`: the embedded addition task and character-level text."""

from ringtrain.data.addition import AdditionDataset, exact_match
from ringtrain.data.chars import CharDataset, TextData, load_text

__all__ = ["AdditionDataset", "CharDataset", "TextData", "exact_match", "load_text"]
