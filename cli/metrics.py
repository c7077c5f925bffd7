"""`eyas metrics RUN`: a run's recorded series as numbers, read straight from the store, daemon or not; `--tensorboard DIR` writes them as TensorBoard event files.

Every format says the same thing: one row per series (stage, attempt, metric, rank) with its
sample count, time span, minimum, maximum and newest value, the table in the units each
metric reads in (`132.7 MiB`, `6.9k`, `24m20s`: state/display.metric), --csv, --json and
--nl raw (unix times as ISO 8601 UTC, as the other listings write them). `--samples` gives
the samples themselves instead, every one, or with --points N each series downsampled in SQL
to N bucket means, as the TUI draws it. `eyas show RUN --plot` draws the curves (cli/plot.py).
"""

from __future__ import annotations

import sys

from eyas.state import display, queries

from . import output as out
from .history import load_stage_scoped

SUMMARY_COLUMNS = [
    out.Column("stage"),
    out.Column("attempt", right=True),
    out.Column("name"),
    out.Column("rank", lambda v: "stage" if v is None else str(v), right=True),
    out.Column("samples", display.count, right=True),
    out.Column("first", display.local_second, display.iso_utc),
    out.Column("last", display.local_second, display.iso_utc),
    out.Column("min", lambda v: _fig(v), right=True),
    out.Column("max", lambda v: _fig(v), right=True),
    out.Column("value", lambda v: _fig(v), right=True),
]
SAMPLE_COLUMNS = [
    out.Column("time", display.local_second, display.iso_utc),
    out.Column("stage"),
    out.Column("attempt", right=True),
    out.Column("rank", lambda v: "stage" if v is None else str(v), right=True),
    out.Column("name"),
    out.Column("value", right=True),
]
FIGURES = ("min", "max", "value")  # the columns a table shows in the metric's own unit


def _fig(v) -> str:
    return "" if v is None else str(v)


def _human(rows: list[dict]) -> list[dict]:
    """The rows with their figures in each metric's unit (the table's view of them)."""
    return [{**r, **{k: display.metric(r["name"], r[k]) for k in FIGURES if k in r}} for r in rows]


def command(args) -> int:
    """List a run's series (a table, or --csv/--json/--nl), its samples (--samples), or write
    them as TensorBoard event files (--tensorboard DIR)."""
    db, run = load_stage_scoped(args, "metrics")
    if run is None:
        return 1
    if args.points is not None and args.points < 1:
        print(f"eyas metrics: --points {args.points}: use a positive number", file=sys.stderr)
        return 2
    if getattr(args, "tensorboard", None):
        from .tbexport import export

        return export(db, run, args)
    if args.samples or args.points is not None:
        rows = _samples(db, args)
        if args.fmt in ("json", "csv", "nl"):
            out.emit(rows, SAMPLE_COLUMNS, args.fmt)
            return 0
        _emit_or_say(args, _human(rows), SAMPLE_COLUMNS)
        return 0
    rows = [r for r in queries.series_summary(db, args.run, args.stage) if not args.name or r["name"] in args.name]
    if args.fmt in ("json", "csv", "nl"):
        out.emit(rows, SUMMARY_COLUMNS, args.fmt)
        return 0
    _emit_or_say(args, _human(rows), SUMMARY_COLUMNS)
    return 0


def _emit_or_say(args, rows: list[dict], columns) -> None:
    if not rows:
        where = f" in {args.stage}" if args.stage else ""
        print(f"eyas metrics: run {args.run} has no recorded metrics{where}", file=sys.stderr)
        return
    out.emit(rows, columns, args.fmt)


def _samples(db, args) -> list[dict]:
    """The samples as rows of raw values (unix times), in series order (stage, attempt, name,
    rank, time)."""
    if args.points is None:
        return [
            {"time": t, "stage": st, "attempt": a, "rank": r, "name": n, "value": v}
            for t, st, a, r, n, v in queries.metric_rows(db, args.run, args.stage, args.name)
        ]
    rows = []
    for s in queries.series_summary(db, args.run, args.stage):
        if args.name and s["name"] not in args.name:
            continue
        for t, v in queries.metric_curve(db, args.run, s["stage"], s["attempt"], s["name"], s["rank"], args.points):
            rows.append(
                {
                    "time": t,
                    "stage": s["stage"],
                    "attempt": s["attempt"],
                    "rank": s["rank"],
                    "name": s["name"],
                    "value": v,
                }
            )
    return rows
