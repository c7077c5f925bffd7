"""Which lines each curve shows (training loss, validation loss, accuracy per TTT step, learning rate, tok/s, GPU memory per rank), read from the store through History for one run or several overlaid.

One run: each line of a curve gets its own colour (TTT step k, rank r). Several runs: every
line of a run gets the run's colour, and the legend names the runs. Over time, x is the
seconds since the stage started (so overlaid runs start together); over steps, the training
step the train stage recorded with its figures (queries.stage_curves). How each curve is drawn
(a log axis for the losses, smoothing for the noisy ones) is eyas.state.axes's, as for `eyas
show --plot`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from eyas.state import axes, queries
from eyas.state.axes import number
from eyas.state.queries import Curve

from .history import History
from .widgets.curves import Line

CURVES = queries.CURVES
BY_KEY = {c.key: c for c in CURVES}


@dataclass(frozen=True)
class RunRef:
    """A run in a plot: its id, its name for the legend and its colour (PALETTE index)."""

    run_id: int
    name: str
    colour: int
    origin: float | None = None  # the stage's start: time 0 on the x axis


def load(history: History, runs: list[RunRef], stage: str, keys: list[str], x: str = "time") -> dict[str, list[Line]]:
    """{curve key: its lines} of `stage` of each run, in the runs' order."""
    out: dict[str, list[Line]] = {k: [] for k in keys}
    overlay = len(runs) > 1
    for ref in runs:
        available = history.metric_names(ref.run_id, stage)
        wanted = {k: queries.curve_names(BY_KEY[k], available) for k in keys}
        rollup = [k for k in keys if BY_KEY[k].stage_rollup and wanted[k]]
        rest = sorted({n for k in keys if k not in rollup for n in wanted[k]})
        data = history.curves(ref.run_id, stage, rest, x=x) if rest else {}
        if rollup:
            names = sorted({n for k in rollup for n in wanted[k]})
            own = history.curves(ref.run_id, stage, names, x=x, ranks=[None])
            for n in names:
                # Without the stage's roll-up (an older daemon), each rank's own series.
                data[n] = own[n] if own[n] else history.curves(ref.run_id, stage, [n], x=x)[n]
        for k in keys:
            curve = BY_KEY[k]
            for j, name in enumerate(wanted[k]):
                series = sorted(data.get(name, {}).items(), key=lambda kv: (kv[0] is not None, kv[0] or 0))
                # Several ranks' own figures (selftest's every rank writes its loss): told apart by rank.
                by_rank = curve.per_rank or (not curve.pattern and sum(bool(points) for _, points in series) > 1)
                for rank, points in series:
                    if not points:
                        continue
                    origin = ref.origin if ref.origin is not None else points[0][0]
                    xs = [p[0] - origin if x == "time" else p[0] for p in points]
                    ys = [p[1] * curve.scale for p in points]
                    part = _part(curve, name, rank, j) or (f"rank {rank}" if by_rank and rank is not None else "")
                    if overlay:
                        label, colour = f"#{ref.run_id} {ref.name}", ref.colour
                    else:
                        label = part or curve.title
                        colour = (rank or 0) if by_rank else j if curve.pattern else ref.colour
                    named = not overlay or not any(ln.run_id == ref.run_id for ln in out[k])
                    out[k].append(Line(label, xs, ys, colour, ref.run_id, {"name": name, "rank": rank}, named))
    return out


def _part(curve: Curve, name: str, rank: int | None, j: int) -> str:
    """What tells a curve's lines apart within one run: the TTT step, the rank."""
    if curve.pattern:
        return f"step {re.fullmatch(curve.pattern, name).group(1)}"
    if curve.per_rank or (rank is not None and curve.stage_rollup):
        return f"rank {rank}"
    return ""


def title(curve: Curve, lines: list[Line], overlay: bool) -> str:
    """The curve's title with its newest value, when it has a single line."""
    if len(lines) == 1 and not overlay:
        return f"{curve.title}  {number(lines[0].ys[-1])}{curve.unit}"
    return curve.title


def stage_start(run: dict | None, stage: str) -> float | None:
    """When a stage's first attempt started (time 0 of its curves)."""
    if run is None:
        return None
    s = next((s for s in run["stages"] if s["name"] == stage), None)
    if s is None:
        return None
    first = s["attempt_list"][0]["started_at"] if s["attempt_list"] else None
    return first or s["started_at"]


def stage_attempts(runs: list[dict], stage: str | None) -> list[dict]:
    """Every attempt of `stage` in these runs (what an empty GPU plot's note is judged by)."""
    return [a for run in runs for s in run["stages"] if s["name"] == stage for a in s["attempt_list"]]


def empty_note(key: str, runs: list[dict], stage: str | None, x: str, daemon_gpu: bool | None) -> str:
    """What a curve with no lines says: why the GPU plot is empty, or that steps were not
    recorded, else "no samples"."""
    if key == "gpu_mem":
        note = axes.gpu_note(stage_attempts(runs, stage), daemon_gpu)
        if note != "no samples":
            return note
    if x == "step":
        return "no training steps recorded here (x: time)"
    return "no samples"
