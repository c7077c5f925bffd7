"""The curves in the app: two runs marked on the Runs screen and overlaid on the Metrics screen,
the x axis switched to steps, the losses' log axis and the smoothing with their keys, the reason
an empty GPU plot gives, and the Run screen's `m` and curves panel, against what the
deterministic store (tui_world) holds (and a real daemon, for what it knows of GPUs)."""

from __future__ import annotations

import pytest
import tui_world as world
from daemon_harness import daemon, selftest_toml  # noqa: F401 (fixture)
from tui_world import cell_texts, until

from eyas.state import axes, paths, queries
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


async def test_losses_on_a_log_axis_smoothed_and_the_keys_that_change_it(home):
    app = _app(home)
    async with app.run_test(size=(160, 48)) as pilot:
        await until(pilot, lambda: app.screen.query("DataTable"), what="runs")
        screen = MetricsScreen([1])
        await app.push_screen(screen)
        loss = await until(pilot, lambda: (p := screen.query_one("#plot-loss", CurvePlot)).drawn and p, what="loss")
        acc = screen.query_one("#plot-acc", CurvePlot)
        lr = screen.query_one("#plot-lr", CurvePlot)
        raw = loss.lines[0].ys
        # By default: the loss on a log axis, smoothed (TensorBoard's 0.6) over its raw series.
        assert loss.on_log_axis and not lr.on_log_axis and not acc.on_log_axis
        assert [(d.faint, d.ys) for d in loss.drawn] == [(True, raw), (False, axes.ema(raw, 0.6))]
        assert [d.label for d in acc.drawn if not d.faint] == ["step 0", "step 1", "step 2"]
        assert [d.faint for d in lr.drawn] == [False]  # a learning rate is not noisy: as it is
        assert "loss: log" in str(screen.query_one("#legend").render())

        await pilot.press("y")
        await until(pilot, lambda: not loss.on_log_axis, what="a linear loss axis")
        assert "loss: linear" in str(screen.query_one("#legend").render())
        await pilot.press("e")
        await until(pilot, lambda: screen.smoothing == 0.9, what="stronger smoothing")
        await pilot.pause()
        assert loss.drawn[1].ys == axes.ema(raw, 0.9)
        await pilot.press("e")
        await until(pilot, lambda: screen.smoothing == 0, what="no smoothing")
        await pilot.pause()
        assert [(d.faint, d.ys) for d in loss.drawn] == [(False, raw)]
        assert "smoothing: off" in str(screen.query_one("#legend").render())


async def test_the_gpu_plot_of_a_cpu_stage_says_why_it_is_empty(home):
    world.add_cpu_curves(home)
    app = _app(home)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.screen.query("DataTable"), what="runs")
        screen = MetricsScreen([4])
        await app.push_screen(screen)
        await until(pilot, lambda: screen.query_one("#plot-loss", CurvePlot).lines, what="the loss")
        gpu = screen.query_one("#plot-gpu_mem", CurvePlot)
        assert not gpu.lines and gpu.note == "no GPUs: this stage ran on CPU"
        assert screen.query_one("#plot-lr", CurvePlot).note == "no samples"
        # Two ranks wrote a loss each: told apart by rank, each in its colour.
        loss = screen.query_one("#plot-loss", CurvePlot).lines
        assert [(ln.label, ln.colour) for ln in loss] == [("rank 0", 0), ("rank 1", 1)]


async def test_a_daemon_that_sees_no_gpu_says_so(daemon):  # noqa: F811 (fixture)
    run_id = daemon.submit(selftest_toml("cpu", ranks=1, options={"steps": 4, "step_time": 0.3}))
    daemon.wait_succeeded(run_id)
    sees_gpus = daemon.request("status")["gpu"]
    app = EyasApp(daemon.home, socket=daemon.socket)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.link.connected, what="the connection")
        screen = MetricsScreen([run_id])
        await app.push_screen(screen)
        gpu = await until(pilot, lambda: screen.query_one("#plot-gpu_mem", CurvePlot), what="the plot")
        await until(pilot, lambda: screen.query_one("#plot-loss", CurvePlot).lines, what="the loss")
        # This host's NVML (through the daemon's status), else the attempt's devices (none: "cpu").
        assert gpu.note == ("no GPUs: this stage ran on CPU" if sees_gpus else "no GPUs on this host")
