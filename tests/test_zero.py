"""ZeRO stages 1, 2, 3 (`ringtrain.zero`) against our DDP and a single process.

    .venv/bin/pytest -q tests/test_zero.py

Pure tests of the plan; then on 2 and 3 gloo ranks, 5 AdamW steps of a small GPT under each
stage, plain and with clipping + gradient accumulation, compared with
`ringtrain.DistributedDataParallel` and with one process on the concatenated batch; and the bytes
each rank holds, counted from the tensors, against the ZeRO formulas. The rings ZeRO
communicates with, against their naive references: tests/test_rings.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from ringtrain.ddp.distributed import DistributedDataParallel
from ringtrain.models import GPT, GPTConfig, loss_fn
from ringtrain.testing import run_workers
from ringtrain.training.config import adamw
from ringtrain.zero import ZeroDataParallel, expected_bytes, plan_units, reshard

MODEL = GPTConfig(vocab_size=10, block_size=6, n_layer=2, n_head=2, n_embd=16)
STEPS, B = 5, 4  # B samples per rank per step


# ---- the plan (pure) ---------------------------------------------------------------------------

def test_plan_pads_each_unit_and_cuts_equal_shards():
    plans = plan_units([[("a", (3, 2)), ("b", (1,))], [("c", (4,))]], world_size=3)
    assert [(p.numel, p.padded, p.shard_numel) for p in plans] == [(7, 9, 3), (4, 6, 2)]
    assert [s.offset for s in plans[0].slots] == [0, 6]
    assert plans[0].owned(0) == [(0, 0, 3)]
    assert plans[0].owned(1) == [(0, 3, 6)]
    assert plans[0].owned(2) == [(1, 0, 1)]  # b, then padding
    assert plans[1].owned(2) == []  # only padding


def test_plan_errors_name_the_value():
    with pytest.raises(ValueError, match="world_size=0"):
        plan_units([[("a", (2,))]], 0)
    with pytest.raises(ValueError, match="'a' is in two units"):
        plan_units([[("a", (2,))], [("a", (2,))]], 2)
    with pytest.raises(ValueError, match="stage=4"):
        expected_bytes(10, 2, 4)


def test_expected_bytes_follow_the_paper():
    assert expected_bytes(100, 4, 1) == {"params": 400, "grads": 400, "optimizer": 200}
    assert expected_bytes(100, 4, 2) == {"params": 400, "grads": 100, "optimizer": 200}
    assert expected_bytes(100, 4, 3) == {"params": 100, "grads": 100, "optimizer": 200}


def _misuse(rank, world_size):
    """The errors a user meets, raised alike on every rank (nobody left in a collective)."""
    errors = []
    z = ZeroDataParallel(GPT(MODEL), adamw(0.1), stage=3)
    x, y = _batch(0, world_size)
    loss_fn(z(x[:B]), y[:B]).backward()
    try:
        z.module(x[:B])  # the plain module while stage 3 has freed its parameters
    except RuntimeError as e:
        errors.append(str(e))
    try:
        loss_fn(z(x[:B]), y[:B]).backward()  # no zero_grad, no no_sync
    except RuntimeError as e:
        errors.append(str(e))
    dist.barrier()
    return errors


def _memory_misuse_reshard(rank, world_size):
    return {"memory": _memory(rank, world_size), "misuse": _misuse(rank, world_size),
            "reshard": _reshard(rank, world_size) if world_size == 3 else None}


@functools.cache
def _one_run(world_size):
    """One spawned run per world size for the bytes, misuse and reshard (spawning costs seconds)."""
    return run_workers(_memory_misuse_reshard, world_size, timeout_s=60)


# ---- training: ZeRO vs DDP vs one process ------------------------------------------------------

def _batch(step, world_size):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, MODEL.vocab_size, (world_size * B, MODEL.block_size), generator=g)
    return x, torch.roll(x, 1, dims=1)


def _run(model, step_fn, world_size, rank, accum):
    for step in range(STEPS):
        x, y = _batch(step, world_size)
        x, y = x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B]
        micro = [(x[:B // 2], y[:B // 2]), (x[B // 2:], y[B // 2:])] if accum else [(x, y)]
        step_fn(micro)


def _micro_loop(wrapper, micro):
    for i, (x, y) in enumerate(micro):
        ctx = wrapper.no_sync() if i < len(micro) - 1 else _null()
        with ctx:
            (loss_fn(wrapper(x), y) * (len(x) / sum(len(m[0]) for m in micro))).backward()


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _train(rank, world_size, variants):
    out = {}
    for accum, clip in variants:
        torch.manual_seed(0)
        ddp = DistributedDataParallel(GPT(MODEL))
        opt = adamw(0.1)(ddp.module.parameters())
        for g in opt.param_groups:
            g["lr"] = 1e-2

        def ddp_step(micro, ddp=ddp, opt=opt, clip=clip):
            _micro_loop(ddp, micro)
            if clip:
                torch.nn.utils.clip_grad_norm_(ddp.module.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        _run(ddp, ddp_step, world_size, rank, accum)
        out[("ddp", accum, clip)] = {k: v.clone() for k, v in ddp.module.state_dict().items()}
        for stage in (1, 2, 3):
            torch.manual_seed(0)
            z = ZeroDataParallel(GPT(MODEL), adamw(0.1), stage=stage)
            for g in z.optimizer.param_groups:
                g["lr"] = 1e-2

            def zero_step(micro, z=z, clip=clip):
                _micro_loop(z, micro)
                if clip:
                    z.clip_grad_norm_(clip)
                z.optimizer.step()
                z.optimizer.zero_grad()
            _run(z, zero_step, world_size, rank, accum)
            out[(stage, accum, clip)] = z.full_state_dict()
    return out


def _single(world_size, clip):
    torch.manual_seed(0)
    model = GPT(MODEL)
    opt = adamw(0.1)(model.parameters())
    for g in opt.param_groups:
        g["lr"] = 1e-2
    for step in range(STEPS):
        x, y = _batch(step, world_size)
        loss_fn(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.state_dict()


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def _close(a, b):
    # AdamW divides by sqrt(v): a last-bit difference in a tiny gradient moves its weight by up
    # to ~lr * 1e-3 over 5 steps (measured: 3e-5 between DDP and one process).
    return all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-4) for k in a)


@pytest.mark.parametrize("world_size", [2, 3])
def test_zero_stages_match_ddp_and_one_process(world_size):
    # plain; accumulation of 2 micro-batches; accumulation + clipping
    variants = [(False, None), (True, None), (True, 0.5)]
    results = run_workers(_train, world_size, args=(variants,), timeout_s=90)
    for r in results[1:]:  # the full model is the same on every rank
        assert all(_same(results[0][k], r[k]) for k in r)
    res = results[0]
    bit_identical = {}
    for accum, clip in variants:
        single = _single(world_size, clip)
        ddp = res[("ddp", accum, clip)]
        assert _close(ddp, single)
        for stage in (1, 2, 3):
            got = res[(stage, accum, clip)]
            assert _close(got, ddp), (stage, accum, clip)
            assert _close(got, single), (stage, accum, clip)
            bit_identical[(stage, accum, clip)] = _same(got, ddp)
            assert _same(got, res[(1, accum, clip)]), "the stages differ in where, not how"
    print(f"world_size={world_size} bit-identical to DDP: {bit_identical}")
    if world_size == 2:  # a + b in either order, and x / 2 is exact: the same bits as DDP
        assert all(v for (s, a, c), v in bit_identical.items() if not c)


# ---- memory: bytes held, counted from the tensors ------------------------------------------------

MEM_MODEL = GPTConfig(vocab_size=10, block_size=6, n_layer=3, n_head=2, n_embd=32)


def _counted(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _memory(rank, world_size):
    torch.manual_seed(0)
    ddp = DistributedDataParallel(GPT(MEM_MODEL))
    opt = adamw(0.1)(ddp.module.parameters())
    x, y = _batch(0, world_size)
    loss_fn(ddp(x[:B]), y[:B]).backward()
    opt.step()
    params = list(ddp.module.parameters())
    out = {"ddp": {"param_bytes": _counted(params), "grad_bytes": _counted(p.grad for p in params),
                   "optimizer_bytes": _counted(t for st in opt.state.values() for t in st.values()),
                   "peak_gathered_bytes": 0}}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        z = ZeroDataParallel(GPT(MEM_MODEL), adamw(0.1), stage=stage)
        x, y = _batch(0, world_size)
        for _ in range(2):
            loss_fn(z(x[:B]), y[:B]).backward()
            z.optimizer.step()
            z.optimizer.zero_grad()
        out[stage] = z.memory()
        biggest = max(u.nbytes for u in z.units)
        out[stage]["biggest_unit_bytes"] = biggest
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_bytes_held_match_the_zero_formulas(world_size):
    for r in _one_run(world_size):
        for stage, m in r["memory"].items():
            if stage == "ddp":
                continue
            for what in ("param", "grad", "optimizer"):
                got, want = m[f"{what}_bytes"], m[f"expected_{what}_bytes"]
                assert abs(got - want) <= 0.05 * want, (stage, what, got, want)
            if stage == 3:
                # The working set: the root unit (embeddings + head), the block computing and
                # the next one, prefetched.
                assert 0 < m["peak_gathered_bytes"] <= 3 * m["biggest_unit_bytes"]
            else:
                assert m["peak_gathered_bytes"] == 0


# ---- ringtrain plan (pure) -----------------------------------------------------------------------

def test_plan_command_counts_and_rows():
    from ringtrain.cli.plan import gpt_stages, gpt_units, parse_count, plan_rows

    assert parse_count("17M") == 17_000_000 and parse_count("1.5B") == 1_500_000_000
    total, root, block = gpt_units(MEM_MODEL)
    assert total == sum(p.numel() for p in GPT(MEM_MODEL).parameters())
    assert root + MEM_MODEL.n_layer * block == total
    stages = gpt_stages(MEM_MODEL, 3)  # embedding + block, block, block + head
    assert sum(stages) == total and len(stages) == 3 and gpt_stages(MEM_MODEL, 6) is None
    rows = {r["strategy"]: r for r in plan_rows(1000, 4, root=100, block=200)}
    assert rows["ddp"]["total"] == 16000
    assert rows["zero --zero-stage 2"]["total"] == 4000 + 12000 / 4
    assert rows["zero --zero-stage 3"]["total"] == 16000 / 4 + 4 * (100 + 2 * 200)


@pytest.mark.parametrize("world_size", [2, 3])
def test_plan_predicts_the_counted_bytes_within_10_percent(world_size):
    from ringtrain.cli.plan import gpt_units, plan_rows

    numel, root, block = gpt_units(MEM_MODEL)
    rows = {r["strategy"]: r for r in plan_rows(numel, world_size, root, block)}
    names = {"ddp": "ddp", 1: "zero --zero-stage 1", 2: "zero --zero-stage 2",
             3: "zero --zero-stage 3"}
    for r in _one_run(world_size):
        for key, m in r["memory"].items():
            counted = (m["param_bytes"] + m["grad_bytes"] + m["optimizer_bytes"]
                       + m["peak_gathered_bytes"])
            predicted = rows[names[key]]["total"]
            assert abs(predicted - counted) <= 0.10 * counted, (key, predicted, counted)


@pytest.mark.parametrize("world_size", [2])
def test_misuse_raises_on_every_rank_naming_the_fix(world_size):
    for r in _one_run(world_size):
        assert len(r["misuse"]) == 2
        assert "full_state_dict(keep_gathered=True)" in r["misuse"][0]
        assert "second synced backward" in r["misuse"][1] and "no_sync()" in r["misuse"][1]


def test_plan_command_prints_a_row_per_strategy(capsys):
    from ringtrain.cli.plan import main

    assert main(["--nproc-per-node", "4", "--n-layer", "2", "--n-embd", "32",
                 "--memory-gb", "1"]) == 0
    out = capsys.readouterr().out
    assert "4 ranks" in out and out.count(" yes") == 5  # ddp, zero 1-3, pipeline --pp 4
    assert "pipeline --pp 4" in out and "fastest that fits by this model:" in out
    assert main(["--params", "1M", "--nproc-per-node", "2", "--memory-gb", "0.001"]) == 0
    out = capsys.readouterr().out
    assert "nothing fits in 0.001 GiB" in out and "pipeline" not in out.split("\n", 1)[1]
    assert main(["--params", "lots"]) == 2


def test_plan_rows_comm_and_pipeline():
    from ringtrain.cli.plan import plan_rows, step_seconds

    rows = {r["strategy"]: r
            for r in plan_rows(1000, 4, root=100, block=200, stages=[100, 300, 300, 300],
                               boundary_bytes=64.0)}
    ring = 3 / 4 * 4000
    assert rows["ddp"]["comm"] == rows["zero --zero-stage 2"]["comm"] == 2 * ring
    assert rows["zero --zero-stage 3"]["comm"] == 3 * ring - 3 / 4 * 400  # the root gathered once
    pipe = rows["pipeline --pp 4"]
    assert pipe["stages"] == [100, 300, 300, 300]
    assert pipe["total"] == 16 * 300 and pipe["comm"] == 128
    one_unit = {r["strategy"]: r for r in plan_rows(1000, 4)}["zero --zero-stage 3"]
    assert one_unit["working_set"] == 4000 and one_unit["comm"] == 2 * ring
    assert (step_seconds(rows["ddp"], 1000, 10, 4, 1.0, 1.0)
            == 6 * 10 * 1000 / 4 / 1e12 + 2 * ring * 8 / 1e9)


# ---- resharding: a state saved by N ranks loaded on M (pure, then 2 -> 3 -> 2 on gloo) ----------

def test_reshard_sources_and_assemble():
    # 10 elements: 2 ranks hold [0, 5) [5, 10); 3 ranks hold [0, 4) [4, 8) [8, 12) (2 padding).
    assert [reshard.sources([10], 2, 3, r) for r in range(3)] == [[0], [0, 1], [1]]
    assert [reshard.sources([10], 3, 2, r) for r in range(2)] == [[0, 1], [1, 2]]
    assert reshard.sources([10, 1], 2, 3, 2) == [1]  # unit 2 is all padding on rank 2
    full = torch.arange(10.0)
    saved = {0: full[:5], 1: full[5:]}
    assert torch.equal(reshard.assemble(saved, 5, 4, 8, 10), full[4:8])
    assert torch.equal(reshard.assemble(saved, 5, 8, 12, 10), torch.tensor([8.0, 9.0, 0.0, 0.0]))


def _train_two_steps(z, rank, world_size):
    x, y = _batch(0, world_size)
    for _ in range(2):
        loss_fn(z(x[rank * B:(rank + 1) * B]), y[rank * B:(rank + 1) * B]).backward()
        z.optimizer.step()
        z.optimizer.zero_grad()


def _equal_full(a, b):
    return (all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
            and all(m.keys() == n.keys() and all(torch.equal(m[k], n[k]) for k in m)
                    for m, n in zip(a["moments"], b["moments"], strict=True))
            and ({k: float(v) for k, v in a["scalars"].items()}
                 == {k: float(v) for k, v in b["scalars"].items()}))


def _gather_parts(state, world_size):
    got = [None] * world_size
    dist.all_gather_object(got, state)
    return {int(s["rank"]): s for s in got if s is not None}


def _reshard(rank, world_size):
    """Ranks 0, 1 train (stage 2) and save; all 3 load those parts (stage 3: the stage may
    change), save again; ranks 0, 1 load the 3 parts (stage 1). Each time the full state,
    parameters and AdamW moments, must be the one saved."""
    pair = dist.new_group([0, 1])
    numels = None
    mine = None
    if rank < 2:
        torch.manual_seed(0)
        z = ZeroDataParallel(GPT(MEM_MODEL), adamw(0.1), stage=2, process_group=pair)
        _train_two_steps(z, rank, 2)
        mine = z.shard_state_dict()
    parts2 = _gather_parts(mine, world_size)
    torch.manual_seed(1)  # another initialisation: loading must overwrite every element
    z3 = ZeroDataParallel(GPT(MEM_MODEL), adamw(0.1), stage=3)
    numels = [u.plan.numel for u in z3.units]
    z3.load_shard_state_dicts({r: parts2[r] for r in reshard.sources(numels, 2, 3, rank)})
    parts3 = _gather_parts(z3.shard_state_dict(), world_size)
    out = {"2to3": _equal_full(reshard.consolidate(parts2.values()),
                               reshard.consolidate(parts3.values()))}
    back = None
    if rank < 2:
        torch.manual_seed(2)
        z2 = ZeroDataParallel(GPT(MEM_MODEL), adamw(0.1), stage=1, process_group=pair)
        z2.load_shard_state_dicts({r: parts3[r] for r in reshard.sources(numels, 3, 2, rank)})
        back = z2.shard_state_dict()
    parts2b = _gather_parts(back, world_size)
    out["3to2"] = _equal_full(reshard.consolidate(parts2.values()),
                              reshard.consolidate(parts2b.values()))
    out["moments"] = sorted(reshard.consolidate(parts3.values())["moments"][0])
    try:
        z3.load_shard_state_dicts({0: parts2[0]})  # rank 1 and 2 need saved rank 1 too
        out["missing"] = None
    except ValueError as e:
        out["missing"] = str(e)
    dist.barrier()
    return out


def test_reshard_2_to_3_to_2_keeps_the_full_state():
    for rank, r in enumerate(_one_run(3)):
        got = r["reshard"]
        assert got["2to3"] and got["3to2"]
        assert got["moments"] == ["exp_avg", "exp_avg_sq"]
        if rank > 0:
            assert "needs the ZeRO parts of saved ranks [1]" in got["missing"]
