"""The Runs screen: the history as a live table, filtered by state and by text, with each run's
acceptance length (its evaluate stage's, as `eyas runs` shows it).

Space marks runs (each in the colour its curves will have) and `m` opens the Metrics screen
over the marked runs overlaid, or over the selected run when none is marked."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Input, Static

from eyas.state import display, queries
from eyas.state.machine import RUN_STATES

from .. import format as fmt
from ..live import Changes
from ..widgets.curves import colour
from ..widgets.modals import SubmitScreen
from .base import EyasScreen

# (key, label, width, priority): at 80 columns the higher priorities give way.
COLUMNS = [
    ("id", "id", 3, 0),
    ("name", "name", 14, 0),
    ("model", "model", 18, 4),
    ("state", "state", 11, 0),
    ("stage", "stage", 9, 0),
    ("started", "started", 16, 2),
    ("duration", "duration", 8, 0),
    ("peak_gpu_mem", "peak GPU", 9, 3),
    ("tok_s", "tok/s", 7, 0),
    # The trained draft's mean acceptance length (evaluate's summary), blank without one.
    ("accept", "accept", 6, 1),
]
NAME_MAX = 28
STATE_FILTERS = (None, *RUN_STATES)


class RunsScreen(EyasScreen):
    TITLE = "runs"
    DEFAULT_CSS = """
    RunsScreen #filterbar { height: 1; padding: 0 1; color: $text-muted; }
    RunsScreen #match { display: none; }
    RunsScreen #match.shown { display: block; }
    RunsScreen #empty { padding: 1 2; color: $text-muted; display: none; }
    RunsScreen #empty.shown { display: block; }
    RunsScreen DataTable { height: 1fr; }
    """
    BINDINGS = [
        Binding("enter", "open", "Open", show=True, priority=False),
        Binding("slash", "match", "Filter"),
        Binding("t", "state_filter", "State filter"),
        Binding("n", "submit", "Submit"),
        Binding("space", "mark", "Mark"),
        Binding("m", "metrics", "Metrics"),
        Binding("escape", "clear_filters", "Clear filters", show=False),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.state_filter: str | None = None
        self.match: str = ""
        self._rows: list[dict] = []
        self._columns: list[tuple[str, str, int]] = []
        self._shown: dict[str, list[str]] = {}  # row key -> the cells' texts on screen
        self.marked: list[int] = []  # in marking order, which gives each its colour

    def compose_body(self) -> ComposeResult:
        yield Static("", id="filterbar")
        yield DataTable(id="runs", cursor_type="row", zebra_stripes=True)
        yield Static("No runs yet. Submit one with `n` (or `eyas submit run.toml`).", id="empty")
        yield Input(placeholder="filter by name or model; enter applies, escape clears", id="match")

    def on_mount(self) -> None:
        self.reload()
        self.set_interval(1.0, self._tick)
        self.query_one(DataTable).focus()

    # -- data ---------------------------------------------------------------------------------

    def reload(self) -> None:
        self._rows = self.app.history.runs(state=self.state_filter, match=self.match)
        self._fill()

    def _tick(self) -> None:
        # Durations of running runs move every second; everything else moves on events.
        if any(r["state"] == "running" for r in self._rows):
            self.reload()

    def on_live(self, changes: Changes) -> None:
        if changes.any_state or changes.overflow:
            self.reload()
        elif changes.metrics:
            self._fill()

    def _cells(self, r: dict) -> list:
        live = None
        if r["state"] == "running" and r["stage"]:
            live = queries.rate(r["stage"], self.app.live.stage.get((r["id"], r["stage"]), {}).get("tok_s"))
        toks = live if live is not None else r["tok_s"]
        started = display.local_minute(r["started"])
        cells = {
            "id": Text(str(r["id"]), justify="right"),
            "name": self._name_cell(r),
            "model": r["model"] or "",
            "state": fmt.badge(r["state"]),
            "stage": r["stage"] or "",
            "started": started if self._wide_started else started[5:],
            "duration": Text(display.duration(r["duration"]), justify="right"),
            "peak_gpu_mem": Text(display.size(r["peak_gpu_mem"]), justify="right"),
            "tok_s": Text(display.count(toks), justify="right"),
            "accept": Text("" if r.get("accept") is None else f"{r['accept']:.2f}", justify="right"),
        }
        return [cells[key] for key, _, _ in self._columns]

    def _name_cell(self, r: dict) -> str | Text:
        if r["id"] not in self.marked:
            return r["name"] or ""
        return Text.assemble(("● ", colour(self.marked.index(r["id"]))[1]), r["name"] or "")

    def on_resize(self) -> None:
        self._fill()

    def _fit(self, table: DataTable) -> None:
        """Choose the columns for the width (80 columns drop model and peak GPU)."""
        width = (self.size.width or 80) - 2  # room for a vertical scrollbar
        columns = fmt.fit_columns(COLUMNS, width)
        if "started" not in [c[0] for c in columns] and width - sum(w + 2 for _, _, w in columns) >= 13:
            # Room for the start time without its year, which takes 11 cells, not 16.
            columns.insert([c[0] for c in columns].index("duration"), ("started", "started", 11))
        spare = width - sum(w + 2 for _, _, w in columns)
        columns = [(k, label, min(NAME_MAX, w + max(0, spare)) if k == "name" else w) for k, label, w in columns]
        if columns != self._columns:
            self._columns = columns
            self._shown = {}
            table.clear(columns=True)
            for key, label, w in columns:
                table.add_column(label, key=key, width=w)

    @property
    def _wide_started(self) -> bool:
        return any(k == "started" and w == 16 for k, _, w in self._columns)

    def _fill(self) -> None:
        table = self.query_one(DataTable)
        self._fit(table)
        keys = [str(r["id"]) for r in self._rows]
        current = [str(k.value) for k in table.rows]
        if keys == current:
            # Only the cells that changed: a history of a thousand runs ticks every second.
            for r in self._rows:
                key, cells = str(r["id"]), self._cells(r)
                shown = self._shown.get(key, [])
                for i, ((col, _, _), cell) in enumerate(zip(self._columns, cells)):
                    if i >= len(shown) or str(cell) != shown[i]:
                        table.update_cell(key, col, cell)
                self._shown[key] = [str(c) for c in cells]
        else:
            selected = self.selected_run()
            table.clear()
            self._shown = {}
            for r in self._rows:
                cells = self._cells(r)
                table.add_row(*cells, key=str(r["id"]))
                self._shown[str(r["id"])] = [str(c) for c in cells]
            if selected is not None and str(selected) in keys:
                table.move_cursor(row=keys.index(str(selected)))
        empty = self.query_one("#empty")
        empty.set_class(not self._rows, "shown")
        if not self._rows and (self.state_filter or self.match):
            empty.update("No run matches the filters (escape clears them).")
        else:
            empty.update("No runs yet. Submit one with `n` (or `eyas submit run.toml`).")
        self._show_filters()

    def _show_filters(self) -> None:
        bits = [
            f"state: {self.state_filter or 'all'} (t)",
            f"text: {self.match or '–'} (/)",
            f"{len(self._rows)} run{'s' if len(self._rows) != 1 else ''}",
        ]
        self.query_one("#filterbar", Static).update("  ·  ".join(bits))

    def selected_run(self) -> int | None:
        table = self.query_one(DataTable)
        if not table.row_count:
            return None
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        return int(key.value)

    # -- actions ------------------------------------------------------------------------------

    def action_open(self) -> None:
        run_id = self.selected_run()
        if run_id is not None:
            from .run import RunScreen

            self.app.push_screen(RunScreen(run_id))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_open()

    def action_mark(self) -> None:
        """Mark the selected run for the Metrics screen's overlay, or unmark it."""
        run_id = self.selected_run()
        if run_id is None:
            return
        if run_id in self.marked:
            self.marked.remove(run_id)
        else:
            self.marked.append(run_id)
        self._shown = {}  # the other marks' colours may have moved: redraw every cell
        self._fill()
        table = self.query_one(DataTable)
        if table.cursor_row < table.row_count - 1:
            table.move_cursor(row=table.cursor_row + 1)  # as in a file manager: mark, move on

    def action_metrics(self) -> None:
        """The Metrics screen over the marked runs (overlaid), else over the selected one."""
        runs = list(self.marked) or [r for r in [self.selected_run()] if r is not None]
        if runs:
            from .metrics import MetricsScreen

            self.app.push_screen(MetricsScreen(runs))

    def action_state_filter(self) -> None:
        i = STATE_FILTERS.index(self.state_filter)
        self.state_filter = STATE_FILTERS[(i + 1) % len(STATE_FILTERS)]
        self.reload()

    def action_match(self) -> None:
        box = self.query_one("#match", Input)
        box.add_class("shown")
        box.value = self.match
        box.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.match = event.value.strip()
        event.input.remove_class("shown")
        self.query_one(DataTable).focus()
        self.reload()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.match = event.value.strip()  # filter as you type: the query is an indexed LIKE
        self.reload()

    def action_clear_filters(self) -> None:
        box = self.query_one("#match", Input)
        box.remove_class("shown")
        self.state_filter, self.match = None, ""
        self.query_one(DataTable).focus()
        self.reload()

    def action_submit(self) -> None:
        if self.refuse_control():
            return

        def done(result: dict | None) -> None:
            if result:
                self.notify(f"Run {result['run_id']} submitted: {', '.join(result.get('stages', []))}")
                self.reload()

        self.app.push_screen(SubmitScreen(), done)
