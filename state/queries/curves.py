"""The curves the TUI and `eyas show --plot` draw: which metrics each picture plots, and one rank's samples of one metric downsampled in SQL to at most a few hundred points, over time or training steps."""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from eyas.state.queries.runs import stage_attempts
from eyas.state.queries.samples import SERIES

# A curve is one rank's samples of one metric, downsampled in SQL to at most `points` bucket
# means. Every statement below is answered from the index on (run_id, stage, attempt, name,
# rank, time, value) (schema migration 7): a bucket is an index range read in place, so a
# series of a million samples costs no table lookups and no sort, and a short series (under
# `points` samples) is read as it is.

CURVE_POINTS = 200


@dataclass(frozen=True)
class Curve:
    """One picture of a stage: the metrics it plots and how (the TUI and `eyas show --plot`)."""

    key: str
    title: str
    short: str  # its name in a narrow label
    names: tuple[str, ...] = ()  # the metrics it plots, or...
    pattern: str = ""  # ...those whose names match, ordered by the number in the match (acc_0, acc_1, ...)
    stage_rollup: bool = False  # the stage's own series (rank None) rather than each rank's, when there is one
    per_rank: bool = False  # one line per rank
    scale: float = 1.0
    unit: str = ""


# What the train stage writes (workers/train/loop.py, through the progress file: loss, acc_<k>,
# lr, val_loss, step) and what the daemon's sampler writes (tok_s: the stage's and each
# rank's; gpu_mem_bytes: each rank's).
CURVES = (
    Curve("loss", "training loss", "loss", names=("loss",)),
    Curve("val_loss", "validation loss", "val loss", names=("val_loss",)),
    Curve("acc", "accuracy per TTT step", "acc", pattern=r"acc_(\d+)"),
    Curve("lr", "learning rate", "lr", names=("lr",)),
    Curve("tok_s", "tok/s", "tok/s", names=("tok_s",), stage_rollup=True),
    Curve(
        "gpu_mem", "GPU memory per rank, GiB", "GPU", names=("gpu_mem_bytes",), per_rank=True, scale=1 / 2**30, unit="G"
    ),
)


def curve_names(curve: Curve, available: list[str]) -> list[str]:
    """The metrics of `available` that `curve` plots, in its order."""
    if curve.pattern:
        found = [(int(m.group(1)), n) for n in available if (m := re.fullmatch(curve.pattern, n))]
        return [n for _, n in sorted(found)]
    return [n for n in curve.names if n in available]


# Each bucket's mean time and value, one index range per bucket, both from one correlated read
# (two scalar subqueries would read each bucket twice) as one text: quote() writes a REAL
# with every digit it needs to read back the same double (json_array and CAST keep 15).
_BUCKETS = f"""
WITH RECURSIVE b(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM b WHERE i < :n - 1)
SELECT (SELECT quote(avg(time)) || ' ' || quote(avg(value)) FROM metrics
        WHERE {SERIES} AND rank IS :rank
          AND time >= :t0 + i * :w AND time < :t0 + (i + 1) * :w)
FROM b
"""


def metric_names(db, run_id: int, stage: str, attempt: int) -> list[str]:
    """The names of the metrics one attempt recorded, sorted: a skip-scan of the index, one
    probe per name, not a read of the samples."""
    sql = """
    WITH RECURSIVE n(name) AS (
      SELECT (SELECT min(name) FROM metrics WHERE run_id = :run AND stage = :stage AND attempt = :attempt)
      UNION ALL
      SELECT (SELECT min(name) FROM metrics WHERE run_id = :run AND stage = :stage AND attempt = :attempt
              AND name > n.name) FROM n WHERE n.name IS NOT NULL)
    SELECT name FROM n WHERE name IS NOT NULL"""
    return [r[0] for r in db.execute(sql, {"run": run_id, "stage": stage, "attempt": attempt})]


def metric_ranks(db, run_id: int, stage: str, attempt: int, name: str) -> list[int | None]:
    """The ranks that wrote `name` in one attempt, None (the stage's own roll-up) first; one
    probe per rank."""
    p = {"run": run_id, "stage": stage, "attempt": attempt, "name": name}
    found: list[int | None] = []
    if db.execute(f"SELECT EXISTS (SELECT 1 FROM metrics WHERE {SERIES} AND rank IS NULL)", p).fetchone()[0]:
        found.append(None)
    sql = f"""
    WITH RECURSIVE k(rank) AS (
      SELECT (SELECT min(rank) FROM metrics WHERE {SERIES})
      UNION ALL
      SELECT (SELECT min(rank) FROM metrics WHERE {SERIES} AND rank > k.rank) FROM k WHERE k.rank IS NOT NULL)
    SELECT rank FROM k WHERE rank IS NOT NULL"""
    return found + [r[0] for r in db.execute(sql, p)]


def metric_curve(
    db, run_id: int, stage: str, attempt: int, name: str, rank: int | None, points: int = CURVE_POINTS
) -> list[tuple[float, float]]:
    """(time, value) of one rank's `name` in one attempt (rank None: the stage's roll-up),
    oldest first: the samples themselves when there are at most `points`, else the means of
    `points` equal spans of time (empty spans left out)."""
    points = max(1, int(points))
    p = {"run": run_id, "stage": stage, "attempt": attempt, "name": name, "rank": rank}
    head = db.execute(
        f"SELECT time, value FROM metrics WHERE {SERIES} AND rank IS :rank ORDER BY time LIMIT :n",
        {**p, "n": points + 1},
    ).fetchall()
    if len(head) <= points:
        return [(t, v) for t, v in head]
    t0 = head[0][0]
    t1 = db.execute(f"SELECT max(time) FROM metrics WHERE {SERIES} AND rank IS :rank", p).fetchone()[0]
    if t1 <= t0:
        values = [v for _, v in head]  # every sample at one instant: their mean
        return [(t0, sum(values) / len(values))]
    out = []
    # n spans of (t1 - t0) / (n - 0.5) reach half a span past t1, so the newest sample is in
    # the last one whatever the rounding (an `OR` for the last span would cost the index its
    # upper bound, and every span would read to the end of the series).
    w = (t1 - t0) / (points - 0.5) if points > 1 else (t1 - t0) * 2
    for (pair,) in db.execute(_BUCKETS, {**p, "n": points, "t0": t0, "w": w}):
        t, _, v = (pair or "NULL").partition(" ")
        if t != "NULL" and v != "NULL":  # an empty bucket's averages are NULL
            out.append((float(t), float(v)))
    return out


def _steps_at(times: list[float], index: list[tuple[float, float]]) -> list[float]:
    """The training step at each time, interpolated on `index` (time, step), held flat
    before its first and after its last point."""
    ts = [t for t, _ in index]
    out = []
    for t in times:
        i = bisect.bisect_left(ts, t)
        if i == 0:
            out.append(index[0][1])
        elif i == len(ts):
            out.append(index[-1][1])
        else:
            (ta, sa), (tb, sb) = index[i - 1], index[i]
            out.append(sa + (sb - sa) * (t - ta) / (tb - ta) if tb > ta else sb)
    return out


def _step_index(db, run_id: int, stage: str, attempt: int, points: int) -> list[tuple[float, float]]:
    """(time, step) of one attempt, from the first rank that wrote `step` (the train stage's
    rank 0); empty when no rank did."""
    for rank in metric_ranks(db, run_id, stage, attempt, "step"):
        curve = metric_curve(db, run_id, stage, attempt, "step", rank, points)
        if curve:
            return curve
    return []


def stage_curves(
    db,
    run_id: int,
    stage: str,
    names: list[str],
    *,
    x: str = "time",
    ranks: list[int | None] | None = None,
    points: int = CURVE_POINTS,
) -> dict[str, dict[int | None, list[tuple[float, float]]]]:
    """{name: {rank: [(x, value)]}} over every attempt of a stage, attempt after attempt:
    x is the sample's unix time, or with x="step" the training step at that time (the
    `step` metric the train stage writes with its figures, interpolated; a stage without it
    gives no points). `ranks` keeps only those ranks (None in it: the stage's roll-up). Each
    attempt's series has at most `points` points, divided among attempts."""
    attempts = [a["number"] for a in stage_attempts(db, run_id, stage)]
    per = max(20, points // max(1, len(attempts)))
    out: dict[str, dict[int | None, list[tuple[float, float]]]] = {n: {} for n in names}
    for attempt in attempts:
        index = None
        if x == "step":
            index = _step_index(db, run_id, stage, attempt, per)
            if not index:
                continue
        for name in names:
            for rank in metric_ranks(db, run_id, stage, attempt, name):
                if ranks is not None and rank not in ranks:
                    continue
                curve = metric_curve(db, run_id, stage, attempt, name, rank, per)
                if index is not None:
                    curve = list(zip(_steps_at([t for t, _ in curve], index), [v for _, v in curve]))
                out[name].setdefault(rank, []).extend(curve)
    return out


def stage_metric_names(db, run_id: int, stage: str) -> list[str]:
    """The names of the metrics any attempt of a stage recorded, sorted."""
    found: set[str] = set()
    for a in stage_attempts(db, run_id, stage):
        found.update(metric_names(db, run_id, stage, a["number"]))
    return sorted(found)
