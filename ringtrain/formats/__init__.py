"""Checkpoints in the formats the rest of the ecosystem reads, and back.

Read `hf_gpt2.py` first (ringtrain's GPT <-> a transformers `GPT2LMHeadModel` directory: the
name and layout mapping, what is refused), then `dcp.py` (<-> a torch distributed checkpoint
directory, loadable by `torch.distributed.checkpoint.load` on any world size), then
`init_from.py` (`ringtrain train --init-from DIR`: which format a directory holds, and loading
it into the run's model). `ringtrain export` (ringtrain/cli/export.py) writes either from a
run's final model or one of its snapshots.

Imports only `models`: a format is a model's weights in other names, nothing distributed is
needed to write or read one (DCP is written and read by one process, `no_dist`).
"""
