"""Every private torch name ringtrain relies on, in one package, looked up once at import.

torch gives no stability promise for names that start with an underscore (nor for module
attributes it does not document), and users' machines come with the torch they have (a GPU
image had 2.11 while we tested 2.13). So a name this torch lacks never fails `import
ringtrain`: it switches off only the feature that needs it, which then, as each section of the
modules below says, uses a public equivalent (nothing lost), or keeps torch's own behaviour and
warns once per process what the user loses (`TorchFeatureWarning`), or also raises
`TorchInternalsError` (the torch version, the missing name, what to install) when the feature is
actually used.

Read in this order: `features.py`, how a name is looked up and a feature switched off; then,
for which names each feature needs and what it does without them, by the part of torch they
reach into:
- `autograd.py`: inside a backward (the TLS guard, the end-of-backward callback, version
  counters, a parameter's tensor hooks);
- `data.py`: a DataLoader iterator's count of batches handed out (what a sampler's state saves);
- `distributed.py`: a process group's internals (its sequence number, the default store, its
  timeout; flat chunks to broadcast);
- `elastic.py`: torch.distributed.elastic's agent and rendezvous, which ringtrain.launch changes;
- `foreach.py`: torch's foreach ops (a snapshot's copies in one call);
- `modules.py`: torch.nn's BatchNorm base class.
Callers import every name from this package. `TESTED_TORCH` lists the torch versions the suite
passed on (`make test-torch TORCH_VERSION=...`), `TORCH_RANGE` is pyproject.toml's range, and
`FEATURES` says at run time what is off. On those versions:

    feature                                   2.11, 2.12                             2.13-2.15
    backward_tls_free (_remove_obj_from_tls)  off, silent: the exit handler suffices  on
    every other feature                       on                                     on

No other module of ringtrain touches these names (`tests/test_torch_internals.py` checks it).
"""

from __future__ import annotations

# Re-exported (`X as X`): callers and tests import them from the package.
from ringtrain.torch_internals import autograd, data, distributed, elastic, foreach, modules
from ringtrain.torch_internals.autograd import _TLS as _TLS  # tests turn it off
from ringtrain.torch_internals.autograd import backward_tls_free as backward_tls_free
from ringtrain.torch_internals.autograd import current_autograd_node as current_autograd_node
from ringtrain.torch_internals.autograd import preserve_version_counter as preserve_version_counter
from ringtrain.torch_internals.autograd import queue_backward_callback as queue_backward_callback
from ringtrain.torch_internals.autograd import tensor_hooks as tensor_hooks
from ringtrain.torch_internals.autograd import tensor_hooks_held_off as tensor_hooks_held_off
from ringtrain.torch_internals.data import driving_loader as driving_loader
from ringtrain.torch_internals.data import samples_handed_out as samples_handed_out
from ringtrain.torch_internals.distributed import default_store as default_store
from ringtrain.torch_internals.distributed import flatten_dense_tensors as flatten_dense_tensors
from ringtrain.torch_internals.distributed import group_timeout as group_timeout
from ringtrain.torch_internals.distributed import process_groups as process_groups
from ringtrain.torch_internals.distributed import sequence_number as sequence_number
from ringtrain.torch_internals.distributed import (
    unflatten_dense_tensors as unflatten_dense_tensors,
)
from ringtrain.torch_internals.elastic import CAPTURE_PROCESS_FAILURES as CAPTURE_PROCESS_FAILURES
from ringtrain.torch_internals.elastic import EXIT_BARRIER as EXIT_BARRIER
from ringtrain.torch_internals.elastic import MONITOR_WORKERS as MONITOR_WORKERS
from ringtrain.torch_internals.elastic import RDZV_REGISTRY as RDZV_REGISTRY
from ringtrain.torch_internals.elastic import RESTART_WORKERS as RESTART_WORKERS
from ringtrain.torch_internals.elastic import START_WORKERS as START_WORKERS
from ringtrain.torch_internals.elastic import adopt as adopt
from ringtrain.torch_internals.elastic import mark_finished as mark_finished
from ringtrain.torch_internals.elastic import matches_machine_hostname as matches_machine_hostname
from ringtrain.torch_internals.elastic import running_workers as running_workers
from ringtrain.torch_internals.elastic import set_remaining_restarts as set_remaining_restarts
from ringtrain.torch_internals.elastic import spawn_like as spawn_like
from ringtrain.torch_internals.elastic import starting_workers_with as starting_workers_with
from ringtrain.torch_internals.elastic import sync_worker_ids as sync_worker_ids
from ringtrain.torch_internals.features import TESTED_TORCH as TESTED_TORCH
from ringtrain.torch_internals.features import TORCH_RANGE as TORCH_RANGE
from ringtrain.torch_internals.features import Feature as Feature
from ringtrain.torch_internals.features import PatchPoint as PatchPoint
from ringtrain.torch_internals.features import TorchFeatureWarning as TorchFeatureWarning
from ringtrain.torch_internals.features import TorchInternalsError as TorchInternalsError
from ringtrain.torch_internals.foreach import copy_tensors as copy_tensors
from ringtrain.torch_internals.modules import BatchNorm as BatchNorm

#: Every feature, module by module; `[f for f in FEATURES if not f.on]` are off on this torch.
FEATURES: list[Feature] = [*autograd.FEATURES, *data.FEATURES, *distributed.FEATURES,
                           *elastic.FEATURES, *foreach.FEATURES, *modules.FEATURES]

# Say once, now, what this torch turns off (a feature whose loss nothing measured, as
# backward_tls_free's on 2.11 and 2.12, says nothing: its `when_off` is None).
for _f in FEATURES:
    _f.announce()
