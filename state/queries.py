"""Read-only queries behind `eyas runs`, `eyas show` and the TUI.

They read roll-up columns kept by the daemon, never the raw metrics, so that they stay
fast on a store with millions of samples.

Every query takes either a sqlite_utils.Database or a plain sqlite3.Connection: they only
call `db.execute`. Importing sqlite_utils costs about 0.5 s here (it imports pandas and
numpy when they are installed), which alone would break the CLI's 0.5 s budget, so this
module never imports it and `connect` opens a plain read-only connection.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import sqlite_utils

# The schema version these queries read (schema.LATEST, checked by a test): kept here
# because importing eyas.state.schema pulls in sqlite_utils.
SCHEMA_VERSION = 5

RUN_COLUMNS = ("id", "name", "model", "state", "stage", "started", "duration", "peak_gpu_mem", "tok_s")


def _duration(started: float | None, ended: float | None, now: float) -> float | None:
    if not started:
        return None
    return (ended or now) - started


def list_runs(
    db: sqlite_utils.Database,
    *,
    state: str | None = None,
    since: float | None = None,
    limit: int | None = None,
    match: str | None = None,
    now: float | None = None,
) -> list[dict[str, Any]]:
    """Runs newest first. `since` is a unix time; `match` is a substring of name or model."""
    now = now or time.time()
    where, params = [], []
    if state:
        where.append("state = ?")
        params.append(state)
    if since is not None:
        where.append("created_at >= ?")
        params.append(since)
    if match:
        where.append("(name LIKE ? ESCAPE '\\' OR model LIKE ? ESCAPE '\\')")
        like = "%" + match.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        params += [like, like]
    sql = (
        "SELECT id, name, model, state, current_stage, created_at, started_at, ended_at, "
        "peak_gpu_mem, tok_s FROM runs"
        + (" WHERE " + " AND ".join(where) if where else "")
        + " ORDER BY created_at DESC, id DESC"
        + (" LIMIT ?" if limit else "")
    )
    if limit:
        params.append(limit)
    rows = []
    for r in db.execute(sql, params).fetchall():
        (rid, name, model, st, stage, created, started, ended, peak, toks) = r
        rows.append(
            {
                "id": rid,
                "name": name,
                "model": model,
                "state": st,
                "stage": stage,
                "started": started or created,
                "duration": _duration(started, ended, now),
                "peak_gpu_mem": peak,
                "tok_s": toks,
            }
        )
    return rows


def get_run(db: sqlite_utils.Database, run_id: int, *, now: float | None = None) -> dict[str, Any]:
    """One run with its stages, their attempts, root-cause errors and per-rank roll-ups."""
    now = now or time.time()
    found = _rows(db, "SELECT * FROM runs WHERE id = ?", [run_id])
    if not found:
        raise KeyError(f"no run {run_id}")
    run = found[0]
    stages = []
    for s in _rows(db, "SELECT * FROM stages WHERE run_id = ? ORDER BY position", [run_id]):
        attempts = []
        for a in _rows(
            db, "SELECT * FROM attempts WHERE run_id = ? AND stage = ? ORDER BY number", [run_id, s["name"]]
        ):
            root = _rows(db, "SELECT * FROM errors WHERE attempt_id = ? AND root_cause = 1 LIMIT 1", [a["id"]])
            ranks = _rows(
                db,
                "SELECT rank, pid, host, device, state, exit_code, signal, oom_killed, peak_gpu_mem, "
                "tok_s, log_path, role, tp_rank, parent_rank FROM ranks WHERE attempt_id = ? ORDER BY rank",
                [a["id"]],
            )
            attempts.append(
                {
                    "number": a["number"],
                    "state": a["state"],
                    "dir": a["dir"],
                    "reason": a["reason"],
                    "world_size": a["world_size"],
                    "devices": json.loads(a["devices"] or "[]"),
                    "started_at": a["started_at"],
                    "ended_at": a["ended_at"],
                    "duration": _duration(a["started_at"], a["ended_at"], now),
                    "root_cause": _error(root[0]) if root else None,
                    "ranks": ranks,
                }
            )
        stages.append(
            {
                "name": s["name"],
                "state": s["state"],
                "attempts": s["attempts"] or 0,
                "restarts": s["restarts"] or 0,
                "reason": s["reason"],
                "started_at": s["started_at"],
                "ended_at": s["ended_at"],
                "duration": _duration(s["started_at"], s["ended_at"], now),
                "tok_s": s["tok_s"],
                "peak_gpu_mem": s["peak_gpu_mem"],
                "summary": json.loads(s["summary_json"]) if s["summary_json"] else None,
                "attempt_list": attempts,
            }
        )
    return {
        "id": run["id"],
        "name": run["name"],
        "model": run["model"],
        "state": run["state"],
        "stage": run["current_stage"],
        "reason": run["reason"],
        "config_path": run["config_path"],
        "output_dir": run["output_dir"],
        "dir": run.get("dir"),
        "created_at": run["created_at"],
        "started_at": run["started_at"],
        "ended_at": run["ended_at"],
        "duration": _duration(run["started_at"], run["ended_at"], now),
        "peak_gpu_mem": run["peak_gpu_mem"],
        "tok_s": run["tok_s"],
        "summary": json.loads(run["summary_json"]) if run["summary_json"] else None,
        "stages": stages,
    }


def _error(row: dict) -> dict[str, Any]:
    return {
        k: row[k]
        for k in ("rank", "pid", "host", "type", "message", "traceback", "time", "source", "path", "role", "tp_rank")
    }


def errors(db: sqlite_utils.Database, run_id: int, stage: str | None = None) -> list[dict[str, Any]]:
    """A run's errors: the root cause of each attempt first, then the others by time."""
    where, params = "run_id = ?", [run_id]
    if stage:
        where += " and stage = ?"
        params.append(stage)
    sql = f"SELECT * FROM errors WHERE {where} ORDER BY attempt_id DESC, root_cause DESC, time, rank"
    return [
        {"stage": r["stage"], "attempt": r["attempt"], "root_cause": bool(r["root_cause"]), **_error(r)}
        for r in _rows(db, sql, params)
    ]


def events(db: sqlite_utils.Database, run_id: int) -> list[dict[str, Any]]:
    return _rows(db, "SELECT * FROM events WHERE run_id = ? ORDER BY time, id", [run_id])


def metric_series(db, run_id: int, stage: str, attempt: int, name: str, since: float | None = None):
    """(time, rank, value) samples of one metric of one attempt, oldest first."""
    sql = "SELECT time, rank, value FROM metrics WHERE run_id=? AND stage=? AND attempt=? AND name=?"
    params: list[Any] = [run_id, stage, attempt, name]
    if since is not None:
        sql += " AND time >= ?"
        params.append(since)
    return db.execute(sql + " ORDER BY time", params).fetchall()


def _rows(db, sql: str, params: list | tuple = ()) -> list[dict[str, Any]]:
    """Rows as dicts, whatever the connection's row factory."""
    cur = db.execute(sql, params)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def connect(path: Path) -> sqlite3.Connection:
    """A plain read-only connection for the CLI, daemon running or not (no sqlite_utils).

    Raises FileNotFoundError when there is no database yet (or an empty one the daemon has
    not migrated), RuntimeError when its schema is newer than these queries.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no eyas database at {path}: nothing has been submitted yet")
    # as_uri() percent-encodes, so a path with '?' or '#' stays a path.
    conn = sqlite3.connect(path.absolute().as_uri() + "?mode=ro", uri=True, timeout=30, check_same_thread=False)
    found = conn.execute("PRAGMA user_version").fetchone()[0]
    if found == 0:
        conn.close()
        raise FileNotFoundError(f"eyas database at {path} has no tables yet: nothing has been submitted yet")
    if found > SCHEMA_VERSION:
        conn.close()
        raise RuntimeError(f"database schema {found} is newer than this eyas ({SCHEMA_VERSION}); upgrade eyas")
    return conn


def stage_attempts(db, run_id: int, stage: str) -> list[dict[str, Any]]:
    """The attempts of one stage, oldest first: number, state, dir, started_at, ended_at.

    Cheap enough to poll: `eyas logs -f` calls it to notice an ended or a new attempt.
    """
    return _rows(
        db,
        "SELECT number, state, dir, started_at, ended_at FROM attempts WHERE run_id = ? AND stage = ? ORDER BY number",
        [run_id, stage],
    )


def stage_state(db, run_id: int, stage: str) -> str | None:
    """The state of one stage of a run; None when the run has no such stage."""
    row = db.execute("SELECT state FROM stages WHERE run_id = ? AND name = ?", [run_id, stage]).fetchone()
    return row[0] if row else None


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


def acceptance_lengths(db, run_ids: list[int]) -> dict[int, float]:
    """{run id: the trained draft's mean acceptance length} from the evaluate stages' stored
    summaries (json_extract, so no roll-up column is needed), one index probe per run on
    stages(run_id, name), in chunks that stay under SQLite's parameter limit."""
    found: dict[int, float] = {}
    for i in range(0, len(run_ids), 500):
        chunk = run_ids[i : i + 500]
        sql = (
            "SELECT run_id, json_extract(summary_json, '$.acceptance_length') FROM stages "
            f"WHERE name = 'evaluate' AND run_id IN ({','.join('?' * len(chunk))})"
        )
        for run_id, value in db.execute(sql, chunk):
            if isinstance(value, (int, float)):
                found[run_id] = float(value)
    return found
