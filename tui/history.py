"""The TUI's read-only view of the store: the same queries as `eyas runs` and `eyas show`.

The database is opened with queries.connect (a plain read-only sqlite3 connection): it
works with the daemon down, and it never writes. A store that does not exist yet (nothing
submitted) reads as empty, and is looked for again on the next call.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eyas.state import paths, queries


class History:
    def __init__(self, home: Path, clock: Callable[[], float] = time.time):
        self.home = Path(home)
        self.clock = clock
        self.db_path = paths.db_path(self.home)
        self._db = None

    @property
    def db(self):
        if self._db is None:
            try:
                self._db = queries.connect(self.db_path)
            except FileNotFoundError:
                return None
        return self._db

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def runs(self, state: str | None = None, match: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        """The listing of `eyas runs`, each run with its acceptance length ("accept", None
        without an evaluate summary)."""
        db = self.db
        if db is None:
            return []
        rows = queries.list_runs(db, state=state, match=match or None, limit=limit, now=self.clock())
        accept = queries.acceptance_lengths(db, [r["id"] for r in rows])
        for r in rows:
            r["accept"] = accept.get(r["id"])
        return rows

    def run(self, run_id: int) -> dict[str, Any] | None:
        db = self.db
        if db is None:
            return None
        try:
            return queries.get_run(db, run_id, now=self.clock())
        except KeyError:
            return None

    def errors(self, run_id: int) -> list[dict[str, Any]]:
        db = self.db
        return [] if db is None else queries.errors(db, run_id)

    def series(self, run_id: int, stage: str, attempt: int, name: str, window: float) -> list[tuple]:
        """(time, rank, value) samples of the last `window` seconds."""
        db = self.db
        if db is None:
            return []
        return queries.metric_series(db, run_id, stage, attempt, name, since=self.clock() - window)

    def latest(self, run_id: int, stage: str, attempt: int, name: str) -> float | None:
        db = self.db
        if db is None:
            return None
        row = queries.latest_metric(db, run_id, stage, attempt, name)
        return None if row is None else row[2]

    def curves(
        self,
        run_id: int,
        stage: str,
        names: list[str],
        *,
        x: str = "time",
        ranks: list[int | None] | None = None,
        points: int = queries.CURVE_POINTS,
    ) -> dict[str, dict[int | None, list[tuple[float, float]]]]:
        """{name: {rank: [(x, value)]}} of a stage, downsampled in SQL (queries.stage_curves)."""
        db = self.db
        if db is None:
            return {n: {} for n in names}
        return queries.stage_curves(db, run_id, stage, names, x=x, ranks=ranks, points=points)

    def metric_names(self, run_id: int, stage: str) -> list[str]:
        db = self.db
        return [] if db is None else queries.stage_metric_names(db, run_id, stage)

    def gpu_memory(self, window: float = 30.0) -> dict[int, dict[str, float]]:
        db = self.db
        return {} if db is None else queries.gpu_memory(db, self.clock() - window)


def attempt_dir(attempt: dict, home: Path) -> Path:
    """An attempt's directory; relative paths in the store are relative to the state dir."""
    d = Path(attempt["dir"])
    return d if d.is_absolute() else Path(home) / d


def pick_stage(run: dict, name: str | None = None) -> dict | None:
    """The stage asked for; else the running one, else the last that ran, else the first."""
    stages = run["stages"]
    if name:
        return next((s for s in stages if s["name"] == name), None)
    for s in stages:
        if s["state"] == "running":
            return s
    ran = [s for s in stages if s["attempt_list"]]
    if ran:
        return ran[-1]
    return stages[0] if stages else None
