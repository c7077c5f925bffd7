"""What each rank's progress file has said so far: its counts and their totals, its token and sample rates, its open phase (its heartbeats), and from these when the rank last showed life.

The sampler (daemon/sampler.py) reads each file on from where the last sample stopped
(daemon/progressfile.py) and rolls the ranks' figures up into their stage's.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eyas.daemon.progressfile import ProgressReader

if TYPE_CHECKING:
    from eyas.daemon.sampler import Key, RankRef

# Record keys that identify a record rather than measure something.
_NOT_METRICS = frozenset({"time", "rank", "pid", "attempt"})
COUNTS = ("samples", "samples_total", "tokens", "tokens_total")


class Series:
    """A cumulative counter over time: rate over a trailing window, and mean since the first point."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.first: tuple[float, float] | None = None
        self.last: tuple[float, float] | None = None
        self.interval = 0.0  # time between the last two points: sparse writers go stale later
        # Points inside the window plus one at or before its start, the baseline of the rate.
        self.win: deque[tuple[float, float]] = deque()

    def add(self, t: float, v: float) -> None:
        if self.first is None:
            self.first = (t, v)
        if self.last is not None:
            self.interval = t - self.last[0]
        self.last = (t, v)
        self.win.append((t, v))
        while len(self.win) >= 2 and self.win[1][0] <= t - self.window_s:
            self.win.popleft()

    def rate(self, now: float) -> float | None:
        """Units per second over the last window of points; 0 once the writer has gone quiet."""
        if self.last is None or len(self.win) < 2:
            return None
        (t0, v0), (t1, v1) = self.win[0], self.last
        if t1 <= t0:
            return None
        if now - t1 > 3 * max(self.window_s, self.interval):
            return 0.0  # stalled or finished: a stale rate would hide a hang and skew the ETA
        return (v1 - v0) / (t1 - t0)

    def mean(self) -> float | None:
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return None
        return (self.last[1] - self.first[1]) / (self.last[0] - self.first[0])


class RankProgress:
    """What one rank's progress file has said so far."""

    def __init__(self, path: Path, window_s: float):
        self.path = path
        self.reader = ProgressReader(path)
        self.window_s = window_s
        self.reset()

    def reset(self) -> None:
        """Forget what the file said: it was truncated or replaced."""
        self.bad = 0
        self.counts: dict[str, float] = {}
        self.tokens = Series(self.window_s)
        self.samples = Series(self.window_s)
        self.gpu_mem: float | None = None  # the largest gpu_mem_bytes a progress line reported
        self.counted_at: float | None = None  # the time of the last record that was no heartbeat
        self.phase: dict | None = None  # the open phase, from its last heartbeat


def _phase_line(prog: RankProgress, rec: dict, t: float) -> str | None:
    """Take a heartbeat line into `prog.phase`: "moved" when its evidence changed (or the phase
    began), "beat" when it did not, "ended" for the phase's last line, None for any other line.

    Moving evidence is the one thing of a heartbeat that shows the phase working rather than a
    thread beating (daemon/phases.py)."""
    if "heartbeat" not in rec:
        return None
    if rec.get("ended"):
        if prog.phase is not None and prog.phase["phase"] == str(rec["heartbeat"]):
            prog.phase = None
        return "ended"
    detail = rec.get("phase") if isinstance(rec.get("phase"), dict) else {}
    name = str(rec["heartbeat"])
    since = _number(detail.get("since")) or t
    evidence = detail.get("evidence")
    old = prog.phase
    before = None if old is None else old.get("evidence")
    fresh = old is None or old["phase"] != name or old["since"] != since
    if fresh:
        prog.phase = {"phase": name, "since": since, "evidence_at": since}
    prog.phase.update(
        kind=str(detail.get("kind") or "other"),
        budget=_number(detail.get("budget")),
        waits=detail.get("waits"),
        evidence=evidence,
        time=t,
    )
    return "moved" if fresh or (evidence is not None and evidence != before) else "beat"


def _number(value: Any) -> float | None:
    # bool is an int, and NaN/inf would land as NULL in a NOT NULL column and sink the batch.
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def last_write(ref: RankRef, prog: RankProgress | None = None) -> float | None:
    """When the rank last showed life: the newest of its log's mtime, its last progress record
    that was no heartbeat, and the last move of its open phase's evidence (None before any).

    A heartbeat is not a sign of life (daemon/phases.py): a rank whose heartbeat thread beats
    while the rest of it hangs must go quiet. The files' own times, so a late sample never
    makes a quiet rank look busy. Without what the progress file said (`prog`), its mtime."""
    if prog is None:
        return newest_mtime(ref.log_path, ref.progress_path)
    times = [newest_mtime(ref.log_path), prog.counted_at, (prog.phase or {}).get("evidence_at")]
    return max((t for t in times if t is not None), default=None)


def newest_mtime(*paths: Path | None) -> float | None:
    """The newest modification time of the files that exist among `paths`; None if none does."""
    newest = None
    for path in paths:
        if path is None:
            continue
        try:
            t = os.stat(path).st_mtime
        except OSError:
            continue
        newest = t if newest is None else max(newest, t)
    return newest


def read_progress(
    progress: dict[Key, RankProgress], ref: RankRef, key: Key, row, window_s: float, log: logging.Logger
) -> RankProgress | None:
    """What the rank's progress file says since the last read, taken into its RankProgress in
    `progress` (made on first sight of the file, reset when it was truncated or replaced); each
    record's figures handed to `row` as metric rows. None while the file does not exist."""
    prog = progress.get(key)
    path = Path(ref.progress_path)
    if prog is None or prog.path != path:
        if not path.exists():
            return None
        if prog is not None:
            prog.reader.close()
        prog = progress[key] = RankProgress(path, window_s)
    restarts = prog.reader.restarts
    records, bad = prog.reader.read()
    counted = moved = False
    if prog.reader.restarts != restarts:  # truncated or replaced: what we knew is void
        prog.reset()
    if bad:
        if not prog.bad:
            log.warning("progress file %s: corrupt line skipped (the rank writes bad JSON)", prog.path)
        prog.bad += bad
    for rec in records:
        t = _number(rec.get("time"))
        if t is None:
            t = time.time()  # a record without its own time: it was written moments ago
        kind = _phase_line(prog, rec, t)
        if kind is not None:
            moved = moved or kind == "moved"
            counted = counted or kind == "ended"  # a phase that ended is work done
            continue
        counted = True
        emit = ref.metrics_since is None or t > ref.metrics_since
        for name, raw in rec.items():
            if name in _NOT_METRICS:
                continue
            value = _number(raw)
            if value is None:
                continue
            if emit:
                row(name, value, t)
            if name in COUNTS:
                prog.counts[name] = value
            elif name == "gpu_mem_bytes":
                prog.gpu_mem = max(prog.gpu_mem or 0, value)
        tokens, samples = _number(rec.get("tokens")), _number(rec.get("samples"))
        if tokens is not None:
            prog.tokens.add(t, tokens)
        if samples is not None:
            prog.samples.add(t, samples)
    if counted or moved:
        # The file's own time, as for the log (last_write): a rank's clock may differ.
        written = newest_mtime(path)
        if counted:
            prog.counted_at = written
        if moved and prog.phase is not None:
            prog.phase["evidence_at"] = written or prog.phase["evidence_at"]
    return prog
