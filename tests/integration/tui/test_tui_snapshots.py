"""Snapshots of every screen at 80x24 and 160x48, in a deterministic state.

The store is written with fixed times under a fixed path (error files' paths are shown),
the clock is frozen, TZ is UTC, and there is no daemon: the banner says so, the same way
every time. Update with `pytest tests/integration/tui/test_tui_snapshots.py --snapshot-update`, then look.
"""

from __future__ import annotations

import pytest
import tui_world as world
from textual.widgets import Input
from tui_world import until

from eyas.tui.app import EyasApp
from eyas.tui.screens.errors import ErrorsScreen
from eyas.tui.screens.logs import LogsScreen
from eyas.tui.screens.metrics import MetricsScreen
from eyas.tui.screens.ranks import RanksScreen
from eyas.tui.screens.run import RunScreen
from eyas.tui.widgets.curves import CurvePlot
from eyas.tui.widgets.logview import LogView
from eyas.tui.widgets.modals import SubmitScreen

SIZES = [(80, 24), (160, 48)]


@pytest.fixture
def app(monkeypatch):
    world.use_tz_utc(monkeypatch)
    home = world.snapshot_home()
    world.build(home)
    return EyasApp(home, socket=home / "no-daemon.sock", clock=lambda: world.NOW)


async def _settle(pilot) -> None:
    await pilot.pause(0.3)
    await pilot.wait_for_scheduled_animations()


def _screen(factory, ready=None):
    async def run_before(pilot) -> None:
        await until(pilot, lambda: pilot.app.screen_stack and pilot.app.screen.query("DataTable"), what="runs")
        await pilot.app.push_screen(factory())
        if ready is not None:
            await until(pilot, lambda: ready(pilot.app.screen), what="the screen's content")
        await _settle(pilot)

    return run_before


def _log_ready(screen) -> bool:
    return bool(screen.query(LogView) and screen.query_one(LogView).visible_rows())


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "160x48"])
def test_runs(snap_compare, app, size):
    async def run_before(pilot):
        await until(pilot, lambda: pilot.app.screen.query("DataTable"), what="runs")
        await _settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "160x48"])
def test_run_running(snap_compare, app, size):
    assert snap_compare(app, terminal_size=size, run_before=_screen(lambda: RunScreen(3)))


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "160x48"])
def test_run_failed(snap_compare, app, size):
    assert snap_compare(app, terminal_size=size, run_before=_screen(lambda: RunScreen(2)))


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "160x48"])
def test_ranks(snap_compare, app, size):
    assert snap_compare(app, terminal_size=size, run_before=_screen(lambda: RanksScreen(3, "extract")))


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "160x48"])
def test_logs_one_rank_following(snap_compare, app, size):
    assert snap_compare(app, terminal_size=size, run_before=_screen(lambda: LogsScreen(3, "extract"), _log_ready))


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "160x48"])
def test_logs_all_ranks_merged(snap_compare, app, size):
    assert snap_compare(
        app, terminal_size=size, run_before=_screen(lambda: LogsScreen(3, "extract", merged=True), _log_ready)
    )


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "160x48"])
def test_errors(snap_compare, app, size):
    assert snap_compare(app, terminal_size=size, run_before=_screen(lambda: ErrorsScreen(2)))


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "160x48"])
def test_errors_none(snap_compare, app, size):
    """A run without errors says why the screen is empty."""
    assert snap_compare(app, terminal_size=size, run_before=_screen(lambda: ErrorsScreen(1)))


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "160x48"])
def test_submit_dialog_with_a_refusal(snap_compare, app, size):
    """The submit dialog reads whole, and so does what it says of a path that is no run config."""

    async def run_before(pilot):
        await until(pilot, lambda: pilot.app.screen.query("DataTable"), what="runs")
        missing = world.snapshot_home() / "configs" / "llama-3.1-8b-eagle3-sharegpt-two-epochs.toml"
        await pilot.app.push_screen(SubmitScreen(str(missing)))
        pilot.app.screen.query_one(Input).cursor_blink = False  # a blink is no part of the picture
        await pilot.press("enter")
        await until(pilot, lambda: "no such file" in str(pilot.app.screen.query_one("#error").content))
        await _settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=run_before)


def _plotted(screen) -> bool:
    return bool(screen.query(CurvePlot)) and any(p.lines for p in screen.query(CurvePlot))


def _run_on_train() -> RunScreen:
    return RunScreen(1, stage="train")  # the finished run's train stage, which has curves


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "160x48"])
def test_run_curves(snap_compare, app, size):
    assert snap_compare(app, terminal_size=size, run_before=_screen(_run_on_train, _plotted))


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "160x48"])
def test_metrics_one_run(snap_compare, app, size):
    assert snap_compare(app, terminal_size=size, run_before=_screen(lambda: MetricsScreen([1]), _plotted))


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "160x48"])
def test_metrics_two_runs_overlaid_by_step(snap_compare, app, size):
    async def run_before(pilot):
        await _screen(lambda: MetricsScreen([1, 2]), _plotted)(pilot)
        await pilot.press("x")
        await until(pilot, lambda: pilot.app.screen.x == "step", what="steps on x")
        await _settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "160x48"])
def test_metrics_linear_and_raw(snap_compare, app, size):
    """`y` puts the losses on a linear axis, `e` twice turns the smoothing off: the raw series."""

    async def run_before(pilot):
        await _screen(lambda: MetricsScreen([1]), _plotted)(pilot)
        await pilot.press("y", "e", "e")
        await until(pilot, lambda: not pilot.app.screen.log_y and pilot.app.screen.smoothing == 0, what="the keys")
        await _settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "160x48"])
def test_metrics_cpu_run(snap_compare, app, size):
    """A stage that ran on no GPU: its GPU plot says so, and its 30 seconds read as m:ss."""
    world.add_cpu_curves(world.snapshot_home())
    assert snap_compare(app, terminal_size=size, run_before=_screen(lambda: MetricsScreen([4]), _plotted))
