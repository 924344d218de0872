"""Snapshots and resume: nothing a run has done is lost to a crash, a signal or a full disk.

Read in this order:
- `files.py`: durable writes, checksums, manifests (one file at a time, no processes).
- `snapshot.py`: `SnapshotManager`, a save as a bounded collective step, committed last;
  finding and loading snapshots.
- `handshake.py`: how the ranks of one save talk through the store (keys, failure reports that
  every rank raises alike, waits bounded by deadlines).
- `host_copy.py`: a save's state copied to host memory (`HostCopy`): the parameters and moments
  a strategy declares in `Strategy.updated_state()` beside the next step, fenced before its
  optimizer step, the rest in the step.
- `copy_plan.py`: that copy's walk of the state kept from save to save (`CopyPlan`), replayed
  after a cheap check while the state's tensors are the same; the full walk is the reference.
- `device_staging.py`: on CUDA with room, those go through device buffers kept from save to
  save (a copy on the device in the step, to the host by the writer), so nothing is fenced.
- `background.py`: a save in the background: that copy, the rest of `SnapshotManager.save` on
  a writer thread (`BackgroundSave`), the one save in flight (`BackgroundSaves`).
- `writer.py`: the files written by a long-lived process instead (`WriterProcess`, an option).
- `commit.py`: rank 0's directory work: the commit (rename, `COMMITTED` last) and the rotation
  that keeps the newest `keep` snapshots.
- `rewind.py`: going back to an earlier snapshot on purpose (`--resume-from STEP`): the later
  ones set aside whole, never deleted.
- `sharded.py`: several saved ranks' parts read for one rank (a sharded resume on M ranks).
- `rng.py`: each rank's random generators (Python, NumPy, torch, CUDA), saved and restored.
- `run_dir.py`: the run directory checked before a run, and the words for a full disk.
- `rules.py`: the rules of a resume as plain functions: which options must match
  (`config_differences`), the global batch kept on another world size (`elastic_batch`), the
  (seed, rank, step) reseed.
- `resume.py`: `Checkpointer`, what the training loop saves and how it resumes (exact, elastic
  on another world size, or in another strategy or layout through the layout-free form of
  `ringtrain.strategies.portable`), applying `rules.py`.
- `stop.py`: `StopSignal` (SIGTERM/SIGINT/SIGUSR1 become a flag the loop votes on, then a
  saved stop); still importable from `resume.py`, as the rules are.

May import: torch, `ringtrain.runtime`, `ringtrain.torch_internals`, `ringtrain.errors`,
`ringtrain.store_keys`, `ringtrain.agreement` (the strategy's agreement), `ringtrain.strategies`
(the seam, for types; the registry, whose converters read another strategy's snapshot),
`ringtrain.collectives`. Never the trainer: the loop hands over its
`LoopState`.

"""
