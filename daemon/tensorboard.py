"""[tracking] tensorboard, live: each tracked run's samples written as TensorBoard event files while it runs, from the very rows the daemon hands the store.

Why in the daemon rather than a process of its own: the daemon holds every sample the moment it
is taken (daemon/metrics.py gives this module the rows it queues for eyas.db), so the files
are as fresh as the store, with nothing to tail, poll or supervise. It costs the daemon no
import it forbids itself: the events are encoded by eyas.state.tbevents with the stdlib
(tensorboard's own writer imports numpy; nothing here imports torch). The writing happens on a
thread of its own, so a slow or full output filesystem never holds the event loop: the loop
only reads a run's config.json once and puts rows on a queue. A write that fails (a full disk,
a folder taken away) is logged once and ends that run's tracking; the store and the run go on.

Where the files go, their tags and steps: state/tbevents.py. Each daemon start opens a new
event file per run (TensorBoard reads them together); a restarted daemon's step for the
daemon's own measures starts again from the next progress record of the attempt.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from eyas.state import privacy, tbevents, tracking

log = logging.getLogger("eyas.daemon.tensorboard")

# A run's file is closed after this long without samples (its run ended or waits); a later
# sample opens a new one beside it.
IDLE_CLOSE_S = 60.0


@dataclass
class _Target:
    """Where one run's events go and how its files are made."""

    folder: Path  # <dir>/run-<id>-<name>
    run_dir: Path
    mode: int  # of each event file: the user's umask in a folder they chose, else owner-only


@dataclass
class _Board:
    target: _Target
    clock: tbevents.StepClock = field(default_factory=tbevents.StepClock)
    file: tbevents.EventFile | None = None
    last: float = 0.0


def _target(run_id: int, attempt_dir: Path) -> _Target | None:
    """The run's TensorBoard folder from its config.json (beside its stages' folders: an
    attempt's is <run>/<stage>/attempt-<n>); None when it tracks none."""
    run_dir = Path(attempt_dir).parent.parent
    try:
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        log.warning("run %s: cannot read its config.json for [tracking] (%s); no TensorBoard files", run_id, exc)
        return None
    base = tracking.tensorboard_dir(config, config.get("output_dir") or run_dir / "out")
    if base is None:
        return None
    shared = privacy.shares_outputs(base, run_dir)
    mode = (0o666 & ~privacy.user_umask()) if shared else 0o600
    return _Target(tbevents.run_folder(base, run_id, config.get("name")), run_dir, mode)


class LiveBoards:
    """The daemon's TensorBoard writer: `add` on the event loop, the files on a thread."""

    def __init__(self) -> None:
        self._targets: dict[int, _Target | None] = {}  # run id -> its target (event loop only)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def add(self, rows: list[dict], groups) -> None:
        """Queue the rows of tracked runs (the sampler's rows, as the store gets them)."""
        by_run: dict[int, list[dict]] = {}
        for r in rows:
            if r["run_id"] is not None:
                by_run.setdefault(r["run_id"], []).append(r)
        if not by_run:
            return
        dirs = {g.run_id: g.dir for g in groups}
        for run_id, batch in by_run.items():
            if run_id not in self._targets and run_id in dirs:
                self._targets[run_id] = _target(run_id, dirs[run_id])
            target = self._targets.get(run_id)
            if target is not None:
                self._queue.put((run_id, target, batch))
                self._start()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._write_forever, name="eyas-tensorboard", daemon=True)
            self._thread.start()

    def _write_forever(self) -> None:
        boards: dict[int, _Board] = {}
        broken: set[int] = set()
        while True:
            try:
                items = [self._queue.get(timeout=IDLE_CLOSE_S / 4)]
            except queue.Empty:
                items = []
            while True:  # whatever else waits: one flush for all of it
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            now = time.monotonic()
            touched = set()
            for run_id, target, rows in items:
                if run_id in broken:
                    continue
                board = boards.setdefault(run_id, _Board(target))
                try:
                    if board.file is None:
                        privacy.make_output_dir(target.folder, target.run_dir)
                        board.file = tbevents.EventFile(target.folder, mode=target.mode)
                        log.info("run %s: TensorBoard events in %s", run_id, board.file.path)
                    board.file.write(board.clock.events(rows))
                    board.last = now
                    touched.add(run_id)
                except OSError as exc:
                    log.warning("run %s: TensorBoard events not written, tracking ends (%s)", run_id, exc)
                    broken.add(run_id)
                    self._close(board)
            for run_id, board in boards.items():
                try:
                    if run_id in touched:
                        board.file.flush()
                    elif board.file is not None and now - board.last >= IDLE_CLOSE_S:
                        self._close(board)
                except OSError as exc:
                    log.warning("run %s: TensorBoard events not written, tracking ends (%s)", run_id, exc)
                    broken.add(run_id)

    @staticmethod
    def _close(board: _Board) -> None:
        if board.file is not None:
            try:
                board.file.close()
            except OSError:
                pass
            board.file = None


def boards(core) -> LiveBoards:
    """The core's writer, made on first use (the daemon's metrics half calls this)."""
    found = core.__dict__.get("_tensorboard")
    if found is None:
        found = core.__dict__["_tensorboard"] = LiveBoards()
    return found
