"""Opening the store, and the writes the daemon makes (it is the only writer).

Every state change goes through `move_*`, which checks the state machine and records an
event with its reason in the same transaction. Each write is a `db.atomic()` block, which
nests as a savepoint: the daemon wraps several writes into one transaction (a settlement, a
stop) that happens whole or not at all, whatever fails in between (a full disk).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import sqlite_utils

from . import integrity, machine, queries, schema
from .integrity import DatabaseDamaged  # noqa: F401 - what open_writer raises, for its callers


class NotFound(KeyError):
    """A run or stage that the store does not hold: the caller's mistake, not eyas's."""

    def __str__(self) -> str:  # KeyError's own str() would quote the message
        return str(self.args[0]) if self.args else "not found"


class StoreMissing(FileNotFoundError):
    """No database yet: nothing has been submitted under this state directory."""


def open_writer(path: Path) -> sqlite_utils.Database:
    """Open (creating and migrating) the database for the daemon, the only writer.

    Raises integrity.DatabaseDamaged (one line: the file and the fix) when the file is not a
    database or `PRAGMA quick_check` finds a damaged page: checked here, before the first
    write, because the daemon would otherwise run until some write touched the bad page.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(path), timeout=30, check_same_thread=False)
    try:
        integrity.check(conn, path)
    except BaseException:
        conn.close()
        raise
    db = sqlite_utils.Database(conn)
    db.execute("PRAGMA journal_mode=WAL")
    # NORMAL is durable across process crashes in WAL mode; only power loss can drop the
    # last transactions, which is the right trade for a 1 Hz metrics writer.
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA foreign_keys=ON")
    schema.migrate(db)
    return db


def open_reader(path: Path) -> sqlite_utils.Database:
    """Open the database read-only, with sqlite-utils' table API (tests, tools). The CLI
    uses `queries.connect`, which skips sqlite-utils' import time."""
    try:
        conn = queries.connect(path)
    except FileNotFoundError as exc:
        raise StoreMissing(str(exc)) from None
    return sqlite_utils.Database(conn)


def _event(db, run_id, entity, old, new, reason, stage=None, attempt=None, now=None) -> None:
    db["events"].insert(
        {
            "time": now or time.time(),
            "run_id": run_id,
            "stage": stage,
            "attempt": attempt,
            "entity": entity,
            "from_state": old,
            "to_state": new,
            "reason": reason,
        }
    )


def create_run(
    db: sqlite_utils.Database,
    *,
    name: str,
    model: str,
    stages: Iterable[dict[str, Any]],
    config: dict[str, Any] | None = None,
    config_path: str | None = None,
    output_dir: str | None = None,
    run_id: int | None = None,
    dir: str | None = None,
    now: float | None = None,
) -> int:
    """Record a new pending run with its stages (dicts with name and max_restarts). `run_id`
    and `dir` are the id and folder the daemon claimed for it (paths.claim_run_dir); without
    them SQLite picks the id and the run has no folder of its own (tests)."""
    now = now or time.time()
    row = {
        "name": name,
        "model": model,
        "state": "pending",
        "config_path": config_path,
        "config_json": json.dumps(config) if config is not None else None,
        "output_dir": output_dir,
        "created_at": now,
        "dir": dir,
    }
    if run_id is not None:
        row["id"] = run_id
    with db.atomic():
        run_id = db["runs"].insert(row).last_pk
        for position, stage in enumerate(stages):
            db["stages"].insert(
                {
                    "run_id": run_id,
                    "name": stage["name"],
                    "position": position,
                    "state": "pending",
                    "max_restarts": stage.get("max_restarts", 0),
                    "world_size": stage.get("world_size"),
                }
            )
        _event(db, run_id, "run", None, "pending", "submitted", now=now)
    return run_id


def move_run(db, run_id: int, new: str, reason: str, now: float | None = None, **fields) -> None:
    """Move a run to `new`, checking the state machine, and record the event."""
    now = now or time.time()
    row = db["runs"].get(run_id)
    machine.check("run", row["state"], new, f"run {run_id}")
    update = {"state": new, "reason": reason, **fields}
    if new == "running" and not row["started_at"]:
        update["started_at"] = now
    if new in machine.TERMINAL:
        update["ended_at"] = now
    elif new in ("pending", "running"):
        update["ended_at"] = None
    with db.atomic():
        db["runs"].update(run_id, update)
        _event(db, run_id, "run", row["state"], new, reason, now=now)


def stage_row(db, run_id: int, stage: str) -> dict:
    rows = list(db["stages"].rows_where("run_id = ? and name = ?", [run_id, stage]))
    if not rows:
        names = [r["name"] for r in db["stages"].rows_where("run_id = ?", [run_id], order_by="position")]
        raise NotFound(f"run {run_id} has no stage {stage!r} (its stages: {', '.join(names)})")
    return rows[0]


def move_stage(db, run_id: int, stage: str, new: str, reason: str, now: float | None = None, **fields) -> None:
    """Move a stage to `new`, checking the state machine, and record the event."""
    now = now or time.time()
    row = stage_row(db, run_id, stage)
    machine.check("stage", row["state"], new, f"stage {stage} of run {run_id}")
    # A pending restart belongs to the stage's current run of attempts: any move ends it.
    update = {"state": new, "reason": reason, "restart_at": None, **fields}
    if new == "running":
        update["started_at"] = now
        update["ended_at"] = None
    if new in machine.TERMINAL:
        update["ended_at"] = now
    with db.atomic():
        db["stages"].update(row["id"], update)
        if new == "running":
            db["runs"].update(run_id, {"current_stage": stage})
        _event(db, run_id, "stage", row["state"], new, reason, stage=stage, attempt=row["attempts"], now=now)


def new_attempt(
    db,
    run_id: int,
    stage: str,
    *,
    dir: str,
    world_size: int,
    devices: list | None = None,
    master_port: int | None = None,
    now: float | None = None,
) -> tuple[int, int]:
    """Record the next attempt of a stage; returns (attempt id, attempt number)."""
    now = now or time.time()
    row = stage_row(db, run_id, stage)
    number = (row["attempts"] or 0) + 1
    with db.atomic():
        attempt_id = (
            db["attempts"]
            .insert(
                {
                    "run_id": run_id,
                    "stage": stage,
                    "number": number,
                    "state": "running",
                    "dir": dir,
                    "world_size": world_size,
                    "devices": json.dumps(devices or []),
                    "master_port": master_port,
                    "started_at": now,
                }
            )
            .last_pk
        )
        # The attempt is the restart that was due: its intent is spent with it.
        db["stages"].update(row["id"], {"attempts": number, "world_size": world_size, "restart_at": None})
        # The run's reason follows its current stage: "starting prepare" must not outlive prepare.
        db["runs"].update(run_id, {"current_stage": stage, "reason": f"{stage}: attempt {number} started"})
        _event(
            db, run_id, "attempt", None, "running", f"attempt {number} started", stage=stage, attempt=number, now=now
        )
    return attempt_id, number


def move_attempt(db, attempt_id: int, new: str, reason: str, now: float | None = None) -> None:
    now = now or time.time()
    row = db["attempts"].get(attempt_id)
    machine.check("attempt", row["state"], new, f"attempt {row['number']} of {row['stage']}")
    with db.atomic():
        db["attempts"].update(attempt_id, {"state": new, "reason": reason, "ended_at": now})
        _event(
            db, row["run_id"], "attempt", row["state"], new, reason, stage=row["stage"], attempt=row["number"], now=now
        )


def record_cancel(db, attempt_id: int, reason: str, now: float | None = None) -> None:
    """Record that a running attempt is being ended on purpose (a stop, the daemon's own
    shutdown), before any signal is sent: a daemon restarted meanwhile settles it as cancelled
    with this reason, and its ranks' deaths after `cancel_at` are not failures."""
    with db.atomic():
        db.execute(
            "UPDATE attempts SET cancel_reason = coalesce(cancel_reason, ?), "
            "cancel_at = coalesce(cancel_at, ?) WHERE id = ?",
            [reason, now or time.time(), attempt_id],
        )


def record_stuck(db, attempt_id: int, stuck: dict) -> None:
    """Record the hang watchdog's finding on a running attempt (daemon/watchdog.py), before the
    teardown it causes; written again once the stacks are in."""
    with db.atomic():
        db.execute("UPDATE attempts SET stuck_json = ? WHERE id = ?", [json.dumps(stuck), attempt_id])


def schedule_restart(db, run_id: int, stage: str, restarts: int, due: float) -> None:
    """Record a restart the policy called for: the stage's restart count and when it is due."""
    with db.atomic():
        db.execute(
            "UPDATE stages SET restarts = ?, restart_at = ? WHERE run_id = ? AND name = ?",
            [restarts, due, run_id, stage],
        )


def upsert_rank(db, attempt_id: int, rank: int, **fields) -> None:
    """Insert or update one rank of an attempt."""
    attempt = db["attempts"].get(attempt_id)
    # Ranks are keyed by a unique (attempt_id, rank) index, not by their primary key, which
    # is what sqlite-utils' upsert would match on: so a lookup, then an update or insert.
    existing = list(db["ranks"].rows_where("attempt_id = ? and rank = ?", [attempt_id, rank]))
    with db.atomic():
        if existing:
            db["ranks"].update(existing[0]["id"], fields)
        else:
            db["ranks"].insert(
                {
                    "attempt_id": attempt_id,
                    "rank": rank,
                    "run_id": attempt["run_id"],
                    "stage": attempt["stage"],
                    **fields,
                }
            )


def record_error(
    db,
    attempt_id: int,
    *,
    rank: int | None,
    type: str,
    message: str,
    traceback: str,
    time_: float,
    root_cause: bool,
    source: str,
    pid: int | None = None,
    host: str | None = None,
    path: str | None = None,
    role: str | None = None,
    tp_rank: int | None = None,
) -> int:
    """Record one rank's failure. An empty message is kept empty: type and traceback say enough.
    A tensor-parallel worker's failure carries role "tp-worker" and its tp_rank."""
    attempt = db["attempts"].get(attempt_id)
    with db.atomic():
        return (
            db["errors"]
            .insert(
                {
                    "run_id": attempt["run_id"],
                    "stage": attempt["stage"],
                    "attempt_id": attempt_id,
                    "attempt": attempt["number"],
                    "rank": rank,
                    "pid": pid,
                    "host": host,
                    "type": type,
                    "message": message,
                    "traceback": traceback,
                    "time": time_,
                    "root_cause": int(root_cause),
                    "source": source,
                    "path": path,
                    "role": role,
                    "tp_rank": tp_rank,
                }
            )
            .last_pk
        )


def insert_metrics(db, rows: list[dict[str, Any]]) -> None:
    """Append metric samples: dicts with time, run_id, stage, attempt, rank, name, value."""
    if rows:
        with db.atomic():
            db["metrics"].insert_all(rows, batch_size=500)


def write_metrics(db, buf: dict) -> None:
    """One second (or, behind a lock, many) of samples: the raw rows, each rank's roll-up
    fields, and the stages' and runs' roll-ups (buf["stages"]: attempt id -> (run id, stage))."""
    insert_metrics(db, buf["rows"])
    for (attempt_id, rank), fields in buf["ranks"].items():
        db.execute(
            "UPDATE ranks SET " + ", ".join(f"{k} = ?" for k in fields) + " WHERE attempt_id = ? AND rank = ?",
            [*fields.values(), attempt_id, rank],
        )
    for attempt_id, (run_id, stage) in buf["stages"].items():
        # History keeps the steady figure: the sum of the ranks' mean rates over the
        # attempt, not the instantaneous rate that the live views show.
        tok_s, peak = db.execute(
            "SELECT sum(tok_s), max(peak_gpu_mem) FROM ranks WHERE attempt_id = ?", [attempt_id]
        ).fetchone()
        if tok_s is not None:
            db.execute("UPDATE stages SET tok_s = ? WHERE run_id = ? AND name = ?", [tok_s, run_id, stage])
            db.execute("UPDATE runs SET tok_s = ? WHERE id = ?", [tok_s, run_id])
        if peak is not None:
            db.execute(
                "UPDATE stages SET peak_gpu_mem = max(coalesce(peak_gpu_mem, 0), ?) WHERE run_id = ? AND name = ?",
                [peak, run_id, stage],
            )
            db.execute("UPDATE runs SET peak_gpu_mem = max(coalesce(peak_gpu_mem, 0), ?) WHERE id = ?", [peak, run_id])


def prune_metrics(db, *, max_age_s: float, max_rows: int, now: float | None = None) -> int:
    """Retention: drop samples older than `max_age_s`, then the oldest beyond `max_rows`.

    History survives pruning because the listings read the roll-ups on runs, stages and
    ranks, not the raw samples.
    """
    now = now or time.time()
    with db.atomic():
        cur = db.execute("DELETE FROM metrics WHERE time < ?", [now - max_age_s])
        removed = cur.rowcount
        count = db.execute("SELECT count(*) FROM metrics").fetchone()[0]
        if count > max_rows:
            cur = db.execute(
                "DELETE FROM metrics WHERE id IN (SELECT id FROM metrics ORDER BY time, id LIMIT ?)",
                [count - max_rows],
            )
            removed += cur.rowcount
    return removed
