"""`eyas metrics RUN` (a run's recorded series as numbers) and `eyas show RUN --plot` (its main curves drawn with plotext): read straight from the store, daemon or not.

The table lists each series (stage, attempt, metric, rank) with its sample count, time span,
minimum, maximum and newest value; --csv, --json and --nl give the samples themselves, raw
(unix times as ISO 8601 UTC, as the other listings write them), or with --points N each
series downsampled in SQL to N bucket means, as the TUI draws it. plotext is imported only
to draw.
"""

from __future__ import annotations

import shutil
import sys

from eyas.state import display, queries

from . import output as out
from .history import load_stage_scoped, open_store

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
SAMPLE_KEYS = ["time", "stage", "attempt", "rank", "name", "value"]
PLOT_HEIGHT = 12


def _fig(v) -> str:
    return "" if v is None else f"{v:.6g}"


def command(args) -> int:
    """List a run's series, or write its samples (--csv, --json, --nl)."""
    db, run = load_stage_scoped(args, "metrics")
    if run is None:
        return 1
    if args.points is not None and args.points < 1:
        print(f"eyas metrics: --points {args.points}: use a positive number", file=sys.stderr)
        return 2
    if args.fmt in ("json", "csv", "nl"):
        out.emit_raw(_samples(db, args), SAMPLE_KEYS, args.fmt, sys.stdout)
        return 0
    rows = [r for r in queries.series_summary(db, args.run, args.stage) if not args.name or r["name"] in args.name]
    if not rows:
        where = f" in {args.stage}" if args.stage else ""
        print(f"eyas metrics: run {args.run} has no recorded metrics{where}", file=sys.stderr)
        return 0
    out.emit(rows, SUMMARY_COLUMNS, args.fmt)
    return 0


def _samples(db, args) -> list[dict]:
    """The samples as rows of raw values, in series order (stage, attempt, name, rank, time)."""
    if args.points is None:
        return [
            {"time": display.iso_utc(t), "stage": st, "attempt": a, "rank": r, "name": n, "value": v}
            for t, st, a, r, n, v in queries.metric_rows(db, args.run, args.stage, args.name)
        ]
    rows = []
    for s in queries.series_summary(db, args.run, args.stage):
        if args.name and s["name"] not in args.name:
            continue
        for t, v in queries.metric_curve(db, args.run, s["stage"], s["attempt"], s["name"], s["rank"], args.points):
            rows.append(
                {
                    "time": display.iso_utc(t),
                    "stage": s["stage"],
                    "attempt": s["attempt"],
                    "rank": s["rank"],
                    "name": s["name"],
                    "value": v,
                }
            )
    return rows


# -- show --plot ---------------------------------------------------------------------------


def plot_stage(run: dict, stage: str | None, names_of) -> str | None:
    """The stage whose curves to draw: the one asked for; else train when it recorded
    figures; else the last stage that recorded any."""
    if stage:
        return stage
    ran = [s["name"] for s in run["stages"] if s["attempt_list"]]
    with_metrics = [name for name in ran if names_of(name)]
    if "train" in with_metrics:
        return "train"
    return with_metrics[-1] if with_metrics else None


def plot_lines(run: dict, stage: str | None = None, width: int | None = None, colour: bool | None = None) -> list[str]:
    """The run's main curves (queries.CURVES) as plotext text, one plot under another, each
    with its title; minutes since the stage started on x. Empty when nothing was recorded."""
    import plotext as plt

    db = open_store()
    if db is None:
        return []
    stage = plot_stage(run, stage, lambda name: queries.stage_metric_names(db, run["id"], name))
    if stage is None:
        return []
    width = width or max(40, min(shutil.get_terminal_size((100, 24)).columns, 160))
    colour = sys.stdout.isatty() if colour is None else colour
    available = queries.stage_metric_names(db, run["id"], stage)
    s = next((s for s in run["stages"] if s["name"] == stage), None)
    origin = (s["attempt_list"][0]["started_at"] if s and s["attempt_list"] else None) or (s or {}).get("started_at")
    palette = ["cyan", "magenta", "green", "yellow", "blue", "red", "cyan+", "magenta+"]
    lines: list[str] = []
    for curve in queries.CURVES:
        names = queries.curve_names(curve, available)
        if not names:
            continue
        ranks = [None] if curve.stage_rollup else None
        data = queries.stage_curves(db, run["id"], stage, names, ranks=ranks)
        if curve.stage_rollup and not any(data.values()):
            data = queries.stage_curves(db, run["id"], stage, names)
        series = [
            (name, rank, points)
            for name in names
            for rank, points in sorted(data[name].items(), key=_rank_key)
            if points
        ]
        if not series:
            continue
        t0 = origin if origin is not None else min(p[0] for _, _, pts in series for p in pts)
        plt.clear_figure()
        plt.plotsize(width, PLOT_HEIGHT)
        plt.theme("pro" if colour else "clear")
        plt.title(f"{curve.title} · run {run['id']} {stage}")
        plt.xlabel("minutes since the stage started")
        for i, (name, rank, points) in enumerate(series):
            label = name if curve.pattern else (f"rank {rank}" if rank is not None and len(series) > 1 else None)
            plt.plot(
                [(t - t0) / 60 for t, _ in points],
                [v * curve.scale for _, v in points],
                marker="braille",
                color=palette[i % len(palette)],
                label=label,
            )
        text = plt.build()
        lines += ["", *(text if colour else plt.uncolorize(text)).rstrip("\n").splitlines()]
    return lines


def _rank_key(item):
    rank = item[0]
    return (rank is not None, rank or 0)


def show_plot(run: dict) -> int:
    """`eyas show RUN --plot`: the curves under the run's usual text."""
    drawn = plot_lines(run)
    if not drawn:
        print(f"eyas show: run {run['id']} has no recorded curves to plot", file=sys.stderr)
        return 0
    sys.stdout.write("".join(line + "\n" for line in drawn))
    return 0
