"""Curves drawn in the terminal: `CurvePlot` shows lines (x, y, label, colour) with plotext, and falls back to one sparkline per line when it is too small for axes.

The plot carries no frame and no legend of its own at small sizes: every cell goes to the
lines, which is what makes a useful plot fit at 80x24 over SSH. Ticks are chosen here (1-2-5
steps, `1h30`, `12k`), not by plotext, whose labels are long floats. The lines shown stay
readable in `lines`, so tests assert what is plotted rather than how it looks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rich.text import Text
from textual_plotext import PlotextPlot

from .. import format as fmt

# (plotext colour, rich style): one line or run each, the same in the plot and its legend.
PALETTE = [
    ("cyan", "cyan"),
    ("magenta", "magenta"),
    ("green", "green"),
    ("yellow", "yellow"),
    ("blue", "blue"),
    ("red", "red"),
    ("cyan+", "bright_cyan"),
    ("magenta+", "bright_magenta"),
]

# Below this height there is no room for a title, a canvas and ticks: sparklines instead.
MIN_PLOT_HEIGHT = 4
MIN_PLOT_WIDTH = 16


def colour(i: int) -> tuple[str, str]:
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


def nice_ticks(lo: float, hi: float, most: int) -> list[float]:
    """At most `most` round values (1, 2 or 5 times a power of ten apart) within [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or most < 1:
        return []
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, most - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step) * step
    ticks, v = [], first
    while v <= hi + step * 1e-9 and len(ticks) < most + 1:
        ticks.append(0.0 if abs(v) < step * 1e-9 else v)
        v += step
    return ticks[:most] if len(ticks) > most else ticks


def time_ticks(lo: float, hi: float, most: int) -> list[float]:
    """Round elapsed times: seconds, minutes or hours (1, 2, 5, 10, 15, 30 of the unit)."""
    span = hi - lo
    if span <= 0:
        return [lo]
    raw = span / max(1, most - 1)
    steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 3 * 3600, 6 * 3600, 12 * 3600, 86400]
    step = next((s for s in steps if s >= raw), 86400 * math.ceil(raw / 86400))
    first = math.ceil(lo / step) * step
    return [first + k * step for k in range(int((hi - first) // step) + 1)][: most + 1]


def elapsed(seconds: float) -> str:
    """`0`, `45s`, `12m`, `1h30`, `2d3h`: short enough for an axis."""
    s = int(round(seconds))
    if s == 0:
        return "0"
    if abs(s) < 60:
        return f"{s}s"
    if abs(s) < 3600:
        m, r = divmod(s, 60)
        return f"{m}m" if not r else f"{m}m{r:02d}"
    if abs(s) < 86400:
        h, r = divmod(s, 3600)
        return f"{h}h" if r < 60 else f"{h}h{r // 60:02d}"
    d, r = divmod(s, 86400)
    return f"{d}d" if r < 3600 else f"{d}d{r // 3600}h"


def number(v: float) -> str:
    """A tick value in at most about 5 characters: `0.012`, `2.5`, `950`, `48.5k`, `1.2M`."""
    a = abs(v)
    if a == 0:
        return "0"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= div:
            return f"{v / div:.3g}{suffix}"
    if a >= 1:
        return f"{v:.3g}"
    if a < 0.01:
        mantissa, _, exp = f"{v:.1e}".partition("e")
        return f"{mantissa}e{int(exp)}"  # 3e-4 rather than 0.0003: a learning rate stays short
    return f"{v:.2g}"


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
        self.x_kind = "time"
        self.unit = ""  # appended to the y figures in the sparkline fallback
        self.note = ""  # said instead of a plot when there are no points

    def show(self, title: str, lines: list[Line], x_kind: str = "time", note: str = "") -> None:
        self.title, self.lines, self.x_kind, self.note = title, [ln for ln in lines if ln.xs], x_kind, note
        self.refresh()

    @property
    def legend(self) -> bool:
        """Labels inside the plot only when it is big enough that they hide little: a row
        each, at most a third of the plot."""
        named = sum(ln.named for ln in self.lines)
        return self.size.width >= 50 and 1 < named <= (self.size.height - 2) // 3

    def render(self):
        width, height = self.size.width, self.size.height
        if not self.lines:
            return Text.assemble((self.title, "bold"), "\n", (self.note or "no samples", "dim"))
        if height < MIN_PLOT_HEIGHT or width < MIN_PLOT_WIDTH:
            return self._sparklines(width, height)
        plt = self.plt
        plt.clear_figure()
        plt.frame(False)
        plt.title(self.title)
        for ln in self.lines:
            kw = {"label": ln.label} if self.legend and ln.named else {}
            plt.plot(ln.xs, ln.ys, marker="braille", color=colour(ln.colour)[0], **kw)
        xs = [x for ln in self.lines for x in ln.xs]
        ys = [y for ln in self.lines for y in ln.ys if math.isfinite(y)]
        ylo, yhi = (min(ys), max(ys)) if ys else (0.0, 1.0)
        rows = height - (2 if height >= 6 else 1)  # title, and the x ticks when there is room
        yt = nice_ticks(ylo, yhi, max(2, min(5, rows // 2)))
        if len(yt) < 2:
            yt = [ylo, yhi] if ylo < yhi else [ylo]
        if ylo < yhi:
            plt.ylim(ylo, yhi)
        plt.yticks(yt, [number(t) for t in yt])
        xlo, xhi = min(xs), max(xs)
        if xlo < xhi:
            plt.xlim(xlo, xhi)
        if height >= 6:
            most = max(2, min(6, width // 10))
            xt = time_ticks(xlo, xhi, most) if self.x_kind == "time" else nice_ticks(xlo, xhi, most)
            plt.xticks(xt, [elapsed(t) if self.x_kind == "time" else number(t) for t in xt])
        else:
            plt.xticks([])
        return super().render()

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
