"""Liveness on the Run and Ranks screens (issue 19): the hung-rank case, one rank exited 0 and the
other still running and silent, shown as such; once from a store with a frozen clock (snapshots,
tui_world.add_hung_run), once live against a real daemon whose selftest ranks do exactly that."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import tui_world as world
from daemon_harness import daemon, selftest_toml  # noqa: F401 (fixture)
from textual.widgets import DataTable
from tui_world import by_column, screen_text, shows, until

from eyas.state import liveness
from eyas.tui.app import EyasApp
from eyas.tui.screens.ranks import RanksScreen
from eyas.tui.screens.run import RunScreen

SIZES = [(80, 24), (160, 48)]
QUIET_S = 3.0  # the live test's threshold (EYAS_QUIET_AFTER), so that it need not wait a minute
SLACK_S = 6.0  # the 1 Hz sampler, the store's write, the screen's redraw, a loaded 2-core machine


def _home() -> Path:
    """A fixed path of its own: test_tui_snapshots' world is rebuilt under snapshot_home()."""
    return Path(f"{world.snapshot_home()}-liveness")


@pytest.fixture
def hung(monkeypatch):
    world.use_tz_utc(monkeypatch)
    monkeypatch.delenv(liveness.QUIET_ENV, raising=False)  # the default minute
    home = _home()
    world.build(home)
    run_id = world.add_hung_run(home)
    return EyasApp(home, socket=home / "no-daemon.sock", clock=lambda: world.NOW), run_id


async def _open(pilot, screen) -> None:
    await until(pilot, lambda: pilot.app.screen_stack and pilot.app.screen.query("DataTable"), what="runs")
    await pilot.app.push_screen(screen)
    await until(pilot, lambda: pilot.app.screen.query_one(DataTable).row_count, what="the screen's rows")
    await pilot.pause(0.3)
    await pilot.wait_for_scheduled_animations()


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "160x48"])
def test_run_hung_rank(snap_compare, hung, size):
    app, run_id = hung
    assert snap_compare(app, terminal_size=size, run_before=lambda pilot: _open(pilot, RunScreen(run_id)))


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "160x48"])
def test_ranks_hung_rank(snap_compare, hung, size):
    app, run_id = hung
    assert snap_compare(app, terminal_size=size, run_before=lambda pilot: _open(pilot, RanksScreen(run_id, "train")))


async def test_the_hung_rank_is_named_on_both_screens_with_its_quiet_time(hung):
    app, run_id = hung
    exited = liveness.ago(world.NOW - world.HUNG_EXITED)
    quiet = liveness.ago(world.NOW - world.HUNG_QUIET)
    assert (exited, quiet) == ("17m", "17m")
    note = f"rank 1 exited 0 {exited} ago; rank 0 still running, quiet {quiet}"
    async with app.run_test(size=(160, 48)) as pilot:
        await _open(pilot, RunScreen(run_id))
        text = screen_text(app)
        # The header says what runs now, from the stage rows, never the stored "starting preflight".
        assert f"train running · attempt 1 · 41m40s · {note}" in text, text
        assert "starting preflight" not in text
        # All counted and nothing moving: waiting, not an ETA of 0 s.
        assert f"train running  ·  waiting: no rank wrote for {quiet}  ·  – tok/s  ·  loss 1.25" in text, text
        assert "ETA" not in text
        train = next(r for r in by_column(app.screen.query_one("#stages", DataTable)) if r["name"] == "train")
        assert train["reason"].startswith(note[: len(train["reason"])]), train

        await pilot.press("r")
        ranks = await until(pilot, lambda: isinstance(app.screen, RanksScreen) and app.screen, what="the ranks")
        await until(pilot, lambda: ranks.query_one(DataTable).row_count == 2, what="two ranks")
        text = screen_text(app)
        assert note in text, text
        rows = by_column(ranks.query_one(DataTable))
        # Rank 0 last wrote 1032 s before the frozen clock, rank 1 1031 s (a second before its exit).
        assert [(r["rank"], r["state"], r["exit"], r["wrote"]) for r in rows] == [
            ("0", "▶ running", "", "quiet 17m12s"),
            ("1", "✓ exited", "exit 0", "17m11s"),
        ]


async def test_all_counted_but_still_running_is_waiting_before_any_rank_is_quiet(monkeypatch):
    """Ten seconds after rank 0's last write (the same store, another frozen clock): every sample
    counted, so no ETA, though nobody is quiet yet; rank 1's exit is said all the same."""
    world.use_tz_utc(monkeypatch)
    monkeypatch.delenv(liveness.QUIET_ENV, raising=False)
    home = _home()
    world.build(home)
    run_id = world.add_hung_run(home)
    app = EyasApp(home, socket=home / "no-daemon.sock", clock=lambda: world.HUNG_QUIET + 10)
    async with app.run_test(size=(160, 48)) as pilot:
        await _open(pilot, RunScreen(run_id))
        text = screen_text(app)
        # Rank 1 exited 2 s after rank 0's last write, so 8 s before this clock.
        lines = [line.strip() for line in text.splitlines()]
        assert "train running · attempt 1 · 24m38s · rank 1 exited 0 8s ago; rank 0 still running" in lines, text
        assert "train running  ·  waiting: all work counted, the stage still runs  ·  " in text, text
        assert "quiet" not in text and "ETA" not in text


async def test_a_live_hung_rank_is_marked_quiet_within_the_threshold(daemon, monkeypatch):
    monkeypatch.setenv(liveness.QUIET_ENV, f"{QUIET_S:g}")
    run_id = daemon.submit(
        # Rank 0 never returns after its steps and writes nothing more; rank 1 exits 0. Both
        # watchdog rules are off (stall_timeout 0 is selftest_toml's; exit_timeout 0 here).
        selftest_toml(
            "tui-hung",
            ranks=2,
            exit_timeout=0,
            options={"steps": 3, "step_time": 0.1, "hang_at_end": True, "fail_rank": 0},
        )
    )
    app = EyasApp(daemon.home, socket=daemon.socket, run_id=run_id)
    try:
        async with app.run_test(size=(160, 48)) as pilot:
            screen = await until(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen, what="the run")
            await until(pilot, lambda: app.link.connected, what="the connection")
            note = "; rank 0 still running, quiet "
            text = await shows(pilot, app, note, timeout=60)
            seen = time.time()
            attempt = screen.stage["attempt_list"][-1]
            adir = Path(attempt["dir"])
            wrote = max((adir / n).stat().st_mtime for n in ("rank-0.log", "rank-0.progress.jsonl"))
            ended = json.loads((adir / "rank-1.exit.json").read_text())["time"]
            print(f"quiet mark shown {seen - wrote:.1f} s after rank 0's last write (threshold {QUIET_S:g} s)")
            assert QUIET_S <= seen - wrote <= QUIET_S + SLACK_S
            assert "selftest running · attempt 1 · " in text and "rank 1 exited 0 " in text, text
            assert "waiting: no rank wrote for " in text, text
            # The store holds the same last write the screen counts from: rank 0's newest file time.
            by_rank = {r["rank"]: r for r in attempt["ranks"]}
            assert by_rank[0]["last_write"] == pytest.approx(wrote, abs=1e-3)
            assert by_rank[1]["state"] == "exited" and by_rank[1]["ended_at"] == pytest.approx(ended, abs=0.5)

            await pilot.press("r")
            ranks = await until(pilot, lambda: isinstance(app.screen, RanksScreen) and app.screen, what="ranks")
            rows = await until(
                pilot,
                lambda: (rs := by_column(ranks.query_one(DataTable))) and len(rs) == 2 and rs[0]["wrote"] and rs,
                what="the ranks' rows",
            )
            assert rows[0]["wrote"].startswith("quiet "), rows
            assert rows[1]["exit"] == "exit 0" and not rows[1]["wrote"].startswith("quiet"), rows
            assert "rank 0 still running, quiet " in screen_text(app)
    finally:
        daemon.cli("stop", run_id)
        daemon.wait_run(run_id)
