"""The runs as `eyas runs`, `eyas show` and the TUI's Runs and Run screens list them: the runs, one run with its stages, attempts, ranks and errors, read from the roll-up columns the daemon keeps.

Never the raw metrics, so that a listing stays fast on a store with millions of samples; only
a streaming run's window (state/queries/streaming.py) reads its few progress series.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from eyas.state.queries.connection import read_rows
from eyas.state.queries.streaming import stream_window, streams

if TYPE_CHECKING:
    import sqlite_utils

RUN_COLUMNS = ("id", "name", "model", "state", "stage", "started", "duration", "peak_gpu_mem", "tok_s")

# Stages whose tok/s means nothing to a reader (the preflight's canary counts its own few
# tokens): the listings show no rate for them.
NO_RATE_STAGES = frozenset({"preflight"})


def rate(stage: str | None, tok_s: float | None) -> float | None:
    """`tok_s` as the listings show it for `stage`: None where it means nothing."""
    return None if stage in NO_RATE_STAGES else tok_s


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
                "tok_s": rate(stage, toks),
            }
        )
    return rows


def get_run(db: sqlite_utils.Database, run_id: int, *, now: float | None = None) -> dict[str, Any]:
    """One run with its stages, their attempts, root-cause errors and per-rank roll-ups."""
    now = now or time.time()
    found = read_rows(db, "SELECT * FROM runs WHERE id = ?", [run_id])
    if not found:
        raise KeyError(f"no run {run_id}")
    run = found[0]
    stages = []
    for s in read_rows(db, "SELECT * FROM stages WHERE run_id = ? ORDER BY position", [run_id]):
        attempts = []
        for a in read_rows(
            db, "SELECT * FROM attempts WHERE run_id = ? AND stage = ? ORDER BY number", [run_id, s["name"]]
        ):
            root = read_rows(db, "SELECT * FROM errors WHERE attempt_id = ? AND root_cause = 1 LIMIT 1", [a["id"]])
            ranks = read_rows(
                db,
                "SELECT rank, pid, host, device, state, exit_code, signal, oom_killed, peak_gpu_mem, "
                "tok_s, log_path, role, tp_rank, parent_rank, started_at, ended_at, last_write "
                "FROM ranks WHERE attempt_id = ? ORDER BY rank",
                [a["id"]],
            )
            for r in ranks:
                r["tok_s"] = rate(s["name"], r["tok_s"])
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
                    # A Slurm attempt's job and nodes (schema 8; None for local attempts).
                    "slurm_job": a.get("slurm_job"),
                    "nodes": a.get("nodes"),
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
                "tok_s": rate(s["name"], s["tok_s"]),
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
        "tok_s": rate(run["current_stage"], run["tok_s"]),
        "summary": json.loads(run["summary_json"]) if run["summary_json"] else None,
        "stages": stages,
        "window": stream_window(db, run_id) if streams(run["config_json"]) else None,
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
    rows = read_rows(db, sql, params)
    jobs = _slurm_jobs(db, {r["attempt_id"] for r in rows})
    return [
        {
            "stage": r["stage"],
            "attempt": r["attempt"],
            "root_cause": bool(r["root_cause"]),
            "slurm_job": jobs.get(r["attempt_id"]),
            **_error(r),
        }
        for r in rows
    ]


def _slurm_jobs(db, attempt_ids: set[int]) -> dict[int, int]:
    """attempt id -> its Slurm job, for the attempts that ran as one (none before schema 8)."""
    if not attempt_ids or "slurm_job" not in {c[1] for c in db.execute("PRAGMA table_info(attempts)")}:
        return {}
    marks = ",".join("?" * len(attempt_ids))
    sql = f"SELECT id, slurm_job FROM attempts WHERE slurm_job IS NOT NULL AND id IN ({marks})"
    return dict(db.execute(sql, sorted(attempt_ids)).fetchall())


def events(db: sqlite_utils.Database, run_id: int) -> list[dict[str, Any]]:
    return read_rows(db, "SELECT * FROM events WHERE run_id = ? ORDER BY time, id", [run_id])


def stage_attempts(db, run_id: int, stage: str) -> list[dict[str, Any]]:
    """The attempts of one stage, oldest first: number, state, dir, started_at, ended_at.

    Cheap enough to poll: `eyas logs -f` calls it to notice an ended or a new attempt.
    """
    return read_rows(
        db,
        "SELECT number, state, dir, started_at, ended_at FROM attempts WHERE run_id = ? AND stage = ? ORDER BY number",
        [run_id, stage],
    )


def stage_state(db, run_id: int, stage: str) -> str | None:
    """The state of one stage of a run; None when the run has no such stage."""
    row = db.execute("SELECT state FROM stages WHERE run_id = ? AND name = ?", [run_id, stage]).fetchone()
    return row[0] if row else None


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
