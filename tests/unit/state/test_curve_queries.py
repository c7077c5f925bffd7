"""The curves' queries (state/queries/curves.py): downsampling in SQL to bucket means, the skip-scans
for names and ranks, the step axis, and the index that answers them."""

from __future__ import annotations

import math
import statistics

import pytest

from eyas.state import paths, queries, store

T0 = 1_800_000_000.0


def _store(tmp_path, samples: dict[tuple[str, int | None], list[tuple[float, float]]], attempts: int = 1):
    """A run with a train stage of `attempts` attempts; samples[(name, rank)] go to the last."""
    db = store.open_writer(paths.db_path(tmp_path))
    run = store.create_run(db, name="r", model="m", stages=[{"name": "train", "world_size": 2}], now=T0)
    store.move_run(db, run, "running", "go", now=T0)
    store.move_stage(db, run, "train", "running", "go", now=T0)
    for n in range(1, attempts + 1):
        aid, _ = store.new_attempt(db, run, "train", dir=str(tmp_path / f"a{n}"), world_size=2, now=T0)
        if n < attempts:
            store.move_attempt(db, aid, "failed", "x", now=T0)
    rows = [
        {"time": t, "run_id": run, "stage": "train", "attempt": attempts, "rank": rank, "name": name, "value": v}
        for (name, rank), pts in samples.items()
        for t, v in pts
    ]
    store.insert_metrics(db, rows)
    db.conn.close()
    return queries.connect(paths.db_path(tmp_path)), run, attempts


def test_a_short_series_is_read_as_it_is(tmp_path):
    pts = [(T0 + i, float(i * i)) for i in range(50)]
    db, run, a = _store(tmp_path, {("loss", 0): pts})
    assert queries.metric_curve(db, run, "train", a, "loss", 0, points=50) == pts


def test_a_long_series_becomes_bucket_means(tmp_path):
    pts = [(T0 + i * 0.5, math.sin(i / 40) + i / 1000) for i in range(10_000)]
    db, run, a = _store(tmp_path, {("loss", 0): pts})
    curve = queries.metric_curve(db, run, "train", a, "loss", 0, points=100)
    assert 90 <= len(curve) <= 100
    # Every sample falls in exactly one bucket: the means weighted by bucket size give the overall mean.
    t_first, t_last = pts[0][0], pts[-1][0]
    w = (t_last - t_first) / (100 - 0.5)
    buckets: dict[int, list[tuple[float, float]]] = {}
    for t, v in pts:
        buckets.setdefault(int((t - t_first) // w), []).append((t, v))
    expected = [
        (statistics.fmean(t for t, _ in b), statistics.fmean(v for _, v in b)) for _, b in sorted(buckets.items())
    ]
    assert len(curve) == len(expected)
    for (t, v), (et, ev) in zip(curve, expected):
        assert t == _approx(et) and v == _approx(ev)
    assert curve[-1][0] > pts[-200][0]  # the newest samples are in the last bucket


def _approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-9)


def test_names_and_ranks_are_skip_scanned(tmp_path):
    db, run, a = _store(
        tmp_path,
        {
            ("tok_s", None): [(T0, 10.0)],
            ("tok_s", 1): [(T0, 4.0)],
            ("tok_s", 0): [(T0, 6.0)],
            ("acc_10", 0): [(T0, 0.1)],
            ("acc_2", 0): [(T0, 0.2)],
        },
    )
    assert queries.metric_names(db, run, "train", a) == ["acc_10", "acc_2", "tok_s"]
    assert queries.metric_ranks(db, run, "train", a, "tok_s") == [None, 0, 1]
    acc = next(c for c in queries.CURVES if c.key == "acc")
    assert queries.curve_names(acc, queries.stage_metric_names(db, run, "train")) == ["acc_2", "acc_10"]


def test_stage_curves_by_rank_and_by_step(tmp_path):
    # The train stage writes step and loss in one record; tok_s comes from the daemon in between.
    steps = [(T0 + 10 * k, float(100 * k)) for k in range(11)]
    loss = [(T0 + 10 * k, 5.0 - k / 10) for k in range(11)]
    toks = [(T0 + 10 * k + 5, 1000.0 + k) for k in range(10)]
    db, run, _ = _store(tmp_path, {("step", 0): steps, ("loss", 0): loss, ("tok_s", None): toks, ("tok_s", 1): toks})
    by_time = queries.stage_curves(db, run, "train", ["loss", "tok_s"], ranks=[None, 0])
    assert by_time["loss"] == {0: loss}
    assert by_time["tok_s"] == {None: toks}  # rank 1 left out
    by_step = queries.stage_curves(db, run, "train", ["loss", "tok_s"], x="step", ranks=[None, 0])
    assert by_step["loss"][0] == [(s, v) for (_, s), (_, v) in zip(steps, loss)]
    # Halfway between two step records: halfway between their steps.
    assert by_step["tok_s"][None] == [(100.0 * k + 50, v) for k, (_, v) in enumerate(toks)]


def test_the_curves_read_only_the_index(tmp_path):
    """Each query of a curve is answered by a covering index: no table scan, no row lookup,
    no sort (the plans SQLite reports)."""
    db, run, a = _store(tmp_path, {("loss", 0): [(T0 + i, float(i)) for i in range(500)]})
    seen: list[tuple[str, dict]] = []
    real = db.execute

    class Spy:
        def execute(self, sql, params=()):
            seen.append((sql, params))
            return real(sql, params)

    queries.stage_curves(Spy(), run, "train", ["loss"], points=50)
    queries.stage_curves(Spy(), run, "train", ["loss"], x="step", points=50)
    plans = []
    for sql, params in seen:
        if "FROM metrics" not in sql:
            continue
        detail = [row[3] for row in db.execute("EXPLAIN QUERY PLAN " + sql, params)]
        plans.append(detail)
        metric_steps = [d for d in detail if "metrics" in d]
        assert metric_steps and all("USING COVERING INDEX" in d for d in metric_steps), (sql, detail)
        assert not any("TEMP B-TREE" in d for d in detail), (sql, detail)
    assert any("idx_metrics_run_id_stage_attempt_name_rank_time_value" in " ".join(p) for p in plans)
