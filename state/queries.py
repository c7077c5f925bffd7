"""Read-only queries behind `eyas runs`, `eyas show` and the TUI.

They read roll-up columns kept by the daemon, never the raw metrics, so that they stay
fast on a store with millions of samples.
"""

from __future__ import annotations

import json
import time
from typing import Any

import sqlite_utils

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
                "id": rid, "name": name, "model": model, "state": st, "stage": stage,
                "started": started or created, "duration": _duration(started, ended, now),
                "peak_gpu_mem": peak, "tok_s": toks,
            }
        )
    return rows


def get_run(db: sqlite_utils.Database, run_id: int, *, now: float | None = None) -> dict[str, Any]:
    """One run with its stages, their attempts, root-cause errors and per-rank roll-ups."""
    now = now or time.time()
    try:
        run = db["runs"].get(run_id)
    except sqlite_utils.db.NotFoundError:
        raise KeyError(f"no run {run_id}") from None
    stages = []
    for s in db["stages"].rows_where("run_id = ?", [run_id], order_by="position"):
        attempts = []
        for a in db["attempts"].rows_where("run_id = ? and stage = ?", [run_id, s["name"]], order_by="number"):
            root = next(iter(db["errors"].rows_where("attempt_id = ? and root_cause = 1", [a["id"]], limit=1)), None)
            ranks = [
                {k: r[k] for k in ("rank", "pid", "host", "device", "state", "exit_code", "signal",
                                   "oom_killed", "peak_gpu_mem", "tok_s", "log_path")}
                for r in db["ranks"].rows_where("attempt_id = ?", [a["id"]], order_by="rank")
            ]
            attempts.append(
                {
                    "number": a["number"], "state": a["state"], "dir": a["dir"], "reason": a["reason"],
                    "world_size": a["world_size"], "devices": json.loads(a["devices"] or "[]"),
                    "started_at": a["started_at"], "ended_at": a["ended_at"],
                    "duration": _duration(a["started_at"], a["ended_at"], now),
                    "root_cause": _error(root) if root else None, "ranks": ranks,
                }
            )
        stages.append(
            {
                "name": s["name"], "state": s["state"], "attempts": s["attempts"] or 0,
                "restarts": s["restarts"] or 0, "reason": s["reason"],
                "started_at": s["started_at"], "ended_at": s["ended_at"],
                "duration": _duration(s["started_at"], s["ended_at"], now),
                "tok_s": s["tok_s"], "peak_gpu_mem": s["peak_gpu_mem"],
                "summary": json.loads(s["summary_json"]) if s["summary_json"] else None,
                "attempt_list": attempts,
            }
        )
    return {
        "id": run["id"], "name": run["name"], "model": run["model"], "state": run["state"],
        "stage": run["current_stage"], "reason": run["reason"], "config_path": run["config_path"],
        "output_dir": run["output_dir"], "created_at": run["created_at"], "started_at": run["started_at"],
        "ended_at": run["ended_at"], "duration": _duration(run["started_at"], run["ended_at"], now),
        "peak_gpu_mem": run["peak_gpu_mem"], "tok_s": run["tok_s"],
        "summary": json.loads(run["summary_json"]) if run["summary_json"] else None,
        "stages": stages,
    }


def _error(row: dict) -> dict[str, Any]:
    return {k: row[k] for k in ("rank", "pid", "host", "type", "message", "traceback", "time", "source", "path")}


def errors(db: sqlite_utils.Database, run_id: int, stage: str | None = None) -> list[dict[str, Any]]:
    """A run's errors: the root cause of each attempt first, then the others by time."""
    where, params = "run_id = ?", [run_id]
    if stage:
        where += " and stage = ?"
        params.append(stage)
    return [
        {"stage": r["stage"], "attempt": r["attempt"], "root_cause": bool(r["root_cause"]), **_error(r)}
        for r in db["errors"].rows_where(where, params, order_by="attempt_id DESC, root_cause DESC, time, rank")
    ]


def events(db: sqlite_utils.Database, run_id: int) -> list[dict[str, Any]]:
    return list(db["events"].rows_where("run_id = ?", [run_id], order_by="time, id"))


def metric_series(db, run_id: int, stage: str, attempt: int, name: str, since: float | None = None):
    """(time, rank, value) samples of one metric of one attempt, oldest first."""
    sql = "SELECT time, rank, value FROM metrics WHERE run_id=? AND stage=? AND attempt=? AND name=?"
    params: list[Any] = [run_id, stage, attempt, name]
    if since is not None:
        sql += " AND time >= ?"
        params.append(since)
    return db.execute(sql + " ORDER BY time", params).fetchall()
