"""The TUI as a new user meets a run going on (issue 36): the Run screen follows the run from
stage to stage until the user picks one, says what a silent phase waits for, and empty screens
say why they are empty; the Runs table shows each run's acceptance length."""

from __future__ import annotations

import json

import pytest
import tui_world as world
from daemon_harness import daemon, selftest_toml  # noqa: F401 (fixture)
from textual.widgets import DataTable, Static
from tui_world import by_column, screen_text, shows, until

from eyas.state import paths, store
from eyas.tui.app import EyasApp
from eyas.tui.screens.errors import ErrorsScreen
from eyas.tui.screens.logs import LogsScreen
from eyas.tui.screens.run import RunScreen
from eyas.tui.widgets.logview import LogView


@pytest.fixture
def home(tmp_path, monkeypatch):
    world.use_tz_utc(monkeypatch)
    h = tmp_path / "home"
    return h, world.build(h)


def _app(home, **kw) -> EyasApp:
    return EyasApp(home, socket=home / "no-daemon.sock", clock=lambda: world.NOW, **kw)


def _hand_over(home, run_id: int, done: str, nxt: str, t: float) -> None:
    """What the daemon records when `done`'s attempt succeeds and `nxt` starts (one rank)."""
    db = store.open_writer(paths.db_path(home))
    (aid,) = db.execute(
        "SELECT id FROM attempts WHERE run_id = ? AND stage = ? ORDER BY number DESC LIMIT 1", [run_id, done]
    ).fetchone()
    store.move_attempt(db, aid, "succeeded", "every rank exited 0", now=t)
    store.move_stage(db, run_id, done, "succeeded", "every rank exited 0", now=t)
    world._stage_run(db, home, run_id, nxt, t + 1, 0, world=1, state="running")
    db.conn.close()


def _figures(screen: RunScreen) -> str:
    return str(screen.query_one("#figures", Static).content)


async def test_the_run_screen_follows_the_run_and_keeps_a_picked_stage(home):
    h, ids = home
    run = ids["running"]  # extract runs (attempt 2); vocab, train and evaluate wait
    app = _app(h, run_id=run)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await until(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen, what="the run")
        table = screen.query_one("#stages", DataTable)
        await shows(pilot, app, "extract running  ·  ETA")
        assert screen.stage_name == "extract"

        # extract hands over to vocab: the screen moves on by itself, cursor and figures too.
        _hand_over(h, run, "extract", "vocab", world.NOW)
        await until(pilot, lambda: screen.stage_name == "vocab", what="the screen to follow vocab")
        await shows(pilot, app, "vocab running")
        assert table.cursor_row == 3 and "picked" not in _figures(screen)
        assert screen.picked is None and screen.check_action("follow", ()) is None  # following: `f` dimmed

        # The user picks extract (up): it stays shown while the run moves on to train.
        await pilot.press("up")
        await until(pilot, lambda: screen.picked == "extract", what="the pick")
        text = await shows(pilot, app, "extract succeeded")
        assert "picked (f follows the run)" in text
        assert screen.check_action("follow", ()) is True
        _hand_over(h, run, "vocab", "train", world.NOW + 5)
        await until(
            pilot,
            lambda: [s["state"] for s in screen.run["stages"]][3:5] == ["succeeded", "running"],
            what="train running",
        )
        await pilot.pause(0.3)
        assert screen.stage_name == "extract" and table.cursor_row == 2
        assert _figures(screen).startswith("extract succeeded")

        # `f` follows the run again: train, the stage running now.
        await pilot.press("f")
        await until(pilot, lambda: screen.stage_name == "train", what="the screen to follow train")
        await shows(pilot, app, "train running")
        assert screen.picked is None and table.cursor_row == 4 and "picked" not in _figures(screen)
        await pilot.press("question_mark")
        await shows(pilot, app, "Follow run (not now)")


async def test_the_run_screen_says_what_a_silent_phase_waits_for(daemon):
    # One rank whose first seconds are a phase with heartbeats only (workers/stages/selftest.py).
    run_id = daemon.submit(
        selftest_toml("phase", ranks=1, options={"steps": 400, "step_time": 0.05, "heartbeat_for": 30})
    )
    app = EyasApp(daemon.home, socket=daemon.socket, run_id=run_id)
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await until(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen, what="the run")
        figures = await until(
            pilot, lambda: "selftest heartbeat_for for" in (f := _figures(screen)) and f, timeout=60, what="the phase"
        )
        # In place of "ETA –" and "– tok/s": what the rank is doing, and for how long.
        assert figures.startswith("selftest running  ·  selftest heartbeat_for for "), figures
        assert "ETA" not in figures and "tok/s" not in figures, figures
        assert "selftest heartbeat_for for" in screen_text(app)
    daemon.request("stop", run=run_id)


@pytest.mark.parametrize("size", [(160, 48), (80, 24)], ids=["160x48", "80x24"])
async def test_the_runs_table_shows_acceptance(home, size):
    h, ids = home
    db = store.open_writer(paths.db_path(h))
    summary = {"acceptance_length": 2.4567, "baseline_acceptance_length": 1.0123}
    db["stages"].update(store.stage_row(db, ids["done"], "evaluate")["id"], {"summary_json": json.dumps(summary)})
    db.conn.close()
    app = _app(h)
    async with app.run_test(size=size) as pilot:
        table = await until(pilot, lambda: app.screen.query(DataTable) and app.screen.query_one(DataTable))
        rows = await until(pilot, lambda: by_column(table), what="the runs")
        assert {r["id"]: r["accept"] for r in rows} == {"4": "", "3": "", "2": "", "1": "2.46"}
        assert "accept" in screen_text(app)


async def test_empty_screens_say_why(home):
    h, ids = home
    hung = world.add_hung_run(h)  # train runs; its ranks wrote no log file
    app = _app(h)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.screen.query(DataTable), what="runs")
        await app.push_screen(ErrorsScreen(ids["done"]))
        await shows(pilot, app, f"No errors: every attempt of run {ids['done']} succeeded (6 attempts).")
        app.pop_screen()
        await app.push_screen(ErrorsScreen(hung))
        await shows(pilot, app, f"No errors: run {hung} has not failed yet (it is at train).")
        app.pop_screen()
        await app.push_screen(ErrorsScreen(ids["cpu"]))
        await shows(pilot, app, f"run {ids['cpu']} cancelled: selftest: stopped by the user (attempts: 1 cancelled)")
        app.pop_screen()
        await app.push_screen(LogsScreen(hung, "train"))
        view = await until(pilot, lambda: app.screen.query(LogView) and app.screen.query_one(LogView))
        await shows(pilot, app, "rank 0 has not written its log yet (rank-0.log does not exist yet)")
        assert view.model is not None and view.model.total() == 0
        # The log appears: its lines replace the reason.
        (paths.attempt_dir(hung, "train", 1, h) / "rank-0.log").write_text("2026-12-02 14:00:00,000 INFO hello\n")
        await shows(pilot, app, "INFO hello")
