"""Runs never share folders, and a rank is settled only by records its own process wrote: the
record stays true when the database is deleted or restored while the daemon is down."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_harness import daemon, selftest_toml, wait_for  # noqa: F401 (fixture)

from eyas.daemon import core as daemon_core
from eyas.daemon import straggler
from eyas.daemon.group import Group
from eyas.daemon.ranks import Rank
from eyas.state import paths, store

WARNING = "that the database does not know"


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _attempt(run: dict, number: int = 1) -> dict:
    (stage,) = run["stages"]
    return stage["attempt_list"][number - 1]


def _warnings(home: Path) -> list[str]:
    log = home / "daemon.log"
    return [line for line in log.read_text().splitlines() if WARNING in line] if log.exists() else []


def test_a_deleted_database_never_sends_a_new_run_into_an_old_runs_folder(daemon):
    home = daemon.home
    old_id = daemon.submit(selftest_toml("doomed", ranks=1, options={"steps": 3, "step_time": 0.01, "fail": "raise"}))
    assert daemon.wait_run(old_id)["state"] == "failed"
    old_dir = paths.runs_dir(home) / str(old_id)
    assert (old_dir / "selftest" / "attempt-1" / "rank-0.error.json").exists()
    before = _files(old_dir)

    daemon.stop()
    for p in home.glob("eyas.db*"):
        p.unlink()
    daemon.start()

    new_id = daemon.submit(selftest_toml("fine", ranks=1, options={"steps": 3, "step_time": 0.01}))
    run = daemon.wait_run(new_id)
    # No stale error file was read: the rank exited 0 and the run is recorded so.
    assert run["state"] == "succeeded", run["reason"]
    assert [(r["state"], r["exit_code"]) for r in _attempt(run)["ranks"]] == [("exited", 0)]
    # A folder of its own: an id above the folders on disk, recorded with the run.
    assert new_id > old_id
    new_dir = Path(run["dir"])
    assert new_dir == paths.runs_dir(home) / str(new_id) and not new_dir.samefile(old_dir)
    assert Path(_attempt(run)["dir"]).parent.parent == new_dir
    assert run["output_dir"] == str(new_dir / "out")
    assert json.loads((new_dir / "config.json").read_text())["name"] == "fine"
    # The old run's folder is byte for byte what it was, with nothing added.
    assert _files(old_dir) == before
    # Each rank log holds one run's output.
    new_log = (Path(_attempt(run)["dir"]) / "rank-0.log").read_text()
    assert new_log.count("stage selftest, attempt 1") == 1 and "selftest failure" not in new_log
    logs = daemon.cli("logs", new_id)
    assert logs.returncode == 0 and "selftest failure" not in logs.stdout and "step 3/3" in logs.stdout
    # The daemon said once, at start, which folders it does not know, and left them alone.
    (warning,) = _warnings(home)
    assert f"1 run folder {WARNING} (ids {old_id})" in warning and "left alone" in warning


def test_a_planted_error_file_of_another_process_is_ignored(daemon):
    run_id = daemon.submit(selftest_toml("planted", ranks=1, options={"steps": 20, "step_time": 0.1}))
    # The attempt is recorded just before its folder is made: wait for the rank's log in it.
    attempt_dir = wait_for(
        lambda: (
            (a := daemon.run(run_id)["stages"][0]["attempt_list"])
            and (Path(a[0]["dir"]) / "rank-0.log").exists()
            and Path(a[0]["dir"])
        ),
        30,
        what="the attempt to start",
    )
    stale = {
        "type": "RuntimeError",
        "message": "stale error of another run",
        "traceback": "Traceback ...",
        "rank": 0,
        "pid": 1,
        "time": time.time(),
        "stage": "selftest",
        "attempt": 1,
    }
    (attempt_dir / "rank-0.error.json").write_text(json.dumps(stale))
    run = daemon.wait_run(run_id)
    assert run["state"] == "succeeded", run["reason"]
    assert [(r["state"], r["exit_code"]) for r in _attempt(run)["ranks"]] == [("exited", 0)]
    assert _attempt(run)["root_cause"] is None
    ignored = [
        line
        for line in (daemon.home / "daemon.log").read_text().splitlines()
        if "ignoring" in line and "rank-0.error.json" in line
    ]
    assert len(ignored) == 1 and "its pid 1 is not" in ignored[0]


def test_a_retry_after_an_older_database_came_back_gets_a_folder_of_its_own(daemon):
    run_id = daemon.submit(selftest_toml("again", ranks=1, options={"steps": 2, "step_time": 0.01, "fail": "raise"}))
    run = daemon.wait_run(run_id)
    # As if the database were an older backup: attempt 2's folder exists, the database has no attempt 2.
    taken = Path(_attempt(run)["dir"]).with_name("attempt-2")
    taken.mkdir()
    (taken / "rank-0.log").write_text("another history's attempt 2\n")
    assert daemon.cli("retry", run_id).returncode == 0  # the run is pending again when it returns
    run = daemon.wait_run(run_id)
    assert run["stages"][0]["attempts"] == 2
    second = _attempt(run, 2)
    assert second["root_cause"]["message"] == "selftest failure"
    assert Path(second["dir"]) == taken.with_name("attempt-2-2")
    assert (taken / "rank-0.log").read_text() == "another history's attempt 2\n"
    assert sorted(p.name for p in taken.iterdir()) == ["rank-0.log"]
    assert "stage selftest, attempt 2" in (Path(second["dir"]) / "rank-0.log").read_text()


def test_spawn_refuses_an_attempt_directory_that_exists(tmp_path):
    existing = tmp_path / "attempt-1"
    existing.mkdir()
    (existing / "rank-0.log").write_text("someone else's\n")
    with pytest.raises(FileExistsError, match="already exists"):
        Group.spawn(
            run_id=1,
            stage="selftest",
            attempt_id=1,
            attempt=1,
            dir=existing,
            world_size=1,
            devices=[],
            output_dir=tmp_path / "out",
            config_path=None,
        )
    assert _files(existing) == {"rank-0.log": b"someone else's\n"}


def _ended_process() -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p


def test_settle_trusts_only_records_of_the_rank_s_own_process(tmp_path, caplog):
    p = _ended_process()
    group = Group(1, "selftest", 1, 2, tmp_path, 1, [], 0)
    group.ranks = [Rank(0, tmp_path / "rank-0.log", p.pid, None, p, pid=p.pid)]
    now = time.time()
    # Another process's exit and error records, and this process's record of another attempt.
    (tmp_path / "rank-0.exit.json").write_text(
        json.dumps({"pid": p.pid + 1, "exit_code": 3, "signal": None, "time": now})
    )
    (tmp_path / "rank-0.error.json").write_text(
        json.dumps(
            {"type": "RuntimeError", "message": "stale", "pid": p.pid, "stage": "selftest", "attempt": 1, "time": now}
        )
    )
    _, (ex,) = group.poll()
    assert (ex.exit_code, ex.error, ex.failed) == (0, None, False)  # the monitor's own status
    assert f"its pid {p.pid + 1} is not {p.pid}" in caplog.text
    assert "rank-0.error.json: it is attempt 1's" in caplog.text

    # The same files written by the rank's own process in this attempt are its record.
    (tmp_path / "rank-0.exit.json").write_text(json.dumps({"pid": p.pid, "exit_code": 1, "signal": None, "time": now}))
    (tmp_path / "rank-0.error.json").write_text(
        json.dumps(
            {"type": "RuntimeError", "message": "mine", "pid": p.pid, "stage": "selftest", "attempt": 2, "time": now}
        )
    )
    ex = group._settle(group.ranks[0], 1)
    assert (ex.exit_code, ex.error["message"], ex.failed) == (1, "mine", True)

    # done.json of another process does not start the straggler clock.
    group.ranks[0].exit, group.exit_timeout = None, 1.0
    (tmp_path / "rank-0.done.json").write_text(json.dumps({"pid": p.pid + 1, "time": 0.0, "exit_code": 0}))
    assert straggler.check(group, now) is None
    (tmp_path / "rank-0.done.json").write_text(json.dumps({"pid": p.pid, "time": 0.0, "exit_code": 0}))
    assert straggler.check(group, now)["after"] == "its stage function returned"


def test_a_tp_worker_s_error_record_must_be_its_own(tmp_path):
    p = _ended_process()
    group = Group(1, "extract", 1, 1, tmp_path, 1, [], 0)
    worker = Rank(1, tmp_path / "tp-0.log", 0, None, pid=p.pid, role="tp-worker", tp_rank=0)
    group.workers[0] = worker
    (tmp_path / "tp-0.error.json").write_text(
        json.dumps({"type": "AttributeError", "message": "stale", "pid": p.pid + 1, "time": time.time()})
    )
    (ex,) = group._poll_tp()
    assert ex.error is None and ex.tp_rank == 0


def test_recovery_reads_only_the_rank_s_own_error_file(tmp_path):
    db = store.open_writer(tmp_path / "eyas.db")
    run_id = store.create_run(db, name="r", model=None, stages=[{"name": "selftest", "world_size": 1}])
    attempt_dir = tmp_path / "runs" / str(run_id) / "selftest" / "attempt-1"
    attempt_dir.mkdir(parents=True)
    attempt_id, _ = store.new_attempt(db, run_id, "selftest", dir=str(attempt_dir), world_size=1)
    store.upsert_rank(db, attempt_id, 0, pid=4242, monitor_pid=4241, state="failed", exit_code=1, ended_at=time.time())
    (attempt_dir / "rank-0.error.json").write_text(
        json.dumps({"type": "RuntimeError", "message": "stale", "pid": 999, "time": time.time()})
    )
    core = daemon_core.Core(db, tmp_path)
    asyncio.run(core.recover())
    assert core.groups[attempt_id].ranks[0].exit.error is None
    (attempt_dir / "rank-0.error.json").write_text(
        json.dumps({"type": "RuntimeError", "message": "mine", "pid": 4242, "time": time.time()})
    )
    core = daemon_core.Core(db, tmp_path)
    asyncio.run(core.recover())
    assert core.groups[attempt_id].ranks[0].exit.error["message"] == "mine"


def test_runs_recorded_before_runs_had_folders_keep_the_old_layout(tmp_path):
    import sqlite_utils

    from eyas.state import schema

    db = sqlite_utils.Database(tmp_path / "eyas.db")
    for migration in schema.MIGRATIONS[:2]:
        migration(db)
    db.execute("PRAGMA user_version = 2")
    db["runs"].insert({"id": 7, "name": "old", "state": "succeeded", "created_at": 1.0})
    db.conn.commit()
    db.conn.close()
    db = store.open_writer(tmp_path / "eyas.db")
    assert schema.version(db) == schema.LATEST
    run = db["runs"].get(7)
    assert run["dir"] is None and paths.run_dir(run, tmp_path) == tmp_path / "runs" / "7"
