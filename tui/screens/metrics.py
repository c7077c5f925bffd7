"""The Metrics screen: one stage's curves (training loss, validation loss, accuracy per TTT step, learning rate, tok/s, GPU memory per rank) of one run, or of several runs overlaid in one colour each with a legend that names them.

Opened with `m` from the Run screen (its run, its selected stage) or from the Runs screen
(the runs marked with space). `x` switches the x axis between elapsed time and training
steps, `y` the losses' y axis between log (the default: a loss falls by decades) and linear,
`e` the smoothing of the noisy curves (loss, accuracy, tok/s) between TensorBoard's EMA
weights 0.6, 0.9 and off (the raw series stays faint behind), `s` goes to the next stage that
has curves, `z` shows the focused plot alone, its legend beside it. The curves are downsampled
in SQL (queries.stage_curves), so a long run opens as fast as a short one; a running stage's
curves are read again every few seconds.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid
from textual.widgets import Static

from eyas.state import axes

from .. import curves
from ..live import Changes
from ..widgets.curves import CurvePlot, colour
from .base import EyasScreen

KEYS = [c.key for c in curves.CURVES]
REFRESH_S = 5.0
# Plots per row: two fit 80 columns (about 38 cells each), three from 120.
WIDE = 120


class MetricsScreen(EyasScreen):
    DEFAULT_CSS = """
    MetricsScreen #legend { height: auto; max-height: 2; padding: 0 1; }
    MetricsScreen #plots { grid-size: 2; grid-gutter: 0 2; padding: 0 1; height: 1fr; }
    MetricsScreen #plots.zoomed { grid-size: 1; }
    MetricsScreen CurvePlot { height: 1fr; }
    """
    BINDINGS = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("x", "toggle_x", "Steps/time"),
        Binding("y", "toggle_log", "Log/linear"),
        Binding("e", "smoothing", "Smoothing"),
        Binding("s", "next_stage", "Stage"),
        Binding("z", "zoom", "Zoom"),
    ]

    def __init__(self, run_ids: list[int], stage: str | None = None) -> None:
        super().__init__()
        self.run_ids = list(dict.fromkeys(run_ids))
        self.stage = stage
        self.x = "time"
        self.runs: dict[int, dict] = {}
        self.lines: dict[str, list] = {k: [] for k in KEYS}
        self.zoomed = False
        self.log_y = True  # the losses (axes.LOG_Y) on a log axis
        self.smoothing = axes.DEFAULT_SMOOTHING  # the EMA weight of the noisy curves (axes.SMOOTHED)

    def title_text(self) -> str:
        return "metrics · " + ", ".join(f"run {r}" for r in self.run_ids)

    def compose_body(self) -> ComposeResult:
        yield Static("", id="legend")
        with Grid(id="plots"):
            for c in curves.CURVES:
                yield CurvePlot(c.title, short=c.short, id=f"plot-{c.key}")

    def on_mount(self) -> None:
        self._layout()
        self.reload()
        self.set_interval(REFRESH_S, self._tick)
        self.query_one(f"#plot-{KEYS[0]}", CurvePlot).focus()

    # -- data ---------------------------------------------------------------------------------

    def stages(self) -> list[str]:
        """Stages that ran in any of the runs, in pipeline order of the first run that has them."""
        found: list[str] = []
        for run in self.runs.values():
            for s in run["stages"]:
                if s["attempt_list"] and s["name"] not in found:
                    found.append(s["name"])
        return found

    def reload(self) -> None:
        hist = self.app.history
        self.runs = {r: run for r in self.run_ids if (run := hist.run(r)) is not None}
        ran = self.stages()
        if self.stage not in ran:
            # The train stage has the most to show; else the last stage that ran.
            self.stage = "train" if "train" in ran else (ran[-1] if ran else None)
        refs = self._refs()
        self.lines = curves.load(hist, refs, self.stage, KEYS, self.x) if self.stage else {k: [] for k in KEYS}
        self._draw(refs)

    def _refs(self) -> list[curves.RunRef]:
        return [
            curves.RunRef(r, run["name"] or "", i, curves.stage_start(run, self.stage))
            for i, (r, run) in enumerate(self.runs.items())
        ]

    def _tick(self) -> None:
        if any(
            s["name"] == self.stage and s["state"] == "running" for run in self.runs.values() for s in run["stages"]
        ):
            self.reload()

    def on_live(self, changes: Changes) -> None:
        if changes.overflow or any(r in changes.runs for r in self.run_ids):
            self.reload()  # a stage moved: its curves may have a new attempt

    def _draw(self, refs: list[curves.RunRef]) -> None:
        overlay = len(refs) > 1
        daemon_gpu = self.app.link_status.gpu if self.app.link_status.connected else None
        for c in curves.CURVES:
            plot = self.query_one(f"#plot-{c.key}", CurvePlot)
            lines = self.lines[c.key]
            plot.unit = c.unit
            note = "" if lines else curves.empty_note(c.key, list(self.runs.values()), self.stage, self.x, daemon_gpu)
            plot.show(
                curves.title(c, lines, overlay),
                lines,
                self.x,
                note,
                log_y=self.log_y and c.key in axes.LOG_Y,
                smoothing=self.smoothing if c.key in axes.SMOOTHED else 0.0,
                legend=not overlay,  # overlaid runs are named once, in the legend above
            )
        self.query_one("#legend", Static).update(self._legend(refs))

    def _legend(self, refs: list[curves.RunRef]) -> Text:
        """Two rows: the stage and its runs (each in its colour when overlaid), then how the
        plots are drawn (x, the losses' axis, the smoothing)."""
        head = Text.assemble(("stage ", "dim"), (self.stage or "–", "bold"), "  ·  ")
        if not refs:
            head.append("no such run in the store", style="dim")
        elif len(refs) == 1:
            run = self.runs[refs[0].run_id]
            head.append(f"run {refs[0].run_id} {run['name'] or ''}".rstrip())
        else:
            for i, ref in enumerate(refs):
                head.append("  " if i else "")
                head.append("■ ", style=colour(ref.colour)[1])
                head.append(f"#{ref.run_id} {ref.name}".rstrip())
        head.truncate(max(1, self.size.width - 2), overflow="ellipsis")
        if self.x == "step":
            axis = "training step"
        else:
            span = max((max(ln.xs) - min(ln.xs) for ls in self.lines.values() for ln in ls if ln.xs), default=0)
            axis = f"{axes.clock_unit(span)} since the stage started"
        smooth = f"EMA {self.smoothing:g}" if self.smoothing else "off"
        how = Text.assemble(
            ("x: ", "dim"),
            axis,
            ("  ·  loss: ", "dim"),
            "log" if self.log_y else "linear",
            ("  ·  smoothing: ", "dim"),
            smooth,
        )
        return Text("\n").join([head, how])

    # -- layout -------------------------------------------------------------------------------

    def on_resize(self) -> None:
        self._layout()

    def _layout(self) -> None:
        grid = self.query_one("#plots", Grid)
        focused = self.focused if isinstance(self.focused, CurvePlot) else None
        for plot in self.query(CurvePlot):
            plot.display = not self.zoomed or plot is focused
        grid.set_class(self.zoomed, "zoomed")
        if not self.zoomed:
            grid.styles.grid_size_columns = 3 if self.size.width >= WIDE else 2

    # -- actions ------------------------------------------------------------------------------

    def action_toggle_x(self) -> None:
        self.x = "step" if self.x == "time" else "time"
        self.reload()

    def action_toggle_log(self) -> None:
        self.log_y = not self.log_y
        self._draw(self._refs())

    def action_smoothing(self) -> None:
        levels = axes.SMOOTHING_LEVELS
        self.smoothing = levels[(levels.index(self.smoothing) + 1) % len(levels)] if self.smoothing in levels else 0.0
        self._draw(self._refs())

    def action_next_stage(self) -> None:
        ran = self.stages()
        if ran:
            self.stage = ran[(ran.index(self.stage) + 1) % len(ran)] if self.stage in ran else ran[0]
            self.reload()

    def action_zoom(self) -> None:
        if not isinstance(self.focused, CurvePlot):
            self.query_one(f"#plot-{KEYS[0]}", CurvePlot).focus()
        self.zoomed = not self.zoomed
        self._layout()
        if self.zoomed:
            self.query_one("#plots", Grid).styles.grid_size_columns = 1
