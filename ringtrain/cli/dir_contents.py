"""What a directory holds of ringtrain's, read the same way by every command that takes one.

    holds("runs/a")       # "a run"
    holds("data/shakes")  # "a prepared dataset"
    holds("gpt2_dir")     # "an hf export" ("a dcp export", "a ringtrain export")

Each command refuses the others' directories with the command that reads them: `ringtrain
train --run-dir` an export (the run would write its config.json and model.safetensors over the
export's) or a dataset; `--data` a run or an export; `ringtrain prepare` a run or an export;
`ringtrain explain` anything but a run.
"""

from __future__ import annotations

import os


def holds(path: str) -> str | None:
    """What the directory `path` holds of ringtrain's: "a run", "a prepared dataset", "an hf
    export", "a dcp export", "a ringtrain export", or None (nothing of these; not there)."""
    import json

    from ringtrain.cli.sample import _is_run
    from ringtrain.data.prepare import FORMAT, META
    from ringtrain.formats.hf_gpt2 import FormatError
    from ringtrain.formats.init_from import detect

    if not os.path.isdir(path):
        return None
    ran = ("snapshots", "metrics.jsonl")  # a run's, whatever else is there
    if _is_run(path) or any(os.path.exists(os.path.join(path, n)) for n in ran):
        return "a run"
    try:
        with open(os.path.join(path, META), encoding="utf-8") as f:
            if json.load(f).get("format") == FORMAT:
                return "a prepared dataset"
    except (OSError, ValueError, AttributeError):
        pass
    try:  # one model: read by --init-from and sample
        return {"hf": "an hf", "dcp": "a dcp", "ringtrain": "a ringtrain"}[detect(path)] + \
            " export"
    except FormatError:
        return None
