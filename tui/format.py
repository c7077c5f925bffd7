"""How the TUI writes states, figures and small charts: rich Text, so that DataTable cells and Statics share one look.

Durations, sizes, counts and times are eyas.state.display's (the screens import it), so the
TUI and `eyas runs` print the same figures the same way."""

from __future__ import annotations

from rich.text import Text

from eyas.state.display import count, duration

STATE_STYLE = {
    "succeeded": ("✓", "green"),
    "failed": ("✗", "bold red"),
    "running": ("▶", "bold cyan"),
    "cancelled": ("■", "yellow"),
    "pending": ("·", "dim"),
    "skipped": ("↷", "dim"),
    # rank states
    "exited": ("✓", "green"),
    "killed": ("■", "yellow"),
    "lost": ("?", "magenta"),
}

RANK_COLOURS = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta"]

_BARS = "▁▂▃▄▅▆▇█"


def badge(state: str | None, text: str | None = None) -> Text:
    """A state as a coloured glyph and word: `✗ failed`."""
    if not state:
        return Text("")
    glyph, style = STATE_STYLE.get(state, ("•", ""))
    return Text(f"{glyph} {text or state}", style=style)


def rank_style(rank: int) -> str:
    return RANK_COLOURS[rank % len(RANK_COLOURS)]


def sparkline(values: list[float], width: int, top: float | None = None, style: str = "cyan") -> Text:
    """The last values as block characters, one per cell, bucketed by maximum.

    Scaled from 0 to `top` when given (memory against the GPU's total), else from the
    minimum to the maximum, so that a rate's changes show. Hand-written rather than
    Textual's Sparkline widget: a DataTable cell holds a Text, not a widget. Right-aligned,
    so the newest value is always at the right edge.
    """
    if width <= 0:
        return Text("")
    if not values:
        return Text(" " * width)
    if len(values) > width:
        per = len(values) / width
        values = [max(values[int(i * per) : max(int((i + 1) * per), int(i * per) + 1)]) for i in range(width)]
    lo, hi = (0.0, top) if top else (min(values), max(values))
    n = len(_BARS) - 1
    if hi - lo <= 0:
        chars = _BARS[n // 2 if hi > 0 else 0] * len(values)
    else:
        chars = "".join(_BARS[min(n, max(0, int((v - lo) / (hi - lo) * n + 0.5)))] for v in values)
    return Text(chars.rjust(width), style=style)


def bar(used: float | None, total: float | None, width: int) -> Text:
    """`███████░░░ 50/80G`: used of total (GiB) as a bar of `width` cells, coloured by how full."""
    if not total or used is None:
        return Text("")
    frac = max(0.0, min(1.0, used / total))
    filled = round(frac * width)
    style = "green" if frac < 0.75 else "yellow" if frac < 0.9 else "red"
    t = Text("█" * filled, style=style)
    t.append("░" * (width - filled), style="dim")
    t.append(f" {used / 2**30:.0f}/{total / 2**30:.0f}G")
    return t


def eta(seconds: float | None) -> str:
    if seconds is None:
        return "ETA –"
    return "ETA " + (duration(seconds) if seconds >= 1 else "0s")


def rate(tok_s: float | None) -> str:
    return "– tok/s" if tok_s is None else f"{count(tok_s)} tok/s"


def fit_columns(specs: list[tuple[str, str, int, int]], width: int) -> list[tuple[str, str, int]]:
    """The columns that fit in `width` cells: specs are (key, label, width, priority), and
    the lowest priorities go first until the rest fit (a DataTable pads 2 cells a column).
    Priority 0 columns always stay."""
    chosen = list(specs)
    while sum(w + 2 for _, _, w, _ in chosen) > width:
        droppable = [c for c in chosen if c[3] > 0]
        if not droppable:
            break
        chosen.remove(max(droppable, key=lambda c: c[3]))
    return [(k, label, w) for k, label, w, _ in chosen]
