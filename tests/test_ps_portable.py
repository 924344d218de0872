"""A parameter-server snapshot resumed by another strategy: the servers' pieces joined into the
layout-free form (`ringtrain.strategies.ps_portable`, `PSStrategy.to_portable`).

    .venv/bin/pytest -q tests/test_ps_portable.py

4 gloo ranks on CPU (2 workers, 2 servers; the 24x24 matrix split in rows across the servers).
The form's parameters are the servers' bit for bit; its AdamW moments are those of one process
on the global batch; one process that loads it and trains on goes where the servers went, and
so do servers of another layout (1 server, 2 workers) that take it on.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_ps import LRS, OPTIMIZERS, batch, mse, ps_strategy, tiny_model

from ringtrain.errors import ConfigError
from ringtrain.strategies import portable
from ringtrain.strategies.ps import PSStrategy
from ringtrain.testing import run_workers

WORKERS, SERVERS, STOP, STEPS = 2, 2, 3, 5


def _train(rank, world_size):
    s = ps_strategy("sync", SERVERS, "adamw", split_numel=100)
    trains = not s.topology.is_server(rank)

    def train(first: int, last: int) -> None:
        for step in range(first, last):
            s.train_step([batch(step, rank)] if trains else [], lr=LRS[step], grad_clip=None)

    train(0, STOP)
    part = copy.deepcopy(s.state_dict())  # a snapshot's copy (the optimizer's state goes on)
    at_stop = s.model_state_dict()
    train(STOP, STEPS)
    at_end = s.model_state_dict()
    s.close()
    return part, at_stop, at_end


def _taken_on(rank, world_size, state):
    """A parameter server of another layout (1 server) takes the form on and trains on."""
    s = ps_strategy("sync", 1, "adamw", split_numel=100)
    torch.manual_seed(rank)
    with torch.no_grad():  # other weights on every rank: every value must come from the form
        for p in s.module.parameters():
            p.normal_()
    s.load_portable_state_dict(state)
    trains = not s.topology.is_server(rank)
    for step in range(STOP, STEPS):
        s.train_step([batch(step, rank)] if trains else [], lr=LRS[step], grad_clip=None)
    at_end = s.model_state_dict()
    s.close()
    return at_end


def _global_step(model, opt, step: int) -> None:
    """One process on both workers' batches (sync ps is data parallel)."""
    xs, ys = zip(*(batch(step, w) for w in range(WORKERS)), strict=True)
    opt.zero_grad()
    mse(model(torch.cat(xs)), torch.cat(ys)).backward()
    for g in opt.param_groups:
        g["lr"] = LRS[step]
    opt.step()


def _named(opt, model) -> list[str]:
    return portable.optimizer_param_names(opt, portable.param_names(model))


@pytest.fixture(scope="module")
def ranks():
    return run_workers(_train, WORKERS + SERVERS, timeout_s=90)


def test_the_servers_pieces_join_into_the_model_and_its_adamw_state(ranks):
    parts = {r: part for r, (part, _, _) in enumerate(ranks)}
    assert any(p[1] > 0 for part in parts.values() if "server" in part
               for p in part["server"]["pieces"])  # a matrix split in rows
    state = PSStrategy.to_portable(lambda wanted: {r: parts[r] for r in wanted}, None,
                                   {"world_size": WORKERS + SERVERS})
    at_stop = ranks[0][1]
    for name, value in at_stop.items():
        assert torch.equal(state["model"][name], value), name
    model = tiny_model()  # the reference: one process, the global batch, to the snapshot
    opt = OPTIMIZERS["adamw"](model.parameters())
    for step in range(STOP):
        _global_step(model, opt, step)
    ref = portable.optimizer_by_name(opt.state_dict(), _named(opt, model))["state"]
    assert state["optimizer"]["state"].keys() == ref.keys() == at_stop.keys()
    for name, moments in ref.items():
        assert float(state["optimizer"]["state"][name]["step"]) == STOP
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state["optimizer"]["state"][name][key], moments[key],
                                       rtol=1e-5, atol=1e-7)

    # One process takes the form on and trains as the servers did after the snapshot.
    model = tiny_model()
    torch.nn.init.zeros_(model[0].weight)  # every value must come from the snapshot
    opt = OPTIMIZERS["adamw"](model.parameters())
    portable.load_model(model, state["model"])
    portable.load_optimizer(opt, _named(opt, model), state["optimizer"])
    for step in range(STOP, STEPS):
        _global_step(model, opt, step)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ranks[0][2][name], rtol=1e-5, atol=1e-6)


def test_a_snapshot_of_a_ringtrain_before_the_converter_is_refused(ranks):
    parts = {r: dict(part) for r, (part, _, _) in enumerate(ranks)}  # the fixture's stay whole
    server = next(part for part in parts.values() if "server" in part)
    server["server"] = {k: v for k, v in server["server"].items() if k != "param_pieces"}
    with pytest.raises(ConfigError, match=r"did not name its optimizer's pieces.*--strategy ps"):
        PSStrategy.to_portable(lambda wanted: {r: parts[r] for r in wanted}, None,
                               {"world_size": WORKERS + SERVERS})


def test_servers_of_another_layout_take_the_form_on(ranks):
    parts = {r: part for r, (part, _, _) in enumerate(ranks)}
    state = PSStrategy.to_portable(lambda wanted: {r: parts[r] for r in wanted}, None,
                                   {"world_size": WORKERS + SERVERS})
    for at_end in run_workers(_taken_on, WORKERS + 1, args=(state,), timeout_s=90):
        for name, value in ranks[0][2].items():
            torch.testing.assert_close(at_end[name], value, rtol=1e-5, atol=1e-6)
