"""Progress lines of one rank: rank-<r>.progress.jsonl, written by the rank, read by the daemon.

Each line is one JSON object: {"time", "samples", "samples_total", "tokens", "tokens_total",
...metrics}, counts cumulative, or a heartbeat {"time", "heartbeat": phase, "phase": {...}} that
says which long silent phase the rank is in (a weight load, an engine start) and carries no
counts, then {"time", "heartbeat": phase, "ended": true} when it is over. A heartbeat is not proof of life: the
daemon believes a phase alive only while its evidence moves (the "phase" object's `evidence`,
which the rank measures, and the CPU of the rank's processes, which the daemon does) and while
it is inside its `budget` (daemon/phases.py). The
writer appends each line with a single write() on an O_APPEND descriptor, so a reader sees
whole lines, except for the last one while it is being written or after a crash mid-write;
the daemon's reader (eyas.daemon.progressfile) leaves such a tail for the next call.

Stdlib only (json, os, threading, time), so that importing it costs a stage nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

_COUNTS = ("samples", "samples_total", "tokens", "tokens_total")
# Seconds between heartbeats: a phase's evidence is measured this often, so it must stay well
# under the smallest stall_timeout a user sets (the tests' are 10 to 30 s).
BEAT_S = 5.0


class ProgressWriter:
    """Append progress lines, at most one per `min_interval` seconds unless forced.

    A throttled update is not lost: it is kept pending and written by the next write, by
    `flush()` or by `close()`. A change of a total is always written at once, because the
    daemon uses totals to compute the ETA.
    """

    def __init__(self, path: str | os.PathLike[str], min_interval: float = 0.25):
        self.path = os.fspath(path)
        self.min_interval = min_interval
        self._fd: int | None = None
        self._counts: dict[str, Any] = dict.fromkeys(_COUNTS)
        self._metrics: dict[str, Any] = {}  # metrics not yet written
        self._pending = False
        self._last_write = float("-inf")
        # Heartbeats come from a thread of their own (beating); the descriptor is shared.
        self._lock = threading.Lock()

    def update(
        self,
        samples: int | None = None,
        tokens: int | None = None,
        samples_total: int | None = None,
        tokens_total: int | None = None,
        force: bool = False,
        **metrics: Any,
    ) -> bool:
        """Record cumulative counts and metrics; return True when a line was written."""
        totals_changed = False
        for key, value in (
            ("samples", samples),
            ("tokens", tokens),
            ("samples_total", samples_total),
            ("tokens_total", tokens_total),
        ):
            if value is None:
                continue
            if key.endswith("_total") and value != self._counts[key]:
                totals_changed = True
            self._counts[key] = value
        self._metrics.update(metrics)
        self._pending = True
        if force or totals_changed or time.monotonic() - self._last_write >= self.min_interval:
            self.flush()
            return True
        return False

    def flush(self) -> None:
        """Write the pending update now, if there is one."""
        if not self._pending:
            return
        self._write({"time": time.time(), **self._counts, **self._metrics})
        self._metrics.clear()
        self._pending = False
        self._last_write = time.monotonic()

    def heartbeat(self, phase: str, detail: dict[str, Any] | None = None) -> None:
        """Append {"time", "heartbeat": phase, "phase": detail}: in `phase`, with nothing to count."""
        record: dict[str, Any] = {"time": time.time(), "heartbeat": phase}
        if detail is not None:
            record["phase"] = detail  # nested: its numbers are not metrics (daemon/sampler.py)
        self._write(record)

    @contextlib.contextmanager
    def beating(
        self,
        phase: str,
        every: float = BEAT_S,
        *,
        kind: str = "other",
        budget: float | None = None,
        evidence: Callable[[], dict[str, Any]] | None = None,
        waits: str | None = None,
    ) -> Iterator[None]:
        """A heartbeat at entry, then one every `every` seconds from a daemon thread, then an
        "ended" one, around a phase that writes nothing for minutes.

        `kind` is one of contract.PHASE_KINDS (what `[stages.<name>] phase_budgets` keys on);
        `budget` the seconds the phase may take at most, derived from its work
        (workers/runtime/phases.py), None for none; `evidence()` a small JSON object of counters
        that move while the phase works (bytes read, files written), measured at each beat;
        `waits` the stage a wait depends on (a streaming sibling), whose own liveness then
        stands for this rank's. Daemon thread: it must never keep a rank alive.
        """
        detail: dict[str, Any] = {"kind": kind, "since": time.time()}
        if budget is not None:
            detail["budget"] = round(float(budget), 3)
        if waits is not None:
            detail["waits"] = waits

        def beat() -> None:
            if evidence is not None:
                try:
                    detail["evidence"] = evidence()
                except Exception as exc:  # evidence is a report: it must never fail the phase
                    detail["evidence"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            self.heartbeat(phase, dict(detail))

        beat()
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(every):
                try:
                    beat()
                except OSError:
                    return  # a full disk must not kill the phase it reports on

        thread = threading.Thread(target=run, name=f"heartbeat-{phase}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            with contextlib.suppress(OSError):
                self._write({"time": time.time(), "heartbeat": phase, "ended": True})

    def _write(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, default=_jsonable) + "\n").encode("utf-8")
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(self._fd, line)  # one write: whole lines for readers (O_APPEND)
            except OSError as exc:
                exc.filename = self.path  # os.write names no file; a full disk's root cause does
                raise

    def close(self) -> None:
        """Write the last pending update and close the file; later updates reopen it."""
        try:
            self.flush()
        finally:
            with self._lock:
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None

    def __enter__(self) -> ProgressWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _jsonable(value: Any) -> Any:
    # Metrics often arrive as numpy or torch scalars; both have .item().
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    return str(value)
