"""`eyas metrics` and `eyas show --plot` as processes, daemon down, on a real store: the table
sums each series up in its units and the CSV carries the same rows raw, `--samples` exactly the
samples written; the plot draws the curves readably (a log loss axis, time as h:mm, legends
beside the plots, the reason for an empty GPU plot)."""

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


def test_samples_csv_is_every_sample_written(home):
    p = eyas(home, "metrics", "2", "--samples", "--csv")
    assert p.returncode == 0, p.stderr
    header, rows = _parsed(p.stdout)
    assert header == ["time", "stage", "attempt", "rank", "name", "value"]
    stored = _stored(home, 2)
    assert len(stored) > 600
    assert rows == stored  # every sample, exact values, in series order (stage, attempt, name, rank, time)


def test_csv_of_one_stage_and_metric(home):
    p = eyas(home, "metrics", "3", "--stage", "extract", "--name", "tok_s", "--samples", "--csv")
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
    assert float(row[-1]) == pytest.approx(loss[-1][5], rel=1e-3)  # the newest value, 4 digits
    assert float(row[-3]) == pytest.approx(min(r[5] for r in loss), rel=1e-3)
    assert any(line.split()[2:4] == ["tok_s", "stage"] for line in lines)


def test_table_figures_read_in_their_units_and_the_csv_has_the_same_rows_raw(home):
    table = eyas(home, "metrics", "1", "--stage", "train", "--name", "gpu_mem_bytes", "--name", "tok_s")
    csv_p = eyas(home, "metrics", "1", "--stage", "train", "--name", "gpu_mem_bytes", "--name", "tok_s", "--csv")
    assert table.returncode == 0 and csv_p.returncode == 0, table.stderr + csv_p.stderr
    rows = list(csv.DictReader(io.StringIO(csv_p.stdout)))
    assert list(rows[0]) == ["stage", "attempt", "name", "rank", "samples", "first", "last", "min", "max", "value"]
    lines = table.stdout.splitlines()[2:]
    assert len(rows) == len(lines) == 9  # GPU memory of 8 ranks, and the stage's tok/s
    stored = _stored(home, 1, "train")
    for row, line in zip(rows, lines):
        cells = line.split()
        assert cells[:5] == [row["stage"], row["attempt"], row["name"], row["rank"] or "stage", row["samples"]]
        series = [r[5] for r in stored if r[4] == row["name"] and r[3] == (int(row["rank"]) if row["rank"] else None)]
        assert int(row["samples"]) == len(series)
        assert (float(row["min"]), float(row["max"]), float(row["value"])) == (min(series), max(series), series[-1])
        if row["name"] == "gpu_mem_bytes":  # bytes as GiB, not 7.51619e+10
            assert cells[-2:] == [f"{series[-1] / 2**30:.1f}", "GiB"] and "e+" not in line
        else:  # a rate as 9.12k
            assert cells[-1] == f"{series[-1] / 1000:.3g}k"
    assert "e+" not in table.stdout


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
    assert "h:mm since the stage started" in p.stdout and "minutes" not in p.stdout
    assert "\x1b[" not in p.stdout  # not a terminal: no colour codes
    # The loss on a log axis, smoothed; tok/s in thousands, never a long float.
    assert "training loss · run 1 train (log, EMA 0.6)" in p.stdout
    assert "validation loss · run 1 train (log)" in p.stdout
    assert "tok/s · run 1 train (EMA 0.6)" in p.stdout
    assert {"8k", "6k"} <= set(_y_ticks("\n".join(_plot(p.stdout, "tok/s ·"))))  # not 8000.0
    assert max(len(tick) for tick in _y_ticks(p.stdout)) <= 6  # 2.0e-4, never 0.00020
    # Each legend beside its plot: every row of it right of the frame, none inside.
    acc = _plot(p.stdout, "accuracy per TTT step")
    assert acc[1].endswith("┐  step") and acc[2].endswith("│  ━ 0") and acc[4].endswith("│  ━ 2")
    assert not any("━" in row.split("│")[1] for row in acc if row.count("│") == 2)
    assert "linear" not in p.stdout
    linear = eyas(home, "show", "1", "--plot", "--linear", "--smooth", "0")
    assert linear.returncode == 0, linear.stderr
    assert "training loss · run 1 train" in [line.strip() for line in linear.stdout.splitlines()]
    assert "(EMA" not in linear.stdout and "(log" not in linear.stdout


def _plot(text: str, title: str) -> list[str]:
    """The lines of one plot of `eyas show --plot`, its title first."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if title in line)
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


def _y_ticks(text: str) -> list[str]:
    return [line.split("┤")[0].strip() for line in text.splitlines() if "┤" in line]


def test_show_plot_says_why_a_cpu_run_has_no_gpu_curve(tmp_path):
    h = tmp_path / "home"
    world.build(h)
    world.add_cpu_curves(h)
    p = eyas(h, "show", "4", "--plot")
    assert p.returncode == 0, p.stderr
    assert "training loss · run 4 selftest" in p.stdout
    assert "GPU memory per rank, GiB · run 4 selftest: no GPUs: this stage ran on CPU" in p.stdout
    assert "m:ss since the stage started" in p.stdout  # a 30-second stage


def test_bad_smoothing_weight(home):
    p = eyas(home, "show", "1", "--plot", "--smooth", "1.5")
    assert p.returncode == 2 and "--smooth 1.5: use a weight from 0 (off) to below 1" in p.stderr


def test_show_plot_without_curves(home):
    p = eyas(home, "show", "4", "--plot")  # the CPU run recorded no metrics
    assert p.returncode == 0, p.stderr
    assert "has no recorded curves" in p.stderr
