"""Reads of a run's raw metric samples: one series, its newest value, the GPUs' memory, a summary of every series, and every sample streamed; each answered from the metrics index."""

from __future__ import annotations

from typing import Any

from eyas.state.queries.connection import read_rows

# One series of the metrics index (run_id, stage, attempt, name, rank, time, value), less its rank.
SERIES = "run_id = :run AND stage = :stage AND attempt = :attempt AND name = :name"


def metric_series(db, run_id: int, stage: str, attempt: int, name: str, since: float | None = None):
    """(time, rank, value) samples of one metric of one attempt, oldest first."""
    sql = "SELECT time, rank, value FROM metrics WHERE run_id=? AND stage=? AND attempt=? AND name=?"
    params: list[Any] = [run_id, stage, attempt, name]
    if since is not None:
        sql += " AND time >= ?"
        params.append(since)
    return db.execute(sql + " ORDER BY time", params).fetchall()


def latest_metric(db, run_id: int, stage: str, attempt: int, name: str) -> tuple[float, int | None, float] | None:
    """The newest (time, rank, value) of one metric of one attempt, or None (the TUI's
    progress, ETA and loss when no live figures have arrived). One index probe."""
    return db.execute(
        "SELECT time, rank, value FROM metrics WHERE run_id=? AND stage=? AND attempt=? AND name=? "
        "ORDER BY time DESC LIMIT 1",
        [run_id, stage, attempt, name],
    ).fetchone()


def gpu_memory(db, since: float) -> dict[int, dict[str, float]]:
    """The newest `mem_used` and `mem_total` of each GPU sampled since `since`:
    {index: {"mem_used": bytes, "mem_total": bytes}}; empty without GPUs."""
    found: dict[int, dict[str, float]] = {}
    for name, value in db.execute(
        "SELECT name, value FROM metrics WHERE time >= ? AND run_id IS NULL AND name LIKE 'gpu%.mem_%' ORDER BY time",
        [since],
    ):
        index, _, field = name[3:].partition(".")
        if index.isdigit() and field in ("mem_used", "mem_total"):
            found.setdefault(int(index), {})[field] = value
    return found


def series_summary(db, run_id: int, stage: str | None = None) -> list[dict[str, Any]]:
    """One row per recorded series of a run (stage, attempt, name, rank): its sample count,
    first and last time, minimum, maximum and newest value. One pass over the run's index
    entries in index order (no sort), then one probe per series for the newest value."""
    where, params = "run_id = ?", [run_id]
    if stage:
        where += " AND stage = ?"
        params.append(stage)
    rows = read_rows(
        db,
        "SELECT stage, attempt, name, rank, count(*) AS samples, min(time) AS first, max(time) AS last, "
        f"min(value) AS min, max(value) AS max FROM metrics WHERE {where} "
        "GROUP BY stage, attempt, name, rank ORDER BY stage, attempt, name, rank",
        params,
    )
    for r in rows:
        r["value"] = db.execute(
            f"SELECT value FROM metrics WHERE {SERIES} AND rank IS :rank ORDER BY time DESC LIMIT 1",
            {"run": run_id, "stage": r["stage"], "attempt": r["attempt"], "name": r["name"], "rank": r["rank"]},
        ).fetchone()[0]
    return rows


# The orders metric_rows can stream in: each series whole (a table, a CSV), or in the order the
# samples were met, attempt after attempt (a TensorBoard writer, which wants steps in order).
SERIES_ORDER = "stage, attempt, name, rank, time"
TIME_ORDER = "stage, attempt, time"


def metric_rows(db, run_id: int, stage: str | None = None, names: list[str] | None = None, order: str = SERIES_ORDER):
    """Every sample of a run (or of one stage, or of some metrics), as (time, stage, attempt,
    rank, name, value) tuples in `order`, streamed: a cursor, not a list."""
    if order not in (SERIES_ORDER, TIME_ORDER):
        raise ValueError(f"order: {order!r} is neither SERIES_ORDER nor TIME_ORDER")
    where, params = "run_id = ?", [run_id]
    if stage:
        where += " AND stage = ?"
        params.append(stage)
    if names:
        where += f" AND name IN ({','.join('?' * len(names))})"
        params += list(names)
    return db.execute(
        f"SELECT time, stage, attempt, rank, name, value FROM metrics WHERE {where} ORDER BY {order}",
        params,
    )
