"""`eyas show RUN --plot`: a run's main curves (queries.CURVES) drawn with plotext under the run's usual text, read straight from the store, daemon or not.

Drawn as the TUI's Metrics screen draws them (eyas.state.axes): the losses on a log y axis
(`--linear` turns it off), loss, accuracy and tok/s smoothed with TensorBoard's EMA
(`--smooth W`, 0 for the raw series) with the raw series faint behind on a terminal, round
ticks in the units people read (`6.9k`, `2.0e-4`; elapsed time as `m:ss` or `h:mm`), and each
legend in a column beside its plot, never over the lines. An empty GPU-memory curve says why
(eyas.state.axes.gpu_note). plotext is imported only to draw.
"""

from __future__ import annotations

import math
import shutil
import sys

from eyas.state import axes, queries

from .history import open_store

PLOT_HEIGHT = 12
PALETTE = ["cyan", "magenta", "green", "yellow", "blue", "red", "cyan+", "magenta+"]
# The raw series behind a smoothed line: the palette's colour, dark.
FAINT = [(0, 88, 96), (96, 24, 96), (24, 88, 24), (96, 88, 16), (32, 48, 112), (112, 32, 32), (24, 104, 112)]
# ANSI foreground codes of PALETTE, for the legend column beside plotext's canvas.
ANSI = ["36", "35", "32", "33", "34", "31", "96", "95"]
LEGEND_MARK = "━"


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


def _rank_key(item):
    rank = item[0]
    return (rank is not None, rank or 0)


def _label(curve: queries.Curve, name: str, rank: int | None, many: bool) -> str | None:
    if curve.pattern:
        return f"step {name.rsplit('_', 1)[-1]}"
    return f"rank {rank}" if rank is not None and many else None


def _legend(entries: list[tuple[str, int]], colour: bool) -> tuple[int, list[str]]:
    """(its width, its rows) of the legend column: a heading when the labels share their first
    word ("step"), then one coloured mark and label a row."""
    if len(entries) < 2:
        return 0, []
    words = [e.split(" ", 1) for e, _ in entries]
    heading = ""
    if all(len(w) == 2 for w in words) and len({w[0] for w in words}) == 1:
        heading, entries = words[0][0], [(w[1], c) for w, (_, c) in zip(words, entries)]
    width = max([len(heading)] + [len(e) + 2 for e, _ in entries]) + 2
    rows = [""] + ([f"  {heading}"] if heading else [])
    for entry, c in entries:
        mark = f"\x1b[{ANSI[c % len(ANSI)]}m{LEGEND_MARK}\x1b[0m" if colour else LEGEND_MARK
        rows.append(f"  {mark} {entry}")
    return width, rows


def _series(db, run_id: int, stage: str, curve: queries.Curve, available: list[str]) -> list[tuple]:
    """[(name, rank, points)] of one curve: the stage's own roll-up where it has one."""
    names = queries.curve_names(curve, available)
    if not names:
        return []
    ranks = [None] if curve.stage_rollup else None
    data = queries.stage_curves(db, run_id, stage, names, ranks=ranks)
    if curve.stage_rollup and not any(data.values()):
        data = queries.stage_curves(db, run_id, stage, names)
    return [(n, r, pts) for n in names for r, pts in sorted(data[n].items(), key=_rank_key) if pts]


def _draw(curve, series, title: str, t0: float, width: int, colour: bool, log_y: bool, smoothing: float) -> list[str]:
    """One curve as text lines: plotext's canvas, the legend column beside it."""
    import plotext as plt

    entries = [(lab, i) for i, (n, r, _) in enumerate(series) if (lab := _label(curve, n, r, len(series) > 1))]
    legend_w, legend = _legend(entries, colour)
    lines = [([t - t0 for t, _ in pts], [v * curve.scale for _, v in pts]) for _, _, pts in series]
    ys_all = [y for _, ys in lines for y in ys if math.isfinite(y)]
    log = log_y and axes.log_ready(ys_all)
    to_y = math.log10 if log else float
    xs_all = [x for xs, _ in lines for x in xs]
    xlo, xhi = min(xs_all), max(xs_all)
    unit = axes.clock_unit(xhi - xlo)
    plt.clear_figure()
    plt.plotsize(width - legend_w, PLOT_HEIGHT)
    plt.theme("pro" if colour else "clear")
    how = [w for w, on in (("log", log), (f"EMA {smoothing:g}", smoothing > 0 and curve.key in axes.SMOOTHED)) if on]
    plt.title(title + (f" ({', '.join(how)})" if how else ""))
    plt.xlabel(f"{unit} since the stage started")
    for i, (xs, ys) in enumerate(lines):
        if smoothing > 0 and curve.key in axes.SMOOTHED and len(ys) > 2:
            if colour:  # faint behind; without colour it could not be told from the trend
                plt.plot(xs, [to_y(y) for y in ys], marker="braille", color=FAINT[i % len(FAINT)])
            ys = axes.ema(ys, smoothing)
        plt.plot(xs, [to_y(y) for y in ys], marker="braille", color=PALETTE[i % len(PALETTE)])
    ylo, yhi = min(ys_all), max(ys_all)
    yt = axes.log_ticks(ylo, yhi, 5) if log else axes.nice_ticks(ylo, yhi, 5)
    if len(yt) < 2:
        yt = [ylo, yhi] if ylo < yhi else [ylo]
    if ylo < yhi:
        plt.ylim(to_y(ylo), to_y(yhi))
    plt.yticks([to_y(t) for t in yt], [axes.number(t) for t in yt])
    if xlo < xhi:
        plt.xlim(xlo, xhi)
    xt = axes.time_ticks(xlo, xhi, max(2, min(8, (width - legend_w) // 12)))
    plt.xticks(xt, [axes.clock(t, unit) for t in xt])
    text = plt.build()
    rows = (text if colour else plt.uncolorize(text)).rstrip("\n").splitlines()
    return [row + (legend[i] if i < len(legend) else "") for i, row in enumerate(rows)]


def plot_lines(
    run: dict,
    stage: str | None = None,
    width: int | None = None,
    colour: bool | None = None,
    *,
    log_y: bool = True,
    smoothing: float = axes.DEFAULT_SMOOTHING,
) -> list[str]:
    """The run's main curves as text, one plot under another, each with its title; time since
    the stage started on x. Empty when nothing was recorded."""
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
    out: list[str] = []
    for curve in queries.CURVES:
        series = _series(db, run["id"], stage, curve, available)
        if not series:
            note = axes.gpu_note(s["attempt_list"] if s else []) if curve.key == "gpu_mem" else ""
            if note and note != "no samples" and out:  # only beside curves that were drawn
                out += ["", f"{curve.title} · run {run['id']} {stage}: {note}"]
            continue
        t0 = origin if origin is not None else min(p[0] for _, _, pts in series for p in pts)
        title = f"{curve.title} · run {run['id']} {stage}"
        out += ["", *_draw(curve, series, title, t0, width, colour, log_y and curve.key in axes.LOG_Y, smoothing)]
    return out


def show_plot(run: dict, args=None) -> int:
    """`eyas show RUN --plot`: the curves under the run's usual text."""
    smoothing = getattr(args, "smooth", None)
    if smoothing is not None and not 0 <= smoothing < 1:
        print(f"eyas show: --smooth {smoothing:g}: use a weight from 0 (off) to below 1, e.g. 0.6", file=sys.stderr)
        return 2
    drawn = plot_lines(
        run,
        log_y=not getattr(args, "linear", False),
        smoothing=axes.DEFAULT_SMOOTHING if smoothing is None else smoothing,
    )
    if not drawn:
        print(f"eyas show: run {run['id']} has no recorded curves to plot", file=sys.stderr)
        return 0
    sys.stdout.write("".join(line + "\n" for line in drawn))
    return 0
