"""A stop always stops, whatever holds the store: with another process holding `BEGIN
EXCLUSIVE` on eyas.db, `eyas stop` signals the live ranks at once, answers, and the stop is
recorded once the lock ends; a daemon killed in between is followed by one that settles the
attempt cancelled (daemon/intent.py). Real daemon, real ranks, a real second process locking."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
from daemon_harness import daemon, selftest_toml, wait_for  # noqa: F401 (fixture)

from eyas.state import contract, paths

# The lock is taken the way an sqlite3 shell takes it: one connection, BEGIN EXCLUSIVE, idle;
# it ends after argv[2] seconds, or as soon as a line (or EOF) comes on stdin.
LOCKER = r"""
import select, sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], timeout=30, isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print(time.time(), flush=True)
select.select([sys.stdin], [], [], float(sys.argv[2]))
conn.execute("ROLLBACK")
print(time.time(), flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _start(d, name: str) -> tuple[int, list[int], Path]:
    """A two-rank selftest run that would go on for minutes (and restarts twice on a failure)."""
    run_id = d.submit(selftest_toml(name, ranks=2, max_restarts=2, options={"steps": 5000, "step_time": 0.05}))
    pids = wait_for(
        lambda: (p := [r["pid"] for r in d.ranks(run_id)]) and len(p) == 2 and all(p) and p, 30, what="rank pids"
    )
    attempt_dir = Path(d.run(run_id)["stages"][0]["attempt_list"][0]["dir"])
    return run_id, pids, attempt_dir


class Lock:
    """A second process holding eyas.db locked, until `seconds` pass or `release()`."""

    def __init__(self, d, seconds: float):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LOCKER, str(paths.db_path(d.home)), str(seconds)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.taken_at = float(self.proc.stdout.readline())
        self.released_at: float | None = None
        # Waited for as an event: the daemon's own writes (the 1 Hz samples) meet the lock.
        wait_for(lambda: d.request("status")["store_busy"] is not None, 20, what="the daemon to meet the lock")

    def held(self) -> bool:
        return self.proc.poll() is None

    def release(self, early: bool = True) -> float:
        """The time the lock ended: ended now, or (`early` False) when its time is up."""
        if self.released_at is None:
            if early and self.held():
                self.proc.stdin.close()
            self.released_at = float(self.proc.stdout.readline())
            self.proc.wait(10)
        return self.released_at

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _deaths(attempt_dir: Path, pids: list[int]) -> list[float]:
    """When each rank died, from its monitor's exit record, once every rank has."""
    wait_for(lambda: not any(_alive(p) for p in pids), 10, interval=0.01, what="the ranks to die")
    return wait_for(lambda: _exit_times(attempt_dir, len(pids)), 5, what="the ranks' exit records")


def _exit_times(attempt_dir: Path, n: int) -> list[float] | None:
    files = [attempt_dir / contract.rank_file(r, contract.EXIT) for r in range(n)]
    if not all(f.exists() for f in files):
        return None
    return [json.loads(f.read_text())["time"] for f in files]


def _attempt_row(d, run_id: int) -> dict:
    """Read while the lock is held (WAL: readers pass a writer's lock)."""
    db = d.reader()
    try:
        cur = db.execute("SELECT state, cancel_reason FROM attempts WHERE run_id = ?", [run_id])
        return dict(zip([c[0] for c in cur.description], cur.fetchone(), strict=True))
    finally:
        db.conn.close()


def _restart_at(d, run_id: int) -> float | None:
    db = d.reader()
    try:
        return db.execute("SELECT restart_at FROM stages WHERE run_id = ?", [run_id]).fetchone()[0]
    finally:
        db.conn.close()


def _assert_cancelled_once(d, run_id: int, deaths: list[float]) -> dict:
    run = d.wait_run(run_id, timeout=30)
    (stage,) = run["stages"]
    assert (run["state"], stage["state"], stage["reason"]) == ("cancelled", "cancelled", "stopped by the user"), run
    (attempt,) = stage["attempt_list"]  # never restarted, max_restarts = 2 notwithstanding
    assert (attempt["state"], attempt["reason"], attempt["root_cause"]) == ("cancelled", "stopped by the user", None)
    assert stage["restarts"] == 0 and _restart_at(d, run_id) is None, stage
    assert {r["state"] for r in attempt["ranks"]} <= {"killed", "exited"}, attempt["ranks"]
    # The end is the group's own, not the moment the lock let the record through.
    assert max(deaths) - 0.5 <= attempt["ended_at"] <= max(deaths) + 1.0, (attempt["ended_at"], deaths)
    assert not (Path(attempt["dir"]) / contract.STOP_INTENT).exists(), "the stop intent outlived its record"
    return attempt


def test_eyas_stop_under_a_30s_lock_signals_at_once_and_is_recorded_after_it(daemon):
    run_id, pids, attempt_dir = _start(daemon, "stop-locked")
    lock = Lock(daemon, 30.0)
    try:
        stopped_at = time.time()
        out = daemon.cli("stop", run_id, timeout=30)
        answered = time.time() - stopped_at
        assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
        assert "ranks signalled" in out.stdout and "recorded once the store is free" in out.stdout, out.stdout
        deaths = _deaths(attempt_dir, pids)
        assert lock.held(), "the lock must outlast the stop"
        assert answered < 3.0, answered
        assert max(deaths) - stopped_at < 2.0, [t - stopped_at for t in deaths]
        # Nothing reached the store yet; the intent is durable beside the attempt, owner-only.
        assert _attempt_row(daemon, run_id) == {"state": "running", "cancel_reason": None}
        intent = attempt_dir / contract.STOP_INTENT
        assert stat.S_IMODE(intent.stat().st_mode) == 0o600
        assert json.loads(intent.read_text())["reason"] == "stopped by the user"
        print(
            f"\neyas stop under the lock printed {out.stdout.strip()!r} (rc {out.returncode}) in {answered:.2f} s; "
            f"ranks dead {max(deaths) - stopped_at:.2f} s after the stop"
        )
        released = lock.release(early=False)  # its full 30 s
        assert released - lock.taken_at >= 29.0, released - lock.taken_at
    finally:
        lock.kill()
    _assert_cancelled_once(daemon, run_id, deaths)
    assert "has no recorded errors" in daemon.cli("errors", run_id).stderr


def test_eyas_stop_stage_under_a_lock_signals_at_once_and_is_recorded_after_it(daemon):
    run_id, pids, attempt_dir = _start(daemon, "stop-stage-locked")
    lock = Lock(daemon, 20.0)
    try:
        stopped_at = time.time()
        out = daemon.cli("stop", run_id, "--stage", "selftest", timeout=30)
        assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
        assert "recorded once the store is free" in out.stdout, out.stdout
        deaths = _deaths(attempt_dir, pids)
        assert lock.held()
        assert max(deaths) - stopped_at < 2.0, [t - stopped_at for t in deaths]
        assert _attempt_row(daemon, run_id)["cancel_reason"] is None
        print(f"\neyas stop --stage printed {out.stdout.strip()!r}; ranks dead {max(deaths) - stopped_at:.2f} s after")
        lock.release()
    finally:
        lock.kill()
    _assert_cancelled_once(daemon, run_id, deaths)


def test_a_daemon_killed_after_signalling_under_the_lock_is_followed_by_a_cancelled_record(daemon):
    run_id, pids, attempt_dir = _start(daemon, "stop-locked-crash")
    lock = Lock(daemon, 60.0)
    try:
        stopped_at = time.time()
        reply = daemon.request("stop", run=run_id)
        os.kill(daemon.proc.pid, signal.SIGKILL)  # signalled, not recorded: only the intent holds it
        daemon.proc.wait(10)
        assert reply["stopping"] and reply.get("recorded") is False, reply
        deaths = _deaths(attempt_dir, pids)
        assert max(deaths) - stopped_at < 2.0, [t - stopped_at for t in deaths]
        assert _attempt_row(daemon, run_id) == {"state": "running", "cancel_reason": None}
        print(f"\nranks dead {max(deaths) - stopped_at:.2f} s after the stop; the daemon was SIGKILLed on its answer")
        lock.release()
    finally:
        lock.kill()
    daemon.start()
    attempt = _assert_cancelled_once(daemon, run_id, deaths)
    # The deaths came from the stop: consequences, not failures, whatever signal ended them.
    assert {r["state"] for r in attempt["ranks"]} == {"killed"}, attempt["ranks"]
    assert "has no recorded errors" in daemon.cli("errors", run_id).stderr


def test_a_stop_with_nothing_live_under_a_lock_says_it_was_not_done_and_why(daemon):
    # Run a holds device 0; run b waits for it, pending: there is nothing of b to signal.
    a = daemon.submit(
        selftest_toml("holder", ranks=1, devices="[0]", options={"steps": 5000, "step_time": 0.05}), "a.toml"
    )
    wait_for(lambda: (r := daemon.ranks(a)) and r[0]["pid"], 30, what="run a's rank")
    b = daemon.submit(
        selftest_toml("queued", ranks=1, devices="[0]", options={"steps": 5, "step_time": 0.01}), "b.toml"
    )
    wait_for(lambda: "waiting for devices" in (daemon.run(b)["reason"] or ""), 10, what="run b to queue")
    lock = Lock(daemon, 30.0)
    try:
        out = daemon.cli("stop", b, timeout=30)
        assert lock.held()
        lock.release()
    finally:
        lock.kill()
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)
    assert "store busy: another process holds the database locked" in out.stderr, out.stderr
    assert f"run {b} has no live ranks to signal" in out.stderr and "and that was not done" in out.stderr
    print(f"\neyas stop of a pending run under the lock printed {out.stderr.strip()!r}")
    assert daemon.run(b)["state"] == "pending"  # as said: not done, not later either
    daemon.request("stop", run=a)
    assert daemon.wait_run(a, timeout=30)["state"] == "cancelled"
