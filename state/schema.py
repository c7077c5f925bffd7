"""The store's schema, as numbered migrations tracked by `PRAGMA user_version`."""

from __future__ import annotations

from collections.abc import Callable

import sqlite_utils


def _m1_initial(db: sqlite_utils.Database) -> None:
    db["runs"].create(
        {
            "id": int,
            "name": str,
            "model": str,
            "state": str,
            "current_stage": str,
            "config_path": str,
            "config_json": str,
            "output_dir": str,
            "reason": str,
            "created_at": float,
            "started_at": float,
            "ended_at": float,
            # Roll-ups kept by the daemon, so history listings never scan the metrics table.
            "peak_gpu_mem": float,
            "tok_s": float,
            "summary_json": str,
        },
        pk="id",
        not_null={"name", "state", "created_at"},
    )
    db["runs"].create_index(["created_at"])
    db["runs"].create_index(["state", "created_at"])

    db["stages"].create(
        {
            "id": int,
            "run_id": int,
            "name": str,
            "position": int,
            "state": str,
            "attempts": int,
            "restarts": int,
            "max_restarts": int,
            "world_size": int,
            "started_at": float,
            "ended_at": float,
            "reason": str,
            "tok_s": float,
            "peak_gpu_mem": float,
            "summary_json": str,
        },
        pk="id",
        foreign_keys=[("run_id", "runs", "id")],
        not_null={"run_id", "name", "state"},
        defaults={"attempts": 0, "restarts": 0},
    )
    db["stages"].create_index(["run_id", "name"], unique=True)

    db["attempts"].create(
        {
            "id": int,
            "run_id": int,
            "stage": str,
            "number": int,
            "state": str,
            "dir": str,
            "world_size": int,
            "devices": str,
            "master_port": int,
            "started_at": float,
            "ended_at": float,
            "reason": str,
        },
        pk="id",
        foreign_keys=[("run_id", "runs", "id")],
        not_null={"run_id", "stage", "number", "state"},
    )
    db["attempts"].create_index(["run_id", "stage", "number"], unique=True)
    db["attempts"].create_index(["state"])

    db["ranks"].create(
        {
            "id": int,
            "attempt_id": int,
            "run_id": int,
            "stage": str,
            "rank": int,
            # pid + create_time identify a process for good: a recycled pid has another
            # create time, so a restarted daemon never adopts a stranger.
            "pid": int,
            "create_time": float,
            "monitor_pid": int,
            "monitor_create_time": float,
            "host": str,
            "device": str,
            "state": str,
            "exit_code": int,
            "signal": int,
            "oom_killed": int,
            "started_at": float,
            "ended_at": float,
            "log_path": str,
            "peak_gpu_mem": float,
            "tok_s": float,
            "cpu_percent": float,
            "rss": float,
        },
        pk="id",
        foreign_keys=[("attempt_id", "attempts", "id"), ("run_id", "runs", "id")],
        not_null={"attempt_id", "run_id", "stage", "rank"},
    )
    db["ranks"].create_index(["attempt_id", "rank"], unique=True)
    db["ranks"].create_index(["run_id"])

    db["errors"].create(
        {
            "id": int,
            "run_id": int,
            "stage": str,
            "attempt_id": int,
            "attempt": int,
            "rank": int,
            "pid": int,
            "host": str,
            "type": str,
            "message": str,
            "traceback": str,
            "time": float,
            "root_cause": int,
            "source": str,
            "path": str,
        },
        pk="id",
        foreign_keys=[("run_id", "runs", "id"), ("attempt_id", "attempts", "id")],
        not_null={"run_id", "stage", "type", "time"},
        defaults={"root_cause": 0},
    )
    db["errors"].create_index(["run_id", "stage"])
    db["errors"].create_index(["attempt_id"])

    db["metrics"].create(
        {
            "id": int,
            "time": float,
            "run_id": int,
            "stage": str,
            "attempt": int,
            "rank": int,
            "name": str,
            "value": float,
        },
        pk="id",
        not_null={"time", "name", "value"},
    )
    db["metrics"].create_index(["run_id", "stage", "attempt", "name", "time"])
    db["metrics"].create_index(["time"])

    db["events"].create(
        {
            "id": int,
            "time": float,
            "run_id": int,
            "stage": str,
            "attempt": int,
            "entity": str,
            "from_state": str,
            "to_state": str,
            "reason": str,
        },
        pk="id",
        not_null={"time", "entity", "to_state"},
    )
    db["events"].create_index(["run_id", "time"])


def _m2_tp_workers(db: sqlite_utils.Database) -> None:
    """Tensor-parallel workers are ranks too: a vLLM driver rank spawns them (through its
    engine), so they get rows of their own, told apart by `role` ("driver", "tp-worker";
    NULL for a plain rank) and `tp_rank`. Their `rank` numbers follow the driver ranks
    (world_size + tp_rank) so that (attempt_id, rank) stays unique and every existing
    reader shows them; `parent_rank` names their driver."""
    for column in ("role", "tp_rank", "parent_rank"):
        db["ranks"].add_column(column, str if column == "role" else int)
    for column in ("role", "tp_rank"):
        db["errors"].add_column(column, str if column == "role" else int)


def _m3_run_dir(db: sqlite_utils.Database) -> None:
    """Each run records its own folder (`runs.dir`), chosen when it is submitted and never
    derived from its id again: a database lost or restored from an older backup reissues ids,
    and a run must never write into, or read from, a folder of another run. Rows from before
    this column keep NULL, for the folder of the old layout, `runs/<id>/`."""
    db["runs"].add_column("dir", str)


def _m4_intent(db: sqlite_utils.Database) -> None:
    """Intent is durable before it acts (daemon/intent.py): a stop's reason and time on the
    attempt it ends (`attempts.cancel_reason`, `cancel_at`), and a restart's due time on its
    stage (`stages.restart_at`), so that a daemon restarted at any instant finishes the same
    decision. A stage that an older daemon left running between two attempts (its restart was
    only in memory) is due now: the restart the policy had called for still happens."""
    db["attempts"].add_column("cancel_reason", str)
    db["attempts"].add_column("cancel_at", float)
    db["stages"].add_column("restart_at", float)
    db.execute(
        "UPDATE stages SET restart_at = (julianday('now') - 2440587.5) * 86400.0 WHERE state = 'running' "
        "AND NOT EXISTS (SELECT 1 FROM attempts a WHERE a.run_id = stages.run_id AND a.stage = stages.name "
        "AND a.state = 'running')"
    )


def _m5_stuck(db: sqlite_utils.Database) -> None:
    """The hang watchdog's decision on its attempt (`attempts.stuck_json`: the Stalled or
    Straggler finding, then the stacks it collected), recorded before the teardown it causes,
    so that a daemon restarted mid-teardown settles the attempt with that root cause and not
    as the SIGTERM deaths the teardown caused."""
    db["attempts"].add_column("stuck_json", str)


def _m6_last_write(db: sqlite_utils.Database) -> None:
    """When each rank last wrote a log line or a progress record (`ranks.last_write`, a unix
    time: the newer mtime of its log and progress file), kept by the daemon's 1 Hz sampler in
    the roll-up it already writes, so that every reader can say how long a rank has been quiet
    (state/liveness.py). NULL for ranks of older daemons and ranks that wrote nothing yet."""
    db["ranks"].add_column("last_write", float)


def _m7_metric_series(db: sqlite_utils.Database) -> None:
    """An index that serves one rank's samples of one metric in time order, values included
    (`metrics(run_id, stage, attempt, name, rank, time, value)`), so that the curves (the TUI's,
    `eyas metrics`, `eyas show --plot`) are downsampled in SQL from the index alone: no table
    lookup per sample, no sort, whatever the series' length (state/queries/curves.py, metric_curve).
    The older index on (run_id, stage, attempt, name, time) stays: it serves the newest sample
    of any rank (queries.latest_metric) and the time-ordered reads across ranks."""
    db["metrics"].create_index(["run_id", "stage", "attempt", "name", "rank", "time", "value"], if_not_exists=True)


def _m8_slurm(db: sqlite_utils.Database) -> None:
    """An attempt run as a Slurm job (resources.executor = "slurm", daemon/slurmgroup.py): its job
    id (`attempts.slurm_job`), recorded as soon as sbatch answers so that a restarted daemon
    re-adopts the job, and the nodes Slurm gave it (`attempts.nodes`, a hostlist as Slurm
    writes it). NULL for local attempts."""
    db["attempts"].add_column("slurm_job", int)
    db["attempts"].add_column("nodes", str)


MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [
    _m1_initial,
    _m2_tp_workers,
    _m3_run_dir,
    _m4_intent,
    _m5_stuck,
    _m6_last_write,
    _m7_metric_series,
    _m8_slurm,
]
LATEST = len(MIGRATIONS)


def version(db: sqlite_utils.Database) -> int:
    return db.execute("PRAGMA user_version").fetchone()[0]


def migrate(db: sqlite_utils.Database) -> int:
    """Apply the migrations this database lacks; `user_version` moves only after each one."""
    current = version(db)
    if current > LATEST:
        raise RuntimeError(f"database schema version {current} is newer than this eyas knows ({LATEST}); upgrade eyas")
    for number in range(current + 1, LATEST + 1):
        # One explicit transaction per migration, its DDL included: Python 3.11's sqlite3
        # opens no transaction for DDL inside `with conn:`, so a migration failing halfway
        # would leave columns behind and the next start would fail on "duplicate column".
        # sqlite-utils' atomic() issues BEGIN itself (its own writes nest as savepoints).
        with db.atomic():
            MIGRATIONS[number - 1](db)
            db.execute(f"PRAGMA user_version = {number}")
    return LATEST
