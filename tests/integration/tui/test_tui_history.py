"""The TUI with no daemon, on a store written with fixed times: read-only history, the keys,
the palette, the Ranks and Logs screens' behaviour."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import psutil
import pytest
import tui_world as world
from textual.widgets import DataTable
from tui_world import by_column, cell_texts, screen_text, shows, until

from eyas.state import paths, store
from eyas.tui.app import EyasApp
from eyas.tui.screens.errors import ErrorsScreen
from eyas.tui.screens.logs import LogsScreen
from eyas.tui.screens.ranks import RanksScreen
from eyas.tui.screens.run import RunScreen
from eyas.tui.widgets.chrome import Banner
from eyas.tui.widgets.logview import LogView
from eyas.tui.widgets.modals import ConfirmScreen, SubmitScreen


@pytest.fixture
def home(tmp_path, monkeypatch):
    world.use_tz_utc(monkeypatch)
    h = tmp_path / "home"
    world.build(h)
    return h


def _app(home, **kw) -> EyasApp:
    return EyasApp(home, socket=home / "no-daemon.sock", clock=lambda: world.NOW, **kw)


def _notes(app) -> list[str]:
    return [n.message for n in app._notifications]


async def test_daemon_down_at_start_shows_history_and_refuses_controls(home):
    app = _app(home)
    async with app.run_test(size=(100, 30), notifications=True) as pilot:
        await until(pilot, lambda: app.screen.query(DataTable), what="the runs screen")
        banner = app.screen.query_one(Banner)
        assert banner.has_class("down") and not app.link_status.ever_connected
        await shows(pilot, app, "The eyas daemon is not running: showing read-only history from SQLite")
        rows = by_column(app.screen.query_one(DataTable))
        assert [r["id"] for r in rows] == ["3", "4", "2", "1"]
        assert [r["name"] for r in rows] == ["deepseek-v3-draft", "cpu-smoke", "qwen-draft", "llama-8b-eagle3"]
        assert [r["state"] for r in rows] == ["▶ running", "■ cancelled", "✗ failed", "✓ succeeded"]
        assert rows[0]["tok_s"] == "48,500" and rows[3]["duration"] == "3h03m"
        await pilot.press("n")
        await until(pilot, lambda: any("not connected" in m for m in _notes(app)), what="the refusal")
        assert not isinstance(app.screen, SubmitScreen)
        await pilot.press("enter")
        screen = await until(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen, what="run 3")
        assert screen.run_id == 3
        await pilot.press("S")
        await until(pilot, lambda: sum("not connected" in m for m in _notes(app)) == 2, what="the second refusal")
        assert not isinstance(app.screen, ConfirmScreen)


async def test_runs_filter_by_state_and_text(home):
    app = _app(home)
    async with app.run_test(size=(120, 30)) as pilot:
        table = await until(pilot, lambda: app.screen.query(DataTable) and app.screen.query_one(DataTable))
        await pilot.press("t")  # pending
        assert cell_texts(table) == []
        await shows(pilot, app, "No run matches the filters")
        await pilot.press("t")  # running
        assert [r[0] for r in cell_texts(table)] == ["3"]
        await pilot.press("t", "t")  # failed
        assert [r[0] for r in cell_texts(table)] == ["2"]
        await pilot.press("escape")
        await pilot.press("slash", *"llama")
        assert [r[0] for r in cell_texts(table)] == ["4", "1"]  # tiny-llama is a model, Llama-3.1 too
        await pilot.press("enter")
        await pilot.press("enter")
        screen = await until(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen, what="run 4")
        assert screen.run_id == 4


async def test_keys_help_and_the_command_palette_list_the_actions(home):
    app = _app(home, run_id=2)
    async with app.run_test(size=(120, 36)) as pilot:
        screen = await until(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen, what="run 2")
        titles = {c.title for c in app.get_system_commands(screen)}
        assert {
            "Ranks",
            "Logs",
            "Errors",
            "Stop stage",
            "Stop run",
            "Retry",
            "Skip",
            "Resume",
            "Submit",
            "Back",
            "Keys",
            "Quit",
        } <= titles
        await pilot.press("question_mark")
        text = await shows(pilot, app, "This screen")
        assert re.search(r"S +Stop run \(not now\)", text) and re.search(r"R +Retry", text)
        assert "Retry (not now)" not in text
        assert re.search(r"\? +Keys", text)
        await pilot.press("question_mark")
        await until(pilot, lambda: app.screen is screen, what="the keys to close")
        # Controls that cannot apply now are dimmed: train failed, so it can be retried, not stopped.
        assert screen.stage_name == "train"
        assert screen.check_action("retry", ()) is True and screen.check_action("stop_stage", ()) is None
        assert screen.check_action("resume", ()) is True and screen.check_action("stop_run", ()) is None


async def test_run_screen_shows_pipeline_progress_and_root_cause(home):
    app = _app(home, run_id=3)
    async with app.run_test(size=(160, 48)) as pilot:
        screen = await until(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen, what="run 3")
        text = await shows(pilot, app, "70%")
        assert "✓ preflight 14s → ✓ prepare 6m40s → ▶ extract #2 40m00s → · vocab → · train → · evaluate" in text
        assert "extract running  ·  ETA 14m22s  ·  48,500 tok/s" in text  # from the stored samples
        rows = cell_texts(screen.query_one("#stages", DataTable))
        assert rows[2][:6] == ["extract", "▶ running", "2", "1", "40m00s", "48,500"]
    app = _app(home, run_id=2)
    async with app.run_test(size=(160, 48)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, RunScreen), what="run 2")
        await until(
            pilot,
            lambda: (
                "Root cause of train attempt 1: rank 1 torch.OutOfMemoryError: CUDA out of memory." in screen_text(app)
            ),
            what="the root cause line",
        )


async def test_errors_screen_root_cause_first_others_collapsed_and_copy(home):
    app = _app(home, run_id=2)
    async with app.run_test(size=(220, 48)) as pilot:  # wide: tmp_path makes the error file's path long
        await until(pilot, lambda: isinstance(app.screen, RunScreen), what="run 2")
        await pilot.press("e")
        await until(pilot, lambda: isinstance(app.screen, ErrorsScreen) and app.screen, what="errors")
        await shows(pilot, app, "Root cause: train attempt 1")
        text = await shows(pilot, app, "▶ rank 3 · RuntimeError: NCCL communicator was aborted on rank 3.")
        assert "rank 1 · pid 40101 · on gpu-box · 2026-12-02 13:37:58 · from exception" in text
        assert "error file: " + str(home / "runs/2/train/attempt-1/rank-1.error.json") in text
        assert "▶ rank 3 · RuntimeError: NCCL communicator was aborted on rank 3." in text  # collapsed
        assert "dist.all_reduce(loss)" not in text
        await pilot.press("c")
        assert app.clipboard == (
            "torch.OutOfMemoryError: "
            + world.TRACEBACK.strip().splitlines()[-1].split(": ", 1)[1]
            + "\n"
            + world.TRACEBACK
        )
        await pilot.press("l")  # the root cause's rank log, at its first error line
        logs = await until(pilot, lambda: isinstance(app.screen, LogsScreen) and app.screen, what="its log")
        view = logs.query_one(LogView)
        await until(pilot, lambda: view.mark == (1, 39), what="the jump to the error")
        assert not view.follow
        marked = [r for r in view.visible_rows() if (r.rank, r.line) == (1, 39)]
        assert marked and "ERROR eyas.extract: batch 39 failed on rank 1" in marked[0].text


async def test_ranks_screen_gpu_bars_and_cpu_only_note(home):
    app = _app(home)
    async with app.run_test(size=(160, 48)) as pilot:
        await until(pilot, lambda: app.screen.query(DataTable), what="runs")
        await app.push_screen(RanksScreen(3, "extract"))
        screen = await until(pilot, lambda: isinstance(app.screen, RanksScreen) and app.screen, what="ranks")
        rows = await until(pilot, lambda: cell_texts(screen.query_one(DataTable)), what="the rank rows")
        assert len(rows) == 8 and not screen.query_one("#nogpu").has_class("shown")
        assert rows[0][:3] == ["0", "4900000", "▶ running"]
        # GPU memory bar: latest used of the device's total
        assert by_column(screen.query_one(DataTable))[0]["gpu"].endswith(" 50/80G")
        assert rows[0][-3:] == ["6,550", "97", "11.0 GiB"]
        assert "no GPUs" not in await shows(pilot, app, "extract attempt 2")
        await app.push_screen(RanksScreen(4, "selftest"))
        cpu = await until(
            pilot,
            lambda: app.screen is not screen and isinstance(app.screen, RanksScreen) and app.screen,
            what="cpu ranks",
        )
        assert (await shows(pilot, app, "no GPUs: CPU figures only")).count("no GPUs") == 1
        assert [c.label.plain for c in cpu.query_one(DataTable).columns.values()] == [
            "rank",
            "pid",
            "state",
            "exit",
            "last write",
            "tok/s (5 min)",
            "tok/s",
            "CPU %",
            "RSS",
        ]
        assert [r[:4] for r in cell_texts(cpu.query_one(DataTable))] == [
            ["0", "40100", "■ killed", "SIGTERM"],
            ["1", "40101", "■ killed", "SIGTERM"],
        ]


async def test_ranks_screen_lists_the_processes_under_a_live_rank(home):
    """vLLM's TP workers run under rank 0: real child processes appear as sub-rows."""
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"]
    )
    try:
        child = world_wait(lambda: psutil.Process(parent.pid).children())[0]
        db = store.open_writer(paths.db_path(home))
        run_id = store.create_run(db, name="tp", model="m", stages=[{"name": "selftest"}], now=world.NOW)
        store.move_run(db, run_id, "running", "start", now=world.NOW)
        store.move_stage(db, run_id, "selftest", "running", "started", now=world.NOW)
        adir = paths.attempt_dir(run_id, "selftest", 1, home)
        adir.mkdir(parents=True)
        aid, _ = store.new_attempt(db, run_id, "selftest", dir=str(adir), world_size=1, now=world.NOW)
        store.upsert_rank(db, aid, 0, pid=parent.pid, state="running")
        (adir / "rank-0.proc.json").write_text(
            json.dumps({"pid": parent.pid, "create_time": psutil.Process(parent.pid).create_time()})
        )
        db.conn.close()
        app = _app(home)
        async with app.run_test(size=(160, 40)) as pilot:
            await until(pilot, lambda: app.screen.query(DataTable), what="runs")
            await app.push_screen(RanksScreen(run_id, "selftest"))
            table = await until(pilot, lambda: isinstance(app.screen, RanksScreen) and app.screen.query_one(DataTable))
            rows = await until(
                pilot,
                lambda: len(cell_texts(table)) == 2 and cell_texts(table),
                timeout=20,
                what="the child process row",
            )
            assert rows[1][:4] == ["└", str(child.pid), "sleep", "sleeping"]
    finally:
        for p in psutil.Process(parent.pid).children(recursive=True):
            p.kill()
        parent.kill()
        parent.wait()


def world_wait(fn, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("timed out")


async def test_logs_follow_pauses_on_scroll_up_and_resumes_with_a_key(home):
    log = home / "runs/3/extract/attempt-2/rank-0.log"
    app = _app(home)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.screen.query(DataTable), what="runs")
        await app.push_screen(LogsScreen(3, "extract"))
        view = await until(pilot, lambda: isinstance(app.screen, LogsScreen) and app.screen.query_one(LogView))
        rows = await until(pilot, lambda: view.visible_rows(), what="the tail")
        assert view.follow and rows[-1].line == 239 and "batch 239/400" in rows[-1].text
        await pilot.press("up", "up", "up")
        assert not view.follow
        top = view.visible_rows()[0].line
        with open(log, "a") as out:
            out.write("2026-12-02 15:00:01,000 INFO eyas.extract: rank 0 appended while paused\n")
        await until(pilot, lambda: view.model.total() == 241, what="the new line to be indexed")
        await pilot.pause(0.3)
        assert view.visible_rows()[0].line == top  # paused: the view stays where it was
        await shows(pilot, app, "paused (f follows)")
        await pilot.press("f")
        await until(pilot, lambda: view.visible_rows()[-1].line == 240, what="following again")
        assert view.follow and "appended while paused" in view.visible_rows()[-1].text
        await shows(pilot, app, "FOLLOWING")
        # Scrolling back down to the end also resumes following.
        await pilot.press("pageup")
        assert not view.follow
        await pilot.press("end")
        assert view.follow


async def test_logs_merged_view_wrap_rank_switch_and_highlight_mode(home):
    app = _app(home)
    async with app.run_test(size=(70, 30)) as pilot:
        await until(pilot, lambda: app.screen.query(DataTable), what="runs")
        await app.push_screen(LogsScreen(3, "extract"))
        screen = await until(pilot, lambda: isinstance(app.screen, LogsScreen) and app.screen)
        view = screen.query_one(LogView)
        await until(pilot, lambda: view.visible_rows(), what="rank 0")
        await pilot.press("a")
        rows = await until(pilot, lambda: view.model.merged and view.visible_rows(), what="all ranks")
        assert view.model.total() == 8 * 240
        assert [r.rank for r in rows[-8:]] == list(range(8))  # the last batch of each rank, by time
        assert all("batch 239/400" in r.text for r in rows[-8:])
        await shows(pilot, app, "r7  2026-12-02")
        await pilot.press("]")  # back to one rank: the next one
        await until(pilot, lambda: not view.model.merged and screen.rank == 1, what="rank 1")
        await pilot.press("w")
        await until(pilot, lambda: view.wrap, what="wrap")
        narrow = _app_width_rows(view)
        assert narrow["screen_rows"] > narrow["distinct"]  # long lines fold onto several rows
        await pilot.press("slash", *"batch 23\\d/", "enter")
        await until(pilot, lambda: view.model.total() == 10, what="the filter")
        await pilot.press("m")  # highlight mode: every line, matches marked
        await until(pilot, lambda: view.model.total() == 240, what="highlight mode")
        assert view.pattern.pattern == "batch 23\\d/"


def _app_width_rows(view) -> dict:
    rows = view.visible_rows()
    return {"screen_rows": len(rows), "distinct": len({(r.rank, r.line) for r in rows})}


def test_tp_workers_sit_under_their_driver_rank():
    from eyas.tui.screens.ranks import _ordered

    ranks = [
        {"rank": 0, "role": "driver"},
        {"rank": 1, "role": "driver"},
        {"rank": 3, "role": "tp-worker", "tp_rank": 1, "parent_rank": 1},
        {"rank": 2, "role": "tp-worker", "tp_rank": 1, "parent_rank": 0},
        {"rank": 4},
    ]  # a plain rank of a store without roles
    assert [r["rank"] for r in _ordered(ranks)] == [0, 2, 1, 3, 4]


async def test_readonly_keys_and_palette_have_no_controls(home):
    app = _app(home, run_id=2, readonly=True)
    async with app.run_test(size=(100, 36)) as pilot:
        screen = await until(pilot, lambda: isinstance(app.screen, RunScreen) and app.screen, what="run 2")
        titles = {c.title for c in app.get_system_commands(screen)}
        assert "Logs" in titles and not titles & {"Stop stage", "Stop run", "Retry", "Skip", "Resume", "Submit"}
        await shows(pilot, app, "[read-only]")
        await pilot.press("question_mark")
        text = await shows(pilot, app, "This screen")
        assert "Logs" in text and "Retry" not in text and "Stop" not in text and "Submit" not in text
