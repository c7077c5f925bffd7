"""When each rank last wrote, recorded by a real daemon (ranks.last_write) while its real selftest
ranks write and then go silent, and the quiet mark state/liveness.py draws from it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from daemon_harness import daemon, selftest_toml, wait_for  # noqa: F401 (fixture)

from eyas.state import liveness

QUIET_S = 3.0  # a short threshold, so that the test need not wait the default minute
SLACK_S = 6.0  # the 1 Hz sampler, the store's write, a loaded 2-core machine


def _attempt(daemon, run_id: int) -> dict | None:
    stages = daemon.run(run_id)["stages"]
    return stages[0]["attempt_list"][-1] if stages[0]["attempt_list"] else None


def _file_write(adir: Path, rank: int) -> float | None:
    """The rank's true last write: the newer mtime of its log and progress file."""
    times = [p.stat().st_mtime for p in (adir / f"rank-{rank}.log", adir / f"rank-{rank}.progress.jsonl") if p.exists()]
    return max(times) if times else None


def test_a_silent_rank_is_marked_quiet_within_the_threshold_while_its_peer_exited(daemon, monkeypatch):
    monkeypatch.setenv(liveness.QUIET_ENV, f"{QUIET_S:g}")  # for `eyas show`, run below
    run_id = daemon.submit(
        # Rank 0 writes for about 6 s, then never returns and writes nothing; rank 1 exits 0.
        # Neither watchdog rule may end it first (stall_timeout 0 is selftest_toml's default).
        selftest_toml(
            "quiet-rank",
            ranks=2,
            exit_timeout=0,
            options={"steps": 30, "step_time": 0.2, "hang_at_end": True, "fail_rank": 0},
        )
    )
    try:
        # While rank 0 writes, its recorded last write keeps up with its files.
        lags = []

        def fresh():
            a = _attempt(daemon, run_id)
            r0 = a and next((r for r in a["ranks"] if r["rank"] == 0), None)
            if r0 and r0["last_write"] is not None and r0["state"] == "running":
                lags.append(time.time() - r0["last_write"])
                return lags[-1] < 2.5 and a
            return None

        attempt = wait_for(fresh, 60, interval=0.2, what="a recorded last write under 2.5 s old")
        adir = Path(attempt["dir"])
        assert liveness.stage_note(attempt["ranks"], time.time(), 60.0) == ""  # all run and write

        # Rank 1 exits 0; rank 0 goes silent and is marked once QUIET_S have passed.
        def marked():
            a = _attempt(daemon, run_id)
            note = liveness.stage_note(a["ranks"], time.time(), QUIET_S)
            return "rank 0 still running, quiet " in note and (a, note, time.time())

        attempt, note, seen = wait_for(marked, 60, interval=0.1, what="rank 0 marked quiet")
        wrote = _file_write(adir, 0)
        print(f"rank 0 marked quiet {seen - wrote:.1f} s after its last write (threshold {QUIET_S:g} s): {note}")
        assert QUIET_S <= seen - wrote <= QUIET_S + SLACK_S
        assert note.startswith("rank 1 exited 0 ") and " ago; rank 0 still running, quiet " in note, note
        by_rank = {r["rank"]: r for r in attempt["ranks"]}
        assert by_rank[0]["last_write"] == pytest.approx(wrote, abs=1e-3)
        assert by_rank[1]["state"] == "exited" and by_rank[1]["exit_code"] == 0
        assert by_rank[1]["last_write"] == pytest.approx(_file_write(adir, 1), abs=1e-3)
        assert by_rank[1]["last_write"] <= by_rank[1]["ended_at"]
        # `eyas show` says the same, from the same rows.
        shown = daemon.cli("show", run_id)
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        assert any(ln.startswith("  selftest attempt 1: rank 1 exited 0 ") for ln in lines), shown.stdout
        assert "; rank 0 still running, quiet " in shown.stdout
        header = next(ln for ln in lines if ln.lstrip().startswith("stage ") and "last write" in ln)
        row0 = next(ln for ln in lines[lines.index(header) :] if ln.split()[:3] == ["selftest", "1", "0"])
        assert row0.endswith(" (quiet)") and row0.split()[4] == "running", row0
        # Silent means silent: the recorded time does not move while rank 0 hangs.
        time.sleep(2.0)
        again = {r["rank"]: r for r in _attempt(daemon, run_id)["ranks"]}
        assert again[0]["state"] == "running" and again[0]["last_write"] == by_rank[0]["last_write"]
    finally:
        daemon.cli("stop", run_id)
        daemon.wait_run(run_id)
