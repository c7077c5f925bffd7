"""The TUI driven with Pilot against a real daemon running the selftest stage on several ranks."""

from __future__ import annotations

import re

from daemon_harness import daemon, selftest_toml  # noqa: F401 (fixture)
from textual.widgets import DataTable, Input
from tui_world import cell_texts, screen_text, shows, until

from eyas.tui.app import EyasApp
from eyas.tui.screens.errors import ErrorsScreen
from eyas.tui.screens.logs import LogsScreen
from eyas.tui.screens.run import RunScreen
from eyas.tui.screens.runs import RunsScreen
from eyas.tui.widgets.chrome import Banner
from eyas.tui.widgets.logview import LogView
from eyas.tui.widgets.modals import ConfirmScreen, SubmitScreen

SIZE = (120, 40)


def _stage(screen: RunScreen, name: str = "selftest") -> dict | None:
    run = screen.run
    return next((s for s in run["stages"] if s["name"] == name), None) if run else None


def _stage_row(screen: RunScreen) -> list[str]:
    return cell_texts(screen.query_one("#stages", DataTable))[0]


async def test_submit_watch_stages_open_logs_and_filter(daemon):
    cfg = daemon.home / "tui-ok.toml"
    cfg.write_text(selftest_toml("tui-ok", ranks=3, options={"steps": 80, "step_time": 0.1}))
    app = EyasApp(daemon.home, socket=daemon.socket)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.link.connected, what="the connection")
        assert isinstance(app.screen, RunsScreen)
        await pilot.press("n")
        await until(pilot, lambda: isinstance(app.screen, SubmitScreen), what="the submit dialog")
        app.screen.query_one(Input).value = str(cfg)
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, RunsScreen), what="the dialog to close")
        table = app.screen.query_one(DataTable)
        rows = await until(pilot, lambda: cell_texts(table), what="the run in the table")
        assert rows[0][1] == "tui-ok"
        run_id = int(rows[0][0])

        await pilot.press("enter")
        run_screen = await until(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen, what="the run")
        assert run_screen.run_id == run_id
        # The stage changes state live: pending or running, then running with its attempt.
        await until(pilot, lambda: (s := _stage(run_screen)) and s["state"] == "running", what="selftest running")
        await until(pilot, lambda: _stage_row(run_screen)[1] == "▶ running", what="the running badge")

        await pilot.press("l")
        logs = await until(pilot, lambda: isinstance(app.screen, LogsScreen) and app.screen, what="the logs")
        view = logs.query_one(LogView)
        step = re.compile(r"step (\d+)/80")
        first = await until(
            pilot,
            lambda: [int(m.group(1)) for r in view.visible_rows() if (m := step.search(r.text))],
            what="log lines",
        )
        # Lines keep arriving while following: the last visible step moves on.
        await until(
            pilot,
            lambda: any(int(m.group(1)) > max(first) + 5 for r in view.visible_rows() if (m := step.search(r.text))),
            what="new lines",
        )
        assert view.follow

        await pilot.press("slash")
        await pilot.press(*"step 1\\d/")
        await pilot.press("enter")
        await until(pilot, lambda: len(view.visible_rows()) >= 5, what="filtered lines")
        texts = [r.text for r in view.visible_rows()]
        assert texts and all(re.search(r"step 1\d/80", t) for t in texts), texts
        assert [int(step.search(t).group(1)) for t in texts] == list(range(10, 10 + len(texts)))

        await pilot.press("2")  # rank 2's log, same filter
        rows = await until(
            pilot,
            lambda: logs.rank == 2 and len(view.visible_rows()) >= 5 and view.visible_rows(),
            what="rank 2's lines",
        )
        assert {r.rank for r in rows} == {2} and all(re.search(r"step 1\d/80", r.text) for r in rows)

        await pilot.press("escape")  # clears the filter
        await pilot.press("escape")  # back to the run
        await until(pilot, lambda: app.screen is run_screen, what="the run screen")
        await until(pilot, lambda: run_screen.run["state"] == "succeeded", timeout=60, what="the run to succeed")
        await until(pilot, lambda: _stage_row(run_screen)[1] == "✓ succeeded", what="the succeeded badge")


async def test_failing_rank_root_cause_then_retry_and_stop(daemon):
    run_id = daemon.submit(
        selftest_toml(
            "tui-fail",
            ranks=3,
            options={
                "steps": 600,
                "step_time": 0.05,
                "fail": "raise",
                "fail_rank": 1,
                "fail_at_step": 3,
                "fail_attempts": [1],
            },
        )
    )
    app = EyasApp(daemon.home, socket=daemon.socket, run_id=run_id)
    async with app.run_test(size=SIZE) as pilot:
        screen = await until(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen, what="the run screen")
        await until(pilot, lambda: (s := _stage(screen)) and s["state"] == "failed", timeout=60, what="the failure")
        await until(pilot, lambda: "rank 1 RuntimeError: selftest failure" in screen_text(app), what="the cause")

        await pilot.press("e")
        errors = await until(pilot, lambda: isinstance(app.screen, ErrorsScreen) and app.screen, what="errors")
        root = errors.root
        assert (root["rank"], root["type"], root["message"], root["root_cause"]) == (
            1,
            "RuntimeError",
            "selftest failure",
            True,
        )
        assert root["path"].endswith("selftest/attempt-1/rank-1.error.json")
        shown = await shows(pilot, app, "Root cause: selftest attempt 1")
        assert "rank 1 · pid" in shown and "RuntimeError: selftest failure" in shown
        assert 'raise RuntimeError("selftest failure")' in shown  # the traceback, in full
        assert "error file: " in shown
        await pilot.press("c")
        assert app.clipboard.startswith("RuntimeError: selftest failure\nTraceback (most recent call last):")

        await pilot.press("escape")
        await until(pilot, lambda: app.screen is screen, what="back on the run")
        await pilot.press("l")  # the failed attempt's logs, rank 0
        logs = await until(pilot, lambda: isinstance(app.screen, LogsScreen) and app.screen, what="the logs")
        assert logs.attempt_no == 1
        await pilot.press("1", "e")  # rank 1, its first error line
        view = logs.query_one(LogView)
        await until(pilot, lambda: view.mark is not None and view.mark[0] == 1, what="the error line")
        assert "Traceback (most recent call last):" in next(
            r.text for r in view.visible_rows() if (r.rank, r.line) == view.mark
        )
        await pilot.press("f")
        screen.action_retry()  # what R does on the run screen underneath: the logs follow attempt 2
        await until(pilot, lambda: logs.attempt_no == 2, timeout=60, what="the logs to follow attempt 2")
        await until(pilot, lambda: any("step" in r.text for r in view.visible_rows()), what="attempt 2's lines")
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is screen, what="back on the run")
        await until(
            pilot,
            lambda: (s := _stage(screen)) and s["state"] == "running" and s["attempts"] == 2,
            timeout=60,
            what="attempt 2 running",
        )
        assert screen.check_action("retry", ()) is None  # running: retry is dimmed now, stop is not
        assert screen.check_action("stop_stage", ()) is True
        await pilot.press("s")  # stop the stage: asks first
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="the confirmation")
        await pilot.press("y")
        await until(pilot, lambda: screen.run["state"] == "cancelled", timeout=60, what="the run to be cancelled")
        assert _stage(screen)["state"] == "cancelled"
        assert daemon.run(run_id)["stages"][0]["attempt_list"][-1]["state"] == "cancelled"


async def test_stacks_key_writes_a_hung_ranks_stack_into_the_followed_log(daemon):
    run_id = daemon.submit(selftest_toml("tui-hang", ranks=2, options={"fail": "hang", "fail_rank": 1}))
    app = EyasApp(daemon.home, socket=daemon.socket, run_id=run_id)
    async with app.run_test(size=SIZE) as pilot:
        screen = await until(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen, what="the run screen")
        await until(pilot, lambda: (s := _stage(screen)) and s["state"] == "running", timeout=60, what="running")
        await pilot.press("l")
        logs = await until(pilot, lambda: isinstance(app.screen, LogsScreen) and app.screen, what="the logs")
        await pilot.press("1")
        view = logs.query_one(LogView)
        await until(pilot, lambda: any("hanging" in r.text for r in view.visible_rows()), timeout=60, what="the hang")
        assert not any("most recent call first" in r.text for r in view.visible_rows())
        await pilot.press("t")
        rows = await until(
            pilot,
            lambda: (
                (t := [r.text for r in view.visible_rows()]) and any(x.startswith("Current thread 0x") for x in t) and t
            ),
            timeout=30,
            what="the stacks",
        )
        assert any('selftest.py", line' in x and x.endswith(" in _fail") for x in rows), rows
        assert daemon.run(run_id)["state"] == "running"  # the dump does not end the rank
        daemon.request("stop", run=run_id)


async def test_readonly_hides_and_refuses_controls(daemon):
    run_id = daemon.submit(selftest_toml("tui-ro", ranks=2, options={"steps": 2000, "step_time": 0.05}))
    app = EyasApp(daemon.home, socket=daemon.socket, run_id=run_id, readonly=True)
    async with app.run_test(size=SIZE) as pilot:
        screen = await until(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen, what="the run screen")
        await until(pilot, lambda: (s := _stage(screen)) and s["state"] == "running", timeout=60, what="running")
        keys = {b.binding.action for b in screen.active_bindings.values()}
        assert {"ranks", "logs", "errors"} <= keys
        assert not keys & {"stop_stage", "stop_run", "retry", "skip", "resume", "submit"}
        palette = {c.title for c in app.get_system_commands(screen)}
        assert "Logs" in palette and "Stop run" not in palette and "Stop stage" not in palette
        for key in ("S", "s", "k", "n"):
            await pilot.press(key)
        await pilot.pause(0.5)
        assert isinstance(app.screen, RunScreen)  # no confirmation, no submit dialog
        # Even called directly, a control is refused and nothing reaches the daemon.
        assert await screen.control("stop", run=run_id) is None
        assert daemon.run(run_id)["state"] == "running"


async def test_survives_the_daemon_being_killed_and_restarted(daemon):
    app = EyasApp(daemon.home, socket=daemon.socket)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.link.connected, what="the connection")
        banner = app.screen.query_one(Banner)
        assert not banner.has_class("lost")
        daemon.kill9()
        await until(pilot, lambda: banner.has_class("lost"), what="the banner")
        assert not app.link_status.connected and app.link_status.ever_connected
        await until(pilot, lambda: "Lost the eyas daemon" in screen_text(app), what="the banner's words")
        daemon.start()
        await until(pilot, lambda: app.link.connected, timeout=30, what="the reconnection")
        assert not banner.has_class("lost")
        # Live again without a restart: a run submitted now appears through the event stream.
        run_id = daemon.submit(selftest_toml("after-restart", ranks=2, options={"steps": 5}))
        table = app.screen.query_one(DataTable)
        await until(pilot, lambda: any(r[0] == str(run_id) for r in cell_texts(table)), what="the new run")
        assert app.link.batches >= 1
