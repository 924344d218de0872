"""Training across slow links by syncing rarely: local SGD and DiLoCo's outer step.

Every worker takes H optimizer steps on its own data with no communication, then the workers
meet once: local SGD averages their weights; DiLoCo (Douillard et al. 2023) all-reduces the
pseudo-gradient (the weights at the last outer step minus the worker's weights now) and applies
it with an outer optimizer (SGD with Nesterov momentum). One meeting per H steps instead of one
gradient all-reduce per step: about H times fewer bytes.

Read in this order:
- `outer.py`: `average_weights` (local SGD, the reference) and `OuterStep` (DiLoCo).
- `compress.py`: how the pseudo-gradient travels: fp32, bf16, or int8 with a per-tensor scale.
The strategies are `ringtrain/strategies/localsgd.py` and `ringtrain/strategies/diloco.py`.
May import: torch, `ringtrain.errors`, `ringtrain.collectives`.
"""
