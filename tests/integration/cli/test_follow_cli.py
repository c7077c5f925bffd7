"""`eyas submit --follow` (cli/follow.py) through a real daemon: a failure told root cause first
with the TP worker named as the TUI names it, eyas's own teardown signals never shown, and plain
lines as things happen when stdout is a pipe."""

from __future__ import annotations

import re
import subprocess
import time

import pytest
from daemon_harness import EYAS, daemon, selftest_toml  # noqa: F401 (fixture)

from eyas.state import queries

_ESCAPES = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|\][^\x07]*\x07)")
# A line about a failure or an exit, whichever the follow printed first.
_FAILURE = re.compile(r"root cause|also failed|killed by|SIGTERM|SIGKILL")


def _tp_failure_toml(name: str) -> str:
    """One driver rank whose stand-in TP worker 1 raises (the selftest's "tp-worker" mode)."""
    return selftest_toml(name, ranks=1, options={"steps": 400, "step_time": 0.05, "fail": "tp-worker"})


def _follow(daemon, path, **env) -> subprocess.CompletedProcess:
    """`eyas submit --follow path`; a follow that never ends fails with what the run was doing."""
    try:
        return subprocess.run(
            [EYAS, "submit", "--follow", str(path)],
            env={**daemon.env, "TZ": "UTC", **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired as exc:
        db = daemon.reader()
        try:
            newest = max(r["id"] for r in queries.list_runs(db.conn))
        finally:
            db.conn.close()
        pytest.fail(f"the follow did not end; it printed {exc.stdout!r}\n{daemon.diagnose(newest)}")


def _errors(daemon, run_id: int) -> list[dict]:
    db = daemon.reader()
    try:
        return queries.errors(db.conn, run_id)
    finally:
        db.conn.close()


def test_follow_of_a_failing_run_prints_the_root_cause_first_and_no_teardown_signal(daemon):
    path = daemon.home / "tp.toml"
    path.write_text(_tp_failure_toml("tp-fail"))
    out = _follow(daemon, path)
    assert out.returncode == 1, out.stdout + out.stderr
    run_id = int(re.match(r"run (\d+) submitted", out.stdout).group(1))

    # What the store recorded: the TP worker's exception is the root cause, and the driver
    # rank was ended by the SIGTERM of eyas's teardown, which is no failure of its own.
    errors = _errors(daemon, run_id)
    root = errors[0]
    assert root["root_cause"] and (root["role"], root["tp_rank"], root["type"]) == ("tp-worker", 1, "RuntimeError")
    assert root["rank"] == 1 + root["tp_rank"]  # numbered after the run's one driver rank
    driver = next(r for r in daemon.ranks(run_id) if r["rank"] == 0)
    assert (driver["role"], driver["state"], driver["signal"]) == ("driver", "killed", 15)

    label = f"rank {root['rank']} (TP worker {root['tp_rank']})"
    lines = out.stdout.splitlines()
    first = next(line for line in lines if _FAILURE.search(line))
    assert first.endswith(f"selftest attempt 1 root cause: {label}: RuntimeError: {root['message']}"), out.stdout
    assert root["message"] == "selftest TP worker 1 failure"
    assert "SIGTERM" not in out.stdout and "killed by" not in out.stdout
    # The failure comes before the stage's own line, and the summary names the worker the same way.
    assert lines.index(first) < next(i for i, line in enumerate(lines) if line.endswith("selftest: failed"))
    assert f"selftest attempt 1: {label} RuntimeError: selftest TP worker 1 failure" in out.stdout

    # `eyas errors` names it the same way, and its JSON says which process it was.
    errs = daemon.cli("errors", run_id)
    assert errs.stdout.splitlines()[1].startswith(f"* root cause: {label}, pid {root['pid']}")
    assert '"role": "tp-worker"' in daemon.cli("errors", run_id, "--json").stdout

    # On a terminal (rich's live bars): the same root cause first, and no teardown line either.
    path.write_text(_tp_failure_toml("tp-fail-tty"))
    tty = _follow(daemon, path, FORCE_TERMINAL="1", COLUMNS="200")
    assert tty.returncode == 1, tty.stdout + tty.stderr
    seen = _ESCAPES.sub("", tty.stdout)
    first = next(line for line in seen.splitlines() if _FAILURE.search(line))
    assert f"selftest attempt 1 root cause: {label}: RuntimeError" in first, seen
    assert "SIGTERM" not in seen


def test_piped_follow_prints_plain_stage_lines_as_they_happen(daemon):
    """stdout a pipe: a line per stage change when it happens, progress lines between them as the
    progress moves (looked at every EYAS_FOLLOW_EVERY), each stamped; not everything at the end."""
    every = 0.5
    path = daemon.home / "piped.toml"
    path.write_text(
        selftest_toml(
            "piped",
            ranks=1,
            max_restarts=1,
            backoff=1.0,
            options={"steps": 30, "step_time": 0.1, "fail": "raise", "fail_at_step": 10, "fail_attempts": [1]},
        )
    )
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [EYAS, "submit", "--follow", str(path)],
        env={**daemon.env, "EYAS_FOLLOW_EVERY": str(every)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    arrivals: list[tuple[float, str]] = []
    try:
        for line in proc.stdout:
            arrivals.append((time.monotonic() - t0, line.rstrip("\n")))
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    end = time.monotonic() - t0
    stamped = [(t, line) for t, line in arrivals if re.match(r"\d\d:\d\d:\d\d selftest", line)]
    changes = [(t, line[9:]) for t, line in stamped if re.match(r"selftest: [a-z]+( \(|$)", line[9:])]
    texts = [line for _, line in changes]
    assert texts[0].startswith("selftest: running") and texts[-1] == "selftest: succeeded (every rank exited 0)"
    restart = texts.index("selftest: running (restart 1 of 1 in 1.0s)")
    assert texts[restart + 1] == "selftest: running (attempt 2 started)", texts
    failure = next((t, line) for t, line in stamped if "root cause" in line)
    assert failure[1].endswith("selftest attempt 1 root cause: rank 0: RuntimeError: selftest failure")
    # In order, and as they happen: the first stage line and the failure came seconds before the end.
    order = [line for _, line in arrivals]
    assert order.index(failure[1]) < next(i for i, line in enumerate(order) if "restart 1 of 1" in line)
    assert changes[0][0] <= failure[0] <= changes[-1][0], arrivals
    assert end - changes[0][0] > 2.0 and end - failure[0] > 1.0, arrivals
    # Progress as it moves while the stage runs: several lines, spread over the run, and none
    # that only says again what the line before it said.
    progress = [(t, line[9:].split(" after ")[0]) for t, line in stamped if re.search(r"selftest: \d+% after", line)]
    assert len(progress) >= 4 and progress[-1][0] - progress[0][0] > every * 2, arrivals
    said = [line[9:].split(" after ")[0] for _, line in stamped]
    assert all(a != b for a, b in zip(said, said[1:]) if "%" in a), said
    stamps = [line[:8] for _, line in stamped]
    assert stamps == sorted(stamps)


def test_piped_follow_says_a_silent_phase_once_not_a_stuck_percentage(daemon):
    """A rank in a long phase with heartbeats only (selftest's heartbeat_for): the follow says what
    it waits for, once, in place of "0%"; and it prints no line that says nothing new."""
    every = 0.3
    path = daemon.home / "phase.toml"
    path.write_text(selftest_toml("phase", ranks=1, options={"steps": 10, "step_time": 0.2, "heartbeat_for": 5}))
    out = _follow(daemon, path, EYAS_FOLLOW_EVERY=str(every))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line[9:] for line in out.stdout.splitlines() if re.match(r"\d\d:\d\d:\d\d selftest: ", line)]
    phase = [line for line in lines if "heartbeat_for" in line]
    assert len(phase) == 1, lines
    assert re.fullmatch(r"selftest: selftest heartbeat_for for \d+s", phase[0]), phase
    # A line only when something changed (the progress, the phase): none says again what the
    # line before it said.
    said = [re.sub(r" (after|for) \d+s.*", "", line) for line in lines]
    assert any("%" in line for line in said) and all(a != b for a, b in zip(said, said[1:])), lines
    assert lines[-1] == "selftest: succeeded (every rank exited 0)", lines
