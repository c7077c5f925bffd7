"""Intent survives the daemon: a request acknowledged, or a decision taken, just before the daemon
is SIGKILLed is finished the same way by the daemon started next (real daemon, real ranks)."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
from daemon_harness import daemon, selftest_toml, wait_for  # noqa: F401 (fixture)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pids(d, run_id: int, n: int) -> list[int]:
    return wait_for(
        lambda: (p := [r["pid"] for r in d.ranks(run_id)]) and len(p) == n and all(p) and p, 30, what="rank pids"
    )


def _crash_right_after(d, op: str, **args) -> tuple[dict, float]:
    """Send a request and SIGKILL the daemon as soon as it is answered; the gap, in seconds."""
    reply = d.request(op, **args)
    answered = time.monotonic()
    os.kill(d.proc.pid, signal.SIGKILL)
    gap = time.monotonic() - answered
    d.proc.wait(10)
    return reply, gap


def test_a_stop_acknowledged_just_before_a_crash_ends_the_stage_cancelled(daemon):
    run_id = daemon.submit(
        selftest_toml("stop-crash", ranks=2, max_restarts=2, options={"steps": 2000, "step_time": 0.05})
    )
    pids = _pids(daemon, run_id, 2)
    reply, gap = _crash_right_after(daemon, "stop", run=run_id)
    assert reply["stopping"] and gap < 0.05, gap
    daemon.start()
    run = daemon.wait_run(run_id, timeout=30)
    stage = run["stages"][0]
    assert (run["state"], stage["state"], stage["reason"]) == ("cancelled", "cancelled", "stopped by the user")
    (attempt,) = stage["attempt_list"]  # never restarted, max_restarts = 2 notwithstanding
    assert (attempt["state"], attempt["reason"], attempt["root_cause"]) == ("cancelled", "stopped by the user", None)
    assert {r["state"] for r in attempt["ranks"]} <= {"killed", "exited"}, attempt["ranks"]
    assert not any(_alive(p) for p in pids)
    time.sleep(1.5)  # and nothing starts later either
    assert len(daemon.run(run_id)["stages"][0]["attempt_list"]) == 1
    assert "has no recorded errors" in daemon.cli("errors", run_id).stderr


def test_a_skip_acknowledged_just_before_a_crash_holds(daemon):
    # Run a holds GPU 0; run b's stage waits for it, pending, and is skipped.
    a = daemon.submit(
        selftest_toml("holder", ranks=1, devices="[0]", options={"steps": 2000, "step_time": 0.05}), "a.toml"
    )
    _pids(daemon, a, 1)
    b = daemon.submit(
        selftest_toml("queued", ranks=1, devices="[0]", max_restarts=2, options={"steps": 5, "step_time": 0.01}),
        "b.toml",
    )
    wait_for(lambda: "waiting for devices" in (daemon.run(b)["reason"] or ""), 10, what="run b to queue")
    _reply, gap = _crash_right_after(daemon, "skip", run=b, stage="selftest")
    assert gap < 0.05, gap
    daemon.start()
    run = daemon.wait_run(b, ("succeeded",), timeout=30)
    assert run["stages"][0]["state"] == "skipped" and run["stages"][0]["attempt_list"] == []
    daemon.request("stop", run=a)
    assert daemon.wait_run(a, timeout=30)["state"] == "cancelled"


def test_a_retry_acknowledged_just_before_a_crash_starts_exactly_one_attempt(daemon):
    run_id = daemon.submit(
        selftest_toml(
            "retry-crash",
            ranks=2,
            max_restarts=2,
            backoff=0.1,
            options={
                "steps": 10,
                "step_time": 0.02,
                "fail": "raise",
                "fail_rank": 0,
                "fail_at_step": 1,
                "fail_attempts": [1, 2, 3],
            },
        )
    )
    assert daemon.wait_run(run_id, timeout=60)["state"] == "failed"
    assert len(daemon.run(run_id)["stages"][0]["attempt_list"]) == 3
    _reply, gap = _crash_right_after(daemon, "retry", run=run_id)
    assert gap < 0.05, gap
    daemon.start()
    run = daemon.wait_run(run_id, ("succeeded",), timeout=60)
    attempts = run["stages"][0]["attempt_list"]
    assert [a["state"] for a in attempts] == ["failed", "failed", "failed", "succeeded"], [
        (a["state"], a["reason"], a["root_cause"]) for a in attempts[3:]
    ]
    time.sleep(1.5)
    assert len(daemon.run(run_id)["stages"][0]["attempt_list"]) == 4


def test_a_restart_pending_in_backoff_starts_when_due_after_a_daemon_crash(daemon):
    backoff = 5.0
    run_id = daemon.submit(
        selftest_toml(
            "backoff-crash",
            ranks=1,
            max_restarts=1,
            backoff=backoff,
            options={
                "steps": 5,
                "step_time": 0.01,
                "fail": "raise",
                "fail_rank": 0,
                "fail_at_step": 0,
                "fail_attempts": [1],
            },
        )
    )
    first = wait_for(
        lambda: (a := daemon.run(run_id)["stages"][0]["attempt_list"]) and a[0]["state"] == "failed" and a[0],
        30,
        what="attempt 1 to fail",
    )
    due = first["ended_at"] + backoff
    daemon.kill9()
    assert time.time() < due - 1, "the daemon must die while the restart is pending"
    daemon.start()
    run = daemon.wait_run(run_id, timeout=60)
    assert run["state"] == "succeeded", run
    second = run["stages"][0]["attempt_list"][1]
    # Not at once (the due time survived the daemon), not never, and not much after it is due.
    assert due - 0.1 <= second["started_at"] <= due + 3.0, second["started_at"] - due
    assert len(run["stages"][0]["attempt_list"]) == 2 and run["stages"][0]["restarts"] == 1


def test_a_hang_finding_recorded_just_before_a_crash_is_the_root_cause_after_it(daemon):
    """The watchdog found the stage Stalled and began its teardown; the daemon dies before the
    ranks do. The next daemon settles the attempt as that Stalled finding, with its time and
    stacks, not as the SIGTERM deaths of the teardown, nor as a new finding of its own."""
    import json

    run_id = daemon.submit(
        selftest_toml(
            "stall-crash",
            ranks=2,
            max_restarts=0,
            stall_timeout=3,
            options={
                "steps": 50,
                "step_time": 0.05,
                "fail": "hang",
                "fail_rank": -1,
                "fail_at_step": 2,
                "ignore_sigterm": True,
            },
        )
    )  # only SIGKILL, after the grace, ends them: a window to crash in
    pids = _pids(daemon, run_id, 2)

    def finding():
        db = daemon.reader()
        try:
            row = db.execute("SELECT stuck_json FROM attempts WHERE run_id = ?", [run_id]).fetchone()
        finally:
            db.conn.close()
        stuck = json.loads(row[0]) if row and row[0] else None
        return stuck if stuck and "asked" in stuck else None

    stuck = wait_for(finding, 30, interval=0.01, what="the Stalled finding with its stacks")
    time.sleep(0.3)  # the teardown has sent SIGTERM, which the ranks ignore
    os.kill(daemon.proc.pid, signal.SIGKILL)
    daemon.proc.wait(10)
    assert all(_alive(p) for p in pids)
    daemon.start()
    run = daemon.wait_run(run_id, timeout=60)
    (attempt,) = run["stages"][0]["attempt_list"]
    root = attempt["root_cause"]
    assert (run["state"], attempt["state"], root["type"]) == ("failed", "failed", "Stalled"), attempt
    assert abs(root["time"] - stuck["time"]) < 1e-3  # the first daemon's finding, not a new one
    assert "stall_timeout = 3" in root["message"] and "Current thread 0x" in root["traceback"]
    assert not any(_alive(p) for p in pids)


def test_a_daemon_that_died_while_starting_ranks_is_followed_by_one_that_finishes_the_start(daemon):
    """The state a daemon SIGKILLed inside Group.spawn leaves (the attempt recorded, rank 0
    started, rank 1 never begun), made with the daemon's own code; the next daemon starts
    rank 1 into the same attempt, on rank 0's rendezvous port, rather than settling a rank
    that never existed as Lost and starting another attempt."""
    from eyas.daemon.group import Group
    from eyas.state import paths, store
    from eyas.state import runconfig as run_config

    daemon.stop()
    toml = daemon.home / "half.toml"
    # A real gloo rendezvous: rank 0 waits for rank 1 on its MASTER_PORT.
    toml.write_text(
        selftest_toml(
            "half-started", ranks=2, max_restarts=2, options={"steps": 5, "step_time": 0.05, "gloo_teardown": "safe"}
        )
    )
    cfg = run_config.load(toml)
    db = store.open_writer(paths.db_path(daemon.home))
    run_id, run_dir = paths.claim_run_dir(1, daemon.home)
    data = {**cfg.to_dict(), "output_dir": str(run_dir / "out")}
    (run_dir / "config.json").write_text(json.dumps(data))
    store.create_run(
        db,
        name="half-started",
        model=None,
        stages=[{"name": "selftest", "max_restarts": 2, "world_size": 2}],
        config=data,
        output_dir=data["output_dir"],
        run_id=run_id,
        dir=str(run_dir),
    )
    store.move_run(db, run_id, "running", "starting selftest")
    store.move_stage(db, run_id, "selftest", "running", "started")
    attempt_dir = run_dir / "selftest" / "attempt-1"
    attempt_id, number = store.new_attempt(db, run_id, "selftest", dir=str(attempt_dir), world_size=2, devices=[])
    db.conn.close()
    group = Group(run_id, "selftest", attempt_id, number, attempt_dir, 2, [], 29500 + os.getpid() % 1000)
    attempt_dir.mkdir(parents=True)
    (run_dir / "out").mkdir()
    rank0 = group._start_rank(0, run_dir / "out", run_dir / "config.json", {})
    time.sleep(1.0)  # rank 0 is up, waiting at the rendezvous

    daemon.start()
    run = daemon.wait_run(run_id, timeout=90)
    stage = run["stages"][0]
    (attempt,) = stage["attempt_list"]  # finished, not replaced
    assert (run["state"], attempt["state"]) == ("succeeded", "succeeded"), (attempt["reason"], attempt["root_cause"])
    ranks = {r["rank"]: r for r in attempt["ranks"]}
    assert {r["state"] for r in ranks.values()} == {"exited"}
    db = daemon.reader()
    try:  # rank 0 is the process started before the restart, adopted, not started again
        monitors = dict(db.execute("SELECT rank, monitor_pid FROM ranks WHERE attempt_id = ?", [attempt_id]).fetchall())
    finally:
        db.conn.close()
    assert monitors[0] == rank0.monitor_pid and monitors[1] not in (None, 0, rank0.monitor_pid), monitors
    assert "died while starting its ranks; started rank 1 now" in (daemon.home / "daemon.log").read_text()
