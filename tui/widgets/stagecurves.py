"""The Run screen's curves panel: the selected stage's loss and tok/s side by side, over time, read again at most every few seconds while the stage runs.

It takes the room the screen leaves (at 80x24 a few rows, where each curve becomes a titled
braille plot or, below four rows, a sparkline) and hides itself when the stage has neither
curve, so that the screen's layout is the one it had before. Each curve is drawn as the
Metrics screen first draws it (eyas.state.axes): the loss on a log axis, both smoothed with
the raw series faint behind.
"""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.containers import Horizontal

from eyas.state import axes

from .. import curves
from .curves import CurvePlot

KEYS = ("loss", "tok_s")
# A running stage's curves are read again no sooner than this: one sample a second arrives,
# and a bucket of a long run holds many.
REFRESH_S = 5.0


class StageCurves(Horizontal):
    DEFAULT_CSS = """
    StageCurves { height: 1fr; max-height: 16; padding: 0 1; display: none; }
    StageCurves.shown { display: block; }
    StageCurves CurvePlot { margin: 0 1 0 0; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._key: tuple | None = None
        self._loaded = 0.0
        self.lines: dict[str, list] = {}

    def compose(self) -> ComposeResult:
        for key in KEYS:
            yield CurvePlot(curves.BY_KEY[key].title, short=curves.BY_KEY[key].short, id=f"curve-{key}")

    def show(self, run: dict | None, stage: str | None, *, force: bool = False) -> None:
        """Read the stage's curves if they may have changed since the last read."""
        if run is None or stage is None:
            self.set_class(False, "shown")
            return
        s = next((s for s in run["stages"] if s["name"] == stage), None)
        key = (run["id"], stage, s["attempts"] if s else 0, s["state"] if s else None)
        stale = s is not None and s["state"] == "running" and time.monotonic() - self._loaded >= REFRESH_S
        if key == self._key and not stale and not force:
            return
        self._key, self._loaded = key, time.monotonic()
        ref = curves.RunRef(run["id"], run["name"] or "", 0, curves.stage_start(run, stage))
        self.lines = curves.load(self.app.history, [ref], stage, list(KEYS))
        for k in KEYS:
            plot = self.query_one(f"#curve-{k}", CurvePlot)
            lines = self.lines[k]
            plot.display = bool(lines)
            plot.unit = curves.BY_KEY[k].unit
            plot.show(
                curves.title(curves.BY_KEY[k], lines, False),
                lines,
                "time",
                log_y=k in axes.LOG_Y,
                smoothing=axes.DEFAULT_SMOOTHING if k in axes.SMOOTHED else 0.0,
            )
        self.set_class(any(self.lines.values()), "shown")
