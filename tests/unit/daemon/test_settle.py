"""The settlement under a full disk, in process: a write that fails with "database or disk is
full" leaves nothing half-written and the group in memory, and the retry records it whole."""

from __future__ import annotations

import errno
import json
import sqlite3
import time
from types import SimpleNamespace

from eyas.daemon import diskfull
from eyas.daemon.core import Core
from eyas.daemon.group import Group
from eyas.daemon.ranks import Rank, RankExit
from eyas.state import store


def test_the_errors_that_mean_no_space_are_told_apart():
    assert diskfull.is_full(sqlite3.OperationalError("database or disk is full"))
    assert diskfull.is_full(OSError(errno.ENOSPC, "No space left on device"))
    assert diskfull.is_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert diskfull.is_full(outer)
    assert not diskfull.is_full(sqlite3.OperationalError("database is locked"))
    assert not diskfull.is_full(OSError(errno.EACCES, "Permission denied"))


def _core_with_an_ended_group(tmp_path, max_restarts: int = 0):
    db = store.open_writer(tmp_path / "eyas.db")
    sampler = SimpleNamespace(gpu_available=False, sample=lambda refs, now: None, forget=lambda a: None)
    core = Core(db, tmp_path, sampler=sampler)
    core.sample = lambda now, groups=None, final=False: None
    run_id = store.create_run(
        db,
        name="r",
        model="m",
        stages=[{"name": "selftest", "max_restarts": max_restarts}],
        config={"stages": {"selftest": {"backoff": 7}}},
    )
    store.move_run(db, run_id, "running", "started")
    store.move_stage(db, run_id, "selftest", "running", "started")
    attempt_dir = tmp_path / "attempt-1"
    attempt_dir.mkdir()
    attempt_id, number = store.new_attempt(db, run_id, "selftest", dir=str(attempt_dir), world_size=1)
    group = Group(run_id, "selftest", attempt_id, number, attempt_dir, 1, [], 0)
    rank = Rank(0, attempt_dir / "rank-0.log", 0, None)
    rank.exit = RankExit(0, 4242, 1, None, time.time())
    group.ranks.append(rank)
    core.groups[attempt_id] = group
    return core, db, run_id, group


async def test_a_settlement_that_hits_a_full_disk_is_kept_whole_and_retried(tmp_path, monkeypatch):
    core, db, run_id, group = _core_with_an_ended_group(tmp_path)
    real = store.move_attempt
    full = [True]

    def move_attempt(*args, **kwargs):  # fails after the error row was written in the transaction
        if full[0]:
            raise sqlite3.OperationalError("database or disk is full")
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "move_attempt", move_attempt)
    core.supervise()
    await core.store.drain()
    # Nothing half-done: no error row, the attempt still running, and the group still known.
    assert group.attempt_id in core.groups and core.op_status()["active"]
    assert db.execute("SELECT count(*) FROM errors").fetchone()[0] == 0
    assert db["attempts"].get(group.attempt_id)["state"] == "running"
    assert core.disk.full and core.op_status()["full"]["what"].startswith("ENOSPC while recording the end")
    core.schedule()  # nothing starts while it lasts
    assert db.execute("SELECT count(*) FROM attempts").fetchone()[0] == 1

    full[0] = False
    group.settle_retry_at = 0.0
    core.supervise()
    await core.store.drain()
    assert group.attempt_id not in core.groups
    attempt = db["attempts"].get(group.attempt_id)
    assert attempt["state"] == "failed"
    root = db.execute("SELECT type, message, path, source FROM errors WHERE root_cause = 1").fetchone()
    # The rank's exit and error files are missing while the disk was full: that is the cause, said
    # as such; the record points at the rank's log, never at a missing file as if it were its error's.
    assert root == (
        "ENOSPC",
        f"rank 0 (pid 4242) exited with code 1 while the state directory {tmp_path} was full (no space left on "
        "device): its exit record (rank-0.exit.json) could not be written; no error file (rank-0.error.json) was "
        "written, so its own error, if it raised one, is not known",
        str(group.dir / "rank-0.log"),
        "disk_full",
    )
    assert db.execute("SELECT count(*) FROM errors").fetchone()[0] == 1
    assert store.stage_row(db, run_id, "selftest")["state"] == "failed"


TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/eyas/workers/stages/selftest.py", line 191, in _flood\n'
    "    sys.stdout.write(text)\n"
    "OSError: [Errno 28] No space left on device: '{log}'\n"
)


def _raised_on_a_full_disk(group, log: str, **error) -> None:
    """The rank raised OSError ENOSPC writing `log`, and its error file says so (as
    workers/runtime/rank.py writes it; the daemon read it back into the exit)."""
    rank = group.ranks[0]
    rank.exit.error = {
        "type": "OSError",
        "message": f"[Errno 28] No space left on device: '{log}'",
        "traceback": TRACEBACK.format(log=log),
        "pid": 4242,
        "time": rank.exit.time - 0.01,
        **error,
    }
    (group.dir / "rank-0.error.json").write_text(json.dumps(rank.exit.error))
    (group.dir / "rank-0.log").write_text("".join(f"r0 line {n}\n" for n in range(100)))  # the flood


async def test_a_rank_that_raised_on_a_full_disk_names_the_file_and_keeps_its_own_traceback(tmp_path):
    core, db, run_id, group = _core_with_an_ended_group(tmp_path)
    log = str(group.dir / "rank-0.log")
    _raised_on_a_full_disk(group, log, disk_full={"errno": "ENOSPC", "file": log})
    core.supervise()
    await core.store.drain()
    root = db.execute("SELECT type, message, traceback, path, source FROM errors WHERE root_cause = 1").fetchone()
    assert root == (
        "ENOSPC",
        f"ENOSPC while writing {log} (the state directory {tmp_path} was full); rank 0 (pid 4242) raised OSError: "
        f"[Errno 28] No space left on device: '{log}'",
        TRACEBACK.format(log=log),  # its own, never the log's flood
        str(group.dir / "rank-0.error.json"),
        "disk_full",
    )


async def test_a_full_disk_elsewhere_is_named_from_the_exception_alone(tmp_path):
    """A record without the runtime's disk_full (a vLLM TP worker's, an older rank's): the file
    is read from the OSError's text; it lies outside the state directory, which is not blamed."""
    core, db, run_id, group = _core_with_an_ended_group(tmp_path)
    shard = "/data/out/extract/hidden_states/hs_7.safetensors"
    _raised_on_a_full_disk(group, shard)
    core.supervise()
    await core.store.drain()
    root = db.execute("SELECT type, message, traceback FROM errors WHERE root_cause = 1").fetchone()
    assert root == (
        "ENOSPC",
        f"ENOSPC while writing {shard}; rank 0 (pid 4242) raised OSError: [Errno 28] No space left on device: "
        f"'{shard}'",
        TRACEBACK.format(log=shard),
    )


async def test_a_restart_is_recorded_with_its_due_time(tmp_path):
    core, db, run_id, group = _core_with_an_ended_group(tmp_path, max_restarts=1)
    ended = group.ranks[0].exit.time
    time.sleep(0.2)  # the record is written later than the end it records
    core.supervise()
    await core.store.drain()
    srow = store.stage_row(db, run_id, "selftest")
    assert (srow["state"], srow["restarts"]) == ("running", 1)
    # Due from the group's real end (backoff 7 s), not from when the write got through.
    assert srow["restart_at"] == ended + 7
    assert db["attempts"].get(group.attempt_id)["ended_at"] == ended
    core.schedule()  # not due yet: nothing starts
    await core.store.drain()
    assert db.execute("SELECT count(*) FROM attempts").fetchone()[0] == 1


async def test_an_attempt_whose_ranks_cannot_start_fails_with_that_cause(tmp_path):
    """Scheduled through the store thread, spawned on the loop: the spawn's OSError is the root
    cause recorded after the loop has moved on (the job runs once the except clause is gone)."""
    from eyas.state import paths

    db = store.open_writer(tmp_path / "eyas.db")
    sampler = SimpleNamespace(gpu_available=False, sample=lambda refs, now: None, forget=lambda a: None)
    core = Core(db, tmp_path, sampler=sampler)
    run_id, run_dir = paths.claim_run_dir(1, tmp_path)
    (run_dir / "config.json").write_text("{}")
    (run_dir / "selftest").write_text("a file where the stage's folder goes")
    store.create_run(
        db,
        name="r",
        model=None,
        stages=[{"name": "selftest", "world_size": 1}],
        config={},
        run_id=run_id,
        dir=str(run_dir),
    )
    core.schedule()
    for _ in range(50):
        await core.store.drain()
        if store.stage_row(db, run_id, "selftest")["state"] == "failed":
            break
    attempt = db.execute("SELECT state, reason FROM attempts WHERE run_id = ?", [run_id]).fetchone()
    root = db.execute("SELECT type, message, source FROM errors WHERE root_cause = 1").fetchone()
    assert attempt[0] == "failed" and attempt[1].startswith("could not start ranks: "), attempt
    assert root[0] in ("FileExistsError", "NotADirectoryError") and root[2] == "spawn", root
    assert not core.groups and store.stage_row(db, run_id, "selftest")["state"] == "failed"


async def test_a_bare_exit_code_that_started_the_teardown_stays_the_cause(tmp_path):
    """Rank 0 exits 1 with no error file (its disk was full), the teardown kills rank 1: the
    settlement records the failure that started it, not a success."""
    core, db, run_id, group = _core_with_an_ended_group(tmp_path)
    exited = group.ranks[0].exit.time
    group.teardown_since = exited + 0.5  # the teardown came after, and killed rank 1
    group.world_size = 2
    peer = Rank(1, tmp_path / "attempt-1" / "rank-1.log", 0, None)
    peer.exit = RankExit(1, 4243, None, 15, exited + 0.6)
    group.ranks.append(peer)
    assert [e.rank for e in group.failures()] == [0]
    core.supervise()
    await core.store.drain()
    attempt = db["attempts"].get(group.attempt_id)
    assert attempt["state"] == "failed" and attempt["reason"].startswith("rank 0 failed: "), attempt["reason"]
    assert store.stage_row(db, run_id, "selftest")["state"] == "failed"
