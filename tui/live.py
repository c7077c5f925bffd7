"""Live figures from the daemon's event stream, kept between redraws.

The daemon's "metric" events carry a stage's live roll-up (tok/s, ETA, progress), the
samples of the last second, when each rank last wrote and each rank's open phase (what a silent
rank is doing: loading, starting an engine, waiting); "state" events say that something moved. `Live.apply` folds a
batch of events in and says what changed, so a screen redraws only when its run did.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from eyas.state.machine import TERMINAL
from eyas.wire.protocol import Event

# Samples kept per (run, stage, attempt, rank, metric): five minutes at the daemon's 1 Hz,
# what the Ranks screen's sparklines show.
KEEP = 300
WINDOW_S = 300.0


@dataclass
class Changes:
    """What a batch of events touched."""

    runs: set[int] = field(default_factory=set)  # runs with a state change
    metrics: set[int] = field(default_factory=set)  # runs with new metric samples
    any_state: bool = False
    overflow: bool = False  # events were dropped: re-read everything

    def touches(self, run_id: int | None) -> bool:
        return self.overflow or run_id is None or run_id in self.runs or run_id in self.metrics


class Live:
    def __init__(self) -> None:
        self.stage: dict[tuple[int, str], dict] = {}  # (run, stage) -> live roll-up
        self.samples: dict[tuple, deque] = {}  # (run, stage, attempt, rank, name) -> (t, v)
        self.writes: dict[tuple, float] = {}  # (run, stage, attempt, rank) -> its last write
        # (run, stage) -> (attempt, {rank: open phase}), as the last "metric" event said
        self.phases: dict[tuple[int, str], tuple[int, dict[str, dict]]] = {}
        self.received = 0

    def apply(self, events: list[Event]) -> Changes:
        ch = Changes()
        for ev in events:
            self.received += 1
            d = ev.data
            if ev.event == "overflow":
                ch.overflow = True
            elif ev.event == "state":
                run_id = d.get("run_id")
                ch.any_state = True
                if run_id is not None:
                    ch.runs.add(run_id)
                if d.get("entity") == "stage" and d.get("to_state") in TERMINAL:
                    # The stage is over: its live figures would only go stale, and its samples
                    # are in the store for whoever looks again.
                    self.stage.pop((run_id, d.get("stage")), None)
                    for key in [k for k in self.samples if k[:2] == (run_id, d.get("stage"))]:
                        del self.samples[key]
                    for key in [k for k in self.writes if k[:2] == (run_id, d.get("stage"))]:
                        del self.writes[key]
                    self.phases.pop((run_id, d.get("stage")), None)
            elif ev.event == "metric":
                run_id = d.get("run_id")
                ch.metrics.add(run_id)
                if d.get("live") is not None:
                    self.stage[(run_id, d.get("stage"))] = dict(d["live"])
                for s in d.get("samples") or ():
                    key = (s.get("run_id"), s.get("stage"), s.get("attempt"), s.get("rank"), s.get("name"))
                    q = self.samples.get(key)
                    if q is None:
                        q = self.samples[key] = deque(maxlen=KEEP)
                    q.append((s.get("time"), s.get("value")))
                if isinstance(d.get("phases"), dict):  # a daemon from before phases sends none
                    self.phases[(run_id, d.get("stage"))] = (d.get("attempt"), d["phases"])
                for rank, t in (d.get("last_write") or {}).items():
                    if str(rank).isdigit() and isinstance(t, (int, float)):
                        self.writes[(run_id, d.get("stage"), d.get("attempt"), int(rank))] = float(t)
        return ch

    def with_writes(self, run_id: int, stage: str, attempt: int, ranks: list[dict]) -> list[dict]:
        """The attempt's rank rows with each `last_write` brought up to the newest the daemon
        sent: the store's lags a second behind, the Ranks screen's re-read five."""
        out = []
        for r in ranks:
            t = self.writes.get((run_id, stage, attempt, r["rank"]))
            if t is not None and (r.get("last_write") is None or t > r["last_write"]):
                r = {**r, "last_write": t}
            out.append(r)
        return out

    def phase(self, run_id: int, stage: str, attempt: int) -> dict[str, dict]:
        """The ranks' open phases of the attempt ({rank: {"phase", "since", "budget", ...}}); {}
        when none is open or none was said (queries.phase_text words them)."""
        said = self.phases.get((run_id, stage))
        return said[1] if said is not None and said[0] == attempt else {}

    def last(self, run_id: int, stage: str, attempt: int, rank: int | None, name: str) -> float | None:
        q = self.samples.get((run_id, stage, attempt, rank, name))
        return q[-1][1] if q else None

    def last_any_rank(self, run_id: int, stage: str, attempt: int, name: str) -> float | None:
        """The newest sample of `name` from whichever rank wrote it last (loss, accuracy)."""
        best = None
        for (r, s, a, _rank, n), q in self.samples.items():
            if (r, s, a, n) == (run_id, stage, attempt, name) and q and (best is None or q[-1][0] > best[0]):
                best = q[-1]
        return None if best is None else best[1]

    def names(self, run_id: int, stage: str, attempt: int) -> set[str]:
        return {k[4] for k in self.samples if k[:3] == (run_id, stage, attempt)}

    def series(
        self, run_id: int, stage: str, attempt: int, rank: int | None, name: str, now: float | None = None
    ) -> list[tuple[float, float]]:
        q = self.samples.get((run_id, stage, attempt, rank, name))
        if not q:
            return []
        since = (now or time.time()) - WINDOW_S
        return [p for p in q if p[0] >= since]
