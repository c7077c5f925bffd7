"""The curves in the app: two runs marked on the Runs screen and overlaid on the Metrics screen,
the x axis switched to steps, and the Run screen's `m` and curves panel, against what the
deterministic store (tui_world) holds."""

from __future__ import annotations

import pytest
import tui_world as world
from tui_world import cell_texts, until

from eyas.state import paths, queries
from eyas.tui.app import EyasApp
from eyas.tui.screens.metrics import MetricsScreen
from eyas.tui.screens.run import RunScreen
from eyas.tui.widgets.curves import CurvePlot
from eyas.tui.widgets.stagecurves import StageCurves


@pytest.fixture
def home(tmp_path, monkeypatch):
    world.use_tz_utc(monkeypatch)
    h = tmp_path / "home"
    world.build(h)
    return h


def _app(home) -> EyasApp:
    return EyasApp(home, socket=home / "no-daemon.sock", clock=lambda: world.NOW)


def _raw(home, run_id: int, name: str) -> list[tuple[float, float]]:
    """(time, value) of a train metric straight from the store, every sample."""
    db = queries.connect(paths.db_path(home))
    try:
        return db.execute(
            "SELECT time, value FROM metrics WHERE run_id = ? AND stage = 'train' AND name = ? ORDER BY time",
            [run_id, name],
        ).fetchall()
    finally:
        db.close()


def _started(home, run_id: int) -> float:
    db = queries.connect(paths.db_path(home))
    try:
        return db.execute(
            "SELECT started_at FROM attempts WHERE run_id = ? AND stage = 'train' ORDER BY number LIMIT 1", [run_id]
        ).fetchone()[0]
    finally:
        db.close()


async def _mark(pilot, table, run_id: int) -> None:
    keys = [str(k.value) for k in table.rows]
    table.move_cursor(row=keys.index(str(run_id)))
    await pilot.pause()
    await pilot.press("space")


async def test_two_marked_runs_are_overlaid_each_in_its_colour(home):
    app = _app(home)
    async with app.run_test(size=(120, 40)) as pilot:
        table = await until(pilot, lambda: app.screen.query("DataTable") and app.screen.query_one("DataTable"))
        await until(pilot, lambda: table.row_count == 4, what="the runs")
        await _mark(pilot, table, 2)
        await _mark(pilot, table, 1)
        names = {row[0]: row[1] for row in cell_texts(table)}
        assert names["2"].startswith("● ") and names["1"].startswith("● ") and not names["3"].startswith("●")
        await pilot.press("m")
        screen = await until(pilot, lambda: isinstance(app.screen, MetricsScreen) and app.screen, what="metrics")
        await until(pilot, lambda: screen.query_one("#plot-loss", CurvePlot).lines, what="the loss curves")
        assert screen.run_ids == [2, 1] and screen.stage == "train"

        loss = screen.query_one("#plot-loss", CurvePlot).lines
        assert [ln.run_id for ln in loss] == [2, 1]
        assert [ln.colour for ln in loss] == [0, 1]  # the order they were marked in
        raw2, raw1 = _raw(home, 2, "loss"), _raw(home, 1, "loss")
        # Run 2 has fewer samples than a curve's points: plotted as recorded, x from its start.
        t2 = _started(home, 2)
        assert loss[0].ys == [v for _, v in raw2]
        assert loss[0].xs == [t - t2 for t, _ in raw2]
        # Run 1 has more: bucket means, so fewer points, each within the samples' range,
        # spanning the whole stage.
        assert len(raw1) > queries.CURVE_POINTS >= len(loss[1].ys) > queries.CURVE_POINTS // 2
        lo, hi = min(v for _, v in raw1), max(v for _, v in raw1)
        assert all(lo <= y <= hi for y in loss[1].ys)
        t1 = _started(home, 1)
        assert loss[1].xs[-1] == pytest.approx(raw1[-1][0] - t1, abs=2 * (raw1[-1][0] - raw1[0][0]) / len(loss[1].xs))

        legend = str(screen.query_one("#legend").render())
        assert "#2 qwen-draft" in legend and "#1 llama-8b-eagle3" in legend
        # Every curve of the train stage holds both runs (validation: run 2 only at step 0).
        for key in ("loss", "val_loss", "acc", "lr", "tok_s", "gpu_mem"):
            assert {ln.run_id for ln in screen.query_one(f"#plot-{key}", CurvePlot).lines} == {1, 2}, key
        acc = screen.query_one("#plot-acc", CurvePlot).lines
        assert sorted(ln.meta["name"] for ln in acc if ln.run_id == 1) == ["acc_0", "acc_1", "acc_2"]
        gpu = screen.query_one("#plot-gpu_mem", CurvePlot).lines
        assert sorted(ln.meta["rank"] for ln in gpu if ln.run_id == 2) == [0, 1, 2, 3]

        # Over steps: x is the step the train stage recorded with each figure.
        await pilot.press("x")
        await until(pilot, lambda: screen.x == "step", what="steps")
        by_step = {ln.run_id: ln for ln in screen.query_one("#plot-loss", CurvePlot).lines}
        steps2 = [v for _, v in _raw(home, 2, "step")]
        assert by_step[2].xs == steps2 and by_step[2].ys == [v for _, v in raw2]
        assert max(by_step[1].xs) <= max(v for _, v in _raw(home, 1, "step"))


async def test_run_screen_m_opens_its_run_and_the_panel_shows_the_stage(home):
    app = _app(home)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.screen.query("DataTable"), what="runs")
        screen = RunScreen(2)
        await app.push_screen(screen)
        panel = await until(pilot, lambda: screen.query(StageCurves) and screen.query_one(StageCurves))
        await until(pilot, lambda: panel.lines.get("loss"), what="the panel's curves")
        assert screen.stage_name == "train" and panel.has_class("shown")
        assert panel.lines["loss"][0].ys == [v for _, v in _raw(home, 2, "loss")]
        assert panel.lines["tok_s"][0].meta["rank"] is None  # the stage's own rate, not a rank's
        await pilot.press("m")
        metrics = await until(pilot, lambda: isinstance(app.screen, MetricsScreen) and app.screen, what="metrics")
        assert metrics.run_ids == [2] and metrics.stage == "train"
        await pilot.press("escape")
        # A stage without curves hides the panel: the screen looks as it did without one.
        await until(pilot, lambda: app.screen is screen)
        await pilot.press("up")
        await until(pilot, lambda: screen.stage_name == "vocab" and not panel.has_class("shown"), what="no panel")


async def test_run_screen_without_the_panel(home):
    app = _app(home)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.screen.query("DataTable"), what="runs")
        screen = RunScreen(2, curves=False)
        await app.push_screen(screen)
        await until(pilot, lambda: screen.run is not None, what="the run")
        assert not screen.query(StageCurves)
