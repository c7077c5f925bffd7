"""A streaming run on the Run screen (issue 20): extract and train both live, and the window's
size against its budget, its mode and each side's waits, with the figures `eyas show` prints
for the same store (queries.stream_window, queries.window_lines).

The store holds what the daemon writes for such a run: the stage, attempt and rank rows, and the
ranks' progress figures as metric rows (tui_world.add_streaming_run). The live run's Run screen is
also a snapshot, at 80x24 (where the window's three lines must fit unwrapped) and 160x48."""

from __future__ import annotations

from pathlib import Path

import pytest
import tui_world as world
from textual.widgets import DataTable
from tui_world import by_column, screen_text, shows, until

from eyas.cli.history import show_lines
from eyas.state import paths, queries, store
from eyas.tui.app import EyasApp
from eyas.tui.screens.run import RunScreen

MiB = world.MiB

LIVE = [
    "window: 6.0 MiB (25%) last sampled, 18.0 MiB (75%) at most, budget 24.0 MiB",
    "regenerated each epoch: the dataset does not fit the budget",
    "waits: extract on the window 6x (3.3 s), train on extract 6x (2.5 s)",
]
KEPT = [
    "window: 20.0 MiB (83%) last sampled, 20.0 MiB (83%) at most, budget 24.0 MiB",
    "kept: the whole dataset (20.0 MiB) fits, later epochs read it from disk",
    "waits: extract on the window 0x (0.0 s), train on extract 2x (1.0 s)",
]


SIZES = [(80, 24), (160, 48)]


@pytest.fixture
def home(tmp_path, monkeypatch):
    world.use_tz_utc(monkeypatch)
    h = tmp_path / "home"
    ids = world.build(h)
    ids["live"] = world.add_streaming_run(h)
    ids["kept"] = world.add_streaming_run(h, kept=True)
    return h, ids


def _app(h):
    return EyasApp(h, socket=h / "no-daemon.sock", clock=lambda: world.NOW)


async def _open(pilot, run_id: int) -> RunScreen:
    await until(pilot, lambda: pilot.app.screen_stack and pilot.app.screen.query("DataTable"), what="runs")
    screen = RunScreen(run_id)
    await pilot.app.push_screen(screen)
    await until(pilot, lambda: screen.query_one("#stages", DataTable).row_count, what="the stages")
    return screen


def _eyas_show(h, run_id: int) -> list[str]:
    conn = queries.connect(paths.db_path(h))
    try:
        return show_lines(queries.get_run(conn, run_id), now=world.NOW)
    finally:
        conn.close()


async def _window_shown(pilot, h, run_id: int, lines: list[str]) -> tuple[dict[str, dict], str]:
    """Open the run and wait until its window's lines show; check that `eyas show` prints the
    same lines from the same store. Returns the stages table's rows by stage, and the screen."""
    screen = await _open(pilot, run_id)
    text = await shows(pilot, pilot.app, lines[0])
    for line in lines[1:]:
        assert line in text, text
    shown = _eyas_show(h, run_id)
    at = shown.index("  " + lines[0])
    assert shown[at : at + len(lines)] == ["  " + line for line in lines], shown
    return {r["name"]: r for r in by_column(screen.query_one("#stages", DataTable))}, text


async def test_a_live_streaming_run_shows_both_stages_and_the_window(home):
    h, ids = home
    app = _app(h)
    async with app.run_test(size=(160, 48)) as pilot:
        rows, text = await _window_shown(pilot, h, ids["live"], LIVE)
        # Both halves run at once: each has its running row, and the status line names both.
        assert (rows["extract"]["state"], rows["extract"]["attempt"]) == ("▶ running", "2")
        assert (rows["train"]["state"], rows["train"]["attempt"]) == ("▶ running", "2")
        assert "extract running · attempt 2 · " in text and "train running · attempt 2 · " in text, text

        # The ranks go on: extract rank 0 fills the window to 20 MiB and waits twice more (1.0 s);
        # the screen follows the store while the run runs.
        db = store.open_writer(paths.db_path(h))
        record = world.extract_record(world.NOW + 10, 20 * MiB, 5, 2.5)
        store.insert_metrics(db, world.progress_rows(ids["live"], "extract", 2, 0, [record]))
        db.conn.close()
        text = await shows(pilot, app, "window: 20.0 MiB (83%) last sampled, 20.0 MiB (83%) at most")
        assert "waits: extract on the window 8x (4.3 s), train on extract 6x (2.5 s)" in text, text


async def test_a_finished_streaming_run_says_its_dataset_was_kept(home):
    h, ids = home
    app = _app(h)
    async with app.run_test(size=(160, 48)) as pilot:
        rows, _ = await _window_shown(pilot, h, ids["kept"], KEPT)
        assert rows["extract"]["state"] == rows["train"]["state"] == "✓ succeeded"
        # An offline run has no window: the line is not drawn, and takes no room.
        await pilot.app.pop_screen()
        offline = await _open(pilot, ids["done"])
        await shows(pilot, app, "llama-8b-eagle3")
        assert not offline.query_one("#window").display
        assert "window:" not in screen_text(app)


def test_the_mode_is_not_known_before_train_frees_a_shard_or_a_stage_ends(home):
    """A window-mode run before its first freed shard looks like a kept one: the screen says it
    does not know yet rather than guess."""
    h, ids = home
    db = store.open_writer(paths.db_path(h))
    db.execute("DELETE FROM metrics WHERE run_id = ? AND name = 'shards_freed'", [ids["live"]])
    db.conn.commit()
    db.conn.close()
    conn = queries.connect(paths.db_path(h))
    try:
        window = queries.stream_window(conn, ids["live"])
    finally:
        conn.close()
    assert window["mode"] is None
    assert queries.window_lines(window)[1] == "kept or regenerated each epoch: not known yet"
    assert queries.window_lines(window)[0] == LIVE[0]


@pytest.fixture
def snapshot_app(monkeypatch):
    """The live streaming run beside build()'s runs, under a fixed path of its own (the other
    snapshot tests rebuild theirs under snapshot_home())."""
    world.use_tz_utc(monkeypatch)
    h = Path(f"{world.snapshot_home()}-streaming")
    world.build(h)
    return _app(h), world.add_streaming_run(h)


@pytest.mark.parametrize("size", SIZES, ids=["80x24", "160x48"])
def test_run_streaming(snap_compare, snapshot_app, size):
    app, run_id = snapshot_app

    async def run_before(pilot):
        await _open(pilot, run_id)
        await shows(pilot, pilot.app, LIVE[2])
        await pilot.pause(0.3)
        await pilot.wait_for_scheduled_animations()

    assert snap_compare(app, terminal_size=size, run_before=run_before)
