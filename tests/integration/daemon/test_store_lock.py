"""Another process holding the database locked (a backup tool, an `sqlite3` shell inside a
transaction) delays the record, never the daemon: real daemon, real ranks, a real second
process holding `BEGIN EXCLUSIVE` on eyas.db."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
from daemon_harness import daemon, selftest_toml, wait_for  # noqa: F401 (fixture)

from eyas.state import paths

LOCK_S = 45.0

# The lock is taken the way an sqlite3 shell takes it: one connection, BEGIN EXCLUSIVE, idle.
LOCKER = r"""
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], timeout=30, isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print(time.time(), flush=True)
time.sleep(float(sys.argv[2]))
conn.execute("ROLLBACK")
print(time.time(), flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_locked_store_stalls_neither_status_nor_teardown_and_the_times_stay_real(daemon):
    # Rank 1 raises at step 200 (about 10 s in: inside the lock); rank 0 would go on for 100 s.
    run_id = daemon.submit(
        selftest_toml(
            "locked",
            ranks=2,
            options={"steps": 2000, "step_time": 0.05, "fail": "raise", "fail_rank": 1, "fail_at_step": 200},
        )
    )
    pids = wait_for(
        lambda: (p := [r["pid"] for r in daemon.ranks(run_id)]) and len(p) == 2 and all(p) and p, 30, what="rank pids"
    )
    attempt_dir = Path(daemon.run(run_id)["stages"][0]["attempt_list"][0]["dir"])
    locker = subprocess.Popen(
        [sys.executable, "-c", LOCKER, str(paths.db_path(daemon.home)), str(LOCK_S)], stdout=subprocess.PIPE, text=True
    )
    locked_at = float(locker.stdout.readline())
    answers, busy_seen, down_at = [], [], None
    try:
        while locker.poll() is None and time.time() < locked_at + LOCK_S - 1:
            t0 = time.monotonic()
            info = daemon.request("status")
            answers.append(time.monotonic() - t0)
            busy_seen.append(info["store_busy"] is not None)
            if down_at is None and not any(_alive(p) for p in pids):
                down_at = time.time()
            if down_at is None:
                time.sleep(0.02)  # fine-grained while the teardown is awaited
            else:
                time.sleep(0.5)
        cli = daemon.cli("daemon", "status", timeout=30)
    finally:
        released_at = float(locker.stdout.readline())
        locker.wait(10)
    # Status answered within 1 s throughout the 45 s lock, and said why nothing was recorded.
    assert len(answers) > 40 and max(answers) < 1.0, (len(answers), max(answers))
    assert any(busy_seen) and busy_seen[-1], busy_seen[-5:]
    assert cli.returncode == 0 and "store busy: another process holds" in cli.stdout, cli.stdout

    # Rank 1's failure during the lock tore the group down within 2 s.
    error = json.loads((attempt_dir / "rank-1.error.json").read_text())
    assert locked_at < error["time"] < released_at - 10, (locked_at, error["time"], released_at)
    assert down_at is not None and down_at - error["time"] < 2.0, down_at - error["time"]

    # Once the lock went, the record is the real one: failed, rank 1 as the cause, the times
    # those of the end, not of the release; no attempt that the policy did not call for.
    run = daemon.wait_run(run_id, timeout=30)
    stage = run["stages"][0]
    (attempt,) = stage["attempt_list"]
    assert (run["state"], stage["state"], attempt["state"]) == ("failed", "failed", "failed")
    assert attempt["root_cause"]["rank"] == 1 and attempt["root_cause"]["type"] == "RuntimeError"
    for ended in (attempt["ended_at"], stage["ended_at"], run["ended_at"]):
        assert error["time"] <= ended <= down_at + 0.5, (error["time"], ended, down_at, released_at)
    ranks = {r["rank"]: r for r in attempt["ranks"]}
    assert ranks[1]["state"] == "failed" and ranks[0]["state"] == "killed"

    # The samples taken while locked were kept and written after it.
    db = daemon.reader()
    try:
        during = db.execute(
            "SELECT count(*) FROM metrics WHERE run_id = ? AND time BETWEEN ? AND ?",
            [run_id, locked_at + 1, error["time"]],
        ).fetchone()[0]
    finally:
        db.conn.close()
    assert during > 0
    print(
        f"\nstatus answered {len(answers)} times in the lock, slowest {max(answers) * 1000:.0f} ms; "
        f"teardown {down_at - error['time']:.2f} s after the failure; record at {attempt['ended_at'] - error['time']:.2f} s "
        f"after it (lock released {released_at - error['time']:.1f} s after); {during} samples kept"
    )
    assert wait_for(lambda: daemon.request("status")["store_busy"] is None, 10, what="the store to be free")


async def test_the_tui_says_the_store_is_busy_while_it_is(daemon):
    from tui_world import until

    from eyas.tui.app import EyasApp
    from eyas.tui.widgets.chrome import Banner, TopBar

    run_id = daemon.submit(selftest_toml("busy", ranks=1, options={"steps": 5000, "step_time": 0.02}))
    wait_for(lambda: (r := daemon.ranks(run_id)) and r[0]["pid"], 30, what="the rank")
    app = EyasApp(daemon.home, socket=daemon.socket)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.link.connected, what="the connection")
        banner = app.screen.query_one(Banner)
        assert not banner.has_class("busy")
        # Held until told: the 1 Hz samples meet the lock within a second or two.
        locker = subprocess.Popen(
            [sys.executable, "-c", LOCKER, str(paths.db_path(daemon.home)), "600"], stdout=subprocess.PIPE, text=True
        )
        try:
            locker.stdout.readline()
            await until(pilot, lambda: banner.has_class("busy"), timeout=20, what="the store-busy banner")
            text = str(banner.render())
            assert "Store busy: another process holds eyas.db locked (waiting to record " in text, text
            assert "store busy" in str(app.screen.query_one(TopBar).render())
        finally:
            locker.kill()
            locker.wait(10)
        await until(pilot, lambda: not banner.has_class("busy"), timeout=30, what="the banner to go")
        assert str(banner.render()) == ""
    daemon.request("stop", run=run_id)
