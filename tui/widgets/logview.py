"""A log view that renders only the visible rows of a model of any size (Line API).

The widget's virtual height is the model's row count; each redraw asks the model for the
rows under the viewport and nothing else. Follow mode keeps the view at the end: scrolling
up pauses it, reaching the end again (or `end`, or the screen's follow key) resumes it.
With wrapping on, rows are folded to the width and the view is anchored at the end while
following, so the newest line is always the last one on screen.
"""

from __future__ import annotations

import re
import time

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.geometry import Size
from textual.reactive import var
from textual.scroll_view import ScrollView
from textual.strip import Strip

from ..format import rank_style
from ..logmodel import Row
from ..logsearch import ERROR_RE

# Control characters other than tab and escape would corrupt the terminal: shown as `�`.
_CONTROL = {c: "\ufffd" for c in range(32) if c not in (9, 27)}
_WARN = re.compile(r"\bWARN(?:ING)?\b")
HIGHLIGHT = Style(color="black", bgcolor="yellow", bold=True)
MARK = Style(bgcolor="grey30")


class LogView(ScrollView, can_focus=True):
    DEFAULT_CSS = """
    LogView { height: 1fr; background: $surface; }
    """

    follow: var[bool] = var(True)
    wrap: var[bool] = var(False)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model = None
        self.pattern: re.Pattern | None = None  # matches to highlight
        self.placeholder = "opening log…"  # shown while there is no model
        self.mark: tuple[int, int] | None = None  # (rank, line) to show marked, e.g. the first error
        self.first_paint: float | None = None  # perf_counter of the first frame with rows
        self.paints = 0
        self._total = 0
        self._max_width = 0
        self._frame: list[Strip] | None = None
        self._frame_key = None
        self._rows: list[Row] = []

    # -- driving it -------------------------------------------------------------------------

    def set_model(self, model, placeholder: str = "") -> None:
        self.model = model
        self.placeholder = placeholder
        self._max_width = 0
        self.sync()

    def sync(self) -> None:
        """Pick up new rows (called by the screen's timer, at a bounded rate)."""
        total = self.model.total() if self.model is not None else 0
        # The widest line drawn so far (not the viewport's width, which shrinks when a
        # vertical scrollbar appears and would then ask for a horizontal one); wrapped
        # lines never scroll sideways.
        virtual_w = 1 if self.wrap else max(1, self._max_width)
        if (total, virtual_w) != (self.virtual_size.height, self.virtual_size.width):
            self.virtual_size = Size(virtual_w, total)
        self._total = total
        if self.follow:
            self._to_end()
            # Again once the new virtual size is laid out: before that the scroll is clamped
            # to the old one.
            self.call_after_refresh(self._to_end)
        self._frame = None
        self.refresh()

    def _to_end(self) -> None:
        if self.follow:
            # force: the scrollbars are laid out later; the target is clamped to the virtual size.
            self.scroll_to(
                y=max(0, self._total - self.scrollable_content_region.height), animate=False, immediate=True, force=True
            )

    def on_resize(self) -> None:
        self.sync()

    def goto(self, row: int, mark: tuple[int, int] | None = None) -> None:
        """Show `row` near the top and stop following."""
        self.follow = False
        self.mark = mark
        self.scroll_to(y=max(0, row - 2), animate=False, immediate=True, force=True)
        self._frame = None
        self.refresh()

    def watch_follow(self, follow: bool) -> None:
        if follow:
            self.mark = None
            self.sync()

    def watch_wrap(self, wrap: bool) -> None:
        self.scroll_to(x=0, animate=False, immediate=True, force=True)
        self.sync()

    def watch_scroll_y(self, old: float, new: float) -> None:
        super().watch_scroll_y(old, new)
        at_end = round(new) >= self.max_scroll_y
        if at_end and new > old and not self.follow:
            self.follow = True  # scrolled back down to the end: follow again
        elif not at_end and new < old and self.follow:
            self.follow = False  # scrolled up: pause

    def action_scroll_end(self) -> None:
        self.follow = True

    # -- rendering ----------------------------------------------------------------------------

    def visible_rows(self) -> list[Row]:
        """The rows on screen at the last redraw (for tests and the status line)."""
        self._build_frame()
        return list(self._rows)

    def render_line(self, y: int) -> Strip:
        frame = self._build_frame()
        width = self.scrollable_content_region.width
        if y < len(frame):
            return frame[y]
        return Strip.blank(width, self.rich_style)

    def _build_frame(self) -> list[Strip]:
        region = self.scrollable_content_region
        width, height = region.width, region.height
        sx, sy = self.scroll_offset
        key = (sx, sy, width, height, self._total, self.wrap, self.follow, id(self.model), self.pattern, self.mark)
        if self._frame is not None and key == self._frame_key:
            return self._frame
        self._frame_key = key
        style = self.rich_style
        if self.model is None or self._total == 0:
            self._rows = []
            self._frame = (
                [Strip([Segment(self.placeholder, Style(dim=True))]).crop_extend(0, width, style)]
                if self.placeholder
                else []
            )
            return self._frame
        # Following, the frame is anchored at the end whatever the scroll position says: the
        # scrollbars (and so the viewport height) may still change after the last scroll.
        at_end = self.follow or sy >= self.max_scroll_y
        if at_end:
            rows = self.model.rows(max(0, self._total - height), height)
            if self.follow and sy < self.max_scroll_y:
                self.call_later(self._to_end)
        else:
            rows = self.model.rows(sy, height)
        strips: list[Strip] = []
        shown: list[Row] = []
        console = self.app.console
        for row in rows:
            text = self._text(row)
            if self.wrap:
                pieces = [
                    Strip(line.render(console), line.cell_len).crop_extend(0, width, style)
                    for line in text.wrap(console, max(1, width), overflow="fold")
                ] or [Strip.blank(width, style)]
            else:
                self._max_width = max(self._max_width, text.cell_len)
                pieces = [Strip(text.render(console), text.cell_len).crop_extend(sx, sx + width, style)]
            strips.extend(pieces)
            shown.extend([row] * len(pieces))
        if at_end:
            strips, shown = strips[-height:], shown[-height:]
        else:
            strips, shown = strips[:height], shown[:height]
        self._rows = shown
        self._frame = strips
        if strips:
            self.paints += 1
            if self.first_paint is None:
                self.first_paint = time.perf_counter()
        if not self.wrap and self._max_width > self.virtual_size.width:
            self.call_later(self.sync)  # widen the horizontal scroll range
        if self.show_vertical_scrollbar and self.vertical_scrollbar.position != sy:
            # A scroll made before the scrollbar was laid out never reached it.
            self.vertical_scrollbar.position = sy
        return strips

    def _text(self, row: Row) -> Text:
        s = row.text
        if "\r" in s:
            s = s.rsplit("\r", 1)[-1] or s  # what a terminal shows of a progress bar
        s = s.expandtabs(4).translate(_CONTROL)
        text = Text.from_ansi(s) if "\x1b" in s else Text(s)
        plain = text.plain
        if ERROR_RE.search(plain):
            text.stylize("red")
        elif _WARN.search(plain):
            text.stylize("yellow")
        if self.pattern is not None:
            for m in self.pattern.finditer(plain):
                if m.end() > m.start():
                    text.stylize(HIGHLIGHT, m.start(), m.end())
        if self.model is not None and self.model.merged:
            text = Text(f"r{row.rank:<2} ", style=rank_style(row.rank)) + text
        if self.mark is not None and (row.rank, row.line) == self.mark:
            text.stylize(MARK)
        return text
