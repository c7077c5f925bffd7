"""The thread that indexes log files and runs regex scans, away from the UI.

Toolong's design: file watching and indexing in a thread with no UI code. The UI never
waits for it; it polls `version` on a timer (a bounded redraw rate) and redraws what
changed. The focused file is always indexed first, so the visible log paints before the
other ranks' logs are read.
"""

from __future__ import annotations

import threading

from .logindex import LogFile
from .logsearch import Scan

POLL_S = 0.1
# Files not on screen are indexed in small slices with pauses between them: a 4 MB split
# holds the GIL for ~15 ms, and back to back they would starve the UI thread's redraws.
BACKGROUND_CHUNK = 1 << 20
BACKGROUND_PAUSE_S = 0.01


class LogWatcher(threading.Thread):
    def __init__(self, files: list[LogFile], poll: float = POLL_S, on_ready=None):
        super().__init__(name="eyas-log-watcher", daemon=True)
        self.on_ready = on_ready  # called (in this thread) when the focused files are first indexed
        self.files = list(files)
        self.poll = poll
        self.focus: list[LogFile] = self.files[:1]
        self.scans: list[Scan] = []
        self.want_stamps = False  # the merged view orders by time: fill checkpoints ahead
        self.version = 0  # moves on whenever a file grew or a scan progressed
        self.error: BaseException | None = None
        self._halt = threading.Event()
        self._wake = threading.Event()
        self._ready_told = False

    def set_focus(self, files: list[LogFile]) -> None:
        self.focus = list(files)
        self._ready_told = False
        self.wake()

    def set_scans(self, scans: list[Scan]) -> None:
        self.scans = list(scans)
        self.wake()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._halt.set()
        self._wake.set()

    def caught_up(self, files: list[LogFile] | None = None) -> bool:
        return not any(f.behind for f in (files if files is not None else self.files))

    def step(self) -> str | None:
        """One slice of work, the focused files first. Returns "focus" after work on what is
        on screen, "background" after work on the rest, None when there was nothing to do."""
        for f in self.focus:
            if f.index_more():
                return "focus"
        if not self._ready_told and all(f.caught_up for f in self.focus):
            self._ready_told = True
            if self.on_ready is not None:
                self.on_ready()
        for scan in self.scans:
            if scan.file in self.focus and scan.step():
                return "focus"
        if self.want_stamps:
            for f in self.focus:
                if f.fill_checkpoints():
                    return "focus"
        for f in self.files:
            if f not in self.focus and f.index_more(BACKGROUND_CHUNK):
                return "background"
        for scan in self.scans:
            if scan.step(BACKGROUND_CHUNK):
                return "background"
        return None

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                work = self.step()
                if work is not None:
                    self.version += 1
                    if work == "background":
                        self._halt.wait(BACKGROUND_PAUSE_S)
                    continue
                self._wake.wait(self.poll)
                self._wake.clear()
        except BaseException as exc:  # surfaced by the screen rather than lost in a thread
            self.error = exc
        finally:
            for f in self.files:
                f.close()
