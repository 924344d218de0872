"""The training loop: model-agnostic, it hands micro-batches to a strategy and reduces results.

Read in this order:
- `config.py`: `TrainerConfig`, the LR schedule, the default optimizer, seeds and hashes.
- `state.py`: `LoopState`, the loop's own state (step, metrics window, tokens, sampler cursor).
- `trainer.py`: `Trainer.fit()`: the step loop; it calls the modules below at its edges.
- `record.py`: a logged step's record: the window's and eval sums reduced in one call, the
  NaN check, the metrics line (a live job's line whose sum failed, held for the next: `HeldLine`).
- `metrics_file.py`: `RankZeroMetrics`, metrics.jsonl on whichever process is rank 0 now (a
  live job's rank 0 may be lost: the next one takes the file over).
- `snapshots.py`: when the loop saves (none once a rank has left) and how it stops on a signal
  (`STOP_SIGNALS`, the save and the line that end a stopped run).
- `ending.py`: `RunEnd`, the end of the run in an order that keeps the ranks together: every
  rank's collectives (the final model, its digest), then the last snapshot's write, then files.
- `summary.py`: what the end computes and writes: the replicas' digests compared, the summary,
  summary.json, report.png.
- `batches.py`: `MicroBatches`, a data rank's training batches (sampler order, pinned on CUDA).
- `live.py`: `LiveDriver`, the live mode's steps (`--live`): each step's share of the
  fault-free global batch over whoever is left, recovered in memory through `ringtrain.live`.
- `evaluate.py`: evaluation on the exact eval shard the strategy names.
- `progress.py`: the progress bar, rank-prefixed logging, metrics.jsonl and summary.json.
- `report.py`: report.png from metrics.jsonl.
- `tensorboard.py`: the same metrics as TensorBoard event files (rank 0, when installed).

May import: torch, `ringtrain.strategies` (the seam only: `Strategy`, `StepResult`),
`ringtrain.checkpoint`, `ringtrain.data.sampler`, `ringtrain.runtime`, `ringtrain.types`,
`ringtrain.errors`, `ringtrain.trace`, `ringtrain.replicas`, `ringtrain.config` (options),
`ringtrain.live` (the live mode's generations, commits and batches).
Never a concrete strategy, model or launcher; agreement comes from the strategy.
"""

from ringtrain.training.config import TrainerConfig
from ringtrain.training.state import LoopState
from ringtrain.training.trainer import Trainer

__all__ = ["LoopState", "Trainer", "TrainerConfig"]
