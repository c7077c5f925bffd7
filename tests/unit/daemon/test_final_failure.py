"""A failure the stage marks final (its error file's "final": evaluate's quality gate) is never
restarted, whatever max_restarts allows; any other failure still is. In process, as
tests/unit/daemon/test_settle.py settles a group."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from eyas.daemon.core import Core
from eyas.daemon.group import Group
from eyas.daemon.ranks import Rank, RankExit
from eyas.state import store

GATE = "eyas.workers.stages.evaluate.QualityGateFailed"


def _ended_group(tmp_path, error: dict):
    db = store.open_writer(tmp_path / "eyas.db")
    sampler = SimpleNamespace(gpu_available=False, sample=lambda refs, now: None, forget=lambda a: None)
    core = Core(db, tmp_path, sampler=sampler)
    core.sample = lambda now, groups=None, final=False: None
    run_id = store.create_run(
        db, name="r", model="m", stages=[{"name": "selftest", "max_restarts": 2}], config={"stages": {}}
    )
    store.move_run(db, run_id, "running", "started")
    store.move_stage(db, run_id, "selftest", "running", "started")
    attempt_dir = tmp_path / "attempt-1"
    attempt_dir.mkdir()
    attempt_id, number = store.new_attempt(db, run_id, "selftest", dir=str(attempt_dir), world_size=1)
    group = Group(run_id, "selftest", attempt_id, number, attempt_dir, 1, [], 0)
    rank = Rank(0, attempt_dir / "rank-0.log", 0, None)
    rank.exit = RankExit(0, 4242, 1, None, time.time())
    rank.exit.error = {"traceback": "Traceback ...", "pid": 4242, "time": rank.exit.time - 0.01, **error}
    (attempt_dir / "rank-0.error.json").write_text(json.dumps(rank.exit.error))
    (attempt_dir / "rank-0.log").write_text("")
    group.ranks.append(rank)
    core.groups[attempt_id] = group
    return core, db, run_id


@pytest.mark.parametrize("final", [True, False])
async def test_a_final_failure_is_not_restarted(tmp_path, final):
    error = {"type": GATE, "message": "the draft learned nothing: acceptance 1.00 against 1.00 untrained"}
    core, db, run_id = _ended_group(tmp_path, {**error, "final": True} if final else error)
    core.supervise()
    await core.store.drain()
    stage = store.stage_row(db, run_id, "selftest")
    root = db.execute("SELECT type, message FROM errors WHERE root_cause = 1").fetchone()
    assert root == (GATE, error["message"])
    if final:
        assert (stage["state"], stage["restarts"], stage["restart_at"]) == ("failed", 0, None)
        assert stage["reason"] == f"rank 0 failed: {GATE}: {error['message']}"
        assert db["runs"].get(run_id)["state"] == "failed"
    else:  # the same failure, not marked final: the first of its 2 restarts
        assert (stage["state"], stage["restarts"]) == ("running", 1) and stage["restart_at"] is not None
