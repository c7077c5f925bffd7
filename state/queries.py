"""Read-only queries behind `eyas runs`, `eyas show` and the TUI.

They read roll-up columns kept by the daemon, never the raw metrics, so that they stay
fast on a store with millions of samples; the curves alone read samples, downsampled in SQL
from an index that holds them (see "curves" below).

Every query takes either a sqlite_utils.Database or a plain sqlite3.Connection: they only
call `db.execute`. Importing sqlite_utils costs about 0.5 s here (it imports pandas and
numpy when they are installed), which alone would break the CLI's 0.5 s budget, so this
module never imports it and `connect` opens a plain read-only connection.

Over 500 lines while issue 37 is open: it splits these queries by screen (runs, a run, metrics, streaming, phases).
"""

from __future__ import annotations

import bisect
import json
import re
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import display

if TYPE_CHECKING:
    import sqlite_utils

# The schema version these queries read (schema.LATEST, checked by a test): kept here
# because importing eyas.state.schema pulls in sqlite_utils.
SCHEMA_VERSION = 8

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
        "window": stream_window(db, run_id) if _streams(run["config_json"]) else None,
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
    rows = _rows(db, sql, params)
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


def _streams(config_json: str | None) -> bool:
    try:
        return (json.loads(config_json or "{}").get("storage") or {}).get("mode") == "streaming"
    except ValueError:
        return False


def stream_window(db, run_id: int) -> dict[str, Any] | None:
    """A streaming run's window (workers/extract/stream.py), from the ranks' progress metrics:
    its bytes now and at its peak, its budget, and how often (and how long) each side waited on
    the other, over every attempt; its mode ("keep", "window", or None while not known) and the
    dataset's size when known; None for a run that never streamed.

    Every figure is an index probe or a walk of one series of one attempt: the TUI's Run screen
    reads this each second while the run goes on, beside train's millions of samples."""
    attempts = {
        stage: [n for (n,) in db.execute("SELECT number FROM attempts WHERE run_id=? AND stage=?", [run_id, stage])]
        for stage in ("extract", "train")
    }

    def per_rank(stage: str, name: str) -> list[float]:
        """Each (attempt, rank)'s largest sample of `name`."""
        return [
            v
            for a in attempts[stage]
            for _, v in db.execute(
                "SELECT rank, MAX(value) FROM metrics WHERE run_id=? AND stage=? AND attempt=? AND name=? GROUP BY rank",
                [run_id, stage, a, name],
            )
            if v is not None
        ]

    budgets = per_rank("extract", "window_budget")
    if not budgets:
        return None
    now = None
    for a in attempts["extract"]:
        row = db.execute(
            "SELECT time, value FROM metrics WHERE run_id=? AND stage='extract' AND attempt=? AND name='window_bytes' "
            "ORDER BY time DESC LIMIT 1",
            [run_id, a],
        ).fetchone()
        if row and (now is None or row[0] > now[0]):
            now = row
    # The peak is the window's ledger's own (workers/extract/stream.py: Ledger), which every
    # sample carries as window_peak_bytes and extract's summary reports: the largest of the
    # sampled window_bytes misses the moments between samples. Runs recorded before the
    # ledger kept it have only those samples.
    peaks = per_rank("extract", "window_peak_bytes") or per_rank("extract", "window_bytes")
    out: dict[str, Any] = {
        "budget": max(budgets),
        "peak": max(peaks, default=None),
        "bytes": now[1] if now else None,
    }
    # Counts are cumulative per rank and attempt: each (attempt, rank)'s last value, summed.
    for stage in ("extract", "train"):
        for what in ("waits", "wait_s"):
            out[f"{stage}_{what}"] = float(sum(per_rank(stage, f"{stage}_{what}")))
    out["mode"], out["dataset_bytes"] = _stream_mode(db, run_id, attempts["train"])
    return out


def _stream_mode(db, run_id: int, train_attempts: list[int]) -> tuple[str | None, float | None]:
    """(mode, dataset bytes) of a streaming run. Extract's rank 0 chooses the mode once and its
    summary says which (train's too); before either stage ends, a shard train freed says
    "window", since keep mode never frees one. None for what is not known yet."""
    summaries = {
        name: json.loads(text)
        for name, text in db.execute(
            "SELECT name, summary_json FROM stages WHERE run_id=? AND name IN ('extract', 'train') "
            "AND summary_json IS NOT NULL",
            [run_id],
        )
    }
    ex, tr = (x if isinstance(x := summaries.get(name), dict) else {} for name in ("extract", "train"))
    mode = ex.get("streaming") or tr.get("streaming")
    if mode is None:
        freed = any(
            db.execute(
                "SELECT 1 FROM metrics WHERE run_id=? AND stage='train' AND attempt=? AND name='shards_freed' "
                "AND value > 0 LIMIT 1",
                [run_id, a],
            ).fetchone()
            for a in train_attempts
        )
        mode = "window" if freed else None
    return mode, ex.get("dataset_bytes")


def window_lines(window: dict[str, Any] | None) -> list[str]:
    """A streaming run's window (stream_window) as `eyas show` and the TUI's Run screen write it:
    its size when last sampled and at its peak, each as a share of the budget, whether the
    dataset is kept or made again each epoch, and each side's waits on the other; [] without a
    window. Short lines: each fits the TUI's 80 columns unwrapped."""
    if not window:
        return []
    budget = window["budget"]

    def part(n: float | None) -> str:
        if n is None:
            return "–"
        return f"{display.size(n)} ({n / budget:.0%})" if budget else display.size(n)

    dataset = f" ({display.size(window['dataset_bytes'])})" if window.get("dataset_bytes") is not None else ""
    mode = {
        "keep": f"kept: the whole dataset{dataset} fits, later epochs read it from disk",
        "window": f"regenerated each epoch: the dataset{dataset} does not fit the budget",
    }.get(window.get("mode"), "kept or regenerated each epoch: not known yet")
    return [
        f"window: {part(window['bytes'])} last sampled, {part(window['peak'])} at most, budget {display.size(budget)}",
        mode,
        f"waits: extract on the window {int(window['extract_waits'])}x ({window['extract_wait_s']:.1f} s), "
        f"train on extract {int(window['train_waits'])}x ({window['train_wait_s']:.1f} s)",
    ]


# A phase's name as the ranks write it (workers/runtime/phases.py), in the words the live
# views use for it; a name not listed is shown as written.
_PHASE_WORDS = {
    "load target": "loading the target",
    "vllm engine start": "starting the vLLM engine",
    "canary engine start": "starting the canary's vLLM engine",
    "build draft model": "building the draft model",
    "count rows": "counting the data's rows",
    "save dataset": "saving the dataset",
    "publish dataset": "publishing the dataset",
}


def phase_text(phases: dict[str, dict] | None, now: float) -> str:
    """What a running stage's ranks wait for, from their open phases ({rank: {"phase", "since",
    "budget", ...}}, as the daemon's "metric" events carry them): the phase most ranks are in,
    for how long, and its budget; "" when no rank is in one. `starting the vLLM engine 2 of 3
    (trained draft) for 14s`, `rank 1: saving checkpoint epoch-1 for 3s (budget 2m00s)`."""
    if not phases:
        return ""
    by_name: dict[str, list[tuple[str, dict]]] = {}
    for rank, p in phases.items():
        by_name.setdefault(str(p.get("phase") or "?"), []).append((str(rank), p))
    name, members = max(by_name.items(), key=lambda kv: len(kv[1]))
    words = _PHASE_WORDS.get(name) or ("saving " + name if name.startswith("checkpoint ") else name)
    if len(members) > 1:
        words += f" on {len(members)} ranks"
    elif len(phases) == 1 and members[0][0] != "0":
        words = f"rank {members[0][0]}: {words}"
    since = min((p["since"] for _, p in members if isinstance(p.get("since"), (int, float))), default=None)
    if since is not None:
        words += f" for {display.duration(max(0.0, now - since))}"
    budget = members[0][1].get("budget")
    if isinstance(budget, (int, float)):
        words += f" (budget {display.duration(budget)})"
    return words


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


# -- curves --------------------------------------------------------------------------------
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


_SERIES = "run_id = :run AND stage = :stage AND attempt = :attempt AND name = :name"

# Each bucket's mean time and value, one index range per bucket, both from one correlated read
# (two scalar subqueries would read each bucket twice) as one text: quote() writes a REAL
# with every digit it needs to read back the same double (json_array and CAST keep 15).
_BUCKETS = f"""
WITH RECURSIVE b(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM b WHERE i < :n - 1)
SELECT (SELECT quote(avg(time)) || ' ' || quote(avg(value)) FROM metrics
        WHERE {_SERIES} AND rank IS :rank
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
    if db.execute(f"SELECT EXISTS (SELECT 1 FROM metrics WHERE {_SERIES} AND rank IS NULL)", p).fetchone()[0]:
        found.append(None)
    sql = f"""
    WITH RECURSIVE k(rank) AS (
      SELECT (SELECT min(rank) FROM metrics WHERE {_SERIES})
      UNION ALL
      SELECT (SELECT min(rank) FROM metrics WHERE {_SERIES} AND rank > k.rank) FROM k WHERE k.rank IS NOT NULL)
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
        f"SELECT time, value FROM metrics WHERE {_SERIES} AND rank IS :rank ORDER BY time LIMIT :n",
        {**p, "n": points + 1},
    ).fetchall()
    if len(head) <= points:
        return [(t, v) for t, v in head]
    t0 = head[0][0]
    t1 = db.execute(f"SELECT max(time) FROM metrics WHERE {_SERIES} AND rank IS :rank", p).fetchone()[0]
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


def series_summary(db, run_id: int, stage: str | None = None) -> list[dict[str, Any]]:
    """One row per recorded series of a run (stage, attempt, name, rank): its sample count,
    first and last time, minimum, maximum and newest value. One pass over the run's index
    entries in index order (no sort), then one probe per series for the newest value."""
    where, params = "run_id = ?", [run_id]
    if stage:
        where += " AND stage = ?"
        params.append(stage)
    rows = _rows(
        db,
        "SELECT stage, attempt, name, rank, count(*) AS samples, min(time) AS first, max(time) AS last, "
        f"min(value) AS min, max(value) AS max FROM metrics WHERE {where} "
        "GROUP BY stage, attempt, name, rank ORDER BY stage, attempt, name, rank",
        params,
    )
    for r in rows:
        r["value"] = db.execute(
            f"SELECT value FROM metrics WHERE {_SERIES} AND rank IS :rank ORDER BY time DESC LIMIT 1",
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
