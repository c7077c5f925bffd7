"""The Run screen's table of stages, which tells a stage the user picked from a cursor the screen moved.

The Run screen moves the cursor itself to follow the run (the stage running now); a stage the
user moves to (arrows, page keys, a click) or selects (enter) is a pick, which the screen then
keeps. DataTable's RowHighlighted cannot tell the two apart (it is posted for both, and for the
first row added), so the table posts `Picked` from the user's own actions only.
"""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import DataTable


class StageTable(DataTable):
    class Picked(Message):
        """The user chose the stage `stage` (its row key)."""

        def __init__(self, table: StageTable, stage: str) -> None:
            super().__init__()
            self.table = table
            self.stage = stage

    def _picked(self) -> None:
        if self.row_count:
            key = self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
            self.post_message(self.Picked(self, str(key)))

    def action_cursor_up(self) -> None:
        super().action_cursor_up()
        self._picked()

    def action_cursor_down(self) -> None:
        super().action_cursor_down()
        self._picked()

    def action_page_up(self) -> None:
        super().action_page_up()
        self._picked()

    def action_page_down(self) -> None:
        super().action_page_down()
        self._picked()

    def action_scroll_top(self) -> None:
        super().action_scroll_top()
        self._picked()

    def action_scroll_bottom(self) -> None:
        super().action_scroll_bottom()
        self._picked()

    def action_select_cursor(self) -> None:
        super().action_select_cursor()
        self._picked()

    def on_click(self, event: events.Click) -> None:
        # Called before DataTable's own handler moves the cursor: read it once that has run. A
        # click on the header (row -1) picks nothing.
        if event.style.meta.get("row", -1) >= 0:
            self.call_next(self._picked)
