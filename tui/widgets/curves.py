"""Curves drawn in the terminal: `CurvePlot` shows lines (x, y, label, colour) with plotext, and falls back to one sparkline per line when it is too small for axes.

The plot carries no frame: every cell goes to the lines, which is what makes a useful plot fit
at 80x24 over SSH. Its legend is a column beside the canvas, never drawn over the data (and left
out when the column would take more than a third of the width: `z` zooms). A curve may be drawn
on a log y axis (a loss falling by decades) and smoothed with TensorBoard's EMA, the raw series
faint behind the smoothed one. Ticks and their labels are eyas.state.axes's (1-2-5 steps, log
decades, `h:mm`, `6.9k`), shared with `eyas show --plot`, not plotext's long floats. The lines
given stay readable in `lines` and what was drawn of them in `drawn`, so tests assert what is
plotted rather than how it looks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rich.text import Text
from textual_plotext import PlotextPlot

from eyas.state import axes
from eyas.state.axes import number

from .. import format as fmt

# (plotext colour, rich style, the faint plotext colour of its raw series behind a smoothed
# line): one line or run each, the same in the plot and its legend.
PALETTE = [
    ("cyan", "cyan", (0, 88, 96)),
    ("magenta", "magenta", (96, 24, 96)),
    ("green", "green", (24, 88, 24)),
    ("yellow", "yellow", (96, 88, 16)),
    ("blue", "blue", (32, 48, 112)),
    ("red", "red", (112, 32, 32)),
    ("cyan+", "bright_cyan", (24, 104, 112)),
    ("magenta+", "bright_magenta", (112, 40, 112)),
]

# Below this height there is no room for a title, a canvas and ticks: sparklines instead.
MIN_PLOT_HEIGHT = 4
MIN_PLOT_WIDTH = 16
LEGEND_MARK = "━"


def colour(i: int) -> tuple[str, str, tuple[int, int, int]]:
    return PALETTE[i % len(PALETTE)]


@dataclass
class Line:
    """One plotted line: the points, and how the legend names it."""

    label: str
    xs: list[float]
    ys: list[float]
    colour: int = 0  # index into PALETTE
    run_id: int | None = None
    meta: dict = field(default_factory=dict)
    named: bool = True  # has an entry in the plot's legend (overlaid runs: one line each)


@dataclass(frozen=True)
class Drawn:
    """One series as the last render drew it: y in the data's units (before any log), `faint`
    for the raw series behind a smoothed line."""

    label: str
    xs: list[float]
    ys: list[float]
    faint: bool = False


def legend_entries(lines: list[Line]) -> tuple[str, list[tuple[str, int]]]:
    """(a heading, [(entry, colour)]): labels that share their first word ("step 0",
    "step 1") are headed by it and listed by the rest ("0", "1")."""
    named = [ln for ln in lines if ln.named]
    words = [ln.label.split(" ", 1) for ln in named]
    if len(named) > 1 and all(len(w) == 2 for w in words) and len({w[0] for w in words}) == 1:
        return words[0][0], [(w[1], ln.colour) for w, ln in zip(words, named)]
    return "", [(ln.label, ln.colour) for ln in named]


def _unit_under_y_ticks(row: Text, unit: str, gutter: int, surface: str | None) -> Text:
    """The x tick row with the clock's face ("h:mm", "m:ss") in the corner under the y ticks
    (`gutter` cells wide), where it names the ticks right of it; the row as it was when a tick's
    label reaches into that corner."""
    head = unit.rjust(gutter)
    blank = len(row.plain) - len(row.plain.lstrip(" "))
    if blank < len(head) + 1:
        return row
    return Text(head, style="dim" + (f" on {surface}" if surface else "")) + row[len(head) :]


class CurvePlot(PlotextPlot):
    """A titled plot of some lines; x is elapsed seconds ("time") or a training step ("step")."""

    can_focus = True

    DEFAULT_CSS = """
    CurvePlot { width: 1fr; height: 1fr; min-width: 10; }
    CurvePlot:focus { background: $boost; }
    """

    def __init__(self, title: str = "", *, short: str = "", id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.title = title
        self.short = short or title  # the label of a lone sparkline
        self.lines: list[Line] = []
        self.drawn: list[Drawn] = []
        self.x_kind = "time"
        self.unit = ""  # appended to the y figures in the sparkline fallback
        self.note = ""  # said instead of a plot when there are no points
        self.log_y = False  # a log y axis, when every value is above zero
        self.smoothing = 0.0  # TensorBoard's EMA weight; 0: the raw series alone
        self.with_legend = True  # False: the screen names the lines (overlaid runs)

    def show(
        self,
        title: str,
        lines: list[Line],
        x_kind: str = "time",
        note: str = "",
        *,
        log_y: bool = False,
        smoothing: float = 0.0,
        legend: bool = True,
    ) -> None:
        self.title, self.lines, self.x_kind, self.note = title, [ln for ln in lines if ln.xs], x_kind, note
        self.log_y, self.smoothing, self.with_legend = log_y, smoothing, legend
        self.refresh()

    @property
    def on_log_axis(self) -> bool:
        """The y axis is logarithmic: asked for, and every value can be (above zero)."""
        return self.log_y and axes.log_ready([y for ln in self.lines for y in ln.ys])

    def _legend(self, width: int, height: int) -> tuple[int, list[Text]]:
        """(its width, one Text per row from the top) of the legend column, or (0, []) when
        there is nothing to tell apart or no room beside the canvas."""
        heading, entries = legend_entries(self.lines)
        if not self.with_legend or len(entries) < 2:
            return 0, []
        rows = max(1, height - 2 - (1 if heading else 0))  # under the title, above the x ticks
        per_row = math.ceil(len(entries) / rows)
        cell = max(len(e) for e, _ in entries) + (3 if per_row == 1 else 2)
        col = max(per_row * cell, len(heading)) + 1
        if col > width // 3:
            return 0, []
        out = [Text(" ")] + ([Text(" " + heading, style="dim")] if heading else [])
        for i in range(0, len(entries), per_row):
            row = Text(" ")
            for entry, c in entries[i : i + per_row]:
                mark = LEGEND_MARK + (" " if per_row == 1 else "")
                row.append(mark, style=colour(c)[1])
                row.append(entry.ljust(cell - len(mark)))
            out.append(row)
        return col, out

    def render(self):
        width, height = self.size.width, self.size.height
        if not self.lines:
            self.drawn = []
            return Text.assemble((self.title, "bold"), "\n", (self.note or "no samples", "dim"))
        if height < MIN_PLOT_HEIGHT or width < MIN_PLOT_WIDTH:
            self.drawn = [Drawn(ln.label, ln.xs, ln.ys) for ln in self.lines]
            return self._sparklines(width, height)
        legend_w, legend = self._legend(width, height)
        time_unit = ""
        log = self.on_log_axis
        to_y = math.log10 if log else float
        plt = self.plt
        plt.clear_figure()
        plt.frame(False)
        plt.title(self.title + ("  (log)" if log else ""))
        self.drawn = []
        for ln in self.lines:
            smoothed = axes.ema(ln.ys, self.smoothing) if self.smoothing > 0 and len(ln.ys) > 2 else None
            if smoothed is not None:
                self.drawn.append(Drawn(ln.label, ln.xs, ln.ys, faint=True))
                plt.plot(ln.xs, [to_y(y) for y in ln.ys], marker="braille", color=colour(ln.colour)[2])
            ys = smoothed if smoothed is not None else ln.ys
            self.drawn.append(Drawn(ln.label, ln.xs, ys))
            plt.plot(ln.xs, [to_y(y) for y in ys], marker="braille", color=colour(ln.colour)[0])
        xs = [x for ln in self.lines for x in ln.xs]
        ys = [y for ln in self.lines for y in ln.ys if math.isfinite(y)]
        ylo, yhi = (min(ys), max(ys)) if ys else (0.0, 1.0)
        rows = height - (2 if height >= 6 else 1)  # title, and the x ticks when there is room
        most = max(2, min(5, rows // 2))
        yt = axes.log_ticks(ylo, yhi, most) if log else axes.nice_ticks(ylo, yhi, most)
        if len(yt) < 2:
            yt = [ylo, yhi] if ylo < yhi else [ylo]
        if ylo < yhi:
            plt.ylim(to_y(ylo), to_y(yhi))
        plt.yticks([to_y(t) for t in yt], [number(t) for t in yt])
        xlo, xhi = min(xs), max(xs)
        if xlo < xhi:
            plt.xlim(xlo, xhi)
        if height >= 6:
            most = max(2, min(6, (width - legend_w) // 10))
            if self.x_kind == "time":
                xt = axes.time_ticks(xlo, xhi, most)
                unit = axes.clock_unit(xhi - xlo)
                plt.xticks(xt, [axes.clock(t, unit) for t in xt])
                time_unit = unit
            else:
                xt = axes.nice_ticks(xlo, xhi, most)
                plt.xticks(xt, [number(t) for t in xt])
        else:
            plt.xticks([])
        canvas_w = width - legend_w
        plt.plotsize(canvas_w, height)
        plt._set_size(canvas_w, height)
        plt.theme(self._get_plotext_theme_name(self.app.theme))
        text = Text.from_ansi(plt.build())
        surface = self.app.theme_variables.get("surface")
        rows_out = text.split("\n", allow_blank=True)
        ticks = max((i for i, row in enumerate(rows_out) if row.plain.strip()), default=None)
        if time_unit and ticks is not None:
            gutter = max(len(number(t)) for t in yt)
            rows_out[ticks] = _unit_under_y_ticks(rows_out[ticks], time_unit, gutter, surface)
        if not legend:
            return Text("\n").join(rows_out)
        # The legend on the canvas's own background (plotext paints the theme's surface).
        for i, row in enumerate(rows_out):
            row.pad_right(canvas_w - row.cell_len)
            cell = legend[i].copy() if i < len(legend) else Text()
            cell.pad_right(legend_w - cell.cell_len)
            if surface:
                cell.stylize(f"on {surface}")
            row.append_text(cell)
        return Text("\n").join(rows_out)

    def _sparklines(self, width: int, height: int) -> Text:
        """One row per line: its label, a sparkline and its newest value."""
        out = Text()
        for i, ln in enumerate(self.lines[: max(1, height)]):
            if i:
                out.append("\n")
            label = f"{self.short if len(self.lines) == 1 else ln.label} "[: max(0, width // 3)]
            last = f" {number(ln.ys[-1])}{self.unit}"
            out.append(label, style="bold")
            out.append_text(fmt.sparkline(ln.ys, max(0, width - len(label) - len(last)), style=colour(ln.colour)[1]))
            out.append(last)
        return out
