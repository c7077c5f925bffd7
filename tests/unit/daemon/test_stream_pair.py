"""A streaming run's extract and train as one pair, in process on a real store: the scheduler starts vocab first, then both halves in one pass (train sharing extract's GPU when there is one), and a failure of either half is the run's one root cause, the other half's end its consequence, restarted with it when the policy restarts the failed half."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from eyas.daemon.core import Core
from eyas.daemon.group import Group
from eyas.daemon.ranks import Rank, RankExit
from eyas.state import contract, specs, store

STAGES = ["prepare", "extract", "vocab", "train"]


def _core(tmp_path, gpus: int = 0, restarts: int = 0, devices="cpu"):
    db = store.open_writer(tmp_path / "eyas.db")
    sampler = SimpleNamespace(
        gpu_available=gpus > 0,
        gpu=SimpleNamespace(device_count=lambda: gpus),
        sample=lambda refs, now: None,
        forget=lambda a: None,
    )
    core = Core(db, tmp_path, sampler=sampler)
    core.sample = lambda now, groups=None, final=False: None
    cfg = {
        "pipeline": STAGES,
        "storage": {"mode": "streaming"},
        "resources": {"devices": devices},
        "extract": {"backend": "hf"},
        "stages": {"train": {"backoff": 5}},
    }
    run_id = store.create_run(
        db,
        name="r",
        model="m",
        stages=[{"name": s, "max_restarts": restarts if s == "train" else 0, "world_size": 1} for s in STAGES],
        config=cfg,
        output_dir=str(tmp_path / "out"),
    )
    store.move_run(db, run_id, "running", "started")
    for s in ("prepare",):
        store.move_stage(db, run_id, s, "running", "started")
        store.move_stage(db, run_id, s, "succeeded", "done")
    return core, db, run_id


def _states(db, run_id):
    return {r["name"]: r["state"] for r in db["stages"].rows_where("run_id = ?", [run_id])}


def test_vocab_runs_first_then_extract_and_train_start_in_one_pass(tmp_path):
    core, db, run_id = _core(tmp_path)
    starts = core._plan(db, set(), {}, time.time())
    assert [s.stage for s in starts] == ["vocab"]  # it reads only prepare's output
    store.move_stage(db, run_id, "vocab", "succeeded", "done")
    starts = core._plan(db, set(), {}, time.time())
    assert [s.stage for s in starts] == ["extract", "train"]
    assert _states(db, run_id) == {
        "prepare": "succeeded",
        "vocab": "succeeded",
        "extract": "running",
        "train": "running",
    }
    assert db.execute("SELECT stage, number, state FROM attempts WHERE stage != 'vocab' ORDER BY id").fetchall() == [
        ("extract", 1, "running"),
        ("train", 1, "running"),
    ]


@pytest.mark.parametrize(
    "gpus, expected", [(1, [("extract", [0]), ("train", [0])]), (2, [("extract", [0]), ("train", [1])])]
)
def test_train_takes_a_gpu_of_its_own_or_shares_extracts(tmp_path, gpus, expected):
    core, db, run_id = _core(tmp_path, gpus=gpus, devices="auto")
    store.move_stage(db, run_id, "vocab", "running", "started")
    store.move_stage(db, run_id, "vocab", "succeeded", "done")
    assert [(s.stage, s.devices) for s in core._plan(db, set(), {}, time.time())] == expected


def _live_pair(core, db, run_id, tmp_path):
    store.move_stage(db, run_id, "vocab", "running", "started")
    store.move_stage(db, run_id, "vocab", "succeeded", "done")
    groups = {}
    for start in core._plan(db, set(), {}, time.time()):
        d = tmp_path / f"{start.stage}-{start.number}"
        d.mkdir()
        g = Group(run_id, start.stage, start.attempt_id, start.number, d, 1, [], 0)
        g.ranks.append(Rank(0, d / "rank-0.log", 0, None))
        core.groups[start.attempt_id] = g
        groups[start.stage] = g
    return groups


async def _settle_all(core):
    for _ in range(50):
        core.supervise()
        await core.store.drain()
        if not core.groups:
            return
    raise AssertionError(f"groups left: {[(g.stage, g.cancel_reason) for g in core.groups.values()]}")


async def test_a_failed_half_ends_the_run_with_one_root_cause(tmp_path):
    core, db, run_id = _core(tmp_path)
    g = _live_pair(core, db, run_id, tmp_path)
    now = time.time()
    g["extract"].ranks[0].exit = RankExit(0, 4242, None, 9, now)  # SIGKILL, its own failure
    # What the agent does when it sees the failure: the other half is torn down as its consequence.
    core._end_sibling(g["extract"])
    await core._cancel_group(g["train"], g["train"].cancel_reason or f"{specs.SIBLING_TEARDOWN}extract failed")
    g["train"].ranks[0].exit = RankExit(0, 4243, None, 15, now + 0.5)
    g["extract"].teardown_since = now + 0.1
    assert core._sibling_first(g["train"])  # it waits for the failed half's settlement
    await _settle_all(core)
    assert _states(db, run_id)["extract"] == "failed" and _states(db, run_id)["train"] == "cancelled"
    run = db["runs"].get(run_id)
    assert run["state"] == "failed" and run["reason"].startswith("extract: rank 0 failed: SIGKILL")
    errors = db.execute("SELECT stage, root_cause, type FROM errors ORDER BY id").fetchall()
    assert errors == [("extract", 1, "SIGKILL")]  # train's end is no error at all
    attempts = dict(db.execute("SELECT stage, reason FROM attempts WHERE stage IN ('extract', 'train')").fetchall())
    assert attempts["train"] == f"{specs.SIBLING_TEARDOWN}extract failed"


async def test_a_restart_of_the_failed_half_restarts_both(tmp_path):
    core, db, run_id = _core(tmp_path, restarts=1)
    g = _live_pair(core, db, run_id, tmp_path)
    now = time.time()
    g["train"].ranks[0].exit = RankExit(0, 4242, 1, None, now)  # exit code 1
    await core._cancel_group(g["extract"], f"{specs.SIBLING_TEARDOWN}train failed")
    g["extract"].ranks[0].exit = RankExit(0, 4243, None, 15, now + 0.5)
    g["train"].teardown_since = now + 0.1
    await _settle_all(core)
    rows = {r["name"]: r for r in db["stages"].rows_where("run_id = ?", [run_id])}
    assert (rows["train"]["state"], rows["train"]["restarts"]) == ("running", 1)
    # The same due time, and no restart of its own spent.
    assert (rows["extract"]["state"], rows["extract"]["restarts"]) == ("running", 0)
    assert rows["extract"]["restart_at"] == rows["train"]["restart_at"] > now
    assert db["runs"].get(run_id)["state"] == "running"
    starts = core._plan(db, set(), {}, rows["train"]["restart_at"] + 0.1)
    assert [(s.stage, s.number) for s in starts] == [("extract", 2), ("train", 2)]


async def test_the_watchdogs_finding_on_one_half_tears_the_other_down(tmp_path):
    core, db, run_id = _core(tmp_path)
    g = _live_pair(core, db, run_id, tmp_path)
    g["train"].stuck = {"kind": "stall", "since": time.time()}
    core._end_sibling(g["train"])
    core._end_sibling(g["extract"])  # the healthy half tears nothing down
    await core.store.drain()
    for _ in range(20):
        if g["extract"].cancel_reason:
            break
        await asyncio.sleep(0.05)
    assert g["extract"].cancel_reason == f"{specs.SIBLING_TEARDOWN}train failed"
    assert g["train"].cancel_reason is None
    # A user's stop is no failure: it tears nothing down as a consequence.
    (tmp_path / "b").mkdir()
    core2, db2, run2 = _core(tmp_path / "b")
    h = _live_pair(core2, db2, run2, tmp_path / "b")
    h["extract"].cancel_reason = "stopped by the user"
    core2._end_sibling(h["extract"])
    await asyncio.sleep(0.1)
    assert h["train"].cancel_reason is None


async def test_a_stop_during_a_scheduling_pass_stops_at_once_and_the_half_started_after_it_too(tmp_path):
    """The scheduler holds its lock while it spawns a pair: a stop then signals the live half
    at once, without waiting for the pass, and the half the pass starts after it is stopped
    once the pass is over, so that the pair still stops as one."""
    core, db, run_id = _core(tmp_path)
    g = _live_pair(core, db, run_id, tmp_path)
    train = core.groups.pop(g["train"].attempt_id)  # the pass has spawned extract, not train yet
    await core._decide.acquire()
    reply = await asyncio.wait_for(core.op_stop(run_id), 2.0)
    assert reply == {"run_id": run_id, "stage": "extract", "stopping": True, "recorded": True}
    assert g["extract"].cancel_reason == "stopped by the user" and g["extract"].teardown_since is not None
    assert db["attempts"].get(g["extract"].attempt_id)["cancel_reason"] == "stopped by the user"
    # Recorded in the store: the intent file beside the attempt has done its job.
    assert not (g["extract"].dir / contract.STOP_INTENT).exists()
    core.groups[train.attempt_id] = train  # the pass spawns train, then ends
    core._decide.release()
    for _ in range(40):
        if train.cancel_reason:
            break
        await asyncio.sleep(0.05)
    assert train.cancel_reason == "stopped by the user"
    await core.store.drain()
    assert db["attempts"].get(train.attempt_id)["cancel_reason"] == "stopped by the user"
