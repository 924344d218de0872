"""`ringtrain.check_replicas` (ringtrain/replicas.py): replicas compared across ranks, the first
tensor that differs named with the ranks holding each version; and the trainer's end-of-run
warning naming it too.

    .venv/bin/pytest -q tests/test_replicas.py
"""

import pytest
import torch
from torch import nn

from ringtrain.replicas import divergence, first_divergence, tensor_checksums
from ringtrain.testing import run_workers


def test_one_ulp_in_one_element_changes_the_checksum_and_copies_do_not():
    torch.manual_seed(0)
    tensors = [torch.randn(5, 7), torch.randn(3, dtype=torch.bfloat16), torch.arange(4)]
    same = tensor_checksums([t.clone() for t in tensors])
    assert torch.equal(tensor_checksums(tensors), same) and same.dtype == torch.int64
    nudged = tensors[0].clone()
    nudged[2, 3] = torch.nextafter(nudged[2, 3], torch.tensor(10.0))
    assert tensor_checksums([nudged, *tensors[1:]]).tolist()[0] != same.tolist()[0]
    assert tensor_checksums([nudged, *tensors[1:]]).tolist()[1:] == same.tolist()[1:]


def test_the_first_differing_tensor_is_named_with_each_versions_ranks():
    names = ["embed", "block.weight", "head"]
    assert first_divergence(names, {0: [1, 2, 3], 1: [1, 2, 3]}) is None
    said = first_divergence(names, {0: [1, 2, 3], 1: [1, 9, 8], 2: [1, 2, 3]})
    assert said == ("2 of 3 tensors differ across ranks; the first is 'block.weight', one version "
                    "per group of ranks: 0, 2 | 1")


def test_the_trainers_gather_path_names_the_tensor():
    state = {"a": torch.zeros(3), "b": torch.ones(2)}
    other = {"a": torch.zeros(3), "b": torch.tensor([1.0, 2.0])}
    mine = ",".join(str(x) for x in tensor_checksums(state.values()).tolist())
    theirs = ",".join(str(x) for x in tensor_checksums(other.values()).tolist())
    said = divergence(state, lambda text: {0: text, 1: theirs})
    assert "the first is 'b'" in said and "0 | 1" in said
    assert divergence(state, lambda text: {0: text, 1: mine}) is None


def _check(rank, world_size, nudge):
    import ringtrain

    torch.manual_seed(0)
    model = ringtrain.DistributedDataParallel(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    )
    before = ringtrain.check_replicas(model)  # the wrapper: its module is compared
    if nudge and rank == 1:
        with torch.no_grad():
            model.module[2].bias[0] += 1e-6  # one rank's weights move on their own
    try:
        ringtrain.check_replicas(model)
    except ringtrain.ReplicasDivergedError as e:
        return before, str(e)
    return before, None


@pytest.mark.parametrize("nudge", [False, True])
def test_two_ranks_agree_or_both_name_the_nudged_tensor(nudge):
    out = run_workers(_check, 2, (nudge,), timeout_s=90)
    assert [before for before, _ in out] == [None, None]
    errors = [e for _, e in out]
    if not nudge:
        assert errors == [None, None]
        return
    assert errors[0] == errors[1] and errors[0].startswith("replicas diverged: 1 of 4 tensors")
    assert "the first is '2.bias', one version per group of ranks: 0 | 1" in errors[0]


def test_without_a_process_group_check_replicas_says_how_to_start_one(clean_env):
    from ringtrain import check_replicas

    with pytest.raises(ValueError, match=r"none is initialised: call "
                                         r"ringtrain\.init_distributed\(\) first"):
        check_replicas(nn.Linear(2, 2))
