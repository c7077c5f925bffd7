"""Rank log files opened by indexing line offsets, as Toolong does, never by loading them.

A LogFile keeps where each line starts (an array of byte offsets: 8 bytes a line, so a
million-line log costs 8 MB) and reads only the lines a view shows, with os.pread. The
indexing itself runs in a LogWatcher thread (tui/logwatch.py); the UI asks for counts and
for the few visible lines. Nothing here imports Textual.
"""

from __future__ import annotations

import array
import bisect
import itertools
import operator
import os
import threading
from pathlib import Path

from eyas.state import logcut
from eyas.state.logtime import stamp

# Bytes read per indexing step: big enough that split() runs at C speed, small enough that
# one step holds the GIL only a few milliseconds and the UI stays responsive.
CHUNK = 4 << 20
# A line longer than this is shown cut: a 100 MB line of JSON must not stall a redraw.
MAX_SHOWN = 64 << 10
# Stamps are looked for only this far back from a line without one (see `stamp`); beyond,
# a per-block checkpoint answers, so a log of a million unstamped lines stays cheap.
BLOCK = 256


def parse_stamp(line: str, year: str, monthday: str) -> str | None:
    """The sortable local time a line starts with, or None (eyas.state.logtime)."""
    return stamp(line, year, monthday)


def decode(raw: bytes) -> str:
    """One line's bytes as text: undecodable bytes replaced, the line ending dropped."""
    text = raw.decode("utf-8", "replace")
    if text.endswith("\r"):
        text = text[:-1]
    return text


def _shown(raw: bytes, length: int) -> str:
    """A line as shown: decoded, and marked when cut at MAX_SHOWN bytes."""
    if length > MAX_SHOWN:
        return decode(raw) + " …"
    return decode(raw.rstrip(b"\n"))


class LogFile:
    """One rank's log: a growing index of line starts, and reads of single lines.

    Thread-safe: one thread indexes (`index_more`) while others read. A file that shrinks, is
    cut at its bound (its middle replaced by a marker line) or is replaced is indexed afresh
    and `generation` moves on, so views can drop what they derived from it.
    """

    def __init__(self, path: Path | str, rank: int, start: tuple[int, int, int] = (1970, 1, 1)):
        self.path = Path(path)
        self.rank = rank
        self.year, self.monthday = str(start[0]), f"{start[1]:02d}-{start[2]:02d}"
        self.generation = 0
        self.caught_up = False  # set once the whole file as first seen has been indexed
        self._lock = threading.Lock()
        self._cp_lock = threading.RLock()  # checkpoints are filled by the watcher and the UI
        self._fd: int | None = None
        self._ino: tuple[int, int] | None = None
        self._reset()

    def _reset(self) -> None:
        self._starts = array.array("Q", [0])  # start offset of each line; the last may be EOF
        self._scanned = 0  # bytes examined for newlines
        self._before = b""  # the last bytes indexed, to notice a cut (see _moved)
        self._stamps: dict[int, str] = {}
        self._checkpoints: list[str] = []  # last stamp in lines [0, (b+1)*BLOCK)

    # -- indexing (the watcher thread) --------------------------------------------------

    def index_more(self, max_bytes: int = CHUNK) -> int:
        """Index up to `max_bytes` more of the file; returns how many bytes it read (0 when
        the file is missing or fully indexed)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self.caught_up = True  # nothing written yet: nothing to wait for
            return 0
        ino = (st.st_dev, st.st_ino)
        if self._fd is None or ino != self._ino or st.st_size < self._scanned or self._moved():
            self._reopen(ino)
        if st.st_size <= self._scanned:
            self.caught_up = True
            return 0
        base = self._scanned
        data = os.pread(self._fd, min(st.st_size - base, max_bytes), base)
        if not data:
            return 0
        parts = data.split(b"\n")
        parts.pop()  # what follows the last newline: a line still being written, or b""
        # The start of the line after each newline, at C speed (no Python loop per line).
        starts = map(operator.add, itertools.accumulate(map(len, parts)), itertools.count(base + 1))
        with self._lock:
            self._starts.extend(starts)
            self._scanned = base + len(data)
        self._before = logcut.remember(self._before, data)
        return len(data)

    def _moved(self) -> bool:
        """True when the bytes last indexed are no longer there: the log was cut at its bound."""
        return not logcut.still_there(self._fd, self._scanned, self._before)

    def _reopen(self, ino: tuple[int, int]) -> None:
        if self._fd is not None:
            os.close(self._fd)
        fd = os.open(self.path, os.O_RDONLY)
        with self._lock:
            if self._ino is not None:
                self.generation += 1
            self._fd, self._ino = fd, ino
            self._reset()

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def progress(self) -> float:
        """How much of the file is indexed, 0..1 (1 for a missing or empty file)."""
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            return 1.0
        return 1.0 if size == 0 else min(1.0, self._scanned / size)

    @property
    def behind(self) -> bool:
        """True while the file holds bytes not indexed yet."""
        try:
            return os.stat(self.path).st_size != self._scanned
        except FileNotFoundError:
            return False

    # -- reading (any thread) -------------------------------------------------------------

    def line_count(self) -> int:
        """Lines indexed so far, counting a last line still without its newline."""
        with self._lock:
            return len(self._starts) - 1 + (self._scanned > self._starts[-1])

    def complete_count(self) -> int:
        """Lines indexed so far that end with a newline."""
        return len(self._starts) - 1

    def span(self, first: int, last: int) -> tuple[int, int]:
        """Byte offsets of lines [first, last): from the start of `first` to the end of `last - 1`."""
        with self._lock:
            end = self._starts[last] if last < len(self._starts) else self._scanned
            return self._starts[first], end

    def lines(self, first: int, last: int) -> list[str]:
        """The text of lines [first, last) (clamped to what is indexed)."""
        with self._lock:
            count = len(self._starts) - 1 + (self._scanned > self._starts[-1])
            last = min(last, count)
            if first >= last or self._fd is None:
                return []
            fd = self._fd
            bounds = self._starts[first : last + 1].tolist()
            if len(bounds) < last - first + 1:
                bounds.append(self._scanned)  # the last line has no newline yet
        starts, ends = bounds[:-1], bounds[1:]
        if ends[-1] - starts[0] <= CHUNK * 2:
            blob = os.pread(fd, ends[-1] - starts[0], starts[0])
            base = starts[0]
            return [_shown(blob[s - base : min(e, s + MAX_SHOWN) - base], e - s) for s, e in zip(starts, ends)]
        return [_shown(os.pread(fd, min(e - s, MAX_SHOWN), s), e - s) for s, e in zip(starts, ends)]

    def line(self, i: int) -> str:
        got = self.lines(i, i + 1)
        return got[0] if got else ""

    def line_at_offset(self, offset: int) -> int:
        """The line that holds byte `offset`."""
        with self._lock:
            return max(0, bisect.bisect_right(self._starts, offset) - 1)

    # -- times, for the merged view ----------------------------------------------------------

    def stamp(self, i: int) -> str:
        """The time of line `i`: its own stamp, else the last earlier line's (as Toolong
        does, so a traceback sorts with the line that logged it); "" before any stamp."""
        got = self._stamps.get(i)
        if got is not None:
            return got
        s = parse_stamp(self.line(i), self.year, self.monthday)
        if s is None:
            b = i // BLOCK
            s = self._last_stamp(self.lines(b * BLOCK, i)) or (self.checkpoint(b - 1) if b else "")
        if len(self._stamps) > 200_000:
            self._stamps.clear()  # a crude bound; views ask for few lines again and again
        self._stamps[i] = s
        return s

    def _last_stamp(self, texts: list[str]) -> str | None:
        for text in reversed(texts):
            s = parse_stamp(text, self.year, self.monthday)
            if s is not None:
                return s
        return None

    def checkpoint(self, b: int) -> str:
        """The last stamp in lines [0, (b + 1) * BLOCK); filled forward, once per block."""
        with self._cp_lock:
            cps = self._checkpoints
            while len(cps) <= b:
                k = len(cps)
                if (k + 1) * BLOCK > self.complete_count():
                    return cps[-1] if cps else ""
                cps.append(self._last_stamp(self.lines(k * BLOCK, (k + 1) * BLOCK)) or (cps[-1] if cps else ""))
            return cps[b]

    def fill_checkpoints(self, budget: int = 64) -> bool:
        """Fill up to `budget` more checkpoints (the watcher does this ahead of the merged
        view); True when some were filled."""
        before = len(self._checkpoints)
        target = min(before + budget, self.complete_count() // BLOCK)
        if target > before:
            self.checkpoint(target - 1)
        return len(self._checkpoints) > before
