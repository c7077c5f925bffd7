"""A daemon SIGKILLed during a streaming run's sibling teardown (real daemon, real extract and train
ranks on a tiny target): train fails, the daemon records the teardown of extract as its
consequence (attempts.cancel_reason, specs.SIBLING_TEARDOWN) and settles train, and dies before
extract is settled. The next daemon finishes the teardown and settles the run failed with
train's root cause, extract cancelled and never a root cause."""

from __future__ import annotations

import contextlib
import os
import signal

import psutil
import pytest
from daemon_harness import private_daemon, wait_for
from ptrace_hold import held
from runtoml import run_toml

from eyas.state import queries, specs

# Two stages load torch and a model on two shared cores: about a minute in all.
pytestmark = pytest.mark.slow

# The first daemon waits this long between its SIGTERM and SIGKILL of the torn-down half, whose
# ranks the test holds (ptrace_hold): the window in which the daemon is killed. The second
# daemon's grace is short, so that it finishes the same teardown at once.
FIRST_GRACE = 60.0
SECOND_GRACE = 2.0


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from eyas.workers.models import assets

    root = tmp_path_factory.mktemp("stream-restart")
    return assets.build_model(root / "tiny-llama", "llama"), assets.write_dataset(root / "chat.jsonl", n=30)


def _toml(model, data) -> str:
    # Window mode (a budget below the dataset): extract lives until train is done, so both
    # halves are alive when train is killed. No preflight, no restarts: one attempt each.
    return run_toml(
        "stream-restart",
        ["prepare", "extract", "vocab", "train"],
        preflight=False,
        target={"path": model, "dtype": "float32"},
        data={"path": data, "max_length": 128, "limit": 24, "validation_fraction": 0.2},
        extract={"batch_size": 4, "canary": False},
        resources={"ranks": 1, "devices": "cpu"},
        draft={"vocab_size": 256},
        train={"epochs": 50, "batch_tokens": 256},
        storage={"mode": "streaming", "budget_gb": 0.0002},
        stages={"extract": {"max_restarts": 0}, "train": {"max_restarts": 0}},
    )


def _attempt(d, run_id: int, stage: str) -> dict | None:
    stages = {s["name"]: s for s in d.run(run_id)["stages"]}
    attempts = stages[stage]["attempt_list"]
    return attempts[-1] if attempts else None


def _cancel_reason(d, run_id: int, stage: str) -> str | None:
    """The stop recorded on the stage's latest attempt (daemon/intent.py), settled or not."""
    db = d.reader()
    try:
        row = db.execute(
            "SELECT cancel_reason FROM attempts WHERE run_id = ? AND stage = ? ORDER BY number DESC LIMIT 1",
            [run_id, stage],
        ).fetchone()
        return row[0] if row else None
    finally:
        db.conn.close()


def _session(pid: int) -> list[psutil.Process]:
    """Every process of a rank's session (its monitor is the session leader)."""
    sid = os.getsid(pid)
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


def _alive(procs) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def test_a_daemon_killed_between_the_sibling_teardowns_record_and_its_settlement(target):
    model, data = target
    with private_daemon(grace=FIRST_GRACE) as d, contextlib.ExitStack() as stack:
        run_id = d.submit(_toml(model, data))

        def both_live():
            ex, tr = _attempt(d, run_id, "extract"), _attempt(d, run_id, "train")
            if not (ex and tr and ex["state"] == tr["state"] == "running"):
                return None
            pids = [r["pid"] for r in ex["ranks"]], [r["pid"] for r in tr["ranks"]]
            return (ex, tr, pids) if all(pids[0]) and all(pids[1]) and pids[0] and pids[1] else None

        _, _, (ex_pids, tr_pids) = wait_for(both_live, 120, 0.1, "extract and train running together")
        # Extract's ranks cannot end on the teardown's SIGTERM now (nor resume on its SIGCONT): only
        # the SIGKILL after the grace ends them, and the daemon is dead by then.
        stopped = [p for pid in ex_pids for p in _session(pid)]
        stack.enter_context(held([p.pid for p in stopped]))
        os.kill(tr_pids[0], signal.SIGKILL)

        # The daemon records extract's teardown as train's consequence, and train's end.
        reason = wait_for(
            lambda: _cancel_reason(d, run_id, "extract"), 30, 0.02, "the sibling teardown's reason to be recorded"
        )
        assert reason == f"{specs.SIBLING_TEARDOWN}train failed"
        wait_for(lambda: _attempt(d, run_id, "train")["state"] == "failed", 30, 0.02, "train's attempt to settle")
        run = d.run(run_id)
        stages = {s["name"]: s for s in run["stages"]}
        # Train settled as failed; the run's end is left to extract's settlement, not yet written.
        assert (run["state"], stages["train"]["state"], stages["extract"]["state"]) == ("running", "failed", "running")
        assert _attempt(d, run_id, "extract")["state"] == "running"
        d.kill9()

        assert len(_alive(stopped)) == len(stopped)  # the torn-down half outlived the daemon
        d.grace = SECOND_GRACE
        d.start()
        run = d.wait_run(run_id, timeout=60)
        assert not _alive(stopped)  # the next daemon finished the teardown

        stages = {s["name"]: s for s in run["stages"]}
        tr_att, ex_att = stages["train"]["attempt_list"], stages["extract"]["attempt_list"]
        assert (len(tr_att), len(ex_att)) == (1, 1)  # no attempt restarted
        assert (run["state"], stages["train"]["state"], stages["extract"]["state"]) == ("failed", "failed", "cancelled")
        # The run fails in train's words: its rank's death is the one root cause.
        assert tr_att[0]["state"] == "failed" and tr_att[0]["root_cause"]["type"] == "SIGKILL"
        assert run["reason"] == f"train: {stages['train']['reason']}" and "SIGKILL" in run["reason"]
        # Extract: cancelled, as train's consequence, and never a root cause.
        assert (ex_att[0]["state"], ex_att[0]["reason"], ex_att[0]["root_cause"]) == ("cancelled", reason, None)
        assert stages["extract"]["reason"] == reason
        db = d.reader()
        try:
            errors = queries.errors(db, run_id)
        finally:
            db.conn.close()
        # Every error recorded is train's, and it has one root cause: extract's teardown left none.
        assert {e["stage"] for e in errors} == {"train"}
        assert [e["type"] for e in errors if e["root_cause"]] == [tr_att[0]["root_cause"]["type"]]
