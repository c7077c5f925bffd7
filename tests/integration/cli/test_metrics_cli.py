"""`eyas metrics` and `eyas show --plot` as processes, daemon down, on a real store: the CSV
carries exactly the samples written, the table sums them up, the plot draws the curves."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
from datetime import datetime

import pytest
import tui_world as world

from eyas.state import paths, queries


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    h = tmp_path_factory.mktemp("metrics") / "home"
    world.build(h)  # no daemon ever runs here: the commands read SQLite read-only
    return h


def eyas(home, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "eyas.cli.main", "--home", str(home), *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _stored(home, run_id: int, stage: str | None = None) -> list[tuple]:
    db = queries.connect(paths.db_path(home))
    try:
        sql = "SELECT time, stage, attempt, rank, name, value FROM metrics WHERE run_id = ?"
        params: list = [run_id]
        if stage:
            sql += " AND stage = ?"
            params.append(stage)
        return sorted(
            db.execute(sql, params).fetchall(), key=lambda r: (r[1], r[2], r[4], r[3] is not None, r[3], r[0])
        )
    finally:
        db.close()


def _parsed(text: str) -> tuple[list[str], list[tuple]]:
    rows = list(csv.reader(io.StringIO(text)))
    parsed = [
        (
            datetime.fromisoformat(t).timestamp(),
            stage,
            int(attempt),
            int(rank) if rank else None,
            name,
            float(value),
        )
        for t, stage, attempt, rank, name, value in rows[1:]
    ]
    return rows[0], parsed


def test_csv_is_every_sample_written(home):
    p = eyas(home, "metrics", "2", "--csv")
    assert p.returncode == 0, p.stderr
    header, rows = _parsed(p.stdout)
    assert header == ["time", "stage", "attempt", "rank", "name", "value"]
    stored = _stored(home, 2)
    assert len(stored) > 600
    assert rows == stored  # every sample, exact values, in series order (stage, attempt, name, rank, time)


def test_csv_of_one_stage_and_metric(home):
    p = eyas(home, "metrics", "3", "--stage", "extract", "--name", "tok_s", "--csv")
    assert p.returncode == 0, p.stderr
    _, rows = _parsed(p.stdout)
    assert rows == [r for r in _stored(home, 3, "extract") if r[4] == "tok_s"]
    assert {r[3] for r in rows} == {None, *range(8)}  # the stage's rate and each rank's


def test_points_downsample_each_series(home):
    p = eyas(home, "metrics", "1", "--name", "loss", "--points", "50", "--csv")
    assert p.returncode == 0, p.stderr
    _, rows = _parsed(p.stdout)
    raw = [r for r in _stored(home, 1) if r[4] == "loss"]
    assert 40 <= len(rows) <= 50 < len(raw)
    values = [r[5] for r in raw]
    assert all(min(values) <= r[5] <= max(values) for r in rows)
    assert sum(r[5] for r in rows) / len(rows) == pytest.approx(sum(values) / len(values), rel=0.02)


def test_table_sums_up_each_series(home):
    p = eyas(home, "metrics", "2", "--stage", "train", "--name", "loss", "--name", "tok_s")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["stage", "attempt", "name", "rank", "samples", "first", "last", "min", "max", "value"]
    loss = [r for r in _stored(home, 2) if r[4] == "loss"]
    row = next(line.split() for line in lines if " loss " in line)
    assert row[:5] == ["train", "1", "loss", "0", str(len(loss))]
    assert float(row[-1]) == pytest.approx(loss[-1][5], rel=1e-5)  # the newest value
    assert float(row[-3]) == pytest.approx(min(r[5] for r in loss), rel=1e-5)
    assert any(line.split()[2:4] == ["tok_s", "stage"] for line in lines)


def test_unknown_run_and_stage(home):
    assert eyas(home, "metrics", "99").returncode == 1
    p = eyas(home, "metrics", "2", "--stage", "nope")
    assert p.returncode == 1 and "no stage 'nope'" in p.stderr


def test_show_plot_draws_the_main_curves(home):
    p = eyas(home, "show", "1", "--plot")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("run 1: llama-8b-eagle3")  # the usual text first
    titles = [c.title for c in queries.CURVES]
    assert "training loss" in titles and "GPU memory per rank, GiB" in titles
    for title in titles:  # run 1's train stage recorded every one of them
        assert f"{title} · run 1 train" in p.stdout
    assert "minutes since the stage started" in p.stdout
    assert "\x1b[" not in p.stdout  # not a terminal: no colour codes


def test_show_plot_without_curves(home):
    p = eyas(home, "show", "4", "--plot")  # the CPU run recorded no metrics
    assert p.returncode == 0, p.stderr
    assert "has no recorded curves" in p.stderr
