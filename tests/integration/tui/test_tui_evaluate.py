"""The Run screen shows the evaluate stage's figures: from its stored summary once it succeeded,
from its progress metrics while it runs."""

from __future__ import annotations

import json

import pytest
import tui_world as world
from tui_world import shows

from eyas.state import paths, store
from eyas.tui.app import EyasApp
from eyas.tui.screens.run import RunScreen

SUMMARY = {
    "acceptance_length": 2.4567,
    "baseline_acceptance_length": 1.0123,
    "per_position": [0.71, 0.46, 0.2867],
    "baseline_per_position": [0.0101, 0.0022, 0.0],
    "draft_tok_s": 7388.5,
    "target_tok_s": 4012.25,
    "baseline_tok_s": 3320.0,
    "lossless": True,
    "mismatched_prompts": 0,
}


@pytest.fixture
def home(tmp_path, monkeypatch):
    world.use_tz_utc(monkeypatch)
    h = tmp_path / "home"
    ids = world.build(h)
    db = store.open_writer(paths.db_path(h))
    # The finished run's evaluate stage, as the daemon stores a succeeded stage's summary.json.
    db["stages"].update(store.stage_row(db, ids["done"], "evaluate")["id"], {"summary_json": json.dumps(SUMMARY)})
    # A run whose evaluate stage is running: the trained draft measured, the baseline not yet.
    run = store.create_run(db, name="eval-running", model="tiny", stages=[{"name": "evaluate"}], now=world.NOW - 100)
    store.move_run(db, run, "running", "started", now=world.NOW - 90)
    store.move_stage(db, run, "evaluate", "running", "started", now=world.NOW - 90)
    aid, _ = store.new_attempt(
        db, run, "evaluate", dir=str(paths.attempt_dir(run, "evaluate", 1, h)), world_size=1, now=world.NOW - 90
    )
    store.upsert_rank(db, aid, 0, pid=4_900_100, state="running")
    store.insert_metrics(
        db,
        [
            {
                "time": world.NOW - 30,
                "run_id": run,
                "stage": "evaluate",
                "attempt": 1,
                "rank": 0,
                "name": name,
                "value": value,
            }
            for name, value in (("accept_len", 1.1823), ("target_tok_s", 863.1))
        ],
    )
    db.conn.close()
    return h, ids["done"], run


async def test_the_run_screen_shows_the_evaluate_figures(home):
    h, done, _ = home
    app = EyasApp(h, socket=h / "no-daemon.sock", clock=lambda: world.NOW)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.app.push_screen(RunScreen(done))
        # The last stage that ran is selected first: evaluate.
        await shows(
            pilot,
            app,
            "accept 2.46 (untrained 1.01)  ·  per position 0.71/0.46/0.29  ·  7,388 tok/s with "
            "the draft, 4,012 without  ·  lossless",
        )


async def test_a_running_evaluate_shows_what_it_measured_so_far(home):
    h, _, run = home
    app = EyasApp(h, socket=h / "no-daemon.sock", clock=lambda: world.NOW)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.app.push_screen(RunScreen(run))
        text = await shows(pilot, app, "accept 1.18")
        assert "untrained" not in text


async def test_the_run_screen_shows_the_intervals_and_the_gain(home):
    """A summary with the bootstrap's intervals (workers/evaluate/bootstrap.py): each figure with
    its 95 % interval, and the gain over the untrained draft with its own."""
    h, done, _ = home
    db = store.open_writer(paths.db_path(h))
    summary = dict(
        SUMMARY,
        acceptance_length_lo=2.3012,
        acceptance_length_hi=2.6049,
        gain=1.4444,
        gain_lo=1.2889,
        gain_hi=1.5926,
        prompts=256,
    )
    db["stages"].update(store.stage_row(db, done, "evaluate")["id"], {"summary_json": json.dumps(summary)})
    db.conn.close()
    app = EyasApp(h, socket=h / "no-daemon.sock", clock=lambda: world.NOW)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.app.push_screen(RunScreen(done))
        await shows(pilot, app, "accept 2.46 [2.30, 2.60] (untrained 1.01), gain 1.44 [1.29, 1.59] on 256 prompts")
